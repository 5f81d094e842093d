"""Start a child process and wait until it is ready: the one way launchers, agents, benchmarks and tests do it.

A server that picks its own port says where it listens by writing a small JSON "ready file" atomically once it
accepts connections; the spawner polls for that file (or any other readiness probe) while watching that the child
is still alive, so a child that dies during start-up fails at once with its log named, never after the timeout.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gyre_slurm.errors import GyreError

T = TypeVar("T")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawn(argv: Sequence[str], log_file: Path | None = None, *, env: Mapping[str, str] | None = None,
          cwd: Path | str | None = None, die_with_parent: bool = True,
          new_session: bool = False, inherit_output: bool = False, stdin_pipe: bool = False) -> subprocess.Popen:
    """Start argv (never through a shell) with stdout and stderr appended to log_file (or discarded). With
    die_with_parent the child gets SIGTERM when its spawner dies, so nothing is left behind — but Linux ties this
    (PR_SET_PDEATHSIG) to the spawning *thread*: spawn from a short-lived thread with die_with_parent=False.
    new_session: the child leads a process group of its own (stop it and what it started with os.killpg).
    inherit_output: without a log file, the child writes where this process does (a job's output).
    stdin_pipe: the child reads what this process writes to `proc.stdin` (its end closed: EOF)."""
    out: Any
    if inherit_output and log_file is None:
        out = None
    elif log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_file, "ab")  # noqa: SIM115 - the child keeps its own copy of the descriptor
    else:
        out = subprocess.DEVNULL
    try:
        return subprocess.Popen(list(argv), stdout=out, stderr=None if out is None else subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd,
                                preexec_fn=_die_with_parent if die_with_parent else None,
                                start_new_session=new_session)
    finally:
        if log_file is not None:
            out.close()


def stop(procs: subprocess.Popen | Sequence[subprocess.Popen], grace_s: float = 10.0, *, group: bool = False) -> None:
    """Stop processes: SIGTERM to each, up to grace_s for all of them to end, then SIGKILL to what is left, and reap
    them. group: signal each one's process group instead (spawned with new_session: the leader and what it started,
    e.g. SGLang's scheduler), and wait for the whole group to be gone. The one way a run's processes are stopped."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)

    def running(p: subprocess.Popen) -> bool:
        if not group:
            return p.poll() is None
        p.poll()  # reap the leader, so that a group left with only its zombie counts as gone
        try:
            os.killpg(p.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def send(sig: int) -> None:
        for p in procs:
            if running(p):
                try:
                    os.killpg(p.pid, sig) if group else p.send_signal(sig)
                except (ProcessLookupError, PermissionError):
                    pass

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    send(signal.SIGKILL)
    for p in procs:
        p.wait()


def exit_with_parent(parent: int, poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """In a child: SIGTERM itself (a clean stop) once its parent, the process `parent` that started it, is gone
    (at once if it already is: a child still starting may outlive it), and exit outright if that stop has not
    ended it within grace_s. For children spawned from a short-lived thread, where die_with_parent cannot be used;
    a kill -9 of the parent leaves no orphan."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)  # the clean stop hung (e.g. a peer holding a connection open)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def wait_until(probe: Callable[[], T | None], *, what: str, timeout_s: float,
               procs: subprocess.Popen | Sequence[subprocess.Popen] = (), log: Path | None = None,
               poll_s: float = 0.05) -> T:
    """Poll `probe` until it returns something other than None/False and return it. Raises GyreError naming
    `what` (and the log) as soon as one of `procs` exits, or when `timeout_s` passes."""
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    where = f"; see {log}" if log is not None else ""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        for p in procs:
            if p.poll() is not None:
                raise GyreError(f"{what}: the process exited with code {p.returncode} while starting{where}")
        if time.monotonic() > deadline:
            raise GyreError(f"{what}: not ready within {timeout_s:g} s{where}")
        time.sleep(poll_s)


def write_ready_file(path: Path | str, info: Mapping[str, Any]) -> None:
    """Write the ready file atomically: the spawner polls for it and must never read half of it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(dict(info)) + "\n")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: nothing half-written left behind
        raise


def read_ready_file(path: Path | str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_ready_file(path: Path | str, proc: subprocess.Popen, *, what: str, timeout_s: float,
                    log: Path | None = None) -> dict[str, Any]:
    """Wait for `proc` to write its ready file (remove a stale one before spawning) and return its content."""
    return wait_until(lambda: read_ready_file(path), what=what, timeout_s=timeout_s, procs=proc, log=log)


def free_port(host: str) -> int:
    """A TCP port free on `host` now (for a child or a peer group that must be told its port before it binds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gyre_argv(*args: str) -> list[str]:
    """argv of a `gyre` subcommand run by this interpreter (every process of a run is one of these)."""
    return [sys.executable, "-m", "gyre_slurm", *args]
