"""Live experiment tracking for the daemon: after a step or an evaluation is DONE (and the ledger flushed), its
point is read back from the ledger (series.py) and written to each configured backend.

Reading the ledger rather than taking figures from the caller makes a live log and `gyre export` identical by
construction. A backend that fails (not installed, tb/ unwritable or the disk full, a W&B error) is reported once
through `warn` and dropped; nothing here ever raises into the daemon. With no backends nothing is imported and the
ledger is never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gyre_slurm.config_eval import TrackingSection
from gyre_slurm.tracking.series import Point, eval_point, step_point

TB_FOLDER = "tb"  # state/<run>/tb/; W&B writes state/<run>/wandb/ itself


class Sink(Protocol):
    name: str

    def write(self, point: Point) -> None: ...

    def close(self) -> None: ...


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or "no message"
    return f"{type(e).__name__}: {text[:300]}"


def open_sink(backend: str, tracking: TrackingSection, run_dir: Path, run_id: str, config: dict[str, Any]) -> Sink:
    """The backend's sink for a live run (raises whatever the backend raises)."""
    if backend == "tensorboard":
        from gyre_slurm.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(Path(run_dir) / TB_FOLDER)
    if backend == "wandb":
        from gyre_slurm.tracking.wandb_sink import WandbSink, wandb_run_id

        return WandbSink(project=tracking.wandb_project, entity=tracking.wandb_entity, run_id=run_id,
                         wandb_id=wandb_run_id(run_id), dir=Path(run_dir), mode=tracking.wandb_mode, config=config)
    raise ValueError(f"unknown tracking backend {backend!r}")


@dataclass
class Tracker:
    run_dir: Path
    warn: Callable[[str], None]
    sinks: list[Sink] = field(default_factory=list)

    @classmethod
    def start(cls, tracking: TrackingSection, run_dir: Path, run_id: str, config: dict[str, Any],
              warn: Callable[[str], None]) -> Tracker:
        """Open every backend of `tracking.backends`; one that cannot start is warned about and left out."""
        t = cls(Path(run_dir), warn)
        for backend in tracking.backends:
            try:
                t.sinks.append(open_sink(backend, tracking, run_dir, run_id, config))
            except Exception as e:  # any failure of a backend is a warning, never the daemon's end
                t._warn(f"tracking: {backend} is off for this run: {_one_line(e)}")
        return t

    def _warn(self, message: str) -> None:
        try:
            self.warn(message)
        except Exception:  # a broken warn callback must not stop the daemon either
            pass

    def _read(self, what: str, read: Callable[[Any], Point | None]) -> Point | None:
        from gyre_slurm.ledger.readonly import connect_readonly
        from gyre_slurm.rundir import ledger_path

        try:
            conn = connect_readonly(ledger_path(self.run_dir))
            try:
                return read(conn)
            finally:
                conn.close()
        except Exception as e:
            self._warn(f"tracking: could not read {what} from the ledger, not logged: {_one_line(e)}")
            return None

    def _write(self, point: Point | None) -> None:
        if point is None:
            return
        for sink in list(self.sinks):
            try:
                sink.write(point)
            except Exception as e:
                self.sinks.remove(sink)
                self._warn(f"tracking: {sink.name} is off for the rest of this run: {_one_line(e)}")
                self._close(sink)

    def _close(self, sink: Sink) -> None:
        try:
            sink.close()
        except Exception:  # already warned about: nothing more to report
            pass

    def step_done(self, step: int) -> None:
        """Log a DONE training step (call after the ledger holds it: flush first)."""
        if self.sinks:
            self._write(self._read(f"step {step}", lambda conn: step_point(conn, step)))

    def eval_done(self, eval_id: int) -> None:
        """Log a DONE evaluation (call after the ledger holds it: flush first)."""
        if self.sinks:
            self._write(self._read(f"evaluation {eval_id}", lambda conn: eval_point(conn, eval_id)))

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:
                self._warn(f"tracking: {sink.name} did not close cleanly: {_one_line(e)}")
