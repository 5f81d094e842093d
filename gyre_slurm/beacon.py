"""Signs of life: a supervised process's main loop touches a file, its beacon, about once a second, so that its
supervisor (launch/supervise.py) can tell a hung process from a live one. A process stopped by SIGSTOP, stuck in a
read of a dead file system or deadlocked keeps its pid, its sockets and its place in `ps`: only a loop that turns
says it is alive.

The supervisor names the file in GYRE_BEACON when it starts the process; without it (a process started by hand)
`beat()` costs one clock read. A beat that cannot be written (a full disk) is skipped: the supervisor may then take
the process for hung, which is what a process that cannot write on that disk is, and restart it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "GYRE_BEACON"
EVERY_S = 1.0


class Beacon:
    def __init__(self, path: str | Path | None = None, every_s: float = EVERY_S) -> None:
        path = path if path is not None else os.environ.get(ENV)
        self.path = Path(path) if path else None
        self.every_s = every_s
        self._next = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if self.path is None or now < self._next:
            return
        self._next = now + self.every_s
        try:
            self.path.touch()  # creates it, or sets its mtime to now
        except OSError:
            pass


def beacon_env(beacons: Path | None, name: str) -> dict[str, str] | None:
    """The environment to start process `name` with: this one's, with its beacon named (None: no beacons). A
    beacon left by an earlier process of that name is removed, so that only the new one's beats count."""
    if beacons is None:
        return None
    beacons.mkdir(parents=True, exist_ok=True)
    path = beacons / name
    path.unlink(missing_ok=True)
    return {**os.environ, ENV: str(path)}


def silent_for(beacons: Path, name: str, now: float | None = None) -> float | None:
    """Seconds since process `name` last beat; None while it has not beaten yet (it is starting)."""
    try:
        return (time.time() if now is None else now) - (beacons / name).stat().st_mtime
    except FileNotFoundError:
        return None
