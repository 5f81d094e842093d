"""Single-allocation layout (pure): Slurm's compressed node lists, and which node runs what."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gyre_slurm.errors import GyreError
from gyre_slurm.launch.layout import expand_nodelist, plan

from .conftest import REPO


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node1", ["node1"]),
    ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
    ("gpu-a[08-10],login", ["gpu-a08", "gpu-a09", "gpu-a10", "login"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b[1,3]c,d", ["a", "b1c", "b3c", "d"]),
])
def test_node_lists_expand_as_scontrol_show_hostnames_does(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[1-", "node[a-b]", "node[1-2"])
def test_unreadable_node_lists_are_refused(bad: str) -> None:
    with pytest.raises(GyreError, match="node list"):
        expand_nodelist(bad)


def test_services_share_the_first_node_or_get_it_alone() -> None:
    shared = plan(expand_nodelist("n[1-4]"), cells=2, nodes_per_cell=2)
    assert (shared.services, shared.agents, shared.dedicated) == ("n1", ("n1", "n2", "n3", "n4"), False)
    alone = plan(expand_nodelist("n[1-5]"), cells=2, nodes_per_cell=2)
    assert (alone.services, alone.agents, alone.dedicated) == ("n1", ("n2", "n3", "n4", "n5"), True)
    assert [alone.node_index(h) for h in ("n2", "n5")] == [0, 3]
    with pytest.raises(GyreError, match="node n1 runs no agent"):
        alone.node_index("n1")
    with pytest.raises(GyreError, match=r"has 3 node\(s\); this config needs 4 .* sbatch -N 4 or -N 5"):
        plan(expand_nodelist("n[1-3]"), cells=2, nodes_per_cell=2)


def test_gyre_layout_prints_the_plan_inside_an_allocation(tmp_path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_NODELIST": "node[1-5]", "SLURM_JOB_ID": "77"}
    cmd = [sys.executable, "-m", "gyre_slurm", "layout", str(REPO / "configs/tiny-slurm.yaml")]
    r = subprocess.run([*cmd, "--line"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["tiny-slurm-77", "node2,node3,node4,node5", "4", "node1"]
    r = subprocess.run([*cmd, "--line"], capture_output=True, text=True, env={**env, "GYRE_RUN_ID": "mine"},
                       cwd=tmp_path)
    assert r.stdout.split()[0] == "mine"
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "SLURM_JOB_NODELIST": "node[1-3]"},
                       cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "sbatch -N 4 or -N 5" in r.stderr, r.stderr


def _megatron(cells: int, nodes_per_cell: int, gpus_per_cell: int, tp: int, pp: int, dp: int, ep: int = 1):
    from gyre_slurm.config import parse_config

    return parse_config({"run": {"name": "m"}, "cluster": {"cells": cells, "nodes_per_cell": nodes_per_cell,
                                                           "gpus_per_cell": gpus_per_cell, "engine": "none"},
                         "train": {"backend": "megatron", "tensor_parallel": tp, "pipeline_parallel": pp,
                                   "data_parallel": dp, "expert_parallel": ep}})


def _groups(placed, key) -> list[list[int]]:
    """The rank groups that share every coordinate but `key` (what megatron-core calls that kind's groups)."""
    groups: dict[tuple, list[int]] = {}
    for p in placed:
        groups.setdefault(key(p), []).append(p.rank)
    return sorted(groups.values())


@pytest.mark.parametrize(("tp", "pp", "dp", "ep", "nodes"), [
    (2, 2, 2, 1, 1), (8, 1, 4, 1, 4), (4, 2, 4, 2, 4), (2, 1, 8, 4, 2), (1, 4, 2, 2, 1), (4, 1, 2, 2, 1),
])
def test_ranks_are_megatron_cores_groups(tp: int, pp: int, dp: int, ep: int, nodes: int) -> None:
    from megatron.core.parallel_state import RankGenerator

    from gyre_slurm.launch.ranks import place_ranks

    n = tp * pp * dp
    cfg = _megatron(2, nodes, n, tp, pp, dp, ep)
    placed = place_ranks(cfg, [f"g{i}" for i in range(2 * nodes)])
    assert len(placed) == 2 * n and [p.rank for p in placed] == [*range(n), *range(n)]
    cell1 = [p for p in placed if p.cell == 1]
    assert {p.node for p in cell1} == {f"g{i}" for i in range(nodes, 2 * nodes)}
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")  # etp = tp by default
    c0 = placed[:n]
    assert _groups(c0, lambda p: (p.pp, p.dp)) == sorted(dense.get_ranks("tp"))
    assert _groups(c0, lambda p: (p.tp, p.pp)) == sorted(dense.get_ranks("dp"))
    assert _groups(c0, lambda p: (p.tp, p.dp)) == sorted(dense.get_ranks("pp"))
    assert _groups(c0, lambda p: (p.tp, p.pp, p.dp // ep)) == sorted(expert.get_ranks("ep"))
    assert _groups(c0, lambda p: (p.tp, p.pp, p.ep)) == sorted(expert.get_ranks("dp"))
    # a TP group never leaves its node, and every GPU of a node is used once
    assert all(len({c0[r].node for r in g}) == 1 for g in dense.get_ranks("tp"))
    assert len({(p.node, p.gpu) for p in placed}) == len(placed)


def test_cpu_cells_spread_their_ranks_over_their_nodes() -> None:
    from gyre_slurm.launch.ranks import place_ranks

    placed = place_ranks(_megatron(2, 2, 0, 1, 1, 3), ["a", "b", "c", "d", "e"])  # a: the services alone
    assert [(p.cell, p.rank, p.node, p.gpu) for p in placed] == [
        (0, 0, "b", None), (0, 1, "b", None), (0, 2, "c", None), (1, 0, "d", None), (1, 1, "d", None),
        (1, 2, "e", None)]
    with pytest.raises(GyreError, match=r"has 3 node\(s\); this config needs 4"):
        place_ranks(_megatron(2, 2, 0, 1, 1, 3), ["a", "b", "c"])


def test_gyre_layout_with_nodes_prints_every_rank(tmp_path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "gyre_slurm", "layout", str(REPO / "configs/paper-122b.yaml")]
    run = {"capture_output": True, "text": True, "env": env, "cwd": REPO}  # the config's model.path is relative
    r = subprocess.run([*cmd, "--nodes", "gpu[001-032]"], **run)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("cell ") and " rank " in line]
    assert len(rows) == 4 * 64
    at = {(int(w[1]), int(w[3])): (w[5], int(w[7]), *map(int, w[9::2])) for w in rows}
    assert at[(0, 0)] == ("gpu001", 0, 0, 0, 0, 0)
    assert at[(0, 13)] == ("gpu002", 5, 0, 0, 13, 13)  # TP 1: rank 13 = dp 13, its EP coordinate dp mod 64
    assert at[(3, 63)] == ("gpu032", 7, 0, 0, 63, 63)
    assert "cell 2: gpu017, gpu018, gpu019, gpu020, gpu021, gpu022, gpu023, gpu024" in r.stdout
    assert "memory plan per GPU of 80 GiB" in r.stdout  # as gyre check prints it
    r = subprocess.run([*cmd, "--nodes", "gpu[001-032]", "--line"], **run)
    assert r.returncode == 0 and r.stdout.split()[1:] == [",".join(f"gpu{i:03d}" for i in range(1, 33)), "32",
                                                         "gpu001"]
    for nodes in ("gpu[001-031]", "gpu[001-034]"):
        r = subprocess.run([*cmd, "--nodes", nodes], **run)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and "sbatch -N 32 or -N 33" in lines[0], r.stderr
    r = subprocess.run(cmd, **run)
    assert r.returncode == 1 and "SLURM_JOB_NODELIST is not set" in r.stderr and "Traceback" not in r.stderr
