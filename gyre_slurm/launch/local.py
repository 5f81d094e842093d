"""Start a whole run on this machine (the embedded default): the daemon and one agent per node, as processes.

Children get SIGTERM if the launcher dies (PR_SET_PDEATHSIG), so a killed `gyre run` leaves nothing behind.
Each process logs to state/<run>/logs/.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
from gyre_slurm.rundir import ledger_path, read_control
from gyre_slurm.spawn import gyre_argv, spawn, wait_until


def agents_up(run_dir: Path) -> int:
    """Node agents of the run that are UP in its ledger (0 while the ledger or its schema is not there yet)."""
    if not ledger_path(run_dir).is_file():
        return 0
    conn = connect_readonly(ledger_path(run_dir))
    try:
        return query_dicts(conn, "SELECT count(*) AS n FROM agents WHERE status = 'UP'")[0]["n"]
    except GyreError:
        return 0  # schema not there yet
    finally:
        conn.close()


def wait_agents_up(run_dir: Path, n: int, timeout_s: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    wait_until(lambda: agents_up(run_dir) >= n, what=f"the run's {n} node agents", timeout_s=timeout_s,
               procs=procs, log=run_dir / "logs", poll_s=0.2)


def _daemon_listening(run_dir: Path, pid: int) -> bool:
    try:
        return read_control(run_dir).daemon_pid == pid
    except GyreError:
        return False


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


def start_services(cfg: RunConfig, run_dir: Path) -> list[subprocess.Popen]:
    """The RL loop's processes beside the daemon: the TITO proxy and the harness workers (none without engines).
    They wait for the daemon's control.json themselves."""
    if cfg.cluster.engine == "none":
        return []
    logs = run_dir / "logs"
    procs = [spawn(gyre_argv("proxy", "--run-dir", str(run_dir)), logs / "proxy.log")]
    for w in range(cfg.harness.workers):
        procs.append(spawn(gyre_argv("worker", "--run-dir", str(run_dir), "--worker-id", f"w{w}"),
                           logs / f"worker-{w}.log"))
    return procs


def start_local_run(cfg: RunConfig, config_path: Path, run_id: str, start_timeout_s: float = 60.0) -> LocalRun:
    run_dir = cfg.run.state_dir / run_id
    logs = run_dir / "logs"
    daemon = spawn(gyre_argv("daemon", str(config_path), "--run-id", run_id), logs / "daemon.log")
    try:
        wait_until(lambda: _daemon_listening(run_dir, daemon.pid), what="the daemon", timeout_s=start_timeout_s,
                   procs=daemon, log=logs / "daemon.log", poll_s=0.1)
        run = LocalRun(run_dir, daemon)
        for k in range(cfg.cluster.nodes):
            run.agents.append(spawn(gyre_argv("agent", "--run-dir", str(run_dir), "--node-index", str(k)),
                                    logs / f"agent-{k}.log"))
        wait_agents_up(run_dir, cfg.cluster.nodes, start_timeout_s, run.procs)
        run.services += start_services(cfg, run_dir)
        return run
    except BaseException:
        daemon.terminate()
        raise
