"""Start a whole run on this machine (the embedded default): its plan (launch/plan.py) as processes — the daemon,
one agent per node, the TITO proxy and the harness workers.

Children get SIGTERM if the launcher dies (PR_SET_PDEATHSIG), so a killed `gyre run` leaves nothing behind.
Each process logs to state/<run>/logs/, and logs/pids.json names them. `supervise()` (gyre run's loop) starts
again any that dies (launch/supervise.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.beacon import beacon_env
from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError, disk_full
from gyre_slurm.launch.plan import SERVICES, on_node, run_plan
from gyre_slurm.launch.supervise import DaemonReports, Supervisor, beacons_of
from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
from gyre_slurm.run_context import RunContext
from gyre_slurm.rundir import ledger_path, read_control
from gyre_slurm.spawn import spawn, stop, wait_until


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
    specs: dict[str, tuple[list[str], Path]] = field(default_factory=dict)  # name → (argv, log): how to restart it
    restart_budget: int = 10
    hang_s: float = 0.0  # control.hang_timeout_s: a process silent this long is killed and started again
    sup: Supervisor | None = None
    _reports: DaemonReports | None = None  # restarts, for the daemon's events

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.daemon, *self.agents, *self.services]

    def alive(self) -> bool:
        return self.daemon.poll() is None

    def _slots(self) -> dict[str, subprocess.Popen]:
        names = list(self.specs)
        return dict(zip(names, self.procs, strict=True))

    def _put(self, name: str, proc: subprocess.Popen) -> None:
        k = list(self.specs).index(name)
        if k == 0:
            self.daemon = proc
        elif k <= len(self.agents):
            self.agents[k - 1] = proc
        else:
            self.services[k - 1 - len(self.agents)] = proc

    def supervise(self) -> bool:
        """One look (gyre run's loop): start again what died. False once the daemon has ended the run (exit 0), or
        a process died more often than the budget allows (`gave_up` says which)."""
        if self.sup is None:
            self._reports = DaemonReports(self.run_dir)
            self.sup = Supervisor(self.restart_budget, report=self._reports.add, beacons=beacons_of(self.run_dir),
                                  hang_s=self.hang_s)
            for name, (argv, log) in self.specs.items():
                self.sup.adopt(name, argv, log, self._slots()[name])
            self.write_pids()
        for name, proc in self._slots().items():
            self.sup.members[name].proc = proc  # a caller may have replaced one
        if self.daemon.poll() == 0:
            return False
        if self.sup.poll():
            for name, m in self.sup.members.items():
                self._put(name, m.proc)
            self.write_pids()
        self._reports.send(lambda: _daemon_listening(self.run_dir, self.daemon.pid))
        return self.sup.gave_up is None

    @property
    def gave_up(self) -> str | None:
        return self.sup.gave_up if self.sup else None

    def write_pids(self) -> None:
        """logs/pids.json: each process of the run by name, as it runs now."""
        path = self.run_dir / "logs" / "pids.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({name: p.pid for name, p in self._slots().items()}))
            tmp.replace(path)
        except OSError as e:  # a full disk: the old file stays until there is room (the daemon says why)
            tmp.unlink(missing_ok=True)
            if not disk_full(e):
                raise

    def wait(self, timeout_s: float) -> None:
        """Wait for the daemon and the agents to stop (the daemon's Shutdown), then stop the services."""
        deadline = time.monotonic() + timeout_s
        for p in [self.daemon, *self.agents]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        stop(self.procs, grace_s=10.0)

    def kill(self) -> None:
        """Stop every process of the run now (tests, and a launcher that gives up)."""
        stop(self.procs, grace_s=0.0)

    def failed(self) -> list[int]:
        """Exit codes that mean trouble (a service stopped by our SIGTERM is fine)."""
        ok_service = (0, -signal.SIGTERM)
        return ([p.returncode for p in [self.daemon, *self.agents] if p.returncode != 0]
                + [p.returncode for p in self.services if p.returncode not in ok_service])


def start_local_run(cfg: RunConfig, run_id: str | None, start_timeout_s: float = 300.0,
                    eval_version: int | None = None) -> LocalRun:
    """The run's plan (launch/plan.py) as processes of this machine: the daemon, its agents once it listens, the
    proxy and the workers once they are up. `eval_version`: resume a stopped run to evaluate that version and stop
    (`gyre eval`; -1: its last). A process that dies while starting fails the start at once; the time limit is for
    one that hangs (generous: on a busy machine agents and their engines took over a minute to come up)."""
    ctx = RunContext.create(cfg, run_id)
    plan = run_plan(ctx.config, ctx.run_dir, eval_version=eval_version)
    logs = ctx.run_dir / "logs"
    daemon, *services = on_node(plan, SERVICES)  # the proxy and the workers
    agents = [p for p in plan if p.node is not SERVICES]
    # in LocalRun.procs' order: the daemon, the agents, the services
    specs = {p.name: (p.argv, logs / f"{p.name}.log") for p in [daemon, *agents, *services]}

    def start(name: str) -> subprocess.Popen:  # with its beacon: the supervisor watches it
        return spawn(*specs[name], env=beacon_env(beacons_of(ctx.run_dir), name))

    run = LocalRun(ctx.run_dir, start("daemon"), specs=specs, hang_s=ctx.config.control.hang_timeout_s)
    try:
        wait_until(lambda: _daemon_listening(ctx.run_dir, run.daemon.pid), what="the daemon",
                   timeout_s=start_timeout_s, procs=run.daemon, log=logs / "daemon.log", poll_s=0.1)
        run.agents = [start(p.name) for p in agents]
        wait_agents_up(ctx.run_dir, len(agents), start_timeout_s, run.procs)
        run.services = [start(p.name) for p in services]
        run.write_pids()
        return run
    except BaseException:
        stop(run.procs)
        raise
