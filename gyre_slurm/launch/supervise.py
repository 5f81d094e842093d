"""Supervision of a run's processes (`gyre run`): one that dies is started again, with backoff and a budget.

A process that exits 0 is done (the daemon ended the run; its peers were told to stop). One that dies any other
way (a crash, kill -9, a signal) is started again with the same argv after a backoff that doubles with each of its
restarts (1 s up to 30 s); past `budget` restarts of one process the supervisor gives up and the run is stopped.
Every restart is an `events` row (kind `process_restarted`, through the daemon: it is the ledger's one writer),
and a restarted process rejoins on its own: the daemon resumes from the ledger, agents and workers register
again, a proxy re-sends its journal.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.spawn import spawn

log = logging.getLogger("gyre.supervise")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


@dataclass
class Supervised:
    name: str  # daemon, agent-0, proxy, worker-0 …
    argv: list[str]
    log_file: Path
    proc: subprocess.Popen
    restarts: int = 0
    due: float | None = None  # when it is started again (it died)
    code: int | None = None  # how it last died


@dataclass
class Supervisor:
    budget: int = 10  # restarts of one process before the run is given up
    report: Callable[[str, str], None] = lambda kind, message: None  # an events row (through the daemon)
    members: dict[str, Supervised] = field(default_factory=dict)
    gave_up: str | None = None

    def start(self, name: str, argv: list[str], log_file: Path) -> subprocess.Popen:
        proc = spawn(argv, log_file)
        self.members[name] = Supervised(name, list(argv), log_file, proc)
        return proc

    def adopt(self, name: str, argv: list[str], log_file: Path, proc: subprocess.Popen) -> None:
        """Supervise a process started elsewhere."""
        self.members[name] = Supervised(name, list(argv), log_file, proc)

    def poll(self, now: float | None = None) -> list[str]:
        """Notice deaths, start again what is due; returns the names started again now."""
        now = time.monotonic() if now is None else now
        started = []
        for m in self.members.values():
            code = m.proc.poll()
            if m.due is None and code is not None and code != 0:
                if m.restarts >= self.budget:
                    self.gave_up = self.gave_up or f"{m.name} died {m.restarts + 1} times (last: exit {code})"
                    continue
                m.code, m.due = code, now + BACKOFF_S[min(m.restarts, len(BACKOFF_S) - 1)]
                log.warning("%s died (exit %s): starting it again in %.0f s", m.name, code, m.due - now)
            if m.due is not None and now >= m.due:
                m.proc, m.due = spawn(m.argv, m.log_file), None
                m.restarts += 1
                started.append(m.name)
                msg = f"{m.name} died (exit {m.code}) and was started again (restart {m.restarts} of {self.budget})"
                log.warning("%s", msg)
                self.report("process_restarted", msg)
        return started

    def restarts(self) -> dict[str, int]:
        return {n: m.restarts for n, m in self.members.items() if m.restarts}
