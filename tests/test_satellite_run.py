"""Satellites in a real run: a second training cell joins each step, takes shards and sends its gradients to the
core; killed with -9 mid-step, the shards it held are redone by the core and the run goes on; and a daemon killed
mid-step leaves that step's shards FAILED and runs the step again, with the jobs of its first attempt refused."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import LocalRun, start_local_run

from .conftest import embedded_config, kill_and_resume_daemon, q

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, warm_model: Path, name: str, steps: int, groups: int) -> Path:
    """3 cells: the async split keeps the core and one satellite in TRAIN while cell 2 rolls out."""
    return embedded_config(
        tmp_path, warm_model, name, cluster={"cells": 3, "engine": "embedded", "rollouts_per_cell": 8},
        control={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5},
        scheduler={"policy": "async", "train_cells": 2, "max_staleness": 1},
        tasks={"suite": "builtin:sevens", "group_size": 4, "groups_per_step": groups},
        harness={"timeout_s": 30, "concurrency": 8}, train={"steps": steps, "lr": 3e-4, "shard_runs": 1})


def _satellite(db: Path) -> int:
    """The cell the async split moved to TRAIN beside the core (cell 1, unless cell 2's agent registered first)."""
    (cell,) = {c for (c,) in q(db, "SELECT cell_id FROM role_switches WHERE to_role = 'TRAIN' AND cell_id != 0")}
    return cell


def _finish(run: LocalRun, timeout_s: float) -> None:
    try:
        assert run.daemon.wait(timeout=timeout_s) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()


def test_a_satellite_takes_shards_of_every_step_and_the_core_publishes(tmp_path: Path, warm_model: Path) -> None:
    path = _config(tmp_path, warm_model, "sat", steps=2, groups=2)
    run = start_local_run(load_config(path), "sat1")
    _finish(run, 240)
    assert not run.failed(), run.failed()
    db = run.run_dir
    assert q(db, "SELECT step, status, version_out FROM train_steps ORDER BY step") == [(0, "DONE", 1), (1, "DONE", 2)]
    assert [v for (v,) in q(db, "SELECT version FROM weight_versions ORDER BY version")] == [0, 1, 2]
    assert (run.run_dir / "weights" / "v00002" / "config.json").is_file()
    # every shard of both steps was added by the core, computed by the core or the satellite
    assert q(db, "SELECT count(*) FROM shards WHERE status != 'DONE'") == [(0,)]
    sat = _satellite(db)
    assert {c for (c,) in q(db, "SELECT DISTINCT done_by FROM shards")} == {0, sat}
    for (metrics,) in q(db, "SELECT metrics FROM train_steps"):
        m = json.loads(metrics)
        assert m["shards"] == q(db, "SELECT count(*) FROM shards")[0][0] / 2
        assert m["shards_by_satellites"] + m["shards_core"] == m["shards"] and "mismatch" in m
    assert q(db, "SELECT count(*) FROM v_shards WHERE shards = done") == [(2,)]
    assert q(db, "SELECT count(*) FROM rollouts WHERE cell_id IN (0, ?)", sat) == [(0,)]  # the split held
    # weights went over the Transfer Engine (the default), every version: the core published the base model when
    # step 0 opened; the satellite pulled the versions its steps started from, the rollout cell's engine the new ones
    assert q(db, "SELECT version, transport FROM weight_versions ORDER BY version") == \
        [(0, "mooncake"), (1, "mooncake"), (2, "mooncake")]
    assert all(json.loads(h)[0]["peer"] for (h,) in q(db, "SELECT handle FROM weight_versions"))  # its parts
    got = q(db, "SELECT receiver, version, transport, ok, bytes FROM weight_transfers")
    (rollout_cell,) = {c for (c,) in q(db, "SELECT DISTINCT cell_id FROM rollouts")}
    assert {(t, ok) for _, _, t, ok, _ in got} == {("mooncake", 1)}
    assert 1 in {v for r, v, *_ in got if r == f"engine:{rollout_cell}"}
    sat_versions = {v for r, v, *_ in got if r == f"satellite:{sat}"}
    assert sat_versions and sat_versions <= {0, 1}
    assert len({b for *_, b in got}) == 1 and got[0][4] > 100_000  # the whole model each time


def _satellite_holding_a_shard(run: LocalRun, deadline: float) -> tuple[int, int, int]:
    """Freeze the satellite's agent (SIGSTOP) while the ledger shows it holding a shard, and return (cell, step,
    shard) once it is sure it still holds it: a gradient it sent just before would reach the core within a second
    or two. If one did, let it go on and wait for its next shard."""
    db = run.run_dir / "ledger.db"
    while time.monotonic() < deadline:
        held = q(db, "SELECT cell_id, step, shard FROM shards WHERE status = 'TAKEN' AND cell_id != 0")
        if not held:
            time.sleep(0.02)
            continue
        cell, step, shard = held[0]
        pid = run.agents[cell].pid  # one node per cell
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3.0)
        if q(db, "SELECT done_by FROM shards WHERE step = ? AND shard = ?", step, shard) != [(cell,)]:
            return cell, step, shard  # its gradient never reached the core (the shard may be requeued already)
        os.kill(pid, signal.SIGCONT)
    raise AssertionError("the satellite never held a shard long enough")


