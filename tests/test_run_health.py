"""A failing run says so instead of burning the cluster: DEGRADED after a streak of infrastructure errors or dropped
groups, no work but a probe group now and then, RUNNING again at the first good outcome. The rules alone, then a
real run whose harness cannot start until the test lets it."""

from __future__ import annotations

import time
from pathlib import Path

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run
from gyre_slurm.scheduler.health import RunHealth

from .conftest import embedded_config, gyre, q, wait_for


def test_streaks_degrade_a_run_and_one_good_outcome_heals_it() -> None:
    h = RunHealth(infra_runs=4, dropped_groups=3, probe_s=10)
    for _ in range(3):
        h.run_finished(True)
    assert h.reason() is None  # 3 of 4
    h.run_finished(True)
    assert "last 4 runs were all infrastructure errors" in h.reason()
    assert h.may_probe(100.0) and not h.may_probe(105.0) and h.may_probe(110.0)  # one probe per 10 s
    h.run_finished(False)
    assert h.reason() is None
    for outcome in ("zero_variance", "zero_variance", "too_small", "zero_variance", "zero_variance"):
        h.group_finished(outcome)  # too few valid runs is the other rule's: it neither counts nor breaks
    assert "last 3 groups were all dropped" in h.reason()
    h.group_finished("ready")
    assert h.reason() is None
    assert RunHealth(infra_runs=0, dropped_groups=0).reason() is None  # 0: never


# the harness cannot start while the flag file exists (as if the proxy were gone): exit 3 before any model call
GATED = ("import os, runpy, sys; flag = sys.argv[1]; sys.exit(3) if os.path.exists(flag) else None; "
         "sys.argv = sys.argv[:1]; runpy.run_module('gyre_slurm.harness.reference_agent', run_name='__main__')")


def test_a_run_that_cannot_start_harnesses_degrades_admits_probes_only_and_recovers(tmp_path: Path,
                                                                                     warm_model: Path) -> None:
    flag = tmp_path / "broken"
    flag.write_text("")
    path = embedded_config(
        tmp_path, warm_model, "health", cluster={"cells": 2, "engine": "embedded", "rollouts_per_cell": 8},
        run={"name": "health", "state_dir": str(tmp_path / "state"), "max_wall_s": 600,
             "degrade_after_infra_errors": 8, "degrade_after_dropped_groups": 0, "degraded_probe_s": 3},
        tasks={"suite": "builtin:sevens", "group_size": 8, "groups_per_step": 2},
        harness={"command": ["{python}", "-c", GATED, str(flag)], "sandbox": "none", "timeout_s": 30},
        # a learning rate that barely moves the policy: at 1e-3 one step from two low-reward groups of 8 sometimes
        # collapsed it (every later run scored 0), and the run rightly stopped FAILED for dropping 20 groups
        train={"steps": 2, "lr": 1e-6})
    run = start_local_run(load_config(path), "h1")
    db = run.run_dir
    try:
        wait_for(lambda: q(db, "SELECT status FROM runs") == [("DEGRADED",)], 120, "the run to degrade")
        (reason,), = q(db, "SELECT degraded_reason FROM runs")
        assert "last 8 runs were all infrastructure errors" in reason
        r = gyre("status", "h1", "--state-dir", tmp_path / "state")
        assert "DEGRADED" in r.stdout and "infrastructure errors" in r.stdout, r.stdout
        # while degraded: one probe group (8 runs) every 3 s at most, not the 2 groups the cells could take
        n0, t0 = q(db, "SELECT count(*) FROM rollouts")[0][0], time.time()
        time.sleep(7.5)
        added = q(db, "SELECT count(*) FROM rollouts")[0][0] - n0
        assert added <= 8 * (int((time.time() - t0) / 3) + 1), added
        flag.unlink()  # the cause is gone: the next probe comes back good
        wait_for(lambda: q(db, "SELECT count(*) FROM events WHERE kind = 'run_recovered'") == [(1,)], 60,
                 "the run to recover")
        assert run.daemon.wait(timeout=300) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    errors = q(db, "SELECT kind, message FROM events WHERE severity = 'error'")
    assert q(db, "SELECT status, degraded_reason FROM runs") == [("STOPPED", None)], errors
    assert q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'") == [(2,)]
    assert q(db, "SELECT count(*) FROM events WHERE kind = 'run_degraded' AND severity = 'error'") == [(1,)]
