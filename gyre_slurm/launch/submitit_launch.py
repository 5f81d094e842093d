"""`gyre submit`: the run as Slurm jobs through submitit — one job for the daemon, one job per cell.

The built-in model is made ready before any job is submitted (the daemon is handed its path). A cell job that is
cancelled or fails leaves its cell DOWN (lost heartbeats); the daemon takes the cell back when agents of that cell
register again (e.g. a cell job resubmitted by hand). Not done yet: adding cells to a running run, requeueing
preempted cell jobs, and starting the proxy and harness workers (run `gyre proxy` / `gyre worker` yourself).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config import RunConfig, load_config
from gyre_slurm.launch.local import wait_agents_up
from gyre_slurm.rundir import new_run_id
from gyre_slurm.train.base_model import ensure_model


def daemon_entry(config_path: str, run_dir: str, run_id: str, base_model: str | None) -> None:
    import logging

    from gyre_slurm.coordinator.daemon import run_daemon

    logging.basicConfig(level=logging.INFO, format="%(asctime)s daemon %(levelname)s %(message)s")
    run_daemon(load_config(config_path), Path(run_dir), run_id, Path(base_model) if base_model else None)


def agent_entry(run_dir: str, cell: int, nodes_per_cell: int) -> None:
    import logging

    import submitit

    from gyre_slurm.agent.node_agent import NodeAgent

    node_index = cell * nodes_per_cell + submitit.JobEnvironment().node
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{node_index}] %(levelname)s %(message)s")
    NodeAgent(Path(run_dir), node_index).serve()


@dataclass
class Submission:
    run_id: str
    run_dir: Path
    daemon_job: str
    cell_jobs: list[str]
    jobs: list  # submitit Job objects


def _executor(cfg: RunConfig, folder: Path):
    import submitit

    # the jobs run this interpreter (or slurm.python), so they see the same installed gyre_slurm
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_python=cfg.slurm.python or sys.executable)
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


def submit_run(cfg: RunConfig, config_path: Path, run_id: str | None = None, wait: bool = True,
               wait_timeout_s: float = 300.0, echo: Callable[[str], None] = print) -> Submission:
    run_id = run_id or new_run_id(cfg.run.name)
    run_dir = (cfg.run.state_dir / run_id).resolve()
    base = ensure_model(cfg, echo=echo).resolve() if cfg.cluster.engine != "none" else None  # before any job
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    ex = _executor(cfg, folder)
    ex.update_parameters(name=f"gyre-{run_id}-daemon", nodes=1)
    daemon = ex.submit(daemon_entry, str(Path(config_path).resolve()), str(run_dir), run_id,
                       str(base) if base else None)
    echo(f"submitted the daemon as job {daemon.job_id}")
    jobs = [daemon]
    npc = cfg.cluster.nodes_per_cell
    for cell in range(cfg.cluster.cells):
        extra = {"gpus_per_node": cfg.slurm.gpus_per_node} if cfg.slurm.gpus_per_node else {}
        ex.update_parameters(name=f"gyre-{run_id}-cell{cell}", nodes=npc, **extra)
        jobs.append(ex.submit(agent_entry, str(run_dir), cell, npc))
    echo(f"submitted {cfg.cluster.cells} cell job(s): {', '.join(j.job_id for j in jobs[1:])}")
    if wait:
        wait_agents_up(run_dir, cfg.cluster.nodes, wait_timeout_s)
        echo(f"all {cfg.cluster.nodes} node agents registered")
    return Submission(run_id, run_dir, daemon.job_id, [j.job_id for j in jobs[1:]], jobs)
