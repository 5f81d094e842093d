"""The points trackers get, read from a ledger: one per DONE training step, one per DONE evaluation.

Pure reads on a read-only sqlite3 connection (ledger/readonly.py), no tracker imports: the live tracker and
`gyre export` both go through these functions, so what a run logged as it went and what an export replays are the
same series by construction. x is a policy version (veRL's global_step counts updates from 1): step s publishes
version s+1 and is logged at x = version_out; an evaluation of version v (v = 0: before training) at x = v.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass
from typing import Any, Literal

from gyre_slurm.tracking.names import tagged

SCORED = ("COMPLETED", "TIMEOUT_SCORED", "TRUNCATED_CONTEXT")
ROLE_SECONDS = {"ROLLOUT": "cells.rollout_s", "TRAIN": "cells.train_s", "SWITCHING": "cells.switching_s",
                "DOWN": "cells.down_s"}
SWITCH_SECONDS = {"TRAIN": "switches.to_train_s", "ROLLOUT": "switches.to_rollout_s"}
# train_steps.metrics keys copied as they are (the rest of that JSON stays in the ledger)
STEP_METRIC_KEYS = ("publish_s", "train_busy_s", "open_s", "finish_seconds", "overlap_share", "overlap_s",
                    "staleness_mean", "staleness_max", "mismatch", "loss", "clip_frac", "grad_norm", "kl", "lr",
                    "frac_excluded_eval", "frac_excluded_infra", "frac_timeout_scored", "frac_truncated_context")


@dataclass(frozen=True)
class Point:
    kind: Literal["step", "eval"]
    ref: int  # the step number, or the evaluation's id
    x: int  # the policy version (training/global_step)
    wall_time: float  # when it ended (epoch seconds)
    values: dict[str, float]  # tag → value


def _number(v: Any) -> float | None:
    """A finite number from the ledger, or None (absent, text, a dict such as staleness_hist, NaN)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _rows(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params)
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def pass_score(conn: sqlite3.Connection) -> float:
    """eval.pass_score of the run's config (runs.config JSON); 1.0 when the config has none."""
    row = conn.execute("SELECT config FROM runs ORDER BY created_at LIMIT 1").fetchone()
    try:
        cfg = json.loads(row[0]) if row and row[0] else {}
        score = _number((cfg.get("eval") or {}).get("pass_score"))
    except (ValueError, AttributeError):
        score = None
    return 1.0 if score is None else score


