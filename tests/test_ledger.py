"""The ledger: schema and views, batched idempotent writes, and a read-only path that cannot write."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from gyre_slurm.errors import GyreError, ReadOnlyError
from gyre_slurm.ledger.models import SCHEMA_VERSION
from gyre_slurm.ledger.readonly import connect_readonly, query_dicts, run_query
from gyre_slurm.ledger.store import LedgerWriter, _Checkpointer

from .conftest import gyre, wait_for

TABLES = {"runs", "cells", "cell_spans", "agents", "role_switches", "tasks", "groups", "rollouts", "model_calls",
          "tree_nodes", "train_steps", "shards", "weight_versions", "events", "meta", "evals"}
VIEWS = {"v_cells", "v_cell_role_time", "v_switch_durations", "v_rollouts_by_status", "v_step_times",
         "v_eval", "v_eval_tasks", "v_reward_per_step", "v_tokens_per_step", "v_events", "v_shards"}


@pytest.fixture
def writer(tmp_path: Path) -> LedgerWriter:
    w = LedgerWriter(tmp_path / "ledger.db", flush_interval_s=10)
    yield w
    w.close()


def test_schema_tables_and_views(writer: LedgerWriter) -> None:
    names = {r["name"]: r["type"] for r in writer.rows("SELECT name, type FROM sqlite_master")}
    assert {n for n, t in names.items() if t == "table"} >= TABLES
    assert {n for n, t in names.items() if t == "view"} >= VIEWS
    assert writer.scalar("PRAGMA journal_mode") == "wal"
    for v in VIEWS:  # each view runs on an empty ledger
        writer.rows(f"SELECT * FROM {v}")


def test_a_ledger_of_another_schema_is_refused_whole_but_stays_readable(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    w = LedgerWriter(db)
    w.event("x", "written by this schema")
    w.close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")  # as an older gyre left it
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(GyreError, match=f"ledger schema 1; this gyre writes schema {SCHEMA_VERSION}"):
        LedgerWriter(db)
    assert db.read_bytes() == before
    assert query_dicts(connect_readonly(db), "SELECT message FROM events") == [{"message": "written by this schema"}]


def test_writes_are_batched_in_order_and_replays_are_ignored(writer: LedgerWriter) -> None:
    writer.insert("cells", id=0, is_core=True, role="ROLLOUT", target_role=None, n_nodes=1, last_heartbeat=None,
                  updated_at=1.0)
    for i in range(3):
        writer.insert("events", ts=float(i), kind="k", severity="info", cell_id=None, node_index=None,
                      message=str(i), data=None)
    writer.update("cells", {"id": 0}, role="TRAIN")
    assert writer.pending == 5
    # nothing is visible to readers before the flush
    conn = connect_readonly(writer.path)
    assert query_dicts(conn, "SELECT count(*) AS n FROM events")[0]["n"] == 0
    assert writer.flush() == 5
    assert query_dicts(conn, "SELECT role FROM cells")[0]["role"] == "TRAIN"
    # a model call replayed by a peer after a crash is written once
    writer.insert("runs", id="r", name="r", status="RUNNING", policy="colocate", config={}, created_at=0.0,
                  ended_at=None, daemon_starts=1, slurm_job_id=None)
    call = dict(rollout_id=None, call_index=0, cell_id=0, weight_version=0, tree_node_key=None, api="openai-chat",
                branch_reason=None, prompt_tokens=10, reused_tokens=0, completion_tokens=5, finish_reason="stop",
                started_at=1.0, latency_s=0.1)
    writer.insert("tasks", id=1, suite="s", key="k", spec={})
    writer.insert("groups", id=1, task_id=1, status="ADMITTED", size=1, admitted_version=0, train_step=None,
                  created_at=0.0, ready_at=None, n_valid=None, reward_mean=None, reward_std=None, drop_reason=None)
    writer.insert("rollouts", id=7, group_id=1, task_id=1, status="RUNNING", queued_at=0.0)
    for _ in range(3):
        writer.insert_ignore("model_calls", **{**call, "rollout_id": 7})
    writer.flush()
    assert query_dicts(conn, "SELECT count(*) AS n FROM model_calls")[0]["n"] == 1
    conn.close()


def test_set_coalesces_a_rows_counters_and_commits_them_with_the_flush(writer: LedgerWriter) -> None:
    writer.insert("tasks", id=1, suite="s", key="k", spec={})
    writer.insert("groups", id=1, task_id=1, status="ADMITTED", size=2, admitted_version=0, train_step=None,
                  created_at=0.0, ready_at=None, n_valid=None, reward_mean=None, reward_std=None, drop_reason=None)
    for rid in (1, 2):
        writer.insert("rollouts", id=rid, group_id=1, task_id=1, status="RUNNING", queued_at=0.0)
    writer.flush()
    for n in range(1, 6):  # five calls of run 1, two of run 2: one pending update per row, the last values
        writer.set("rollouts", {"id": 1}, n_calls=n, prompt_tokens=100 * n)
        if n <= 2:
            writer.set("rollouts", {"id": 2}, n_calls=n, prompt_tokens=10 * n)
    writer.update("rollouts", {"id": 2}, status="COMPLETED")  # an ordinary update of other columns, same flush
    assert writer.pending == 3
    conn = connect_readonly(writer.path)
    assert query_dicts(conn, "SELECT n_calls FROM rollouts ORDER BY id") == [{"n_calls": 0}] * 2  # not before
    assert writer.flush() == 3
    assert query_dicts(conn, "SELECT id, status, n_calls, prompt_tokens FROM rollouts ORDER BY id") == [
        {"id": 1, "status": "RUNNING", "n_calls": 5, "prompt_tokens": 500},
        {"id": 2, "status": "COMPLETED", "n_calls": 2, "prompt_tokens": 20}]
    conn.close()


def test_commits_never_checkpoint_a_thread_of_their_own_does(tmp_path: Path) -> None:
    """A commit only appends to the WAL (a checkpoint syncs the disk, and a call's ack waits for the commit): past
    SQLite's 1,000-page autocheckpoint the writer's commits still leave ledger.db as it was; the checkpointer thread
    copies the WAL in, and closing the writer leaves no WAL behind."""
    db = tmp_path / "ledger.db"
    w = LedgerWriter(db, flush_interval_s=10)
    w._checkpointer.stop()  # none for now: whatever reaches ledger.db below, the commits did
    size0 = db.stat().st_size
    for i in range(6):  # ~6 MB of rows in 6 commits: 1,500 WAL pages
        for j in range(1000):
            w.event("x", f"{i}.{j} " + "m" * 1000)
        w.flush()
    assert (db.parent / "ledger.db-wal").stat().st_size > 5e6
    assert db.stat().st_size == size0
    w._checkpointer = _Checkpointer(db, every_s=0.1)
    wait_for(lambda: db.stat().st_size > 5e6, 30, "the checkpointer to copy the WAL into ledger.db")
    w.close()
    assert not (db.parent / "ledger.db-wal").exists()
    assert query_dicts(connect_readonly(db), "SELECT count(*) AS n FROM events WHERE kind = 'x'") == [{"n": 6000}]


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("stmt", [
    "INSERT INTO events(ts, kind, severity, message) VALUES (1, 'x', 'info', 'y')",
    "UPDATE cells SET role = 'TRAIN'",
    "DELETE FROM events",
    "DROP TABLE events",
    "DROP VIEW v_cells",
    "CREATE TABLE t(x)",
    "ALTER TABLE events ADD COLUMN z",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA journal_mode=DELETE",
    "PRAGMA writable_schema=ON",
    "REPLACE INTO meta VALUES ('a', 'b')",
    "WITH x AS (SELECT 1) DELETE FROM events",
    "VACUUM",
])
def test_readonly_refuses_every_write(writer: LedgerWriter, stmt: str) -> None:
    writer.event("k", "m")
    writer.flush()
    before = writer.rows("SELECT * FROM events")
    conn = connect_readonly(writer.path)
    with pytest.raises(ReadOnlyError, match="read-only"):
        run_query(conn, stmt)
    conn.close()
    assert writer.rows("SELECT * FROM events") == before
    assert {r["name"] for r in writer.rows("SELECT name FROM sqlite_master")} >= TABLES | VIEWS
    assert writer.scalar("PRAGMA journal_mode") == "wal"


def test_readonly_allows_reads(writer: LedgerWriter) -> None:
    conn = connect_readonly(writer.path)
    cols, rows = run_query(conn, "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM n WHERE i < 3) "
                                 "SELECT i, (SELECT count(*) FROM cells) FROM n")
    assert cols[0] == "i" and [r[0] for r in rows] == [1, 2, 3]
    assert run_query(conn, "PRAGMA table_info(cells)")[1]
    assert run_query(conn, "EXPLAIN QUERY PLAN SELECT * FROM rollouts WHERE status = 'QUEUED'")[1]
    with pytest.raises(GyreError, match="SQL error"):
        run_query(conn, "SELECT * FROM no_such_table")
    with pytest.raises(GyreError, match="one statement"):
        run_query(conn, "SELECT 1; DELETE FROM events")
    conn.close()


def test_gyre_sql_cli_refuses_writes_and_leaves_the_file_unchanged(tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / "r"
    w = LedgerWriter(run_dir / "ledger.db")
    w.event("k", "hello")
    w.close()
    before = _digest(run_dir / "ledger.db")
    r = gyre("sql", "r", "DELETE FROM events", "--state-dir", tmp_path / "state")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: gyre sql is read-only") and len(r.stderr.strip().splitlines()) == 1
    assert _digest(run_dir / "ledger.db") == before
    r = gyre("sql", "r", "SELECT kind, message FROM events", "--state-dir", tmp_path / "state", "--format", "csv")
    assert r.returncode == 0 and r.stdout.splitlines() == ["kind,message", "k,hello"]
    r = gyre("sql", "nope", "SELECT 1", "--state-dir", tmp_path / "state")
    assert r.returncode == 1 and "no run 'nope'" in r.stderr
