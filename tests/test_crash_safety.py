"""A writer killed with -9 at any moment leaves a ledger that is intact and holds only whole batches."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WRITER = r"""
import sys, time
from gyre_slurm.ledger.store import LedgerWriter
w = LedgerWriter(sys.argv[1], flush_interval_s=60, max_batch_rows=10**9)
w.insert_ignore("tasks", id=1, suite="s", key="k", spec={})
w.insert_ignore("groups", id=1, task_id=1, status="ADMITTED", size=1, admitted_version=0, train_step=None,
                created_at=0.0, ready_at=None, n_valid=None, reward_mean=None, reward_std=None, drop_reason=None)
w.insert_ignore("rollouts", id=1, group_id=1, task_id=1, status="RUNNING", queued_at=0.0)
w.flush()
start = w.scalar("SELECT coalesce(max(call_index), -1) FROM model_calls") + 1
print("ready", flush=True)
i = start
while True:
    for _ in range(500):
        w.insert_ignore("model_calls", rollout_id=1, call_index=i, cell_id=0, weight_version=0, tree_node_key=None,
                        api="openai-chat", branch_reason=None, prompt_tokens=1000, reused_tokens=900,
                        completion_tokens=50, finish_reason="stop", started_at=time.time(), latency_s=0.1)
        i += 1
    w.update("rollouts", {"id": 1}, n_calls=i)
    w.flush()
"""


def test_kill9_during_writes_never_corrupts_the_ledger(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    rng = random.Random(7)
    counts = []
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        n = conn.execute("SELECT count(*) FROM model_calls").fetchone()[0]
        n_calls = conn.execute("SELECT n_calls FROM rollouts WHERE id = 1").fetchone()[0]
        distinct = conn.execute("SELECT count(DISTINCT call_index) FROM model_calls").fetchone()[0]
        conn.close()
        assert n % 500 == 0 and n == distinct, "a partial batch or a duplicate survived the kill"
        assert (n_calls or 0) == n  # the batch's update committed with its inserts, or neither did
        counts.append(n)
    assert counts == sorted(counts) and counts[-1] > counts[0] > 0
