"""The Slurm-facing commands: `gyre submit` (a job per cell), `gyre layout` (who runs where in one allocation),
`gyre node-run` (a node's share of the run in one allocation) and `gyre keep` (a command started again when it
dies)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import typer

from gyre_slurm.cli_common import ConfigOpt, RunDirOpt, RunIdOpt, console
from gyre_slurm.config import RunConfig, load_config
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.layout import Layout, expand_nodelist, plan


def allocation_hosts(nodes: str | None = None) -> list[str]:
    """The hosts of --nodes (Slurm's compressed form), else of this allocation (SLURM_JOB_NODELIST)."""
    nodelist = nodes or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise GyreError("not inside a Slurm allocation (SLURM_JOB_NODELIST is not set); name the nodes with --nodes")
    return expand_nodelist(nodelist)


def layout_of(cfg: RunConfig, nodes: str | None = None) -> Layout:
    return plan(allocation_hosts(nodes), cfg.cluster.cells, cfg.cluster.nodes_per_cell)


def this_host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def layout(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    line: Annotated[bool, typer.Option("--line", help="One line for scripts: RUN_ID AGENT_NODES N_AGENTS "
                                                      "SERVICES_NODE.")] = False,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Node list to lay out, Slurm's form (gpu[001-016]); "
                                                              "default: SLURM_JOB_NODELIST.")] = None,
) -> None:
    """The node of the daemon, proxy and workers, those of each cell's agents, and where every trainer rank of a
    cell runs (inside an allocation, as sbatch/gyre.sbatch asks, or for the nodes given with --nodes); then the
    memory plan per GPU, as `gyre check` prints it."""
    from gyre_slurm.cli_check import print_memory_plan
    from gyre_slurm.launch.ranks import place_ranks
    from gyre_slurm.rundir import run_id_for

    cfg = load_config(config)
    hosts = allocation_hosts(nodes)
    lay, run_id = plan(hosts, cfg.cluster.cells, cfg.cluster.nodes_per_cell), run_id_for(cfg)
    if line:
        print(run_id, ",".join(lay.agents), len(lay.agents), lay.services)
        return
    shared = "alone" if lay.dedicated else "beside cell 0's first agent"
    console.print(f"run {run_id}: daemon, proxy and {cfg.harness.workers} worker(s) on {lay.services} ({shared})")
    npc = cfg.cluster.nodes_per_cell
    for c in range(cfg.cluster.cells):
        console.print(f"  cell {c}{' (core)' if c == cfg.cluster.core_cell else ''}: "
                      f"{', '.join(lay.agents[c * npc:(c + 1) * npc])}")
    t = cfg.train
    console.print(f"trainer ranks of each cell (Megatron order tp-cp-ep-dp-pp; TP {t.tensor_parallel} · PP "
                  f"{t.pipeline_parallel} · DP {t.data_parallel}, EP {t.expert_parallel}):", highlight=False)
    width = max(map(len, lay.agents))
    for p in place_ranks(cfg, hosts):
        gpu = "cpu" if p.gpu is None else f"gpu {p.gpu}"
        console.print(f"cell {p.cell} rank {p.rank:<4} node {p.node:<{width}}  {gpu:<6}  tp {p.tp} pp {p.pp} "
                      f"dp {p.dp} ep {p.ep}", highlight=False)
    print_memory_plan(cfg, config)  # refuses, in one line, a config whose ranks do not fit their GPUs


def submit(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    run_id: Annotated[str | None, typer.Option(help="Run id; an existing run is resumed from its ledger (default: "
                                                    "GYRE_RUN_ID, run.id, else the name and a timestamp).")] = None,
    wait: Annotated[bool, typer.Option(help="Wait until every node agent has registered.")] = True,
) -> None:
    """Submit the run as Slurm jobs: the daemon (with proxy and workers) in one, each cell in one of its own."""
    from gyre_slurm.launch.submitit_launch import submit_run

    cfg = load_config(config)
    sub = submit_run(cfg, run_id=run_id, wait=wait, echo=console.print)
    console.print(f"run {sub.run_id}: daemon job {sub.daemon_job}, cell jobs {', '.join(sub.cell_jobs.values())}; "
                  f"watch with `gyre status {sub.run_id}`, stop with `gyre stop {sub.run_id}`")


def keep(
    name: Annotated[str, typer.Argument(help="The process's name in events; {node} is replaced by SLURM_NODEID.")],
    command: Annotated[list[str], typer.Argument(help="The command to run and keep running: everything after NAME "
                                                      "(so gyre keep's own options come before NAME).")],
    run_dir: RunDirOpt = None,
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    budget: Annotated[int, typer.Option(min=0, help="Restarts in a row (each soon after the last) before giving "
                                                    "up.")] = 10,
) -> None:
    """Run COMMAND and start it again, with backoff, whenever it dies (exit status not 0); each restart an events
    row of the run (through its daemon). The allocation's script runs the daemon, proxy, worker and agents this
    way. SIGTERM and SIGINT go on to COMMAND; then it is not started again. Exits with COMMAND's last status."""
    from gyre_slurm.launch.supervise import keep as keep_running
    from gyre_slurm.run_context import RunContext, locate

    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise GyreError("gyre keep needs a command to run after the name")
    where = locate(run_dir, config, run_id) if (run_dir or config) else None
    name = name.replace("{node}", os.environ.get("SLURM_NODEID", "0"))
    try:  # the run's hang timeout, once its config is saved
        hang_s = RunContext.open(where).config.control.hang_timeout_s if where is not None else 0.0
    except GyreError:
        hang_s = 0.0
    raise typer.Exit(keep_running({name: (command, None)}, name, where, budget=budget, hang_s=hang_s))


def node_run(
    config: Annotated[Path, typer.Argument(help="Run config (YAML).")],
    services: Annotated[bool, typer.Option("--services", help="Run the daemon, the TITO proxy and harness.workers "
                                                              "harness workers (saving the run's config first).")]
    = False,
    node_index: Annotated[int | None, typer.Option(help="Run node agent I (default: the agent the allocation's "
                                                        "layout gives this host).")] = None,
) -> None:
    """One node's share of a run in one Slurm allocation (sbatch/gyre.sbatch runs it on every node): the processes
    of the run's plan for this node, each started again if it dies, as `gyre keep` does. --services: the daemon,
    the proxy and the workers (the batch step); else this node's agent (srun). SIGTERM and SIGINT go on to the
    daemon (the agent), which stops cleanly; the others stop after it. Exits with the daemon's (agent's) status."""
    from gyre_slurm.launch.plan import SERVICES, on_node, run_plan
    from gyre_slurm.launch.supervise import keep_node
    from gyre_slurm.run_context import RunContext, run_dir_for

    cfg = load_config(config)
    if services:
        node, run_dir = SERVICES, RunContext.create(cfg).run_dir  # the run's config, saved before its daemon starts
    else:
        node = layout_of(cfg).node_index(this_host()) if node_index is None else node_index
        run_dir = run_dir_for(cfg)
    specs = run_plan(cfg, run_dir)
    console.print(f"gyre: {this_host()} runs {', '.join(p.name for p in on_node(specs, node))}", highlight=False)
    raise typer.Exit(keep_node(specs, node, run_dir, cfg.control.hang_timeout_s))
