"""Experiment tracking from the ledger: the points series.py reads, the live tracker into real TensorBoard event
files and a real (offline) W&B run, `gyre export` giving the same series, and backends that fail without stopping
anything. Everything is read back with the trackers' own readers: TensorBoard's EventAccumulator, and W&B's own
reader of its .wandb log (`wandb leet inspect --json`; wandb >= 0.30 has no Python datastore reader any more)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gyre_slurm.config_eval import TrackingSection
from gyre_slurm.ledger.readonly import connect_readonly
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.tracking.names import METRICS, STEP_AXIS, tag
from gyre_slurm.tracking.series import Point, eval_point, eval_points, step_point, step_points
from gyre_slurm.tracking.tracker import Tracker
from gyre_slurm.tracking.wandb_sink import wandb_run_id

from .conftest import REPO, gyre

RUN_ID = "trk-20261206-000000"
T = 1_000_000.0  # the ledger's epoch offset
REWARDS = [1.0, 0.0, 0.5, None]  # per group: the last run is an infrastructure error (no reward, no advantage)


def _metrics(step: int) -> dict:
    m = {"staleness_mean": 0.25 * step, "staleness_max": step, "staleness_hist": {"0": 5, "1": 1},
         "frac_truncated_context": 0.0, "frac_timeout_scored": 0.125, "frac_excluded_infra": 0.25,
         "frac_excluded_eval": 0.0, "groups_dropped_zero_var": step, "groups_dropped_small": 1,
         "tokens_trained": 900.0 + step, "clip_frac": 0.01 * step, "mismatch": 1e-4 * (step + 1),
         "loss": -0.002 + 0.001 * step, "grad_norm": 0.8 + step, "lr": 1e-5 * (step + 1), "finish_seconds": 0.7,
         "publish_s": 0.03, "train_busy_s": 17.5, "overlap_s": 4.0, "overlap_share": 4.0 / 17.5, "open_s": 2.0}
    if step == 1:
        m["kl"] = 0.02  # a reference policy only for this step
    if step == 2:
        del m["lr"]  # a figure the trainer did not report: absent from the point, never 0
    return m


def _insert_runs(w: LedgerWriter) -> None:
    """Two groups of four runs per step (steps 0–2), a dropped group, and four evaluation runs."""
    rid = 0
    for step in range(3):
        for j in range(2):
            gid = 2 * step + j + 1
            w.insert("groups", id=gid, task_id=1, status="TRAINED", size=4, admitted_version=step, train_step=step,
                     created_at=T + 100 * step, ready_at=T + 100 * step + 30, n_valid=3, reward_mean=0.5,
                     reward_std=0.5, drop_reason=None)
            for k, reward in enumerate(REWARDS):
                rid += 1
                w.insert("rollouts", id=rid, kind="train", group_id=gid, eval_id=None, task_id=1,
                         status="INFRA_ERROR" if reward is None else "COMPLETED", queued_at=T,
                         prompt_tokens=1000 * (k + 1), completion_tokens=100 + 10 * step + k, reward=reward,
                         advantage=None if reward is None else (reward - 0.5) * 2)
    w.insert("groups", id=99, task_id=1, status="DROPPED", size=4, admitted_version=0, train_step=None,
             created_at=T, ready_at=T + 5, n_valid=1, reward_mean=0.0, reward_std=None, drop_reason="too_small")
    for k in range(4):
        w.insert("rollouts", id=1000 + k, kind="eval", group_id=None, eval_id=1, task_id=2, status="COMPLETED",
                 queued_at=T, prompt_tokens=50, completion_tokens=5, reward=1.0)


def _insert_cells(w: LedgerWriter) -> None:
    for cell in (0, 1):
        w.insert("cells", id=cell, is_core=cell == 0, role="TRAIN", target_role=None, n_nodes=1, updated_at=T)
    spans = [(0, "TRAIN", 90, None), (1, "ROLLOUT", 90, 150), (1, "SWITCHING", 150, 158), (1, "TRAIN", 158, 160),
             (1, "SWITCHING", 160, 165), (1, "ROLLOUT", 165, 235), (1, "SWITCHING", 235, 240), (1, "TRAIN", 240, None)]
    for i, (cell, role, a, b) in enumerate(spans, 1):
        w.insert("cell_spans", id=i, cell_id=cell, role=role, started_at=T + a, ended_at=None if b is None else T + b)
    switches = [("ROLLOUT", "TRAIN", "DONE", 158, 8.5), ("TRAIN", "ROLLOUT", "DONE", 165, 3.5),
                ("ROLLOUT", "TRAIN", "FAILED", 170, None), ("ROLLOUT", "TRAIN", "DONE", 240, 9.0),
                ("ROLLOUT", "TRAIN", "DONE", 250, 7.0)]
    for i, (src, dst, status, end, dur) in enumerate(switches, 1):
        w.insert("role_switches", id=i, cell_id=1, from_role=src, to_role=dst, reason="scheduler", status=status,
                 requested_at=T + end - (dur or 1), started_at=T + end - (dur or 1), ended_at=T + end, duration_s=dur,
                 error="timed out" if status == "FAILED" else None)


def _insert_steps_and_evals(w: LedgerWriter) -> None:
    windows = [(100, 160), (160, 230), (230, 300)]
    for step, (a, b) in enumerate(windows):
        w.insert("train_steps", step=step, policy="elastic", version_in=step, version_out=step + 1, status="DONE",
                 started_at=T + a, ended_at=T + b, n_groups=2, n_runs=8, n_cells=1, tokens_trained=900 + step,
                 reward_mean=0.5, loss=_metrics(step)["loss"], rollout_s=40.0 + step, train_s=18.0,
                 metrics=_metrics(step))
    w.insert("train_steps", step=3, policy="elastic", version_in=3, version_out=None, status="RUNNING",
             started_at=T + 300, ended_at=None, n_groups=2, n_runs=8, n_cells=0, tokens_trained=0, reward_mean=None,
             loss=None, rollout_s=None, train_s=None, metrics=None)
    evals = [(1, 0, None, "start", "DONE", 95, 140, (4, 0, 0.25, 0.5, 0.3, 0.0)),
             (2, 2, 1, "every_steps", "DONE", 231, 310, (4, 1, 0.5, 0.75, 0.55, 0.25)),
             (3, 3, 2, "every_steps", "RUNNING", 301, None, (None,) * 6)]
    for eid, version, step, reason, status, a, b, (n, excl, p1, pk, score, tshare) in evals:
        w.insert("evals", id=eid, version=version, step=step, reason=reason, status=status, samples=4,
                 temperature=1.0, pass_score=0.5, n_tasks=1, created_at=T + a, ended_at=None if b is None else T + b,
                 n_runs=n, n_excluded=excl, pass_at_1=p1, pass_at_k=pk, k=None if pk is None else 4,
                 score_mean=score, timeout_share=tshare, mixed_versions=0)


CONFIG = {"run": {"name": "trk"}, "eval": {"pass_score": 0.5, "samples": 4},
          "tracking": {"backends": ["tensorboard", "wandb"], "wandb_project": "gyre-test", "wandb_mode": "offline"}}


def make_run(folder: Path) -> Path:
    """A run folder whose ledger holds 3 DONE steps, a RUNNING one, 2 DONE evaluations and a RUNNING one."""
    w = LedgerWriter(folder / "ledger.db", flush_interval_s=10)
    w.insert("runs", id=RUN_ID, name="trk", status="STOPPED", policy="elastic", config=CONFIG, created_at=T,
             ended_at=T + 400, daemon_starts=1, slurm_job_id=None)
    w.insert("tasks", id=1, suite="builtin:sevens", key="t1", spec={}, split="train")
    w.insert("tasks", id=2, suite="builtin:sevens", key="t2", spec={}, split="eval")
    _insert_cells(w)
    _insert_steps_and_evals(w)  # before the runs: an evaluation run refers to its evaluation
    _insert_runs(w)
    w.close()
    return folder


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var, sub in (("WANDB_CONFIG_DIR", "wb-config"), ("WANDB_CACHE_DIR", "wb-cache"), ("WANDB_DATA_DIR", "wb-data")):
        monkeypatch.setenv(var, str(tmp_path / sub))  # W&B keeps its own files out of the home folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    return make_run(tmp_path / "state" / RUN_ID)


def _points(run_dir: Path) -> list[Point]:
    conn = connect_readonly(run_dir / "ledger.db")
    try:
        return step_points(conn) + eval_points(conn)
    finally:
        conn.close()


# --- reading the trackers back with their own readers ----------------------------------------------------------
def tb_series(folder: Path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {t: sorted((e.step, e.value, e.wall_time) for e in acc.Scalars(t)) for t in acc.Tags()["scalars"]}


def wandb_records(folder: Path) -> list[dict]:
    """The records of the one offline W&B run under `folder`, through W&B's own reader of its .wandb log."""
    files = list(folder.rglob("run-*.wandb"))
    assert len(files) == 1, files
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wandb_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.get("type") == "history":
            row = r["history"]["item"]
            for k, v in row.items():
                if not k.startswith("_"):
                    series.setdefault(k, []).append((int(row[STEP_AXIS]), float(v)))
    return {k: sorted(v) for k, v in series.items()}


