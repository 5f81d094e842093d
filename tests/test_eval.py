"""Evaluation on held-out tasks, without processes: pass@k, the split, placement within the slot share, the
figures written when the last run ends, and the ledger refusing an evaluation run in a group."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from gyre_slurm.config import parse_config
from gyre_slurm.coordinator.evals import EvalBook
from gyre_slurm.coordinator.rollouts import CellSlot, RolloutBook
from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.harness.task_split import split_tasks
from gyre_slurm.harness.tasks import load_suite
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import RolloutDone
from gyre_slurm.scoring.pass_at_k import EvalRun, figures, pass_at_k
from gyre_slurm.statuses import RolloutStatus

from .conftest import q


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 − C(3,2)/C(4,2)
    assert pass_at_k(2, 1, 5) == 1.0  # k beyond n: any of them
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_figures_exclude_errors_and_count_timeouts() -> None:
    ok, to, err = RolloutStatus.COMPLETED, RolloutStatus.TIMEOUT_SCORED, RolloutStatus.EVAL_ERROR
    runs = [EvalRun(0, ok, 1.0), EvalRun(0, ok, 0.5), EvalRun(0, err, None),
            EvalRun(1, to, 1.0), EvalRun(1, ok, 0.0, mixed_versions=True), EvalRun(2, RolloutStatus.INFRA_ERROR, None)]
    f = figures(runs, k=2, pass_score=1.0)
    assert (f.n_runs, f.n_excluded, f.mixed_versions) == (4, 2, 1)
    assert f.pass_at_1 == pytest.approx(0.5)  # task 0: 1/2, task 1: 1/2; task 2 had no scored run
    assert f.pass_at_k == pytest.approx(1.0)  # 2 runs per task, one passing: any of 2 passes
    assert f.score_mean == pytest.approx(2.5 / 4) and f.timeout_share == pytest.approx(0.25)
    assert figures([EvalRun(0, err, None)], 1, 1.0).pass_at_1 is None  # nothing scored: no figure, never 0


def _eval_cfg(**ev):
    return parse_config({"run": {"name": "t", "seed": 3}, "tasks": {"suite": "builtin:sevens"}, "eval": ev}).eval


def test_the_split_holds_tasks_out_of_training() -> None:
    suite = load_suite("builtin:sevens")  # digits-7x4 … digits-7x8
    s = split_tasks(suite, _eval_cfg(holdout_tasks=["digits-7x6"]), seed=0)
    assert [s.tasks[i].id for i in s.eval] == ["digits-7x6"] and len(s.train) == 4
    a, b = (split_tasks(suite, _eval_cfg(holdout_share=0.4), seed=3) for _ in range(2))
    assert a.eval == b.eval and len(a.eval) == 2 and not set(a.eval) & set(a.train)  # the seed draws the same
    assert split_tasks(suite, _eval_cfg(), seed=0).eval == []  # no eval section: everything trains
    with pytest.raises(ConfigError, match="no such task in tasks.suite: nope"):
        split_tasks(suite, _eval_cfg(holdout_tasks=["nope"]), seed=0)
    with pytest.raises(ConfigError, match="none would be left"):
        split_tasks(suite, _eval_cfg(holdout_tasks=[t.id for t in suite]), seed=0)
    own = split_tasks(suite, _eval_cfg(suite="builtin:six-sevens"), 0, load_suite("builtin:six-sevens"))
    assert len(own.train) == 5 and [own.tasks[i].id for i in own.eval] == ["digits-7x6"]


def test_eval_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="every_steps: 5 needs tasks to evaluate on"):
        _eval_cfg(every_steps=5)
    with pytest.raises(ConfigError, match="exclude each other"):
        _eval_cfg(suite="builtin:sevens", holdout_tasks=["digits-7x4"])
    with pytest.raises(ConfigError, match="no such folder of Harbor tasks"):
        _eval_cfg(suite="harbor:/no/such/folder")


def _books(tmp_path: Path, k: int = 8) -> tuple[RolloutBook, EvalBook, Ledger]:
    cfg = parse_config({"run": {"name": "t", "state_dir": str(tmp_path)}, "cluster": {"rollouts_per_cell": k},
                        "tasks": {"suite": "builtin:sevens", "group_size": 4},
                        "eval": {"holdout_tasks": ["digits-7x6", "digits-7x8"], "samples": 3, "slot_share": 0.25}})
    ledger = Ledger(tmp_path / "ledger.db")
    book = RolloutBook(cfg, ledger, tmp_path, "tok")
    book.create()
    return book, EvalBook(cfg, ledger, book), ledger


def _done(book: RolloutBook, rid: int, reward: float | None, status=RolloutStatus.COMPLETED) -> None:
    book.done(RolloutDone(rollout_id=rid, worker_id="w", status=status, reward=reward, started_at=time.time(),
                          harness_s=1.0, score=reward), time.time())


def test_evaluation_runs_hold_their_share_of_the_slots_and_never_join_a_group(tmp_path: Path) -> None:
    book, evals, ledger = _books(tmp_path)
    cells = [CellSlot(0, "http://e0"), CellSlot(1, "http://e1")]
    book.admit(8, 0, time.time())  # 32 training runs wait
    eid = evals.start(0, "start", time.time())  # 2 held-out tasks × 3 samples
    got = book.take("w", 100, cells, "http://proxy", 0, time.time())
    ev = [a for a in got if book.rollouts[a.rollout_id].eval_id == eid]
    per_cell = {c.id: sum(1 for a in ev if book.rollouts[a.rollout_id].cell == c.id) for c in cells}
    assert per_cell == {0: 2, 1: 2}  # ⌈0.25·8⌉ per cell, 2 wait
    assert len(got) == 16 and len(book.eval_queue) == 2  # the cells are full; the share is kept for the rest
    assert {book.tasks[book.rollouts[a.rollout_id].task_index].id for a in ev} == {"digits-7x6", "digits-7x8"}
    assert not {book.tasks[i].id for i in book._deck} & {"digits-7x6", "digits-7x8"}
    assert all(book.tasks[g.task_index].id not in ("digits-7x6", "digits-7x8") for g in book.groups.values())
    # the watermark counts training runs only
    assert book.counts()["running"] == 12 and book.counts()["queued"] == 20
    # an evaluation run ends: the cell's freed slot goes to the next evaluation run first
    _done(book, ev[0].rollout_id, 1.0)
    nxt = book.take("w", 1, cells, "http://proxy", 0, time.time())
    assert book.rollouts[nxt[0].rollout_id].eval_id == eid
    ledger.flush()
    rows = q(tmp_path / "ledger.db", "SELECT DISTINCT kind, group_id IS NULL, eval_id FROM rollouts "
                                     "WHERE eval_id IS NOT NULL")
    assert rows == [("eval", 1, eid)]
    assert q(tmp_path / "ledger.db", "SELECT key, split FROM tasks WHERE split = 'eval' ORDER BY key") == \
        [("digits-7x6", "eval"), ("digits-7x8", "eval")]
    # the ledger itself refuses an evaluation run in a group, or one with an advantage
    conn = sqlite3.connect(tmp_path / "ledger.db")
    for bad in ("UPDATE rollouts SET group_id = 1 WHERE kind = 'eval'",
                "UPDATE rollouts SET advantage = 0.5 WHERE kind = 'eval'"):
        with pytest.raises(sqlite3.IntegrityError, match="ck_rollouts_kind"):
            conn.execute(bad)
    conn.close()


def test_an_evaluation_is_done_when_its_last_run_ends(tmp_path: Path) -> None:
    book, evals, ledger = _books(tmp_path, k=32)
    done: list[int] = []
    evals.on_done = done.append
    eid = evals.start(4, "every_steps", time.time())
    runs = book.take("w", 100, [CellSlot(0, "http://e0")], "http://proxy", 4, time.time())
    assert len(runs) == 6
    rewards = [1.0, 0.5, None, 1.0, 1.0, 0.0]
    for a, r in zip(runs, rewards, strict=True):
        assert done == []
        _done(book, a.rollout_id, r, RolloutStatus.EVAL_ERROR if r is None else RolloutStatus.COMPLETED)
    assert done == [eid] and not evals.open and not book.rollouts  # the runs leave memory with it
    row = ledger.rows("SELECT status, version, step, n_runs, n_excluded, pass_at_1, pass_at_k, k, score_mean "
                      "FROM evals WHERE id = :e", e=eid)[0]
    # runs alternate over the two tasks: 7x6 got 1.0, None, 1.0 → 2/2; 7x8 got 0.5, 1.0, 0.0 → 1/3
    assert row["status"] == "DONE" and (row["version"], row["step"], row["n_runs"], row["n_excluded"]) == (4, 3, 5, 1)
    assert row["pass_at_1"] == pytest.approx((1.0 + 1 / 3) / 2) and row["k"] == 3
    assert row["pass_at_k"] == pytest.approx(1.0) and row["score_mean"] == pytest.approx(3.5 / 5)
    assert evals.due(4, 4, finishing=False) is None  # an every_steps evaluation of version 4 is not due again
    v = ledger.rows("SELECT eval, version, pass_at_1, runs, excluded FROM v_eval")
    assert v == [{"eval": eid, "version": 4, "pass_at_1": round(row["pass_at_1"], 4), "runs": 5, "excluded": 1}]


def test_a_resumed_daemon_goes_on_with_an_evaluation_and_refuses_changed_suites(tmp_path: Path) -> None:
    book, evals, ledger = _books(tmp_path)
    eid = evals.start(0, "start", time.time())
    first = book.take("w", 2, [CellSlot(0, "http://e0")], "http://proxy", 0, time.time())
    _done(book, first[0].rollout_id, 1.0)
    ledger.flush()
    # the daemon dies; a new one reads the ledger back
    cfg = book.cfg
    book2 = RolloutBook(cfg, ledger, tmp_path, "tok")
    evals2 = EvalBook(cfg, ledger, book2)
    book2.recover()
    evals2.recover()
    assert list(evals2.open) == [eid] and len(evals2.open[eid].runs) == 6
    assert len(book2.eval_queue) == 4 and 0 in evals2.evaluated  # the running one waits for its worker's report
    done: list[int] = []
    evals2.on_done = done.append
    _done(book2, first[1].rollout_id, 0.0)
    while book2.eval_queue:  # two at a time: ⌈0.25·8⌉ slots of the one cell
        for a in book2.take("w", 10, [CellSlot(0, "http://e0")], "http://proxy", 0, time.time()):
            _done(book2, a.rollout_id, 0.5)
    assert done == [eid]
    assert ledger.rows("SELECT status, n_runs FROM evals")[0] == {"status": "DONE", "n_runs": 6}
    changed = parse_config({"run": {"name": "t", "state_dir": str(tmp_path)}, "tasks": {"suite": "builtin:digits"}})
    with pytest.raises(GyreError, match="task suites changed since it started"):
        RolloutBook(changed, ledger, tmp_path, "tok").recover()


def test_gyre_check_says_how_the_tasks_split(tmp_path: Path) -> None:
    from gyre_slurm.harness.task_split import split_line

    ev = _eval_cfg(holdout_tasks=["digits-7x5-c", "digits-7x7-c"])
    assert split_line("builtin:sevens-reworded", ev, 0) == "tasks: 13 to train on, 2 held out for evaluation"
    assert split_line("builtin:sevens", _eval_cfg(), 0) == "tasks: 5 to train on"


def test_gyre_eval_during_a_run_takes_the_version_served_now(tmp_path: Path) -> None:
    from gyre_slurm.coordinator.cells import CellRegistry
    from gyre_slurm.coordinator.loop import RLLoop
    from gyre_slurm.errors import ControlError

    def loop(ev: dict) -> RLLoop:
        cfg = parse_config({"run": {"name": "t", "state_dir": str(tmp_path)}, "tasks": {"suite": "builtin:sevens"},
                            "eval": ev})
        ledger = Ledger(tmp_path / f"ledger{len(ev)}.db")
        reg = CellRegistry(cfg, ledger, lambda n, m: None)
        reg.create(0.0)
        lp = RLLoop(cfg, ledger, reg, tmp_path, "tok", lambda n, m: None, lambda *a, **k: None, tmp_path / "m")
        lp.book.create()
        return lp

    lp = loop({"holdout_tasks": ["digits-7x6"]})
    lp.version = 3
    with pytest.raises(ControlError, match="version 2 is not the one the rollout engines serve now \\(3\\)"):
        lp.evaluate(2, time.time())
    eid = lp.evaluate(None, time.time())
    assert lp.ledger.rows("SELECT version, reason, status FROM evals WHERE id = :e", e=eid) == \
        [{"version": 3, "reason": "manual", "status": "RUNNING"}]
    assert lp.evals.due(3, 3, finishing=True) == "end"  # a manual evaluation does not stand for the end's
    with pytest.raises(ControlError, match="this run has no evaluation tasks"):
        loop({}).evaluate(None, time.time())
