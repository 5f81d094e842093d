"""Start a whole run on this machine (the embedded default): the daemon and one agent per node, as processes.

Children get SIGTERM if the launcher dies (PR_SET_PDEATHSIG), so a killed `gyre run` leaves nothing behind.
Each process logs to state/<run>/logs/.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
from gyre_slurm.ledger.store import ledger_path
from gyre_slurm.rundir import read_control


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def gyre_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gyre_slurm", *args]


def spawn(args: Sequence[str], log_file: Path) -> subprocess.Popen:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)


def wait_agents_up(run_dir: Path, n: int, timeout_s: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise GyreError(f"a process of the run exited early (code {p.returncode}); see {run_dir}/logs/")
        if ledger_path(run_dir).is_file():
            conn = connect_readonly(ledger_path(run_dir))
            try:
                up = query_dicts(conn, "SELECT count(*) AS n FROM agents WHERE status = 'UP'")[0]["n"]
            except GyreError:
                up = 0  # schema not there yet
            finally:
                conn.close()
            if up >= n:
                return
        time.sleep(0.2)
    raise GyreError(f"only some of the {n} node agents registered within {timeout_s:g} s; see {run_dir}/logs/")


@dataclass
class LocalRun:
    run_dir: Path
    daemon: subprocess.Popen
    agents: list[subprocess.Popen] = field(default_factory=list)
    services: list[subprocess.Popen] = field(default_factory=list)  # proxy and harness workers

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.daemon, *self.agents, *self.services]

    def alive(self) -> bool:
        return self.daemon.poll() is None

    def wait(self, timeout_s: float) -> None:
        """Wait for the daemon and the agents to stop (the daemon's Shutdown), then stop the services."""
        deadline = time.monotonic() + timeout_s
        for p in [self.daemon, *self.agents]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.services:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        """Stop every process of the run now (tests, and a launcher that gives up)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def failed(self) -> list[int]:
        """Exit codes that mean trouble (a service stopped by our SIGTERM is fine)."""
        ok_service = (0, -signal.SIGTERM)
        return ([p.returncode for p in [self.daemon, *self.agents] if p.returncode != 0]
                + [p.returncode for p in self.services if p.returncode not in ok_service])


def start_local_run(cfg: RunConfig, config_path: Path, run_id: str, start_timeout_s: float = 60.0) -> LocalRun:
    run_dir = cfg.run.state_dir / run_id
    logs = run_dir / "logs"
    daemon = spawn(gyre_cmd("daemon", str(config_path), "--run-id", run_id), logs / "daemon.log")
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                if read_control(run_dir).daemon_pid == daemon.pid:
                    break
            except GyreError:
                pass
            if daemon.poll() is not None:
                raise GyreError(f"the daemon exited with code {daemon.returncode}; see {logs / 'daemon.log'}")
            if time.monotonic() > deadline:
                raise GyreError(f"the daemon did not start within {start_timeout_s:g} s; see {logs / 'daemon.log'}")
            time.sleep(0.1)
        run = LocalRun(run_dir, daemon)
        for k in range(cfg.cluster.nodes):
            run.agents.append(spawn(gyre_cmd("agent", "--run-dir", str(run_dir), "--node-index", str(k)),
                                    logs / f"agent-{k}.log"))
        wait_agents_up(run_dir, cfg.cluster.nodes, start_timeout_s, run.procs)
        if cfg.cluster.engine != "none":  # the RL loop: the proxy and the harness workers
            run.services.append(spawn(gyre_cmd("proxy", "--run-dir", str(run_dir)), logs / "proxy.log"))
            for w in range(cfg.harness.workers):
                run.services.append(spawn(gyre_cmd("worker", "--run-dir", str(run_dir), "--worker-id", f"w{w}"),
                                        logs / f"worker-{w}.log"))
        return run
    except BaseException:
        daemon.terminate()
        raise
