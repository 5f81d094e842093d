"""`gyre export`: replay a run's ledger (every DONE step and DONE evaluation) into TensorBoard or W&B.

The points come from series.py, as the live tracker's do, so an export of a run is the series the run would have
logged live. It reads the ledger read-only: a running run can be exported too (what is DONE so far).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gyre_slurm.errors import GyreError
from gyre_slurm.tracking.series import Point, all_points
from gyre_slurm.tracking.tracker import Sink

TB_EXPORT_FOLDER = "tb-export"
WANDB_EXPORT_FOLDER = "wandb-export"


@dataclass(frozen=True)
class ExportResult:
    points: int
    steps: int
    evals: int
    folder: Path  # the event files' folder, or the W&B run's own folder
    url: str | None = None  # an online W&B run's page


def _read(run_dir: Path) -> tuple[str, dict[str, Any], list[Point]]:
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path

    conn = connect_readonly(ledger_path(run_dir))
    try:
        row = conn.execute("SELECT id, config FROM runs ORDER BY created_at LIMIT 1").fetchone()
        config = json.loads(row["config"]) if row and row["config"] else {}
        return (row["id"] if row else Path(run_dir).name), config, all_points(conn)
    finally:
        conn.close()


def _tensorboard(run_dir: Path, out: Path | None) -> tuple[Sink, Path]:
    folder = Path(out) if out is not None else Path(run_dir) / TB_EXPORT_FOLDER
    if folder.is_dir() and any(folder.glob("events.out.tfevents.*")):
        # TensorBoard would show both files' points: twice the same curve
        raise GyreError(f"{folder} already holds TensorBoard event files: remove them or export with --out")
    try:
        from gyre_slurm.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(folder), folder
    except ImportError as e:
        raise GyreError(f"TensorBoard is not installed ({e}): pip install 'gyre_slurm[tracking]'") from None
    except OSError as e:
        raise GyreError(f"cannot write TensorBoard files to {folder}: {e}") from None


def _wandb(run_id: str, config: dict[str, Any], run_dir: Path, out: Path | None,
           online: bool) -> tuple[Sink, Path, str | None]:
    try:
        from gyre_slurm.tracking.wandb_sink import WandbSink, wandb_run_id

        tracking = config.get("tracking") or {}
        mode: Literal["offline", "online"] = "online" if online or os.environ.get("WANDB_MODE") == "online" \
            else "offline"
        # its own W&B id: an export never appends to the run the daemon logged live (same name, side by side)
        sink = WandbSink(project=tracking.get("wandb_project") or "gyre", entity=tracking.get("wandb_entity"),
                         run_id=run_id, wandb_id=wandb_run_id(f"{run_id}-export"),
                         dir=Path(out) if out is not None else Path(run_dir) / WANDB_EXPORT_FOLDER, mode=mode,
                         config=config)
    except ImportError as e:
        raise GyreError(f"W&B is not installed ({e}): pip install 'gyre_slurm[tracking]'") from None
    except Exception as e:
        raise GyreError(f"W&B did not start: {' '.join(str(e).split())}") from None
    return sink, sink.folder, sink.run.url if mode == "online" else None


def export_run(run_dir: Path, to: str, out: Path | None = None, online: bool = False,
               progress: Callable[[int, int, Point], None] = lambda _i, _n, _p: None) -> ExportResult:
    """Write every DONE step and evaluation of the run to `to` (tensorboard or wandb); `progress(points written,
    points in all, the point)` after each."""
    if to not in ("tensorboard", "wandb"):
        raise GyreError(f"--to must be tensorboard or wandb, not {to!r}")
    run_id, config, points = _read(run_dir)
    if to == "tensorboard":
        sink, folder, url = *_tensorboard(run_dir, out), None
    else:
        sink, folder, url = _wandb(run_id, config, run_dir, out, online)
    try:
        for i, p in enumerate(points, 1):
            sink.write(p)
            progress(i, len(points), p)
    finally:
        sink.close()
    return ExportResult(len(points), sum(p.kind == "step" for p in points), sum(p.kind == "eval" for p in points),
                        folder, url)
