"""The daemon's queue of a step's shards (coordinator/shard_queue.py) and the loop's part in it, without
processes: on a real ledger, with the messages the training cells send."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gyre_slurm.config import parse_config
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.coordinator.loop import RLLoop
from gyre_slurm.coordinator.rollouts import GroupState
from gyre_slurm.coordinator.shard_queue import ShardQueue
from gyre_slurm.coordinator.steps import StepInFlight
from gyre_slurm.errors import IllegalTransition
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import (
    Heartbeat,
    JoinStep,
    NoShard,
    Register,
    ShardAssignment,
    ShardDone,
    ShardFailed,
    StepOpen,
    StepSeal,
    SwitchReport,
    TakeShard,
    TrainDone,
    TrainStep,
)
from gyre_slurm.roles import Role
from gyre_slurm.scheduler.view import Train
from gyre_slurm.statuses import SHARD, GroupStatus, ShardStatus, StepStatus
from gyre_slurm.train.batch import TrainBatch, TrainSample, read_batch
from gyre_slurm.train.shards import check_shards

from .conftest import q


def batch(n_runs: int = 5, step: int = 3) -> TrainBatch:
    samples = [TrainSample(r, [1, 2, 3, 4, 5][:2 + r % 4], [0] + [1] * (1 + r % 4), [0.0] + [-0.5] * (1 + r % 4))
               for r in range(1, n_runs + 1)]
    return TrainBatch(samples, {s.run_id: 0.5 - s.run_id % 2 for s in samples},
                      {s.run_id: sum(s.loss_mask) for s in samples}, step=step, version_in=2)


def rows(ledger: Ledger) -> list[tuple]:
    return [tuple(r.values()) for r in ledger.rows(
        "SELECT shard, status, cell_id, attempts, done_by FROM shards ORDER BY id")]


@pytest.fixture
def queue(tmp_path: Path) -> tuple[ShardQueue, Ledger]:
    ledger = Ledger(tmp_path / "ledger.db")
    return ShardQueue(ledger, tmp_path), ledger


def test_a_step_is_split_into_whole_run_shards_written_and_queued(queue, tmp_path: Path) -> None:
    mq, ledger = queue
    b = batch(5)
    refs = mq.open(b, attempt=1, shard_runs=2, now=10.0)
    assert [r.shard for r in refs] == [0, 1, 2]  # ceil(5 / 2)
    shards = [read_batch(Path(r.path)) for r in refs]
    check_shards(b, shards)  # whole runs
    # unnormalised losses in every shard: the seal tells the core the step's valid runs
    assert all(s.n_valid_runs == 0 for s in shards) and mq.seal == StepSeal(n_shards=3, n_valid_runs=5)
    assert all(Path(r.path).parent == tmp_path / "batches" / "step-00003" for r in refs)
    got = ledger.rows("SELECT step, shard, status, n_runs, tokens, attempts, queued_at FROM shards")
    assert [(r["step"], r["status"], r["attempts"], r["queued_at"]) for r in got] == [(3, "QUEUED", 0, 10.0)] * 3
    assert sum(r["n_runs"] for r in got) == 5 and sum(r["tokens"] for r in got) == sum(b.targets_per_run.values())
    assert mq.current(3, 1) and not mq.current(3, 2) and not mq.current(4, 1)


def test_shards_go_to_cells_come_back_when_a_cell_leaves_and_count_once(queue) -> None:
    mq, ledger = queue
    mq.open(batch(3), attempt=1, shard_runs=1, now=0.0)
    assert mq.take(0, True, 1.0) == ShardAssignment(step=3, shard=0, path=str(mq.shards[0].path),
                                                         seal=StepSeal(n_shards=3, n_valid_runs=3))
    assert mq.take(1, False, 1.1).shard == 1
    assert mq.take(2, False, 1.2).shard == 2
    assert mq.holders() == {0, 1, 2} and mq.joined == {1, 2}
    # nothing queued: ask again later (a requeue may come), the step is not over for anyone
    assert mq.take(1, False, 1.3) == NoShard(step=3, retry_after_s=0.2, step_over=False)
    assert mq.requeue(1, "cell 1 is DOWN") == [1] and 1 not in mq.joined
    assert rows(ledger)[1] == (1, "QUEUED", 1, 1, None)  # cell_id keeps who held it last
    assert mq.take(0, True, 2.0).shard == 1  # the core redoes it
    assert rows(ledger)[1] == (1, "TAKEN", 0, 2, None)
    # the late gradient of cell 1 reached the core first: the core's word counts, and nothing counts twice
    assert mq.done(1, by_cell=1, now=2.5) and not mq.done(1, by_cell=0, now=2.6)
    assert mq.done(0, by_cell=0, now=3.0)
    # cell 2 is pulled back before its gradient came: requeued, then its gradient arrives (QUEUED → DONE)
    assert mq.requeue(2, "cell 2 → ROLLOUT") == [2]
    assert mq.done(2, by_cell=2, now=3.5)
    assert rows(ledger) == [(0, "DONE", 0, 1, 0), (1, "DONE", 0, 2, 1), (2, "DONE", 2, 1, 2)]
    assert mq.done_by() == {0, 1, 2} and mq.holders() == set()
    # every shard DONE: a satellite is done with the step; the core never hears "over" from the queue
    assert mq.take(2, False, 4.0).step_over and not mq.take(0, True, 4.0).step_over
    assert not mq.done(7, by_cell=0, now=4.0)  # an unknown shard
    mq.close(True, 5.0)
    assert mq.step is None and ledger.scalar("SELECT count(*) FROM events WHERE kind = 'shards_requeued'") == 2
    view = ledger.rows("SELECT * FROM v_shards")[0]
    assert (view["step"], view["shards"], view["done"], view["redone"], view["cells"]) == (3, 3, 3, 1, 3)
    assert view["done_by_cell"] == "cell 0: 1, cell 1: 1, cell 2: 1" and view["mean_shard_s"] > 0


def test_a_failed_step_fails_its_open_shards_and_a_restart_fails_the_step_in_flight(queue, tmp_path: Path) -> None:
    mq, ledger = queue
    mq.open(batch(3), attempt=1, shard_runs=1, now=0.0)
    mq.take(0, True, 1.0)
    mq.done(0, 0, 2.0)
    mq.take(1, False, 2.0)
    mq.close(False, 3.0, "the step failed: boom")
    assert [r[1] for r in rows(ledger)] == ["DONE", "FAILED", "FAILED"]
    assert "boom" in ledger.rows("SELECT message FROM events WHERE kind = 'shards_failed'")[0]["message"]
    with pytest.raises(IllegalTransition):  # FAILED is final
        ledger.transition(SHARD, {"id": 2}, ShardStatus.FAILED, ShardStatus.QUEUED, "shard")
    # a daemon killed during the next step: the new one fails what was open (the step runs again, new rows)
    mq.open(batch(2, step=4), attempt=1, shard_runs=1, now=4.0)
    mq.take(0, True, 4.5)
    ledger.flush()
    again = ShardQueue(ledger, tmp_path)
    assert again.recover(5.0) == 2
    ledger.flush()
    assert q(tmp_path / "ledger.db", "SELECT step, status, count(*) FROM shards GROUP BY step, status") == \
        [(3, "DONE", 1), (3, "FAILED", 2), (4, "FAILED", 2)]
    refs = again.open(batch(2, step=4), attempt=2, shard_runs=1, now=6.0)
    assert [r.shard for r in refs] == [0, 1] and again.shards[0].row == 6  # new rows after the old ones


def test_a_satellite_that_cannot_do_its_shard_gives_it_back_and_takes_no_more(queue) -> None:
    mq, ledger = queue
    mq.open(batch(2), attempt=1, shard_runs=1, now=0.0)
    mq.take(1, False, 1.0)
    assert not mq.give_back(1, 1, "not its shard") and mq.give_back(0, 1, "GradChannelError: core gone")
    assert rows(ledger)[0] == (0, "QUEUED", 1, 1, None)
    assert mq.take(1, False, 2.0).step_over  # no more for it this step
    assert mq.take(0, True, 2.0).shard == 0


# --- the loop's part: joins, takes from cells in and out of TRAIN, the core's reports ----------------------------
def loop_with_cells(tmp_path: Path, sent: list, **train) -> tuple[RLLoop, CellRegistry]:
    cfg = parse_config({"run": {"name": "t", "state_dir": str(tmp_path)}, "cluster": {"cells": 3},
                        "control": {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 5},
                        "tasks": {"suite": "builtin:sevens"}, "train": {"shard_runs": 1, **train}})
    ledger = Ledger(tmp_path / "ledger.db")
    reg = CellRegistry(cfg, ledger, lambda n, m: sent.append((n, m)))
    reg.create(0.0)
    for n in range(3):
        reg.register(Register(node_index=n, node_name=f"n{n}", host="h", pid=n + 1), 0.0)
    for cell in (0, 1):  # the core and a satellite in TRAIN
        sid = reg.request_switch(cell, Role.TRAIN, "test", 0.5)
        reg.switch_done(cell, SwitchReport(switch_id=sid, role=Role.TRAIN, ok=True, started_at=0.5, ended_at=0.6),
                        0.6)
    loop = RLLoop(cfg, ledger, reg, tmp_path, "tok", lambda n, m: sent.append((n, m)), lambda *a, **k: None,
                  tmp_path / "model")
    return loop, reg


def test_the_loop_asks_train_cells_to_join_and_requeues_the_shards_of_a_lost_one(tmp_path: Path) -> None:
    sent: list = []
    loop, reg = loop_with_cells(tmp_path, sent)
    loop.shards.open(batch(3, step=0), loop.attempt, 1, now=1.0)
    sent.clear()
    loop._tend_step()
    assert sent == []  # no JoinStep before the core said where gradients go
    loop.step_open(StepOpen(step=0, attempt=loop.attempt + 1, grad_endpoint="tcp://elsewhere:1"))  # stale attempt
    loop._tend_step()
    assert sent == []
    loop.step_open(StepOpen(step=0, attempt=loop.attempt, grad_endpoint="tcp://core:5555"))
    loop._tend_step()
    loop._tend_step()  # asked once
    assert sent == [(1, JoinStep(step=0, attempt=loop.attempt, version_in=0, weights=loop.weights(),
                                 grad_endpoint="tcp://core:5555"))]

    def take(node: int, attempt: int = loop.attempt, step: int = 0):
        return loop.take_shard(TakeShard(step=step, attempt=attempt, node_index=node), 2.0)

    assert take(0).shard == 0 and take(1).shard == 1
    assert take(2).step_over  # cell 2 rolls out
    assert take(1, attempt=loop.attempt + 1).step_over and take(0, step=1).step_over  # not this step
    loop.training = StepInFlight(0, [], 1.0, tmp_path / "batch.msgpack", {}, loop.attempt)  # for the view
    assert loop.view().step_cells == (0, 1)
    # cell 1 goes silent: LOST, DOWN, its shard back in the queue, redone by the core
    for n in (0, 2):
        reg.heartbeat(Heartbeat(node_index=n, cell=n, role=Role.TRAIN if n == 0 else Role.ROLLOUT, seq=1), 9.0)
    assert reg.check_heartbeats(9.0) == [1]
    loop._tend_step()
    assert loop.view().step_cells == (0,)
    assert take(1).step_over
    assert take(0).shard == 1
    loop.shard_done(ShardDone(step=0, attempt=loop.attempt, shard=1, by_cell=0), 3.0)
    loop.shard_done(ShardDone(step=0, attempt=loop.attempt + 1, shard=2, by_cell=0), 3.0)  # stale
    # the core's failure is its TrainDone: a ShardFailed from it changes nothing
    loop.shard_failed(ShardFailed(step=0, attempt=loop.attempt, shard=0, node_index=0, error="x"))
    assert rows(loop.ledger) == [(0, "TAKEN", 0, 1, None), (1, "DONE", 0, 2, 0), (2, "QUEUED", None, 0, None)]


def test_with_optimizer_minibatches_the_core_trains_alone(tmp_path: Path) -> None:
    sent: list = []
    loop, _ = loop_with_cells(tmp_path, sent, minibatches=4)
    loop.book.groups[1] = GroupState(1, 0, [], GroupStatus.READY)
    sent.clear()
    loop._start_training(Train(groups=1, cells=(0, 1)), 1.0)
    (node, cmd), = sent  # TrainStep without shards: the whole batch, on the core
    assert node == 0 and isinstance(cmd, TrainStep) and not cmd.sharded and cmd.shards == []
    assert read_batch(Path(cmd.batch_path)).meta["groups"] == [1]
    assert loop.ledger.scalar("SELECT count(*) FROM shards") == 0
    sent.clear()
    loop._tend_step()
    assert sent == []  # no satellite is asked to join
    assert loop.take_shard(TakeShard(step=0, attempt=loop.attempt, node_index=1), 2.0).step_over


def test_groups_dropped_without_end_stop_the_run_failed(tmp_path: Path) -> None:
    """A collapsed policy scores every run of a group alike: groups are dropped and refilled; past 10·B of them
    between two steps the run stops FAILED with one line saying why, instead of refilling for ever."""
    stops: list = []
    loop, _reg = loop_with_cells(tmp_path, [])
    loop.stop = lambda reason, failed=False: stops.append((reason, failed))
    loop.book.dropped = {"zero_variance": 10 * loop.cfg.tasks.groups_per_step - 1}
    loop.schedule(1.0)
    assert stops == []
    loop.book.dropped["zero_variance"] += 1
    loop.schedule(2.0)
    (reason, failed), = stops
    assert failed and reason.startswith(f"{10 * loop.cfg.tasks.groups_per_step} groups dropped since step 0")
    assert "zero_variance" in reason and "collapsed" in reason
    loop.ledger.flush()
    assert loop.ledger.scalar("SELECT count(*) FROM events WHERE kind = 'groups_dropped' AND severity = 'error'") == 1


def test_a_core_agent_that_dies_mid_step_has_the_step_run_again_under_a_new_attempt(tmp_path: Path) -> None:
    sent: list = []
    loop, reg = loop_with_cells(tmp_path, sent)
    loop._set_step(0, None, StepStatus.RUNNING, policy="colocate", version_in=0, started_at=1.0, n_groups=1,
                   n_runs=3, n_cells=2)
    loop.shards.open(batch(3, step=0), loop.attempt, 1, now=1.0)
    first = loop.attempt
    loop.training = StepInFlight(0, [1], 1.0, tmp_path / "batch.msgpack", {}, first)
    loop.core_restarted(2, 3.0)  # a fresh agent elsewhere: nothing to do
    assert loop.training is not None
    loop.core_restarted(0, 3.0)  # the core's: its trainer died with it
    assert loop.training is None and loop.attempt == first + 1
    loop.train_done(TrainDone(step=0, attempt=first, ok=True, weights=None), 4.0)  # the dead attempt's report: ignored
    loop.ledger.flush()
    assert loop.ledger.rows("SELECT status FROM train_steps") == [{"status": "FAILED"}]
    assert loop.ledger.rows("SELECT DISTINCT status FROM shards") == [{"status": "FAILED"}]
    assert "is run again" in loop.ledger.rows("SELECT message FROM events WHERE kind = 'step_retried'")[0]["message"]


def test_training_waits_for_model_calls_a_proxy_owes_or_may_owe(tmp_path: Path) -> None:
    from gyre_slurm.coordinator.proxies import PROXY_GONE_S, PROXY_SILENT_S
    from gyre_slurm.coordinator.rollouts import GroupState, RolloutState
    from gyre_slurm.protocol import ProxyHello
    from gyre_slurm.statuses import RolloutStatus

    loop, _reg = loop_with_cells(tmp_path, [])
    loop.book.groups[1] = GroupState(1, 0, [11, 12], GroupStatus.READY)
    assert loop._records_owed(100.0) is None  # no proxy has said anything: nothing owed
    loop.proxy_hello(ProxyHello(proxy_id="p0", url="http://p0", owed=[12]), 100.0)
    assert "groups [1] wait for model calls" in loop._records_owed(101.0)
    loop.book.rollouts[12] = RolloutState(12, 1, RolloutStatus.RUNNING)
    loop.book.rollouts[13] = RolloutState(13, 1, RolloutStatus.RUNNING)
    loop.book.rollouts[14] = RolloutState(14, 1, RolloutStatus.COMPLETED)
    # a run's report waits while calls of it may come (judged without them it would look as if it never called)
    assert loop.done_waits(12, 101.0) and not loop.done_waits(13, 101.0) and not loop.done_waits(14, 101.0)
    loop.proxy_hello(ProxyHello(proxy_id="p0", url="http://p0", owed=[]), 102.0)  # delivered and acked
    assert loop._records_owed(103.0) is None
    assert "proxy p0 is silent" in loop._records_owed(102.0 + PROXY_SILENT_S + 1)  # killed, restarting?
    assert loop.done_waits(13, 102.0 + PROXY_SILENT_S + 1)
    assert loop._records_owed(102.0 + PROXY_GONE_S + 1) is None  # gone for good: training goes on
    loop.recover()  # a resumed daemon waits a moment for its proxies to speak
    assert "just resumed" in loop._records_owed(time.time())


def test_a_proxy_gone_silent_and_heard_again_is_told_once_each() -> None:
    from gyre_slurm.coordinator.proxies import PROXY_SILENT_S, ProxyBook
    from gyre_slurm.protocol import ProxyHello

    book = ProxyBook()
    book.hello(ProxyHello(proxy_id="p0", url="http://p0"), 100.0)
    assert book.silences(100.0 + PROXY_SILENT_S) == []  # not yet
    (kind, msg), = book.silences(100.0 + PROXY_SILENT_S + 1)  # down, hung or partitioned: told once
    assert kind == "proxy_silent" and "proxy p0: no hello for 7 s" in msg
    assert book.silences(100.0 + PROXY_SILENT_S + 30) == []
    book.hello(ProxyHello(proxy_id="p0", url="http://p0"), 140.0)
    assert book.silences(140.5) == [("proxy_back", "proxy p0 is heard from again")]
    assert book.silences(141.0) == []


def test_a_worker_gone_silent_is_told_and_heard_again_through_the_daemon(tmp_path: Path) -> None:
    """A worker whose slots are all busy asks for nothing; its hellos say it is there. Through the daemon's loop:
    silent past WORKER_SILENT_S (worker_silent in events), back at its next hello (worker_back)."""
    from gyre_slurm.coordinator.proxies import WORKER_SILENT_S

    sent: list = []
    loop, _ = loop_with_cells(tmp_path, sent)
    loop.workers.heard("worker-0", 100.0)
    loop.schedule(100.0 + WORKER_SILENT_S)
    loop.schedule(100.0 + WORKER_SILENT_S + 1)
    loop.schedule(100.0 + WORKER_SILENT_S + 20)
    loop.workers.heard("worker-0", 130.0)
    loop.schedule(130.5)
    rows = loop.ledger.rows("SELECT kind, message FROM events WHERE kind LIKE 'worker_%' ORDER BY id")
    assert [r["kind"] for r in rows] == ["worker_silent", "worker_back"]
    assert "worker worker-0: no hello for 7 s" in rows[0]["message"]


def test_a_streaming_step_takes_groups_as_they_become_ready_and_is_sealed_at_b(tmp_path: Path) -> None:
    sent: list = []
    loop, _ = loop_with_cells(tmp_path, sent)  # groups_per_step 2
    loop.cfg = loop.cfg.model_copy(update={"scheduler": loop.cfg.scheduler.model_copy(update={"policy": "elastic"})})
    assert loop.cfg.streaming and loop.cfg.scheduler.max_staleness == 1  # elastic's default: streaming
    loop.book.groups[1] = GroupState(1, 0, [], GroupStatus.READY)
    loop.book.groups[2] = GroupState(2, 0, [], GroupStatus.ADMITTED)
    sent.clear()
    loop._start_training(Train(groups=2, cells=(0,)), 1.0)
    (_, cmd), = sent
    assert cmd.sharded and cmd.seal is None and [r.shard for r in cmd.shards] == [0]  # group 1 in, not sealed
    assert loop.training.groups == [1] and loop.shards.seal is None
    take = TakeShard(step=0, attempt=loop.attempt, node_index=0)
    assert loop.take_shard(take, 1.5).seal is None
    loop._stream_groups(2.0)
    assert loop.training.groups == [1]  # group 2 is still rolling out
    loop.book.groups[2].status = GroupStatus.READY
    loop._stream_groups(3.0)
    assert loop.training.groups == [1, 2] and loop.shards.seal == StepSeal(n_shards=2, n_valid_runs=0)
    assert loop.take_shard(take, 3.5).seal == loop.shards.seal  # the core learns the step's end
