"""The coordinator's typed ledger API (ledger/reads.py, ledger/records.py) against a real SQLite ledger: what each
method writes, what each reader gives back, and that the writes only queue (the caller's flush commits them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
from gyre_slurm.ledger.reads import AgentRow, CellRow, EvalRow, GroupRow, ShardRow, SwitchRow, UnheldRun
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.roles import Role
from gyre_slurm.statuses import (
    EVAL,
    GROUP,
    ROLLOUT,
    RUN,
    SHARD,
    STEP,
    SWITCH,
    AgentStatus,
    EvalStatus,
    GroupStatus,
    RolloutStatus,
    RunStatus,
    Severity,
    ShardStatus,
    StepStatus,
    SwitchStatus,
)


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    w = Ledger(tmp_path / "ledger.db", flush_interval_s=60)
    yield w
    w.close()


def _committed(ledger: Ledger, sql: str) -> list[dict]:
    """What another process sees: only committed rows."""
    conn = connect_readonly(ledger.path)
    try:
        return query_dicts(conn, sql)
    finally:
        conn.close()


def _call(ledger: Ledger, rid: int, index: int, version: int, counters: tuple[int, int, int]) -> None:
    ledger.call_recorded(rid, index, cell=0, weight_version=version, api="openai-chat", branch_reason=None,
                         prompt_tokens=10, reused_tokens=2, completion_tokens=5, finish_reason="stop",
                         started_at=100.0 + index, latency_s=0.5, segment=(64 * index, 64), counters=counters)


def _groups_and_runs(ledger: Ledger) -> None:
    """Task 1; group 1 ADMITTED (runs 1, 2), group 2 TRAINED (run 3); evaluation 1 RUNNING (run 4)."""
    ledger.task(1, "suite", "t-1", {"id": "t-1"}, "train")
    for gid, version in ((1, 3), (2, 0)):
        ledger.transition(GROUP, {"id": gid}, None, GroupStatus.ADMITTED, f"group {gid}", task_id=1, size=2,
                          admitted_version=version, created_at=1.0)
    for rid, gid in ((1, 1), (2, 1), (3, 2)):
        ledger.transition(ROLLOUT, {"id": rid}, None, RolloutStatus.QUEUED, f"rollout {rid}", group_id=gid,
                          task_id=1, queued_at=1.0)
    ledger.transition(GROUP, {"id": 2}, GroupStatus.ADMITTED, GroupStatus.READY, "group 2")
    ledger.transition(GROUP, {"id": 2}, GroupStatus.READY, GroupStatus.TRAINED, "group 2", train_step=0)
    ledger.transition(EVAL, {"id": 1}, None, EvalStatus.RUNNING, "evaluation 1", version=0, reason="start",
                      samples=1, pass_score=1.0, n_tasks=1, created_at=1.0)
    ledger.transition(ROLLOUT, {"id": 4}, None, RolloutStatus.QUEUED, "rollout 4", kind="eval", eval_id=1,
                      task_id=1, queued_at=1.0)


def test_an_empty_ledger_reads_as_a_new_run(ledger: Ledger) -> None:
    assert ledger.run("r") is None and not ledger.was_suspended() and ledger.daemon_starts() == 0
    assert (ledger.last_switch_id(), ledger.last_group_id(), ledger.last_rollout_id(), ledger.last_eval_id(),
            ledger.last_shard_id(), ledger.groups_trained(), ledger.steps_done()) == (0,) * 7
    assert ledger.cells() == [] and ledger.agents() == [] and ledger.open_groups() == []
    assert ledger.weight_version() is None and ledger.step_status(0) is None and ledger.task_keys() == {}


def test_writes_only_queue_until_the_flush(ledger: Ledger) -> None:
    ledger.cell_created(0, True, 2, now=5.0)
    ledger.event("k", "m", severity=Severity.WARNING)
    assert _committed(ledger, "SELECT id FROM cells") == [] and _committed(ledger, "SELECT id FROM events") == []
    assert ledger.pending == 3
    ledger.flush()
    assert _committed(ledger, "SELECT id, role, is_core, n_nodes FROM cells") == [
        {"id": 0, "role": "DOWN", "is_core": 1, "n_nodes": 2}]
    assert _committed(ledger, "SELECT severity FROM events") == [{"severity": "warning"}]


def test_an_events_severity_is_a_severity_member(ledger: Ledger) -> None:
    with pytest.raises(TypeError, match="must be a Severity"):
        ledger.event("k", "m", severity="warning")
    assert ledger.pending == 0
    ledger.event("k", "m")
    assert ledger.rows("SELECT severity FROM events") == [{"severity": "info"}]


def test_a_run_and_how_its_last_daemon_ended(ledger: Ledger) -> None:
    ledger.transition(RUN, {"id": "r"}, None, RunStatus.RUNNING, "run r", name="n", policy="elastic", config={},
                      created_at=7.0, daemon_starts=2)
    assert ledger.run("r") is not None and ledger.run("r").status is RunStatus.RUNNING
    assert (ledger.run("r").created_at, ledger.run("r").daemon_starts, ledger.daemon_starts()) == (7.0, 2, 2)
    ledger.degraded_reason("r", "too many infra errors")
    assert ledger.rows("SELECT degraded_reason FROM runs") == [{"degraded_reason": "too many infra errors"}]
    for kind, suspended in (("run_started", False), ("daemon_suspended", True), ("proxy_up", True),
                            ("daemon_restarted", False)):
        ledger.event(kind, "m")
        assert ledger.was_suspended() is suspended, kind


def test_cells_roles_and_their_spans(ledger: Ledger) -> None:
    ledger.cell_created(0, True, 1, now=1.0)
    ledger.cell_created(1, False, 1, now=1.0)
    ledger.role_changed(1, Role.DOWN, Role.ROLLOUT, now=2.0)
    ledger.role_changed(1, Role.ROLLOUT, Role.SWITCHING, now=3.0, target=Role.TRAIN)
    ledger.cell_job(1, "PENDING", now=4.0, job="123")
    ledger.cell_job(1, "RUNNING", now=5.0)
    ledger.cell_pinned(1, True, now=6.0)
    assert ledger.cells() == [CellRow(0, Role.DOWN, False, None, None), CellRow(1, Role.SWITCHING, True, "123",
                                                                                 "RUNNING")]
    assert ledger.rows("SELECT target_role, updated_at FROM cells WHERE id = 1") == [
        {"target_role": "TRAIN", "updated_at": 6.0}]
    spans = ledger.rows("SELECT role, started_at, ended_at FROM cell_spans WHERE cell_id = 1 ORDER BY id")
    assert [tuple(s.values()) for s in spans] == [("DOWN", 1.0, 2.0), ("ROLLOUT", 2.0, 3.0), ("SWITCHING", 3.0, None)]
    ledger.spans_ended(1, 9.0)
    assert ledger.scalar("SELECT count(*) FROM cell_spans WHERE ended_at IS NULL AND cell_id = 1") == 0
    ledger.transition(SWITCH, {"id": 4}, None, SwitchStatus.PENDING, "switch 4", cell_id=1, from_role="ROLLOUT",
                      to_role="TRAIN", reason="manual", requested_at=3.0)
    assert ledger.pending_switches() == [SwitchRow(4, 1, Role.ROLLOUT, Role.TRAIN, 3.0)]
    assert ledger.last_switch_id() == 4


def test_agents_register_again_and_beat(ledger: Ledger) -> None:
    ledger.cell_created(0, True, 1, now=1.0)
    reg = dict(cell_id=0, node_name="n0", host="h", pid=11, slurm_job_id=None, role=Role.ROLLOUT)
    ledger.agent_registered(0, None, **reg, now=2.0)
    ledger.flush()
    ledger.agent_registered(0, AgentStatus.UP, **{**reg, "pid": 12}, now=3.0)
    ledger.heartbeat(0, 0, now=4.0, rss_mb=512.0)
    ledger.agent_role(0, Role.TRAIN)
    assert ledger.agents() == [AgentRow(0, 0, Role.TRAIN, AgentStatus.UP)]
    assert ledger.rows("SELECT pid, registrations, registered_at, last_heartbeat, rss_mb FROM agents") == [
        {"pid": 12, "registrations": 2, "registered_at": 2.0, "last_heartbeat": 4.0, "rss_mb": 512.0}]
    assert ledger.rows("SELECT last_heartbeat FROM cells") == [{"last_heartbeat": 4.0}]


def test_groups_runs_and_evaluations_read_back(ledger: Ledger) -> None:
    _groups_and_runs(ledger)
    ledger.rollout_cell(2, 1)
    ledger.advantage(1, 0.5)
    assert ledger.task_keys() == {1: "t-1"}
    ledger.task(1, "suite", "t-other", {}, "train")  # a task already there is kept
    assert ledger.task_keys() == {1: "t-1"}
    assert ledger.open_groups() == [GroupRow(1, 1, GroupStatus.ADMITTED, 3)]
    assert (ledger.last_group_id(), ledger.last_rollout_id(), ledger.groups_trained()) == (2, 4, 1)
    runs = ledger.group_runs(1)
    assert [(r.id, r.status, r.cell_id, r.advantage, r.task_id) for r in runs] == [
        (1, RolloutStatus.QUEUED, None, 0.5, 1), (2, RolloutStatus.QUEUED, 1, None, 1)]
    assert [r.id for r in ledger.eval_runs(1)] == [4]
    assert ledger.evals() == [EvalRow(1, 0, EvalStatus.RUNNING, "start")]
    assert ledger.running_evals() == [1] and ledger.last_eval_id() == 1
    ledger.event("context_limit", "m", severity=Severity.WARNING, data={"rollout_id": 2})
    assert ledger.context_limited() == [2]


def test_model_calls_counters_and_late_calls(ledger: Ledger) -> None:
    _groups_and_runs(ledger)
    ledger.transition(ROLLOUT, {"id": 4}, RolloutStatus.QUEUED, RolloutStatus.RUNNING, "rollout 4", started_at=5.0)
    _call(ledger, 4, 0, 0, (1, 10, 5))
    _call(ledger, 4, 1, 1, (2, 20, 10))
    _call(ledger, 4, 1, 1, (2, 20, 10))  # a replay: no second row
    assert ledger.rows("SELECT n_calls, prompt_tokens, completion_tokens, version_end FROM rollouts WHERE id = 4") \
        == [{"n_calls": 2, "prompt_tokens": 20, "completion_tokens": 10, "version_end": 1}]
    calls = ledger.rows("SELECT call_index, reused_tokens, segment_offset, segment_length, tree_node_key "
                        "FROM model_calls ORDER BY call_index")
    assert [tuple(c.values()) for c in calls] == [(0, 2, 0, 64, None), (1, 2, 64, 64, None)]
    assert ledger.runs_served_later(1, 0) == {4} and ledger.runs_served_later(1, 1) == set()
    assert ledger.unheld_run(4, 1) == UnheldRun(2, 20, 10, None, True)
    assert ledger.unheld_run(3, 0) == UnheldRun(0, 0, 0, GroupStatus.TRAINED, False)
    assert ledger.unheld_run(99, 0) is None


def test_runs_between(ledger: Ledger) -> None:
    _groups_and_runs(ledger)
    for rid, started in ((1, 10.0), (2, 30.0)):
        ledger.transition(ROLLOUT, {"id": rid}, RolloutStatus.QUEUED, RolloutStatus.RUNNING, f"rollout {rid}",
                          started_at=started)
    ledger.transition(ROLLOUT, {"id": 1}, RolloutStatus.RUNNING, RolloutStatus.COMPLETED, "rollout 1",
                      ended_at=20.0)
    assert ledger.runs_between(15.0, 40.0) == [(10.0, 20.0), (30.0, None)]
    assert ledger.runs_between(20.0, 25.0) == []  # one ended at t0, the other started after now


def test_steps_shards_and_weight_versions(ledger: Ledger) -> None:
    ledger.version_published(0, None, "/w/v0", now=1.0)
    ledger.version_published(1, 0, "/w/v1", now=2.0, handle={"version": 1, "peer": "p"})
    assert ledger.rows("SELECT version, transport, handle IS NULL AS no_handle FROM weight_versions") == [
        {"version": 0, "transport": "file", "no_handle": 1}, {"version": 1, "transport": "mooncake", "no_handle": 0}]
    last = ledger.weight_version()
    assert (last.version, last.location, last.handle) == (1, "/w/v1", {"version": 1, "peer": "p"})
    assert ledger.weight_version(0).handle is None and ledger.weight_version(5) is None
    ledger.version_handle(0, {"version": 0})
    assert json.loads(ledger.scalar("SELECT handle FROM weight_versions WHERE version = 0")) == {"version": 0}
    ledger.weight_transfer(3.0, 1, 2, "engine:2", "mooncake", 2**31, 2.0, True, None)
    assert ledger.rows("SELECT bytes, gib_s, ok FROM weight_transfers") == [{"bytes": 2**31, "gib_s": 1.0, "ok": 1}]

    for step, dst in ((0, StepStatus.DONE), (1, StepStatus.FAILED), (2, StepStatus.RUNNING)):
        ledger.transition(STEP, {"step": step}, None, StepStatus.RUNNING, f"step {step}", policy="elastic",
                          version_in=step, started_at=1.0)
        if dst != StepStatus.RUNNING:
            ledger.transition(STEP, {"step": step}, StepStatus.RUNNING, dst, f"step {step}")
    ledger.step_sealed(2, 4, 30, 1000, 0.25)
    assert (ledger.steps_done(), ledger.running_steps(), ledger.step_status(1)) == (1, [2], StepStatus.FAILED)
    assert ledger.rows("SELECT n_groups, n_runs, tokens_trained, reward_mean FROM train_steps WHERE step = 2") == [
        {"n_groups": 4, "n_runs": 30, "tokens_trained": 1000, "reward_mean": 0.25}]

    for row, dst in ((1, ShardStatus.QUEUED), (2, ShardStatus.TAKEN), (3, ShardStatus.DONE)):
        ledger.transition(SHARD, {"id": row}, None, ShardStatus.QUEUED, f"shard {row}", step=2,
                          shard=row - 1, path=f"/b/{row}", n_runs=1, tokens=10, queued_at=1.0)
        if dst != ShardStatus.QUEUED:
            ledger.transition(SHARD, {"id": row}, ShardStatus.QUEUED, dst, f"shard {row}")
    assert ledger.open_shards() == [ShardRow(1, 2, 0, "/b/1", ShardStatus.QUEUED),
                                          ShardRow(2, 2, 1, "/b/2", ShardStatus.TAKEN)]
    assert ledger.last_shard_id() == 3


def test_a_policy_decision(ledger: Ledger) -> None:
    ledger.policy_decision(1.0, policy="elastic", kind="switch", cells=[1, 2], role=Role.TRAIN, groups=None,
                           reason="r", watermark=5, capacity=8, queued=1, running=4, groups_ready=0, groups_open=2,
                           version=3, roles="R T")
    row = ledger.rows("SELECT kind, cells, role, groups, capacity, roles FROM policy_decisions")[0]
    assert {**row, "cells": json.loads(row["cells"])} == {"kind": "switch", "cells": [1, 2], "role": "TRAIN",
                                                          "groups": None, "capacity": 8, "roles": "R T"}
