"""What Slurm says about a run's jobs: their states, read with squeue (and sacct for jobs squeue has forgotten).

Used by the daemon (a cell whose job ended is DOWN at once, with the job's state as the reason, instead of after
the heartbeat timeout) and by node agents (an agent whose daemon's job ended for good stops instead of waiting
for ever). Never raises: a Slurm that does not answer yields no states, and the callers fall back on heartbeats.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("gyre.slurm")

# A job in one of these will not run again by itself (a requeued job goes back to PENDING instead).
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT"})
RUNNING = frozenset({"RUNNING"})  # anything else (PENDING, REQUEUED, COMPLETING, SUSPENDED…): its agents are not up


def _run(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("%s: %s", argv[0], e)
        return ""
    return r.stdout if r.returncode == 0 else ""


def _parse(out: str) -> dict[str, str]:
    states = {}
    for line in out.splitlines():
        if "|" in line:
            job, state = line.split("|", 1)
            if job.strip() and state.strip():
                states[job.strip()] = state.split()[0]  # sacct says "CANCELLED by 1000"
    return states


def job_states(jobs: Iterable[str]) -> dict[str, str]:
    """{job id: state} for the jobs Slurm knows; squeue first (current), then sacct for what squeue no longer lists."""
    ids = sorted({j for j in jobs if j})
    if not ids:
        return {}
    states = _parse(_run(["squeue", "--states=all", "-h", "-o", "%i|%T", "-j", ",".join(ids)]))
    missing = [j for j in ids if j not in states]
    if missing:
        states.update({j: s for j, s in _parse(_run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j",
                                                      ",".join(missing)])).items() if j in missing})
    return states


class JobWatch:
    """Polls the states of a changing set of jobs in a thread, so the daemon's loop never waits on Slurm."""

    def __init__(self, jobs: Callable[[], Iterable[str]], poll_s: float = 5.0,
                 query: Callable[[Iterable[str]], dict[str, str]] = job_states) -> None:
        self._jobs, self._query, self.poll_s = jobs, query, poll_s
        self._lock = threading.Lock()
        self._states: dict[str, tuple[str, float]] = {}  # job → (state, when it was read)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="slurm-watch", daemon=True)

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = list(self._jobs())
                at = time.time()  # before the query: a registration after this instant is newer than the answer
                states = self._query(jobs) if jobs else {}
                with self._lock:
                    self._states = {j: (s, at) for j, s in states.items()}
            except Exception:  # a watch that fails leaves the heartbeats to notice
                log.exception("reading Slurm job states failed")
            self._stop.wait(self.poll_s)

    def states(self) -> dict[str, tuple[str, float]]:
        with self._lock:
            return dict(self._states)