def expected_tb(points: list[Point]) -> dict[str, list[tuple[int, float, float]]]:
    out: dict[str, list[tuple[int, float, float]]] = {}
    for p in points:
        for t, v in p.values.items():  # TensorBoard keeps simple_value as float32
            out.setdefault(t, []).append((p.x, float(np.float32(v)), p.wall_time))
    return {k: sorted(v) for k, v in out.items()}


def expected_wandb(points: list[Point]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        for t, v in {**p.values, STEP_AXIS: float(p.x)}.items():  # every W&B row carries its x
            out.setdefault(t, []).append((p.x, v))
    return {k: sorted(v) for k, v in out.items()}


# --- the points ------------------------------------------------------------------------------------------------
def test_points_read_from_the_ledger(run_dir: Path) -> None:
    conn = connect_readonly(run_dir / "ledger.db")
    s0, s1, s2 = (step_point(conn, s) for s in range(3))
    assert step_point(conn, 3) is None and eval_point(conn, 3) is None  # RUNNING: nothing to log yet
    assert [p.x for p in step_points(conn)] == [1, 2, 3] and [p.x for p in eval_points(conn)] == [0, 2]
    v = s0.values
    assert s0.wall_time == T + 160 and v[STEP_AXIS] == 1.0 and v["timing_s/step"] == 60.0
    # six trained runs (rewards 1, 0, 0.5 twice); the two infrastructure errors count only in runs/tokens
    assert v["critic/score/mean"] == pytest.approx(0.5) and v["gyre/score/std"] == pytest.approx(np.std([1, 0, .5]))
    assert v["gyre/pass_rate"] == pytest.approx(4 / 6)  # pass_score 0.5 from the run's config
    assert (v["gyre/runs/trained"], v["gyre/runs/total"]) == (6.0, 8.0)
    assert v["gyre/tokens/prompt"] == 2 * (1000 + 2000 + 3000 + 4000)
    assert v["response_length/mean"] == pytest.approx(sum(2 * [100, 101, 102, 103]) / 8)
    assert v["gyre/switch/to_train_s"] == 8.5 and v["gyre/switch/count"] == 1.0
    assert "gyre/switch/to_rollout_s" not in v
    # window [100, 160]: cell 0 trains throughout; cell 1 rolls out 50 s, switches 8 s, trains 2 s
    assert (v["gyre/cells/train_s"], v["gyre/cells/rollout_s"], v["gyre/cells/switching_s"]) == (62.0, 50.0, 8.0)
    assert v["gyre/cells/down_s"] == 0.0 and v["gyre/groups_dropped"] == 1.0
    assert v["timing_s/gen"] == 40.0 and v["timing_s/update_weights"] == 0.03 and v["actor/lr"] == 1e-5
    assert "actor/kl_loss" not in v and s1.values["actor/kl_loss"] == 0.02
    assert s1.values["gyre/switch/to_rollout_s"] == 3.5  # the FAILED switch of that window is not one
    assert s2.values["gyre/switch/to_train_s"] == 8.0 and s2.values["gyre/switch/count"] == 2.0
    assert "actor/lr" not in s2.values  # absent from the step's metrics: absent from its point
    e1 = eval_point(conn, 1).values
    assert e1 == {"eval/pass@1": 0.25, "eval/pass@k": 0.5, "eval/k": 4.0, "eval/score_mean": 0.3,
                  "eval/timeout_share": 0.0, "eval/runs": 4.0, "eval/excluded": 0.0}
    tags = {m.tag for m in METRICS}
    assert all(set(p.values) <= tags for p in step_points(conn) + eval_points(conn))
    conn.close()


def test_every_tag_is_documented() -> None:
    doc = (REPO / "docs" / "tracking.md").read_text()
    missing = [m.tag for m in METRICS if f"`{m.tag}`" not in doc]
    assert missing == []
    assert tag("metrics.grad_norm") == "actor/grad_norm"


# --- live, then an export of the same ledger -------------------------------------------------------------------
def _live(run_dir: Path) -> list[str]:
    """The daemon's calls, in the order a run makes them: the version-0 evaluation ends before the first step,
    the version-2 one after step 2 published version 3 (W&B gets x = 2 after x = 3)."""
    warnings: list[str] = []
    t = Tracker.start(TrackingSection(backends=["tensorboard", "wandb"], wandb_project="gyre-test"), run_dir,
                      RUN_ID, CONFIG, warnings.append)
    assert [s.name for s in t.sinks] == ["tensorboard", "wandb"], warnings
    t.eval_done(1)
    for step in range(4):  # step 3 is still RUNNING: nothing logged
        t.step_done(step)
    t.eval_done(2)
    t.eval_done(3)  # RUNNING
    t.close()
    return warnings


def test_live_tracking_writes_every_figure_to_tensorboard_and_wandb(run_dir: Path) -> None:
    assert _live(run_dir) == []
    points = _points(run_dir)
    assert len(points) == 5
    assert tb_series(run_dir / "tb") == expected_tb(points)
    records = wandb_records(run_dir / "wandb")
    assert wandb_series(records) == expected_wandb(points)
    run = next(r["run"] for r in records if r.get("type") == "run")
    assert (run["display_name"], run["run_id"], run["project"]) == (RUN_ID, wandb_run_id(RUN_ID), "gyre-test")
    assert run["config"]["update"]["eval"] == CONFIG["eval"]
    axes = {r["metric"]["name"]: r["metric"].get("step_metric") for r in records if r.get("type") == "metric"}
    assert axes[STEP_AXIS] is None and all(axes[m.tag] == STEP_AXIS for m in METRICS if m.tag != STEP_AXIS)


def test_export_through_the_cli_gives_the_live_series(run_dir: Path, tmp_path: Path) -> None:
    assert _live(run_dir) == []
    env = {k: os.environ[k] for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_MODE")}
    res = gyre("export", run_dir, "--to", "tensorboard", "--out", tmp_path / "tbx", env=env)
    assert res.returncode == 0, res.stderr
    assert "5 points written (3 steps, 2 evaluations)" in res.stdout and str(tmp_path / "tbx") in res.stdout
    assert tb_series(tmp_path / "tbx") == tb_series(run_dir / "tb")
    res = gyre("export", run_dir, "--to", "tensorboard", "--out", tmp_path / "tbx", env=env)
    assert res.returncode == 1 and "already holds TensorBoard event files" in res.stderr  # one line, no traceback
    assert len(res.stderr.strip().splitlines()) == 1

    res = gyre("export", RUN_ID, "--to", "wandb", "--state-dir", run_dir.parent, env=env)
    assert res.returncode == 0, res.stderr
    exported = run_dir / "wandb-export"
    assert "wandb sync" in res.stdout and str(exported) in res.stdout
    records = wandb_records(exported)
    assert wandb_series(records) == wandb_series(wandb_records(run_dir / "wandb"))
    run = next(r["run"] for r in records if r.get("type") == "run")
    assert run["display_name"] == RUN_ID and run["run_id"] == wandb_run_id(f"{RUN_ID}-export")


# --- failures: one warning, the backend is off, nothing raises -------------------------------------------------
def test_an_unwritable_tensorboard_folder_is_one_warning(run_dir: Path) -> None:
    (run_dir / "tb").write_text("a file where the folder should be")
    warnings: list[str] = []
    t = Tracker.start(TrackingSection(backends=["tensorboard"]), run_dir, RUN_ID, CONFIG, warnings.append)
    for step in range(3):
        t.step_done(step)
    t.eval_done(1)
    t.close()
    assert len(warnings) == 1 and "tensorboard" in warnings[0], warnings
    assert "\n" not in warnings[0]


_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from gyre_slurm.config_eval import TrackingSection
    from gyre_slurm.tracking.tracker import Tracker
    warnings = []
    t = Tracker.start(TrackingSection(backends=json.loads(sys.argv[2])), Path(sys.argv[1]), "trk", {},
                      warnings.append)
    sinks = [s.name for s in t.sinks]
    t.step_done(0); t.eval_done(1); t.step_done(1)
    t.close()
    print(json.dumps({"warnings": warnings, "sinks": sinks,
                      "modules": sorted(m for m in ("torch", "tensorboard", "wandb") if m in sys.modules)}))
""")


def _tracker_process(run_dir: Path, backends: list[str], path_first: Path | None = None) -> dict:
    """The tracker in a fresh process (what it imports is its own), optionally with `path_first` first on
    sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([str(path_first)] if path_first else []), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(run_dir), json.dumps(backends)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_wandb_that_cannot_be_imported_is_one_warning(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    (broken / "wandb").mkdir(parents=True)
    (broken / "wandb" / "__init__.py").write_text("raise ImportError('wandb is broken on this node')\n")
    res = _tracker_process(run_dir, ["wandb", "tensorboard"], path_first=broken)
    assert res["sinks"] == ["tensorboard"]  # the other backend goes on
    assert len(res["warnings"]) == 1 and "wandb" in res["warnings"][0]
    assert "broken on this node" in res["warnings"][0]
    assert "torch" not in res["modules"]
    assert set(tb_series(run_dir / "tb")) >= {"critic/score/mean", "eval/pass@1"}


def test_no_backends_imports_nothing_and_reads_nothing(tmp_path: Path) -> None:
    res = _tracker_process(tmp_path / "no-such-run", [])  # a read of the missing ledger would warn
    assert res == {"warnings": [], "sinks": [], "modules": []}


def test_the_tracker_never_imports_torch(run_dir: Path) -> None:
    res = _tracker_process(run_dir, ["tensorboard", "wandb"])
    assert res["warnings"] == [] and res["sinks"] == ["tensorboard", "wandb"]
    assert res["modules"] == ["tensorboard", "wandb"]