def _run_figures(conn: sqlite3.Connection, step: int, threshold: float) -> dict[str, float]:
    # only training runs have a group (an evaluation run's group_id is null)
    runs = _rows(conn, "SELECT r.reward, r.advantage, r.prompt_tokens, r.completion_tokens FROM groups g "
                       "JOIN rollouts r ON r.group_id = g.id WHERE g.train_step = ?", (step,))
    if not runs:
        return {}
    out = {"runs.total": float(len(runs)),
           "runs.prompt_tokens": float(sum(r["prompt_tokens"] or 0 for r in runs)),
           "runs.completion_tokens": float(sum(r["completion_tokens"] or 0 for r in runs))}
    out["runs.prompt_tokens_mean"] = out["runs.prompt_tokens"] / len(runs)
    out["runs.completion_tokens_mean"] = out["runs.completion_tokens"] / len(runs)
    # trained runs: those that got an advantage (valid: scored, not excluded), as the step's batch took them
    rewards = [float(r["reward"]) for r in runs if r["advantage"] is not None and r["reward"] is not None]
    out["runs.trained"] = float(len(rewards))
    if rewards:
        mean = sum(rewards) / len(rewards)
        out.update({"runs.reward_mean": mean, "runs.reward_max": max(rewards), "runs.reward_min": min(rewards),
                    "runs.reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                    "runs.pass_rate": sum(r >= threshold for r in rewards) / len(rewards)})
    return out


def _cell_figures(conn: sqlite3.Connection, t0: float, t1: float) -> dict[str, float]:
    """Switches that ended within [t0, t1], and the cell-seconds per role of the spans overlapping it."""
    out: dict[str, float] = {}
    switches = _rows(conn, "SELECT to_role, duration_s FROM role_switches WHERE status = 'DONE' AND ended_at >= ? "
                           "AND ended_at <= ?", (t0, t1))
    out["switches.count"] = float(len(switches))
    for role, source in SWITCH_SECONDS.items():
        d = [s["duration_s"] for s in switches if s["to_role"] == role and s["duration_s"] is not None]
        if d:
            out[source] = sum(d) / len(d)
    spans = _rows(conn, "SELECT role, started_at, ended_at FROM cell_spans WHERE started_at < ? AND "
                        "(ended_at IS NULL OR ended_at > ?)", (t1, t0))
    if spans:  # no span at all: the ledger does not know, rather than every role 0 s
        seconds = dict.fromkeys(ROLE_SECONDS.values(), 0.0)
        for s in spans:
            if s["role"] in ROLE_SECONDS:
                end = t1 if s["ended_at"] is None else min(s["ended_at"], t1)
                seconds[ROLE_SECONDS[s["role"]]] += max(0.0, end - max(s["started_at"], t0))
        out.update(seconds)
    return out


def _metric_figures(metrics: dict[str, Any]) -> dict[str, float]:
    out = {f"metrics.{k}": v for k in STEP_METRIC_KEYS if (v := _number(metrics.get(k))) is not None}
    dropped = [v for k in ("groups_dropped_small", "groups_dropped_zero_var") if (v := _number(metrics.get(k)))
               is not None]
    if dropped:
        out["metrics.groups_dropped"] = sum(dropped)
    return out


def _step_row_point(conn: sqlite3.Connection, row: dict[str, Any], threshold: float) -> Point:
    try:
        metrics = json.loads(row["metrics"]) if row["metrics"] else {}
    except ValueError:
        metrics = {}
    metrics = metrics if isinstance(metrics, dict) else {}
    x = row["version_out"] if row["version_out"] is not None else row["step"] + 1
    t0, t1 = row["started_at"], row["ended_at"] if row["ended_at"] is not None else row["started_at"]
    figures: dict[str, float] = {"train_steps.version_out": float(x), "train_steps.step_s": t1 - t0}
    for col in ("rollout_s", "train_s", "tokens_trained"):
        if (v := _number(row[col])) is not None:
            figures[f"train_steps.{col}"] = v
    figures |= _run_figures(conn, row["step"], threshold)
    figures |= _cell_figures(conn, t0, t1)
    figures |= _metric_figures(metrics)
    return Point("step", row["step"], int(x), t1, tagged(figures))


_STEP_SQL = ("SELECT step, version_out, started_at, ended_at, rollout_s, train_s, tokens_trained, metrics "
             "FROM train_steps WHERE status = 'DONE'")


def step_point(conn: sqlite3.Connection, step: int) -> Point | None:
    """The point of one training step, or None unless it is DONE."""
    rows = _rows(conn, _STEP_SQL + " AND step = ?", (step,))
    return _step_row_point(conn, rows[0], pass_score(conn)) if rows else None


def step_points(conn: sqlite3.Connection) -> list[Point]:
    """Every DONE training step's point, in step order."""
    threshold = pass_score(conn)
    return [_step_row_point(conn, r, threshold) for r in _rows(conn, _STEP_SQL + " ORDER BY step")]


_EVAL_SQL = ("SELECT id, version, created_at, ended_at, n_runs, n_excluded, pass_at_1, pass_at_k, k, score_mean, "
             "timeout_share FROM evals WHERE status = 'DONE'")
_EVAL_COLUMNS = ("pass_at_1", "pass_at_k", "k", "score_mean", "timeout_share", "n_runs", "n_excluded")


def _eval_row_point(row: dict[str, Any]) -> Point:
    figures = {f"evals.{c}": v for c in _EVAL_COLUMNS if (v := _number(row[c])) is not None}
    if "evals.pass_at_k" not in figures:
        figures.pop("evals.k", None)  # a k without its pass@k says nothing
    wall = row["ended_at"] if row["ended_at"] is not None else row["created_at"]
    return Point("eval", row["id"], int(row["version"]), wall, tagged(figures))


def eval_point(conn: sqlite3.Connection, eval_id: int) -> Point | None:
    """The point of one evaluation, or None unless it is DONE."""
    rows = _rows(conn, _EVAL_SQL + " AND id = ?", (eval_id,))
    return _eval_row_point(rows[0]) if rows else None


def eval_points(conn: sqlite3.Connection) -> list[Point]:
    """Every DONE evaluation's point, in id order (none in a ledger older than schema 5, which has no evals)."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'evals'").fetchone():
        return []
    return [_eval_row_point(r) for r in _rows(conn, _EVAL_SQL + " ORDER BY id")]


def all_points(conn: sqlite3.Connection) -> list[Point]:
    """Steps and evaluations merged by x (a version's evaluation after the step that published it)."""
    return sorted(step_points(conn) + eval_points(conn), key=lambda p: (p.x, p.kind == "eval", p.ref))
