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
