"""`gyre submit`: the run as Slurm jobs through submitit — one small job for the daemon (with the TITO proxy and
the harness workers beside it), one job of `nodes_per_cell` nodes per cell — and `gyre cells add`, which submits
more cell jobs while the run goes on.

Slurm is part of the elasticity: the daemon reads its cell jobs' states (cells.slurm_job_id / slurm_state), so a
cell job that is cancelled, fails or is preempted turns its cell DOWN at once, its runs continue on the other
cells and its shards are redone. Every job is requeueable: one requeued by Slurm (`scontrol requeue`,
preemption) or by itself before its time limit (submitit's checkpoint, signalled `signal_delay_s` before) runs
again under the same job id — a cell's agents register again and the cell rejoins; the daemon resumes from the
ledger, its agents waiting meanwhile. Stop the whole run with `gyre stop RUN`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import submitit

from gyre_slurm.bootstrap.base_model import ensure_model
from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.local import wait_agents_up
from gyre_slurm.launch.plan import SERVICES, run_plan
from gyre_slurm.launch.start_check import check_model_at_start
from gyre_slurm.run_context import RunContext
from gyre_slurm.rundir import read_control


class DaemonJob(submitit.helpers.Checkpointable):
    """The daemon's job: the services of the run's plan — `gyre daemon --cell-jobs` with the proxy and the harness
    workers beside it — each started again if it dies (launch/supervise.py). Requeued (its checkpoint is itself), it
    resumes the run from the ledger."""

    def __call__(self, run_dir: str) -> None:
        from gyre_slurm.launch.supervise import keep_node

        ctx = RunContext.open(Path(run_dir))  # the config gyre submit saved
        code = keep_node(run_plan(ctx.config, ctx.run_dir, cell_jobs=True), SERVICES, ctx.run_dir,
                         ctx.config.control.hang_timeout_s)
        if code != 0:
            raise GyreError(f"the daemon ended with exit status {code}; see the job's output and {run_dir}/logs/")


class CellJob(submitit.helpers.Checkpointable):
    """One cell's job: the node agent of the plan on each of its nodes, started again if it dies. Requeued, the
    agents register again and the cell rejoins."""

    def __call__(self, run_dir: str, cell: int) -> None:
        from gyre_slurm.launch.supervise import keep_node

        ctx = RunContext.open(Path(run_dir))
        node_index = cell * ctx.config.cluster.nodes_per_cell + submitit.JobEnvironment().node
        code = keep_node(run_plan(ctx.config, ctx.run_dir, cells=cell + 1), node_index, ctx.run_dir,
                         ctx.config.control.hang_timeout_s)
        if code != 0:
            raise GyreError(f"the agent of node {node_index} ended with exit status {code}")


@dataclass
class Submission:
    run_id: str
    run_dir: Path
    daemon_job: str
    cell_jobs: dict[int, str]  # cell → Slurm job id


def _executor(cfg: RunConfig, run_dir: Path) -> submitit.AutoExecutor:
    # the jobs run this interpreter (or slurm.python), so they see the same installed gyre_slurm
    ex = submitit.AutoExecutor(folder=run_dir / "slurm", cluster="slurm", slurm_max_num_timeout=cfg.slurm.max_requeues,
                               slurm_python=cfg.slurm.python or sys.executable)
    params = dict(timeout_min=cfg.slurm.time_limit_min, cpus_per_task=cfg.slurm.cpus_per_task, tasks_per_node=1)
    if cfg.slurm.partition:
        params["slurm_partition"] = cfg.slurm.partition
    if cfg.slurm.account:
        params["slurm_account"] = cfg.slurm.account
    if cfg.slurm.mem_gb:
        params["mem_gb"] = cfg.slurm.mem_gb
    if cfg.slurm.extra_args:
        params["slurm_additional_parameters"] = dict(cfg.slurm.extra_args)
    ex.update_parameters(**params)
    return ex


def submit_cells(cfg: RunConfig, run_dir: Path, cells: list[int]) -> dict[int, str]:
    """One job per cell (its nodes, its GPUs); the daemon is told the job ids so `gyre status` shows them pending."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import CellJobsRequest

    ex = _executor(cfg, run_dir)
    npc = cfg.cluster.nodes_per_cell
    extra = {"gpus_per_node": cfg.slurm.gpus_per_node} if cfg.slurm.gpus_per_node else {}
    jobs = {}
    for cell in cells:
        ex.update_parameters(name=f"gyre-{run_dir.name}-cell{cell}", nodes=npc, **extra)
        jobs[cell] = ex.submit(CellJob(), str(run_dir), cell).job_id
    request(run_dir, CellJobsRequest(jobs=jobs))
    return jobs


def _wait_daemon(run_dir: Path, since: float, timeout_s: float) -> None:
    """Until the daemon of the job just submitted listens (a resumed run's control.json is an old daemon's first)."""
    deadline = time.monotonic() + timeout_s
    while read_control(run_dir, wait_s=timeout_s).started_at < since:
        if time.monotonic() > deadline:
            raise GyreError(f"the daemon's job did not start within {timeout_s:g} s (see {run_dir}/slurm/)")
        time.sleep(0.2)


def submit_run(cfg: RunConfig, run_id: str | None = None, wait: bool = True, wait_timeout_s: float = 300.0,
               echo: Callable[[str], None] = print) -> Submission:
    if cfg.cluster.engine != "none":
        # before any job: a planning shape, sizes that do not split, a plan that does not fit are refused here
        check_model_at_start(cfg, ensure_model(cfg, echo=echo))
    ctx = RunContext.create(cfg, run_id)  # the config every job of the run reads
    run_id, run_dir = ctx.run_id, ctx.run_dir
    ex = _executor(cfg, run_dir)
    ex.update_parameters(name=f"gyre-{run_id}-daemon", nodes=1)
    submitted_at = time.time()
    daemon = ex.submit(DaemonJob(), str(run_dir))
    echo(f"submitted the daemon (with the proxy and {cfg.harness.workers} harness worker(s)) as job {daemon.job_id}")
    _wait_daemon(run_dir, since=submitted_at, timeout_s=wait_timeout_s)  # the cell jobs' ids go to this daemon
    cells = submit_cells(cfg, run_dir, list(range(cfg.cluster.cells)))
    echo(f"submitted {len(cells)} cell job(s): {', '.join(cells.values())}")
    if wait:
        wait_agents_up(run_dir, cfg.cluster.nodes, wait_timeout_s)
        echo(f"all {cfg.cluster.nodes} node agents registered")
    return Submission(run_id, run_dir, daemon.job_id, cells)


def add_cells(run_dir: Path, n: int, echo: Callable[[str], None] = print) -> dict[int, str]:
    """`gyre cells add`: the daemon names the cells (DOWN ones whose job is over first), then each gets a job."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import AddCellsRequest

    cfg = RunContext.open(run_dir).config
    cells = request(run_dir, AddCellsRequest(n=n))["cells"]
    jobs = submit_cells(cfg, run_dir.resolve(), cells)
    echo(f"cell(s) {', '.join(map(str, cells))}: submitted job(s) {', '.join(jobs.values())}; they join the run "
         "when their agents register")
    return jobs
