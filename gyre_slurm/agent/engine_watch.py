"""The node agent's watch over the engine process it starts (engine_launch.py), which no supervisor knows.

The supervisor's hang rule (launch/supervise.py `watch_silence`) on the engine's beacon: a silence past STALL_S
that ends is told (process_stalled); past control.hang_timeout_s the engine is killed (process_hung). An engine
that is gone, killed so or dead on its own, is started again by its agent at the version it served, its memory
released again when its cell trains (process_restarted); the calls it had in flight fail there and the proxy
continues them on another cell.
An SGLang server beats no beacon: only its death is seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre_slurm.launch.supervise import Supervised, watch_silence


class EngineWatch:
    def __init__(self, backend: Any, hang_s: float, report: Callable[[str, str], None]) -> None:
        self.backend, self.hang_s, self.report = backend, hang_s, report
        self.member: Supervised | None = None

    def gone(self) -> str | None:
        """Watch the engine once (each turn of the agent's loop): how it went, when a serving engine is gone and
        must be started again; else None."""
        b = self.backend
        proc = getattr(b, "engine", None)
        if proc is None or not getattr(b, "lead", False):
            self.member = None
            return None
        name = b.launcher.beacon_name or f"engine-{b.node_index}"
        if self.member is None or self.member.proc is not proc:
            self.member = Supervised(name, [], None, proc)
        m = self.member
        if proc.poll() is None:
            if b.launcher.beacon_name:
                watch_silence(m, b.run_dir / "alive", self.hang_s, self.report)
            if not m.hung:
                return None
            proc.wait(10)  # killed as hung just now
        return f"{name} was killed as hung" if m.hung else f"{name} died (exit {proc.returncode})"
