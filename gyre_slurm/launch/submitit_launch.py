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
from gyre_slurm.launch.local import service_specs, wait_agents_up
from gyre_slurm.rundir import load_run_config, read_control, run_id_for


class DaemonJob(submitit.helpers.Checkpointable):
    """The daemon's job: `gyre daemon --cell-jobs` with the proxy and the harness workers beside it, each started
    again if it dies (launch/supervise.py). Requeued (its checkpoint is itself), it resumes the run from the ledger."""

    def __call__(self, cfg: RunConfig, run_dir: str, run_id: str, base_model: str | None) -> None:
        import yaml

        from gyre_slurm.config import dump_config
        from gyre_slurm.launch.supervise import keep
        from gyre_slurm.spawn import gyre_argv

        rd = Path(run_dir)
        # the config as the job sees it: absolute folders (the job may start elsewhere), the model submit made
        run = cfg.run.model_copy(update={"state_dir": rd.parent})
        model = cfg.model.model_copy(update={"path": Path(base_model)}) if base_model and cfg.model.path else cfg.model
        path = rd / "slurm" / "daemon-config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(dump_config(cfg.model_copy(update={"run": run, "model": model})),
                                       sort_keys=False))
        specs = {"daemon": (gyre_argv("daemon", str(path), "--run-id", run_id, "--cell-jobs"), None),
                 **service_specs(cfg, rd)}
        code = keep(specs, "daemon", rd)
        if code != 0:
            raise GyreError(f"the daemon ended with exit status {code}; see the job's output and {rd}/logs/")


class CellJob(submitit.helpers.Checkpointable):
    """One cell's job: a node agent on each of its nodes, started again if it dies. Requeued, the agents register
    again and the cell rejoins."""

    def __call__(self, run_dir: str, cell: int, nodes_per_cell: int) -> None:
        from gyre_slurm.launch.supervise import keep
        from gyre_slurm.spawn import gyre_argv

        node_index = cell * nodes_per_cell + submitit.JobEnvironment().node
        name = f"agent-{node_index}"
        argv = gyre_argv("agent", "--run-dir", run_dir, "--node-index", str(node_index))
        code = keep({name: (argv, None)}, name, Path(run_dir))
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
        jobs[cell] = ex.submit(CellJob(), str(run_dir), cell, npc).job_id
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
    run_id = run_id_for(cfg, run_id)
    run_dir = (cfg.run.state_dir / run_id).resolve()
    base = ensure_model(cfg, echo=echo).resolve() if cfg.cluster.engine != "none" else None  # before any job
    run_dir.mkdir(parents=True, exist_ok=True)
    ex = _executor(cfg, run_dir)
    ex.update_parameters(name=f"gyre-{run_id}-daemon", nodes=1)
    submitted_at = time.time()
    daemon = ex.submit(DaemonJob(), cfg, str(run_dir), run_id, str(base) if base else None)
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

    cfg = load_run_config(run_dir)
    cells = request(run_dir, AddCellsRequest(n=n))["cells"]
    jobs = submit_cells(cfg, run_dir.resolve(), cells)
    echo(f"cell(s) {', '.join(map(str, cells))}: submitted job(s) {', '.join(jobs.values())}; they join the run "
         "when their agents register")
    return jobs
