"""A run's processes, for every launcher: `gyre run` (launch/local.py), `gyre submit` (launch/submitit_launch.py)
and one allocation (sbatch/gyre.sbatch through `gyre node-run`) all start what `run_plan` lists.

Pure: the config and the run's folder give the list. Each process is a `gyre` subcommand that opens the run from its
folder (run_context.py); it runs on the services' node (the daemon, the TITO proxy, harness.workers harness
workers) or on agent node k (node agent k; the allocation's layout, launch/layout.py, says which host that is).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.launch.layout import Layout
from gyre_slurm.spawn import gyre_argv

SERVICES = None  # ProcessSpec.node of the daemon, the proxy and the workers


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # daemon, proxy, worker-0 …, agent-<node>: its log (logs/<name>.log) and its name in events
    args: tuple[str, ...]  # the `gyre` subcommand and its options
    node: int | None  # None: the services' node; k: agent node k

    @property
    def argv(self) -> list[str]:
        return gyre_argv(*self.args)

    def host(self, layout: Layout) -> str:
        return layout.services if self.node is SERVICES else layout.agents[self.node]


def run_plan(cfg: RunConfig, run_dir: Path, *, cell_jobs: bool = False, eval_version: int | None = None,
             cells: int | None = None) -> list[ProcessSpec]:
    """The daemon first, then the proxy and the harness workers (none without engines: cluster.engine none), then
    one node agent per node of the cells. cell_jobs: every cell is a Slurm job of its own (gyre submit);
    eval_version: the stopped run resumed to evaluate that version (gyre eval; -1: its last); cells: how many the
    run has (default cluster.cells; `gyre cells add` gives a run more)."""
    rd = str(run_dir)
    daemon = ("daemon", "--run-dir", rd, *(("--cell-jobs",) if cell_jobs else ()),
              *(("--eval-version", str(eval_version)) if eval_version is not None else ()))
    plan = [ProcessSpec("daemon", daemon, SERVICES)]
    if cfg.cluster.engine != "none":
        plan.append(ProcessSpec("proxy", ("proxy", "--run-dir", rd), SERVICES))
        plan += [ProcessSpec(f"worker-{w}", ("worker", "--run-dir", rd, "--worker-id", f"w{w}"), SERVICES)
                 for w in range(cfg.harness.workers)]
    plan += [ProcessSpec(f"agent-{k}", ("agent", "--run-dir", rd, "--node-index", str(k)), k)
             for k in range((cells or cfg.cluster.cells) * cfg.cluster.nodes_per_cell)]
    return plan


def on_node(plan: list[ProcessSpec], node: int | None) -> list[ProcessSpec]:
    """What runs on the services' node (SERVICES) or on agent node `node`."""
    return [p for p in plan if p.node == node]

