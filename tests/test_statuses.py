"""Status machines: every (status, status) pair of every machine through the ledger's one status writer, CHECK
constraints against plain sqlite3, and an illegal transition met by the running daemon (an events row, nothing
written, the daemon serving on)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from gyre_slurm.errors import IllegalTransition
from gyre_slurm.ledger.models import STATUS_COLUMNS
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.protocol import PROTOCOL_VERSION, DoneAck, Error, RolloutDone, decode, encode
from gyre_slurm.roles import TRANSITIONS, Role
from gyre_slurm.rundir import read_control
from gyre_slurm.statuses import (
    AGENT,
    EVAL,
    GROUP,
    MACHINES,
    ROLE,
    ROLLOUT,
    ROLLOUT_TERMINAL,
    RUN,
    SHARD,
    STEP,
    SWITCH,
    RolloutStatus,
    StateMachine,
)

from .conftest import q, wait_for

TABLES = ("runs", "cells", "cell_spans", "agents", "role_switches", "tasks", "groups", "rollouts", "model_calls",
          "tree_nodes", "train_steps", "shards", "weight_versions", "events", "evals")

# a row of each machine's table, minus its key and status column; parents are made by _ledger
ROW = {
    RUN: lambda: dict(name="r", policy="colocate", config={}, created_at=1.0, daemon_starts=1),
    AGENT: lambda: dict(cell_id=0, node_name="n0", host="h", pid=1, role="ROLLOUT", registered_at=1.0,
                        registrations=1),
    SWITCH: lambda: dict(cell_id=0, from_role="ROLLOUT", to_role="TRAIN", reason="manual", requested_at=1.0),
    GROUP: lambda: dict(task_id=1, size=2, admitted_version=0, created_at=1.0),
    ROLLOUT: lambda: dict(group_id=1, task_id=1, queued_at=1.0, n_calls=0, prompt_tokens=0, completion_tokens=0),
    STEP: lambda: dict(policy="colocate", version_in=0, started_at=1.0, n_groups=0, n_runs=0, n_cells=0,
                       tokens_trained=0),
    SHARD: lambda: dict(step=0, shard=0, path="step-00000/shard-0000.msgpack", n_runs=1, tokens=3, attempts=0,
                             queued_at=1.0),
    EVAL: lambda: dict(version=0, reason="start", samples=2, temperature=1.0, pass_score=1.0, n_tasks=1,
                       created_at=1.0),
    ROLE: lambda: dict(is_core=False, n_nodes=1, updated_at=1.0),
}
KEY = {RUN: "id", AGENT: "node_index", SWITCH: "id", GROUP: "id", ROLLOUT: "id", STEP: "step", SHARD: "id",
       EVAL: "id", ROLE: "id"}


def _ledger(path: Path) -> LedgerWriter:
    w = LedgerWriter(path, flush_interval_s=60)
    w.insert("cells", id=0, is_core=True, role="ROLLOUT", n_nodes=1, updated_at=1.0)
    w.insert("tasks", id=1, suite="s", key="k", spec={})
    w.insert("groups", id=1, task_id=1, status="ADMITTED", size=2, admitted_version=0, created_at=1.0)
    w.flush()
    return w


def _dump(db: Path) -> dict[str, list]:
    conn = sqlite3.connect(db)
    try:
        return {t: conn.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in TABLES}
    finally:
        conn.close()


def test_the_tables_are_complete_and_roles_share_roles_py() -> None:
    for m in MACHINES:
        assert set(m.transitions) == set(m.states), m.name
        assert m.initial and all(isinstance(s, m.states) for s in m.initial)
        assert m in STATUS_COLUMNS
    assert {r: set(n) for r, n in ROLE.transitions.items()} == {r: set(n) for r, n in TRANSITIONS.items()}
    assert ROLLOUT.terminal == ROLLOUT_TERMINAL
    assert not SWITCH.allowed(SWITCH.states.DONE, SWITCH.states.PENDING)
    assert not ROLE.allowed(Role.ROLLOUT, Role.TRAIN)  # a switch always passes through SWITCHING


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name.replace(" ", "_"))
def test_every_pair_through_the_ledger_writer(machine: StateMachine, tmp_path: Path) -> None:
    """Legal pairs are written; illegal ones raise IllegalTransition and leave every table as it was."""
    db = tmp_path / "ledger.db"
    w = _ledger(db)
    table, column = STATUS_COLUMNS[machine]
    key_col = KEY[machine]
    pairs = [(None, d) for d in machine.states] + [(s, d) for s in machine.states for d in machine.states]
    legal = 0
    for n, (src, dst) in enumerate(pairs, start=10):
        key = {key_col: f"r{n}" if machine is RUN else n}
        if src is not None:  # a row in src, written as it may stand in a ledger (the CHECK admits it)
            w.insert(table, **key, **{column: src.value}, **ROW[machine]())
            w.flush()
        before = _dump(db)
        if machine.allowed(src, dst):
            legal += 1
            w.transition(machine, key, src, dst, f"{table} {n}", **(ROW[machine]() if src is None else {}))
            w.flush()
            got = w.scalar(f"SELECT {column} FROM {table} WHERE {key_col} = :k", k=key[key_col])
            assert got == dst.value, (src, dst)
        else:
            with pytest.raises(IllegalTransition) as e:
                w.transition(machine, key, src, dst, f"{table} {n}", **(ROW[machine]() if src is None else {}))
            assert e.value.machine == machine.name and e.value.dst == dst.value
            assert w.pending == 0
            w.flush()
            assert _dump(db) == before, f"{machine.name}: {src} → {dst} changed the ledger"
    assert 0 < legal < len(pairs)
    w.close()


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.name.replace(" ", "_"))
def test_a_check_constraint_refuses_an_unknown_status(machine: StateMachine, tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    w = _ledger(db)
    table, column = STATUS_COLUMNS[machine]
    key = {KEY[machine]: "x" if machine is RUN else 5}
    first = sorted(machine.initial, key=lambda s: s.value)[0]
    w.transition(machine, key, None, first, "row", **ROW[machine]())
    w.close()
    conn = sqlite3.connect(db)
    try:
        for bad in ("BOGUS", first.value.lower(), ""):
            with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
                conn.execute(f"UPDATE {table} SET {column} = ?", (bad,))
        cols = {**ROW[machine](), KEY[machine]: "y" if machine is RUN else 6, column: "BOGUS"}
        values = tuple(json.dumps(v) if isinstance(v, dict) else v for v in cols.values())
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            conn.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", values)
        assert conn.execute(f"SELECT {column} FROM {table} WHERE {KEY[machine]} = ?",
                            (key[KEY[machine]],)).fetchone() == (first.value,)
    finally:
        conn.close()


def test_other_enum_columns_refuse_unknown_values(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    _ledger(db).close()
    conn = sqlite3.connect(db)
    try:
        for sql in ("UPDATE cells SET target_role = 'SWITCHING'", "UPDATE cells SET target_role = 'X'",
                    "INSERT INTO events (ts, kind, severity, message) VALUES (1, 'k', 'fatal', 'm')",
                    "INSERT INTO cell_spans (cell_id, role, started_at) VALUES (0, 'IDLE', 1)"):
            with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
                conn.execute(sql)
    finally:
        conn.close()


@pytest.mark.slow
def test_the_daemon_logs_an_illegal_transition_and_writes_nothing(tmp_path: Path, warm_model: Path) -> None:
    """A worker reports a rollout the daemon never handed out (still QUEUED): refused as QUEUED → COMPLETED,
    logged as an events row, acked so the worker stops sending it; the daemon serves on."""
    from gyre_slurm.config import load_config
    from gyre_slurm.launch.local import start_local_run

    from .conftest import write_config

    cfg_path = write_config(tmp_path / "run.yaml", tmp_path / "state", cluster={"cells": 1, "engine": "embedded"},
                            model={"path": str(warm_model)}, tasks={"suite": "builtin:sevens", "group_size": 2,
                                                                    "groups_per_step": 1},
                            harness={"workers": 0}, train={"steps": 1})
    run = start_local_run(load_config(cfg_path), "ill")
    try:
        db = run.run_dir / "ledger.db"
        wait_for(lambda: q(db, "SELECT count(*) FROM rollouts WHERE status = 'QUEUED'")[0][0] == 2, 60,
                 "rollouts to be admitted")
        info = read_control(run.run_dir)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(info.endpoint)
        done = RolloutDone(rollout_id=1, worker_id="rogue", status=RolloutStatus.COMPLETED, reward=1.0,
                           started_at=time.time(), harness_s=1.0)
        sock.send(encode(done, info.token))
        assert sock.poll(10_000), "no answer from the daemon"
        answer = decode(sock.recv(), info.token)
        assert isinstance(answer, DoneAck) and answer.rollout_id == 1
        rows = wait_for(lambda: q(db, "SELECT message, data FROM events WHERE kind = 'illegal_transition'"), 10,
                        "the illegal_transition event")
        assert "rollout 1: QUEUED → COMPLETED" in rows[0][0]
        assert q(db, "SELECT status, reward FROM rollouts WHERE id = 1") == [("QUEUED", None)]
        bogus = {**done.model_dump(mode="json"), "status": "BOGUS"}  # not even a status: refused by the protocol
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "token": info.token, "msg": bogus}))
        assert sock.poll(10_000)
        assert isinstance(decode(sock.recv(), info.token), Error)
        sock.close(linger=0)
        assert run.alive()
    finally:
        run.kill()
