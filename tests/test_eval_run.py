"""Evaluation and tracking in a real embedded run (real processes): held-out pass@1 at versions 0, 1 and 2 in the
ledger, TensorBoard event files written live that `gyre export` reproduces, the curve in `gyre plot`, no evaluation
run in any training batch, and `gyre eval` of an earlier version after the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_slurm.train.batch import read_batch

from .conftest import embedded_config, gyre, q, run_to_the_end
from .test_tracking import tb_series

pytestmark = pytest.mark.slow


def test_a_run_evaluates_held_out_tasks_and_tracks_them(tmp_path: Path, warm_model: Path) -> None:
    path = embedded_config(
        tmp_path, warm_model, "ev", cluster={"cells": 2, "engine": "embedded", "rollouts_per_cell": 8},
        tasks={"suite": "builtin:sevens", "group_size": 4, "groups_per_step": 2},
        eval={"holdout_tasks": ["digits-7x6"], "every_steps": 1, "samples": 4},
        tracking={"backends": ["tensorboard"]}, harness={"timeout_s": 20, "concurrency": 16},
        train={"steps": 2, "lr": 1e-4}, weights={"transport": "file"})  # a gentle lr: no collapse to wait out
    run = run_to_the_end(path, "ev1")
    db = run.run_dir
    # one evaluation per version, every run of it scored or excluded; the last version's counts as the end's
    evals = q(db, "SELECT version, reason, status, tasks, runs + excluded, pass_at_1 IS NOT NULL FROM v_eval "
                  "ORDER BY eval")
    assert evals == [(0, "start", "DONE", 1, 4, 1), (1, "every_steps", "DONE", 1, 4, 1),
                     (2, "every_steps", "DONE", 1, 4, 1)], evals
    # evaluation runs: the held-out task only, in no group; training runs: never the held-out task
    assert q(db, "SELECT DISTINCT t.key, r.group_id, r.advantage FROM rollouts r JOIN tasks t ON t.id = r.task_id "
                 "WHERE r.kind = 'eval'") == [("digits-7x6", None, None)]
    assert q(db, "SELECT count(*) FROM rollouts r JOIN tasks t ON t.id = r.task_id WHERE r.kind = 'train' "
                 "AND t.key = 'digits-7x6'") == [(0,)]
    assert q(db, "SELECT split FROM tasks WHERE key = 'digits-7x6'") == [("eval",)]
    eval_runs = {r for (r,) in q(db, "SELECT id FROM rollouts WHERE kind = 'eval'")}
    trained = set()
    for f in (db / "batches").rglob("*.msgpack"):  # every shard of every step, as the trainer read it
        trained |= set(read_batch(f).runs())
    assert trained and not trained & eval_runs
    # TensorBoard, written live by the daemon: every step and every evaluation, and `gyre export` gives the same
    live = tb_series(db / "tb")
    assert [x for x, _v, _t in live["eval/pass@1"]] == [0, 1, 2]
    assert [x for x, _v, _t in live["critic/score/mean"]] == [1, 2]
    assert q(db, "SELECT count(*) FROM events WHERE kind = 'tracking_failed'") == [(0,)]
    r = gyre("export", "ev1", "--to", "tensorboard", "--out", tmp_path / "tbx", "--state-dir", db.parent)
    assert r.returncode == 0, r.stderr
    assert tb_series(tmp_path / "tbx") == live
    r = gyre("plot", "ev1", "--state-dir", db.parent)
    assert r.returncode == 0 and (db / "plot.png").stat().st_size > 10_000, r.stderr
    r = gyre("eval", "ev1", "--version", "99", "--state-dir", db.parent)  # refused before anything starts
    assert r.returncode == 1 and r.stderr.strip() == "error: run ev1 has no version 99 (its versions: 0–2)", r.stderr
    assert q(db, "SELECT status, daemon_starts FROM runs") == [("STOPPED", 1)]
    # after the run: version 1 again, on demand; the run's processes start for it and stop after it
    r = gyre("eval", "ev1", "--version", "1", "--state-dir", db.parent, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "evaluation 4 of version 1: pass@1" in r.stdout, r.stdout
    assert q(db, "SELECT version, reason, status FROM evals WHERE id = 4") == [(1, "manual", "DONE")]
    served = q(db, "SELECT DISTINCT m.weight_version FROM model_calls m JOIN rollouts r ON r.id = m.rollout_id "
                   "WHERE r.eval_id = 4")
    assert served == [(1,)]
    assert q(db, "SELECT status FROM runs") == [("STOPPED",)]
    assert q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'") == [(2,)]  # nothing trained for it
    r = gyre("status", "ev1", "--state-dir", db.parent)
    assert "held-out eval #4 of v1 pass@1" in r.stdout and "(v0: pass@1" in r.stdout, r.stdout[-800:]