def test_a_satellite_killed_mid_step_loses_nothing(tmp_path: Path, warm_model: Path) -> None:
    path = _config(tmp_path, warm_model, "satkill", steps=3, groups=3)
    run = start_local_run(load_config(path), "satkill1")
    db = run.run_dir / "ledger.db"
    try:
        sat, step, shard = _satellite_holding_a_shard(run, time.monotonic() + 200)
        os.kill(run.agents[sat].pid, signal.SIGKILL)
        run.agents[sat].wait()
        killed_at = time.time()
        assert run.daemon.wait(timeout=240) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    assert q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'") == [(3,)]
    assert q(db, "SELECT status FROM train_steps WHERE step = ?", step) == [("DONE",)]
    # the shard went back to the queue and the core redid it
    assert q(db, "SELECT status, cell_id, attempts, done_by FROM shards WHERE step = ? AND shard = ?",
             step, shard) == [("DONE", 0, 2, 0)]
    assert q(db, "SELECT count(*) FROM shards WHERE status != 'DONE'") == [(0,)]
    assert q(db, "SELECT count(*) FROM shards WHERE done_by = ? AND done_at > ?", sat, killed_at) == [(0,)]
    assert q(db, "SELECT role FROM cells WHERE id = ?", sat) == [("DOWN",)]
    assert q(db, "SELECT status FROM agents WHERE node_index = ?", sat) == [("LOST",)]
    requeued = q(db, "SELECT message FROM events WHERE kind = 'shards_requeued'")
    assert requeued and f"shard(s) [{shard}] of cell {sat}" in requeued[0][0], requeued
    assert [v for (v,) in q(db, "SELECT version FROM weight_versions ORDER BY version")] == [0, 1, 2, 3]


def test_a_daemon_killed_mid_step_fails_its_shards_and_runs_the_step_again(tmp_path: Path,
                                                                           warm_model: Path) -> None:

    path = _config(tmp_path, warm_model, "satd", steps=2, groups=2)
    run = start_local_run(load_config(path), "satd1")
    db = run.run_dir / "ledger.db"
    try:
        deadline = time.monotonic() + 200
        while not q(db, "SELECT count(*) FROM shards WHERE status = 'TAKEN'")[0][0]:
            assert time.monotonic() < deadline, "no shard was ever taken"
            time.sleep(0.02)
        kill_and_resume_daemon(run, path, "satd1", timeout=240)
    finally:
        run.kill()
    assert not run.failed(), run.failed()
    assert q(db, "SELECT step, status, version_out FROM train_steps ORDER BY step") == [(0, "DONE", 1), (1, "DONE", 2)]
    assert q(db, "SELECT daemon_starts FROM runs") == [(2,)]
    # the step in flight: its first shards FAILED, then all of them again, DONE by the new daemon's word
    (step,) = {s for (s,) in q(db, "SELECT DISTINCT step FROM shards WHERE status = 'FAILED'")}
    n = q(db, "SELECT count(DISTINCT shard) FROM shards WHERE step = ?", step)[0][0]
    assert q(db, "SELECT count(*) FROM shards WHERE step = ? AND status = 'DONE'", step) == [(n,)]
    assert q(db, "SELECT count(*) FROM shards WHERE status NOT IN ('DONE', 'FAILED')") == [(0,)]
    assert q(db, "SELECT count(*) FROM events WHERE kind = 'illegal_transition'") == [(0,)]
