"""The whole embedded RL loop with real processes: daemon, two cells with engines, trainer, proxy, worker.

A short run (2 GSPO steps) whose harness gives each rollout of a group a different fate, so one run shows
every rollout status in the ledger, the exclusions, the advantages, the trained versions and the role switches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run
from gyre_slurm.trajectory.segments import read_record, whole_prompts

from .conftest import REPO, embedded_config, gyre, kill_and_resume_daemon, q

pytestmark = pytest.mark.slow

EVALUATOR = ("import os, sys, pathlib\n"
             "if os.path.exists('EVAL_CRASH'): raise SystemExit('evaluator crashed')\n"
             "from gyre_slurm.harness.builtin_suite import score\n"
             "p = pathlib.Path('answer.txt')\n"
             "print(score(p.read_text() if p.exists() else '', 7, 5))\n")




@pytest.fixture
def rl_config(tmp_path: Path, warm_model: Path) -> Path:
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"id": "sevens-5", "prompt": "Write the digit 7 five times to answer.txt.",
                                 "evaluator": ["{python}", "-c", EVALUATOR]}) + "\n")
    cfg = {
        "run": {"name": "loop", "state_dir": str(tmp_path / "state"), "max_wall_s": 400},
        "cluster": {"cells": 2, "engine": "embedded", "rollouts_per_cell": 8},
        "control": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10},
        "model": {"path": str(warm_model)},
        "tasks": {"suite": str(suite), "group_size": 6, "groups_per_step": 1},
        "harness": {"command": [sys.executable, str(REPO / "tests/fixtures/mixed_harness.py")], "timeout_s": 15,
                    "concurrency": 6},
        "train": {"steps": 2, "lr": 1e-3},
        "weights": {"transport": "file"},  # the other runs' tests take the default, mooncake
    }
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_steps_of_the_rl_loop_leave_a_complete_ledger(rl_config: Path) -> None:
    cfg = load_config(rl_config)
    run = start_local_run(cfg, "loop1")
    try:
        assert run.daemon.wait(timeout=300) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    assert not run.failed(), run.failed()
    db = run.run_dir / "ledger.db"
    assert q(db, "SELECT status FROM runs") == [("STOPPED",)]
    expected = ["COMPLETED", "TIMEOUT_SCORED", "INFRA_ERROR", "INFRA_ERROR", "EVAL_ERROR", "TRUNCATED_CONTEXT"]
    for first in (1, 7):  # both steps' groups
        rows = q(db, "SELECT id, status, reward, advantage, error FROM rollouts WHERE id BETWEEN ? AND ? ORDER BY id",
                 first, first + 5)
        assert [r[1] for r in rows] == expected, rows
        by = {r[0] - first + 1: r for r in rows}
        # the timed-out run and the one that hit the model's context were scored from their workspaces
        assert by[2][2] == 1.0 and by[6][2] == pytest.approx(0.2) and "context length" in by[6][4]
        assert by[3][2] is None and "exit code 1" in by[3][4]  # excluded, never scored 0
        assert by[5][2] is None and "evaluator" in by[5][4]
        assert all(by[i][3] is not None for i in (1, 2, 6)) and all(by[i][3] is None for i in (3, 4, 5))
        assert sum(by[i][3] for i in (1, 2, 6)) == pytest.approx(0.0, abs=1e-5)
        # the wrong key was refused: nothing recorded for that run; the others called the model
        assert q(db, "SELECT count(*) FROM model_calls WHERE rollout_id = ?", first + 3) == [(0,)]
        assert q(db, "SELECT count(*) FROM model_calls WHERE rollout_id = ?", first)[0][0] >= 1
    assert q(db, "SELECT status, n_valid FROM groups ORDER BY id") == [("TRAINED", 3), ("TRAINED", 3)]
    steps = q(db, "SELECT step, status, version_in, version_out, tokens_trained FROM train_steps ORDER BY step")
    assert [s[:4] for s in steps] == [(0, "DONE", 0, 1), (1, "DONE", 1, 2)] and all(s[4] > 0 for s in steps)
    assert q(db, "SELECT version, transport, handle FROM weight_versions ORDER BY version") == \
        [(0, "file", None), (1, "file", None), (2, "file", None)]
    # colocate: both cells' engines read each new snapshot folder (version 2 may come after the run's end)
    loaded = q(db, "SELECT receiver, version, transport, ok FROM weight_transfers WHERE version = 1 ORDER BY receiver")
    assert loaded == [("engine:0", 1, "file", 1), ("engine:1", 1, "file", 1)]
    for (metrics,) in q(db, "SELECT metrics FROM train_steps"):  # what the step's data lost, logged with it
        m = json.loads(metrics)
        assert m["frac_excluded_infra"] == pytest.approx(2 / 6) and m["frac_excluded_eval"] == pytest.approx(1 / 6)
        assert m["frac_timeout_scored"] == pytest.approx(1 / 6) and m["staleness_max"] == 0
        assert m["frac_truncated_context"] == pytest.approx(1 / 6) and set(m["staleness_hist"]) == {"0"}
        assert m["mismatch"] < 1e-4 and "clip_frac" in m
    # the second step's runs were sampled by the weights the first step published
    assert q(db, "SELECT DISTINCT weight_version FROM model_calls WHERE rollout_id >= 7") == [(1,)]
    assert q(db, "SELECT DISTINCT weight_version FROM model_calls WHERE rollout_id < 7") == [(0,)]
    # colocate: every cell went to TRAIN and back once per step
    switches = q(db, "SELECT to_role, status FROM role_switches ORDER BY id")
    assert switches.count(("TRAIN", "DONE")) == 4 and switches.count(("ROLLOUT", "DONE")) == 2
    # each call's payload is in the segment file, and a later call extends the earlier one token for token
    seg = run.run_dir / "segments" / "calls.seg"
    calls = q(db, "SELECT rollout_id, call_index, segment_offset, segment_length FROM model_calls ORDER BY id")
    with open(seg, "rb") as f:  # ids and log-probs come back as arrays (packed in the file)
        recs = {(r, c): read_record(f, o, n) for r, c, o, n in calls}
    chains = [(a, b) for (r, c), a in recs.items() for (r2, c2), b in recs.items() if r == r2 and c2 == c + 1]
    assert chains, "no rollout made two calls"
    for a, b in chains:  # b's payload holds only what it added after a's ids
        assert b["parent_call"] == a["call_index"] and b["kind"] == "main" and b["prompt_ids"]
        whole = whole_prompts(v for (r, _), v in sorted(recs.items()) if r == a["rollout_id"])
        prefix = whole[a["call_index"]] + a["output_ids"].tolist()
        assert b["reused_tokens"] == len(prefix) and whole[b["call_index"]][:len(prefix)] == prefix
    # and the run draws: reward curve, tokens per step, cell-role timeline
    r = gyre("plot", "loop1", "--state-dir", run.run_dir.parent)
    png = run.run_dir / "plot.png"
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # every finished rollout that called the model left its tree in the ledger, and `gyre tree` draws it
    called = q(db, "SELECT id, n_calls, completion_tokens FROM rollouts WHERE n_calls > 0 ORDER BY id")
    trees = {r[0]: r[1:] for r in q(db, "SELECT rollout_id, count(*), sum(n_trainable), sum(parent_key IS NULL) "
                                        "FROM tree_nodes GROUP BY rollout_id")}
    assert called and sorted(trees) == [c[0] for c in called]
    for rid, _n_calls, completion in called:  # each sampled token is a target once (a replayed one is not)
        nodes, trainable, roots = trees[rid]
        assert nodes >= 1 and 0 < trainable <= completion and roots >= 1
    assert {r[0] for r in q(db, "SELECT rollout FROM v_rollout_trees")} == set(trees)
    rid = called[0][0]
    r = gyre("tree", "loop1", rid, "--state-dir", run.run_dir.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"rollout {rid} of loop1 · ") and "from the ledger (tree_nodes)" in r.stdout
    assert f"{trees[rid][0]} nodes · " in r.stdout and "◆ path 1" in r.stdout and "main #" in r.stdout


def test_the_rl_loop_survives_a_daemon_killed_mid_step(tmp_path: Path, warm_model: Path) -> None:
    import time


    path = embedded_config(tmp_path, warm_model, "rs",
                           tasks={"suite": "builtin:sevens", "group_size": 4, "groups_per_step": 2},
                           harness={"timeout_s": 30, "concurrency": 8}, train={"steps": 3, "lr": 3e-4})
    run = start_local_run(load_config(path), "rs1")
    db = run.run_dir / "ledger.db"
    try:
        deadline = time.monotonic() + 240
        while not (q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'")[0][0] >= 1
                   and q(db, "SELECT count(*) FROM rollouts WHERE status = 'RUNNING'")[0][0] > 0):
            assert time.monotonic() < deadline, "the run never reached its second step's rollouts"
            time.sleep(0.2)
        kill_and_resume_daemon(run, path, "rs1", timeout=300)
    finally:
        run.kill()
    steps = q(db, "SELECT step, status, version_in, version_out FROM train_steps ORDER BY step")
    assert steps == [(0, "DONE", 0, 1), (1, "DONE", 1, 2), (2, "DONE", 2, 3)]
    assert q(db, "SELECT count(*) FROM rollouts WHERE status IN ('QUEUED', 'RUNNING')") == [(0,)]
    assert q(db, "SELECT daemon_starts, status FROM runs") == [(2, "STOPPED")]
    assert q(db, "SELECT count(*) FROM events WHERE kind = 'daemon_restarted'") == [(1,)]
    n_calls = q(db, "SELECT count(*) FROM model_calls")[0][0]
    assert n_calls == len(set(q(db, "SELECT rollout_id, call_index FROM model_calls"))) > 0
    assert q(db, "PRAGMA integrity_check") == [("ok",)]
