"""Supervision of a run's processes (`gyre run`): one that dies is started again, with backoff and a budget.

A process that exits 0 is done (the daemon ended the run; its peers were told to stop). One that dies any other
way (a crash, kill -9, a signal) is started again with the same argv after a backoff that doubles with each of its
restarts (1 s up to 30 s); past `budget` restarts of one process the supervisor gives up and the run is stopped.
Every restart is an `events` row (kind `process_restarted`, through the daemon: it is the ledger's one writer),
and a restarted process rejoins on its own: the daemon resumes from the ledger, agents and workers register
again, a proxy re-sends its journal.

A process that hangs keeps its pid: the supervisor watches its beacon (beacon.py: its main loop beats about once a
second). Silent for more than STALL_S and then beating again is an event (`process_stalled`); silent for more than
`hang_s` (control.hang_timeout_s) it is killed (`process_hung`) and started again as if it had died. A process
that has not beaten yet is starting (loading a model) and is not judged.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.beacon import beacon_env, silent_for
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.plan import ProcessSpec, on_node
from gyre_slurm.spawn import spawn, stop

log = logging.getLogger("gyre.supervise")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0
STALL_S = 4.0  # a silence this long is told (process_stalled) once the process beats again


@dataclass
class Supervised:
    name: str  # daemon, agent-0, proxy, worker-0 …
    argv: list[str]
    log_file: Path | None  # None: its output goes where the supervisor's does
    proc: subprocess.Popen
    restarts: int = 0  # in all
    streak: int = 0  # restarts since it last ran STABLE_S: backoff and budget count these
    started: float = field(default_factory=time.monotonic)
    due: float | None = None  # when it is started again (it died)
    code: int | None = None  # how it last died
    silent_s: float = 0.0  # the longest silence of the one going on (0: it beats)
    hung: bool = False  # it was killed for its silence


@dataclass
class Supervisor:
    budget: int = 10  # restarts of one process before the run is given up
    report: Callable[[str, str], None] = lambda kind, message: None  # an events row (through the daemon)
    beacons: Path | None = None  # the folder of the processes' beacons (None: hangs are not watched)
    hang_s: float = 0.0  # silent this long, a process is killed and started again (0: never)
    members: dict[str, Supervised] = field(default_factory=dict)
    gave_up: str | None = None

    def start(self, name: str, argv: list[str], log_file: Path | None) -> subprocess.Popen:
        """Start and supervise `argv`; its output goes to log_file, or (None) where this process writes."""
        proc = spawn(argv, log_file, inherit_output=True, env=beacon_env(self.beacons, name))
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
            if code is None and m.due is None:
                watch_silence(m, self.beacons, self.hang_s, self.report)
            if m.due is None and code is not None and code != 0:
                if now - m.started >= STABLE_S:
                    m.streak = 0
                if m.streak >= self.budget:
                    self.gave_up = self.gave_up or f"{m.name} died {m.streak + 1} times (last: exit {code})"
                    continue
                m.code, m.due = code, now + BACKOFF_S[min(m.streak, len(BACKOFF_S) - 1)]
                log.warning("%s died (exit %s): starting it again in %.0f s", m.name, code, m.due - now)
            if m.due is not None and now >= m.due:
                m.proc, m.due, m.started = spawn(m.argv, m.log_file, inherit_output=True,
                                                 env=beacon_env(self.beacons, m.name)), None, now
                m.restarts += 1
                m.streak += 1
                started.append(m.name)
                how = "was killed as hung" if m.hung else f"died (exit {m.code})"
                m.hung = False
                msg = (f"{m.name} {how} and was started again (restart {m.streak} of {self.budget} in a row; "
                       f"{m.restarts} in all)")
                log.warning("%s", msg)
                self.report("process_restarted", msg)
        return started

    def restarts(self) -> dict[str, int]:
        return {n: m.restarts for n, m in self.members.items() if m.restarts}


def watch_silence(m: Supervised, beacons: Path | None, hang_s: float, report: Callable[[str, str], None]) -> None:
    """A live process's silence (its beacon in `beacons`): told once it ends, fatal past hang_s (killed; its
    starter starts it again). The supervisor's rule, and a node agent's for the engine it starts itself."""
    silent = silent_for(beacons, m.name) if beacons is not None else None
    if silent is None:
        return
    if silent > STALL_S:
        m.silent_s = max(m.silent_s, silent)
    elif m.silent_s:
        msg = f"{m.name} gave no sign of life for {m.silent_s:.0f} s, then went on (pid {m.proc.pid})"
        log.warning("%s", msg)
        report("process_stalled", msg)
        m.silent_s = 0.0
    if hang_s and silent > hang_s:
        msg = (f"{m.name} gave no sign of life for {silent:.0f} s (control.hang_timeout_s {hang_s:g}): "
               f"hung; killed to be started again (pid {m.proc.pid})")
        log.warning("%s", msg)
        report("process_hung", msg)
        m.hung, m.silent_s = True, 0.0
        m.proc.kill()


@dataclass
class DaemonReports:
    """Events for the daemon (the ledger's one writer), kept until it answers: a restart of the daemon itself is
    reported by its next process."""

    run_dir: Path | None
    queue: list[tuple[str, str]] = field(default_factory=list)

    def add(self, kind: str, message: str) -> None:
        if self.run_dir is not None:
            self.queue.append((kind, message))

    def send(self, daemon_up: Callable[[], bool] = lambda: True) -> None:
        from gyre_slurm.coordinator.client import request
        from gyre_slurm.protocol import EventRequest

        while self.queue and daemon_up():
            kind, message = self.queue[0]
            try:
                request(self.run_dir, EventRequest(kind=kind, message=message[:1000]), timeout_s=2)
            except GyreError:
                return  # not answering yet: next time
            self.queue.pop(0)


def keep(specs: dict[str, tuple[list[str], Path | None]], until: str, run_dir: Path | None, budget: int = 10,
         poll_s: float = 0.5, hang_s: float = 0.0) -> int:
    """Run processes (name → argv, log file or None for this process's output) under a Supervisor until `until`
    exits 0 (its work is over) or one dies past the budget (1); the others are stopped then. `gyre keep` (one
    process), `gyre node-run` (a node of an sbatch allocation: the daemon with its proxy and workers, or an agent) and
    the submitit jobs (the same, in a job each).
    SIGTERM and SIGINT go on to `until`, and after one nothing is started again: the caller (scancel, a requeue,
    the job script) is stopping it. Returns its exit status (128 + N for signal N). With a run folder, their
    beacons are watched (RUN/alive/<name>): silent past hang_s, a process is killed and started again."""
    reports = DaemonReports(run_dir)
    sup = Supervisor(budget, report=reports.add, beacons=beacons_of(run_dir), hang_s=hang_s)
    stopping: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        stopping.append(sig)
        proc = sup.members[until].proc if until in sup.members else None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    try:
        for name, (argv, log_file) in specs.items():
            try:
                sup.start(name, argv, log_file)
            except OSError as e:
                raise GyreError(f"cannot start {argv[0]}: {e.strerror}") from None
        while True:
            code = sup.members[until].proc.poll()
            if code is not None and (code == 0 or stopping):
                return code if code >= 0 else 128 - code
            if not stopping:
                sup.poll()
                if sup.gave_up:
                    log.error("giving up: %s", sup.gave_up)
                    return 1
                reports.send()
            time.sleep(poll_s)
    finally:
        stop([m.proc for n, m in sup.members.items() if n != until], grace_s=10.0)


def keep_node(plan: list[ProcessSpec], node: int | None, run_dir: Path, hang_s: float) -> int:
    """The processes of a run's plan that run on one node (SERVICES, or agent node k) under `keep`, until the first
    of them ends (the daemon; the node's agent); their output goes where this process's does (the job's)."""
    mine = on_node(plan, node)
    return keep({p.name: (p.argv, None) for p in mine}, mine[0].name, run_dir, hang_s=hang_s)


def beacons_of(run_dir: Path | None) -> Path | None:
    """Where a run's processes beat (beacon.py)."""
    return None if run_dir is None else Path(run_dir) / "alive"
