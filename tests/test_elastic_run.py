"""An elastic run on the embedded engine, with real processes: cells move to training one at a time while the
other keeps serving, no run fails because of a switch, and every decision is in the ledger with its numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run

from .conftest import embedded_config, gyre, q

pytestmark = pytest.mark.slow

# calls that crossed a switch: a run that was RUNNING when a switch of the cell it was on was requested
CROSSED = ("SELECT DISTINCT r.id, r.status FROM rollouts r JOIN role_switches s "
           "ON s.requested_at BETWEEN r.started_at AND coalesce(r.ended_at, s.requested_at) "
           "JOIN model_calls m ON m.rollout_id = r.id AND m.cell_id = s.cell_id")


def _config(tmp_path: Path, warm_model: Path, release: str, engine_update: str = "auto") -> Path:
    return embedded_config(
        tmp_path, warm_model, "elastic", cluster={"cells": 2, "engine": "embedded", "rollouts_per_cell": 4},
        weights={"engine_update": engine_update},
        scheduler={"policy": "elastic", "max_staleness": 1, "release": release},
        tasks={"suite": "builtin:longtail", "group_size": 4, "groups_per_step": 2},
        harness={"timeout_s": 8, "concurrency": 16}, train={"steps": 3, "lr": 4e-4})


# push: each cell's agent pulls every version and pushes it into its engine (what SGLang cells do); auto: the
# embedded engines pull it themselves. Two runs cover both releases and both updates (they are independent).
@pytest.mark.parametrize("release,engine_update", [("drain", "auto"), ("migrate", "push")])
def test_an_elastic_run_moves_cells_one_at_a_time_and_fails_no_run(tmp_path: Path, warm_model: Path,
                                                                   release: str, engine_update: str) -> None:
    path = _config(tmp_path, warm_model, release, engine_update)
    run = start_local_run(load_config(path), "el1")
    try:
        assert run.daemon.wait(timeout=280) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    assert not run.failed(), run.failed()
    db = run.run_dir
    assert q(db, "SELECT status FROM runs") == [("STOPPED",)]
    assert q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'") == [(3,)]
    assert q(db, "SELECT count(*) FROM role_switches WHERE status != 'DONE'") == [(0,)]

    # the core went first, alone, while the other cell kept serving: W fitted the rollout cells left, or B groups
    # were ready and the staleness bound stopped admission (then W only falls; the decision says which)
    first = q(db, "SELECT cells, roles, watermark, capacity, reason FROM policy_decisions "
                  "WHERE kind = 'switch' AND role = 'TRAIN' ORDER BY id LIMIT 1")[0]
    assert first[0] == "[0]" and first[1] == "R R", first
    fits = first[2] <= first[3] // 2
    assert ("fits the rollout cells left" in first[4]) == fits, first
    assert fits or "the staleness bound stops admission" in first[4], first
    # from the decision that sent the core to training until its first step ended, cell 1 kept serving runs
    # (with drain the core first finishes its own runs; with η = 1 cell 1 may run out of admissible work while
    # the core trains, so the window starts at the decision, not at the TRAIN span)
    left = "(SELECT min(ts) FROM policy_decisions WHERE kind = 'switch' AND role = 'TRAIN')"
    trained = "(SELECT min(ended_at) FROM cell_spans WHERE cell_id = 0 AND role = 'TRAIN')"
    served = q(db, f"SELECT count(*) FROM rollouts WHERE cell_id = 1 AND started_at < {trained} "
                   f"AND ended_at > {left}")
    assert served[0][0] > 0
    if release == "drain":  # a draining cell takes no new run
        assert q(db, f"SELECT count(*) FROM rollouts WHERE cell_id = 0 AND started_at > {left} AND started_at < "
                     "(SELECT min(started_at) FROM cell_spans WHERE cell_id = 0 AND role = 'TRAIN')") == [(0,)]
    # no run failed because of a switch
    crossed = q(db, CROSSED)
    assert [r for r in crossed if r[1] == "INFRA_ERROR"] == []
    assert q(db, "SELECT count(*) FROM rollouts WHERE status = 'INFRA_ERROR'") == [(0,)]
    if release == "drain":  # a draining cell takes no new run: nothing was moved off it
        assert q(db, "SELECT count(*) FROM events WHERE kind = 'runs_migrated'") == [(0,)]
    # every version went over the Transfer Engine (weights.transport's default), and every receiver got its copy
    assert q(db, "SELECT version, transport FROM weight_versions ORDER BY version") == \
        [(v, "mooncake") for v in range(4)]
    assert q(db, "SELECT count(*) FROM weight_transfers WHERE NOT ok") == [(0,)]
    if engine_update == "auto":  # the engines pulled every version themselves
        assert q(db, "SELECT count(*), sum(ok), min(bytes) > 0 FROM weight_transfers WHERE transport = 'mooncake'"
                 )[0][0] == q(db, "SELECT count(*) FROM weight_transfers")[0][0] > 0
    else:  # every engine update is a push hop (gloo, named nccl), after the agent's pull hop of that version
        pushes = q(db, "SELECT DISTINCT cell, version, transport, bytes FROM weight_transfers "
                       "WHERE receiver LIKE 'engine:%'")
        pulls = q(db, "SELECT DISTINCT cell, version, transport, bytes FROM weight_transfers "
                      "WHERE receiver LIKE 'agent:%'")
        assert pushes and {t for _, _, t, _ in pushes} == {"nccl"} and {t for _, _, t, _ in pulls} == {"mooncake"}
        assert {(c, v) for c, v, *_ in pushes} == {(c, v) for c, v, *_ in pulls}
        assert len({b for *_, b in pushes + pulls}) == 1  # the whole model each hop
        served = q(db, "SELECT DISTINCT cell_id, weight_version FROM model_calls WHERE weight_version > 0")
        assert served and set(served) <= {(c, v) for c, v, *_ in pushes}
    # staleness stayed within η = 1
    assert q(db, "SELECT max(t.version_in - g.admitted_version) FROM groups g JOIN train_steps t "
                 "ON t.step = g.train_step")[0][0] <= 1
    r = gyre("sql", "el1", "select kind, what, w, capacity, roles, reason from v_policy_decisions",
             "--state-dir", tmp_path / "state", "--format", "csv")
    assert r.returncode == 0 and "switch,TRAIN [0]" in r.stdout and "admit," in r.stdout, r.stdout + r.stderr
    r = gyre("status", "el1", "--state-dir", tmp_path / "state")
    assert r.returncode == 0 and "against rollout capacity" in r.stdout and "last decision" in r.stdout, r.stdout
