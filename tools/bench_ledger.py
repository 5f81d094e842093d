"""Ledger benchmark: batched model_call write rate, and `gyre status` query latency on a large ledger.

    .venv/bin/python tools/bench_ledger.py [--rows 1000000] [--write-rows 200000]

Prints the write rate (rows/s, and its ratio to the 5,000 rows/s target) beside its baseline measured in the same
run — the same rows written one transaction each, as a writer without batching would — then, last, the median
latency of the queries behind `gyre status` on a ledger holding --rows model_call rows (target: under 200 ms; the
baseline is the target itself: a status a user waits for). Exits 1 when either target is missed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gyre_slurm.ledger import queries
from gyre_slurm.ledger.readonly import connect_readonly
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.statuses import Severity

WRITE_TARGET = 5_000.0
STATUS_TARGET_MS = 200.0


def seed_parents(w: LedgerWriter, n_rollouts: int) -> None:
    now = time.time()
    w.insert("runs", id="bench", name="bench", status="RUNNING", policy="elastic", config={}, created_at=now,
             ended_at=None, daemon_starts=1, slurm_job_id=None)
    for c in range(8):
        w.insert("cells", id=c, is_core=c == 0, role="ROLLOUT", target_role=None, n_nodes=1, last_heartbeat=now,
                 updated_at=now)
        w.insert("cell_spans", cell_id=c, role="ROLLOUT", started_at=now, ended_at=None)
    w.insert("tasks", id=1, suite="bench", key="t", spec={})
    for g in range(n_rollouts // 16):
        w.insert("groups", id=g + 1, task_id=1, status="READY", size=16, admitted_version=0, train_step=None,
                 created_at=now, ready_at=None, n_valid=None, reward_mean=None, reward_std=None, drop_reason=None)
    statuses = ["COMPLETED", "RUNNING", "QUEUED", "TIMEOUT_SCORED", "EVAL_ERROR"]
    for r in range(n_rollouts):
        w.insert("rollouts", id=r + 1, group_id=r // 16 + 1, task_id=1, status=random.choice(statuses),
                 queued_at=now, reward=random.random())
    for s in range(200):
        w.insert("train_steps", step=s, policy="elastic", version_in=s, version_out=s + 1, status="DONE",
                 started_at=now, ended_at=now + 10, tokens_trained=100_000, reward_mean=0.5)
    for i in range(2_000):
        w.event("bench", f"event {i}", severity=random.choice([Severity.INFO, Severity.WARNING]))
    w.flush()


def call_row(i: int, n_rollouts: int, t: float) -> dict:
    return dict(rollout_id=i % n_rollouts + 1, call_index=i // n_rollouts, cell_id=i % 8, weight_version=i // 50_000,
                tree_node_key=i, api="openai-chat", branch_reason=None, prompt_tokens=30_000 + i % 1000,
                reused_tokens=29_000, completion_tokens=400, finish_reason="stop", started_at=t, latency_s=2.5)


def bench_writes(path: Path, n: int, n_rollouts: int, batched: bool = True) -> float:
    """Rows/s through the daemon's writer with its default batching (the clock includes every commit); with
    batched False, the baseline: every row its own transaction, as a writer that commits as it goes."""
    w = LedgerWriter(path)
    seed_parents(w, n_rollouts)
    rows = [call_row(i, n_rollouts, time.time()) for i in range(n)]
    t0 = time.perf_counter()
    for r in rows:
        w.insert_ignore("model_calls", **r)
        if not batched or w.due():
            w.flush()
    w.flush()
    rate = n / (time.perf_counter() - t0)
    w.close()
    return rate


def bench_status(path: Path, n_calls: int, n_rollouts: int, reps: int = 15) -> list[float]:
    w = LedgerWriter(path, max_batch_rows=50_000)
    seed_parents(w, n_rollouts)
    t_start = time.time() - 3600
    step = 50_000
    for lo in range(0, n_calls, step):
        for i in range(lo, min(n_calls, lo + step)):
            w.insert("model_calls", **call_row(i, n_rollouts, t_start + i * 3600 / n_calls))
        w.flush()
        print(f"\r  building: {min(n_calls, lo + step):,}/{n_calls:,} model_call rows", end="", file=sys.stderr)
    print(file=sys.stderr)
    w.close()
    times = []
    for _ in range(reps):  # a fresh connection each time, as the CLI opens one per command
        t0 = time.perf_counter()
        conn = connect_readonly(path)
        s = queries.status_summary(conn)
        conn.close()
        times.append((time.perf_counter() - t0) * 1000)
    assert s["model_calls"] == n_calls
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="model_call rows in the status ledger")
    ap.add_argument("--write-rows", type=int, default=200_000, help="model_call rows written for the rate")
    ap.add_argument("--rollouts", type=int, default=16_000)
    ap.add_argument("--baseline-rows", type=int, default=3_000, help="rows written one transaction each")
    a = ap.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory() as d:
        rate = bench_writes(Path(d) / "w.db", a.write_rows, a.rollouts)
        base = bench_writes(Path(d) / "b.db", a.baseline_rows, a.rollouts, batched=False)
        print(f"write: {rate:,.0f} model_call rows/s through the batched writer ({rate / WRITE_TARGET:.1f}x the "
              f"{WRITE_TARGET:,.0f} rows/s target); baseline, one transaction per row: {base:,.0f} rows/s "
              f"(batching: {rate / base:.1f}x)")
        times = bench_status(Path(d) / "s.db", a.rows, a.rollouts)
    med = statistics.median(times)
    missed = [f"write rate {rate:,.0f} < {WRITE_TARGET:,.0f} rows/s"] if rate < WRITE_TARGET else []
    if med >= STATUS_TARGET_MS:
        missed.append(f"status median {med:.1f} ms >= {STATUS_TARGET_MS:.0f} ms")
    for m in missed:
        print(f"MISSED TARGET: {m}", file=sys.stderr)
    print(f"status: median {med:.1f} ms, max {max(times):.1f} ms over {len(times)} runs of the `gyre status` "
          f"queries on {a.rows:,} model_call rows ({STATUS_TARGET_MS / med:.1f}x under the {STATUS_TARGET_MS:.0f} ms "
          "target)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
