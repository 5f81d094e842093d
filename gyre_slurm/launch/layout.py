"""Single-allocation mode (`sbatch sbatch/gyre.sbatch CONFIG`): which node of the allocation does what.

Pure: the allocation's host list (SLURM_JOB_NODELIST, Slurm's compressed form) and the config give the layout.
With exactly cells × nodes_per_cell nodes, the daemon, the TITO proxy and the harness workers share the first node
with cell 0's first agent; with one node more, they get the first node to themselves (a CPU node beside the GPU
cells, so harnesses never compete with an engine). Any other count is refused before anything starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gyre_slurm.errors import GyreError


def _split_top(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _expand_one(host: str, nodelist: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", host)
    if m is None:
        return [host]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise GyreError(f"cannot read the Slurm node list {nodelist!r} (range {part!r})")
        for k in range(int(lo), int(hi or lo) + 1):
            out += _expand_one(f"{host[:m.start()]}{k:0{len(lo)}d}{host[m.end():]}", nodelist)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[1-3,7],gpu-a[01-02],rack[1-2]-n[1-2]` → node1 node2 node3 node7 gpu-a01 gpu-a02 rack1-n1 … (as
    `scontrol show hostnames` does; zero padding kept)."""
    hosts = [h for part in _split_top(nodelist.strip()) if part for h in _expand_one(part, nodelist)]
    if not hosts or any(c in h for h in hosts for c in "[]"):
        raise GyreError(f"cannot read the Slurm node list {nodelist!r}")
    return hosts


@dataclass(frozen=True)
class Layout:
    services: str  # the node of the daemon, the proxy and the harness workers
    agents: tuple[str, ...]  # agent k (node index k, cell k // nodes_per_cell) runs on agents[k]
    dedicated: bool  # the services' node runs no agent

    def node_index(self, host: str) -> int:
        if host not in self.agents:
            raise GyreError(f"node {host} runs no agent in this layout (agents on {', '.join(self.agents)})")
        return self.agents.index(host)


def plan(hosts: list[str], cells: int, nodes_per_cell: int) -> Layout:
    need = cells * nodes_per_cell
    if len(hosts) == need:
        return Layout(hosts[0], tuple(hosts), dedicated=False)
    if len(hosts) == need + 1:
        return Layout(hosts[0], tuple(hosts[1:]), dedicated=True)
    raise GyreError(f"the allocation has {len(hosts)} node(s); this config needs {need} (cluster.cells {cells} × "
                    f"nodes_per_cell {nodes_per_cell}), or {need + 1} to give the daemon, proxy and workers a node "
                    f"of their own: sbatch -N {need} or -N {need + 1}")
