"""Running a black-box program (the harness, an evaluator) in its own process group with a wall-clock limit.

The program gets its own session, so on a timeout or a cancel the whole group goes (SIGTERM, a short grace,
then SIGKILL) and grandchildren it started die too. After a normal exit the group is killed as well: nothing
the harness left running may touch the workspace while the evaluator scores it. A program that leaves its
process group on purpose (setsid) escapes this; containing that needs cgroups.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gyre_slurm.errors import GyreError

TERM_GRACE_S = 2.0  # between SIGTERM and SIGKILL
_POLL_S = 0.05


class HarnessError(GyreError):
    """A program could not be started (missing executable, bad working folder)."""


@dataclass(frozen=True)
class HarnessResult:
    exit_code: int | None  # None when we killed it (timeout or cancel); negative: killed by that signal
    timed_out: bool
    duration_s: float
    cancelled: bool = False  # killed because the worker is shutting down


def _exited(pid: int) -> bool:
    # WNOWAIT: leave the child a zombie, so its pid (= the group id) cannot be reused before we kill the group
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _terminate(pid: int, grace_s: float) -> None:
    _killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not _exited(pid):
        time.sleep(_POLL_S)
    _killpg(pid, signal.SIGKILL)  # always: grandchildren may outlive a leader that obeyed SIGTERM


def run_in_group(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float, stdout: IO | int,
                 stderr: IO | int, cancel: threading.Event | None = None,
                 grace_s: float = TERM_GRACE_S, preexec: Callable[[], None] | None = None) -> HarnessResult:
    """Run argv (never through a shell) in a new session; `env` is the complete environment; `preexec` runs in
    the child before exec (resource limits)."""
    if not argv:
        raise HarnessError("empty command: the argv list has no program")
    if not Path(cwd).is_dir():
        raise HarnessError(f"cannot start {argv[0]!r}: working folder {cwd} does not exist")
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=preexec)
    except OSError as e:
        raise HarnessError(f"cannot start {argv[0]!r} in {cwd}: {e.strerror or e}") from None
    deadline = start + timeout_s
    why = None
    while not _exited(proc.pid):
        if cancel is not None and cancel.is_set():
            why = "cancel"
            break
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        if cancel is not None:
            cancel.wait(min(_POLL_S, left))
        else:
            time.sleep(min(_POLL_S, left))
    if why is None:
        _killpg(proc.pid, signal.SIGKILL)  # leftovers of a program that has exited
    else:
        _terminate(proc.pid, grace_s)
    rc = proc.wait()
    return HarnessResult(exit_code=None if why else rc, timed_out=why == "timeout",
                         duration_s=time.monotonic() - start, cancelled=why == "cancel")


def run_harness(argv: list[str], workspace: Path, env: dict[str, str], timeout_s: float, log_path: Path, *,
                cancel: threading.Event | None = None, grace_s: float = TERM_GRACE_S,
                preexec: Callable[[], None] | None = None) -> HarnessResult:
    """Run the harness in `workspace` with os.environ + `env`; stdout and stderr go to `log_path` (appended).
    Setting `cancel` kills it early (result.cancelled). argv comes sandboxed already (harness/sandbox.py)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return run_in_group(list(argv), Path(workspace), {**os.environ, **env}, timeout_s, log, subprocess.STDOUT,
                            cancel=cancel, grace_s=grace_s, preexec=preexec)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(path: Path, max_lines: int = 10, max_chars: int = 1500) -> str:
    """The last lines of a log file ('' if there is none), for one-message diagnostics."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8 * max_chars))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    tail = "\n".join(text.rstrip().splitlines()[-max_lines:])
    return tail[-max_chars:]
