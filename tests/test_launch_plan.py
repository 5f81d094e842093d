"""One run plan for every launcher (launch/plan.py), one RunContext every process opens (run_context.py), one way
to stop processes (spawn.stop). That the sbatch path starts the plan's workers is tests/test_slurm.py's to show;
that `gyre run` starts it, every local-run test's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import parse_config
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.layout import expand_nodelist, plan
from gyre_slurm.launch.plan import SERVICES, on_node, run_plan
from gyre_slurm.run_context import RunContext, locate
from gyre_slurm.rundir import CONFIG_FILE, ControlInfo, write_control
from gyre_slurm.spawn import spawn, stop


def _cfg(tmp_path: Path, **cluster: object):
    return parse_config({"run": {"name": "p", "state_dir": str(tmp_path / "state")},
                         "cluster": {"cells": 2, "nodes_per_cell": 2, "engine": "embedded", **cluster},
                         "harness": {"workers": 3}})


def test_the_plan_lists_the_daemon_the_proxy_n_workers_and_an_agent_per_node(tmp_path: Path) -> None:
    rd = tmp_path / "state" / "p-1"
    specs = run_plan(_cfg(tmp_path), rd)
    assert [p.name for p in specs] == ["daemon", "proxy", "worker-0", "worker-1", "worker-2",
                                       "agent-0", "agent-1", "agent-2", "agent-3"]
    assert [p.name for p in on_node(specs, SERVICES)] == ["daemon", "proxy", "worker-0", "worker-1", "worker-2"]
    assert [[p.name for p in on_node(specs, k)] for k in range(4)] == [[f"agent-{k}"] for k in range(4)]
    by = {p.name: p for p in specs}
    assert by["daemon"].args == ("daemon", "--run-dir", str(rd))
    assert by["worker-2"].args == ("worker", "--run-dir", str(rd), "--worker-id", "w2")
    assert by["agent-3"].args == ("agent", "--run-dir", str(rd), "--node-index", "3")
    assert by["proxy"].argv == [sys.executable, "-m", "gyre_slurm", "proxy", "--run-dir", str(rd)]
    # gyre submit's daemon, gyre eval's, and a run grown by `gyre cells add`
    daemon = run_plan(_cfg(tmp_path), rd, cell_jobs=True, eval_version=-1, cells=3)
    assert daemon[0].args[3:] == ("--cell-jobs", "--eval-version", "-1") and daemon[-1].name == "agent-5"
    # no engines, no RL loop: the daemon and the agents only
    assert [p.name for p in run_plan(_cfg(tmp_path, engine="none"), rd)] == ["daemon", *(f"agent-{k}" for k in
                                                                                         range(4))]


def test_the_layout_places_the_services_and_each_agent_on_its_host(tmp_path: Path) -> None:
    specs = run_plan(_cfg(tmp_path), tmp_path / "r")
    shared = plan(expand_nodelist("n[1-4]"), cells=2, nodes_per_cell=2)
    alone = plan(expand_nodelist("n[1-5]"), cells=2, nodes_per_cell=2)
    assert {p.name: p.host(shared) for p in specs if p.name in ("daemon", "worker-2", "agent-0", "agent-3")} == {
        "daemon": "n1", "worker-2": "n1", "agent-0": "n1", "agent-3": "n4"}
    assert {p.host(alone) for p in on_node(specs, SERVICES)} == {"n1"}
    assert [p.host(alone) for p in specs if p.node is not SERVICES] == ["n2", "n3", "n4", "n5"]


def test_the_run_context_saves_one_config_that_every_process_reads(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    cfg = parse_config({"run": {"name": "c", "state_dir": "state"}, "model": {"path": "models/m"}})
    ctx = RunContext.create(cfg, "c-1")
    assert ctx.run_dir == tmp_path / "state" / "c-1" and ctx.run_id == "c-1"
    saved = yaml.safe_load((ctx.run_dir / CONFIG_FILE).read_text())
    # absolute folders: a process started on another node or in another folder finds the same ones
    assert saved["run"]["state_dir"] == str(tmp_path / "state") and saved["model"]["path"] == str(tmp_path / "models/m")
    assert sorted(p.name for p in ctx.run_dir.iterdir()) == [CONFIG_FILE]
    monkeypatch.chdir("/")
    opened = RunContext.open(ctx.run_dir)
    assert opened.config == ctx.config and opened.control is None
    with pytest.raises(GyreError, match="no daemon has started for this run yet"):
        RunContext.open(ctx.run_dir, wait_s=0.2)
    info = ControlInfo("tcp://h:1", 1, "tok", 7, "h", time.time())
    write_control(ctx.run_dir, info)
    assert RunContext.open(ctx.run_dir, wait_s=5).control == info
    # --config (and --run-id) names the same run; a resume saves the config it is resumed with
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"run": {"name": "c", "state_dir": "state"}}))
    assert locate(None, tmp_path / "c.yaml", "c-1") == ctx.run_dir
    assert RunContext.of_process(None, tmp_path / "c.yaml", "c-1").config.model.path == tmp_path / "models/m"
    RunContext.create(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": None})}), "c-1")
    assert RunContext.open(ctx.run_dir).config.model.path is None


def test_a_folder_without_a_saved_config_is_refused_in_one_line_unless_optional(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    with pytest.raises(GyreError, match=r"r has no config.yaml: not a gyre run folder"):
        RunContext.open(tmp_path / "r")
    ctx = RunContext.open(tmp_path / "r", config_optional=True)
    assert ctx.cfg is None
    with pytest.raises(GyreError, match="not a gyre run folder"):
        ctx.config  # noqa: B018
    with pytest.raises(GyreError, match="needs --run-dir, or --config"):
        locate(None, None)


STUBBORN = ("import signal, sys, time, os; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print(os.getpid(), flush=True); time.sleep(60)")


def test_stop_terms_then_kills_what_ignores_it(tmp_path: Path) -> None:
    polite = spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = spawn([sys.executable, "-c", STUBBORN], tmp_path / "s.log")
    time.sleep(0.5)  # the stubborn one has set its handler
    t = time.monotonic()
    stop([polite, stubborn], grace_s=1.0)
    assert time.monotonic() - t == pytest.approx(1.0, abs=0.8)
    assert (polite.returncode, stubborn.returncode) == (-signal.SIGTERM, -signal.SIGKILL)
    stop([polite, stubborn])  # already stopped: nothing to do


def test_stop_of_a_group_stops_what_its_leader_started(tmp_path: Path) -> None:
    # a leader that starts a child ignoring SIGTERM, then exits on SIGTERM itself: the child must not survive
    leader = spawn([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                    f"{STUBBORN!r}]); time.sleep(60)"], tmp_path / "g.log", new_session=True)
    deadline = time.monotonic() + 10
    while not (tmp_path / "g.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "g.log").read_text().split()[0])
    stop(leader, grace_s=1.0, group=True)
    assert leader.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                          text=True).stdout.strip()[:1] not in ("", "Z")
