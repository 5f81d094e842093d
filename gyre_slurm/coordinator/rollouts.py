"""The daemon's book of tasks, groups and rollouts: admission, placement on cells, model calls, scoring.

Every change goes to the ledger through the daemon's batched writer; token payloads of model calls go to the
run's segment file first. Each rollout keeps its trajectory tree in memory (rebuilt from the segment file on
restart) until its group is trained. Rollout and group statuses change only through `_set_rollout` and
`_set_group`, which check the state machines of statuses.py before anything is written.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.presets import command as harness_command
from gyre_slurm.harness.task_split import load_split
from gyre_slurm.harness.tasks import TaskSpec
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import CallAck, CallRecord, ContextLimit, RolloutAssignment, RolloutDone, Route
from gyre_slurm.scheduler.health import RunHealth
from gyre_slurm.scoring.advantages import group_advantages
from gyre_slurm.statuses import GROUP, ROLLOUT, ROLLOUT_TERMINAL, GroupStatus, RolloutStatus, Severity
from gyre_slurm.train.batch import TrainBatch, TrainSample
from gyre_slurm.trajectory.persist import persist_tree
from gyre_slurm.trajectory.segments import SegmentFile, insert_payload, payload_of
from gyre_slurm.trajectory.tree import RunTree

log = logging.getLogger("gyre.rollouts")

MAX_ERROR_CHARS = 4000


def never_called_the_model(msg: RolloutDone, n_calls: int) -> bool:
    """A run whose harness exited 0 on its own, was scored (or its evaluator broke), and made no model call the
    ledger knows of: the harness failed without saying so (wrong base URL or key variable, a refused first call
    it shrugged off)."""
    return (n_calls == 0 and msg.harness_exit == 0 and not msg.timed_out
            and msg.status in (RolloutStatus.COMPLETED, RolloutStatus.EVAL_ERROR))


@dataclass
class RolloutState:
    id: int
    group_id: int | None  # None: an evaluation run (eval_id), never in a group, never trained
    status: RolloutStatus = RolloutStatus.QUEUED
    cell: int | None = None
    started_at: float | None = None
    reward: float | None = None
    worker: str | None = None  # the worker running it
    n_calls: int = 0  # the ledger row's counters, kept here so a model call sets them instead of adding to them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tree: RunTree = field(default_factory=RunTree)
    calls: set[int] = field(default_factory=set)  # call indices recorded (a replay is acked, not re-inserted)
    context_limited: bool = False  # the proxy refused a prompt longer than the model's context
    eval_id: int | None = None
    task_index: int = 0  # into RolloutBook.tasks


@dataclass
class GroupState:
    id: int
    task_index: int
    rollouts: list[int]
    status: GroupStatus = GroupStatus.ADMITTED
    version: int = 0  # the policy version it was admitted at (its staleness counts from there)
    advantages: dict[int, float] = field(default_factory=dict)
    ready_at: float | None = None
    batched: bool = False  # in a training batch: its runs' trees are read, a late model call no longer joins them


@dataclass
class CellSlot:
    """What the book needs to know of a ROLLOUT cell to place runs on it."""

    id: int
    engine_url: str


class RolloutBook:
    def __init__(self, cfg: RunConfig, ledger: Ledger, run_dir: Path, token: str) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.run_dir = run_dir
        self.token = token
        self.refused: list[str] = []  # tasks of the suites that cannot run here (harness/harbor.py), one line each
        ev = cfg.eval
        split = load_split(cfg.tasks.suite, ev, cfg.run.seed, self.refused, cfg.harness.runtime)
        self.tasks: list[TaskSpec] = split.tasks
        self.train_tasks, self.eval_tasks = split.train, split.eval
        h = cfg.harness  # every run's harness argv; the worker resolves its placeholders on its node
        self.harness_argv = harness_command(h.preset, h.model_name, h.max_turns, h.extra_args, h.command, h.cli)
        self.harness_cli = h.cli.model_dump(mode="json") if h.cli is not None else None
        self.rng = random.Random(cfg.run.seed)
        self._deck: list[int] = []  # task indices left in this pass over the suite
        self.segments = SegmentFile(run_dir / "segments" / "calls.seg")
        self.groups: dict[int, GroupState] = {}
        self.rollouts: dict[int, RolloutState] = {}
        self.queue: list[int] = []  # QUEUED rollout ids, FIFO
        self.eval_queue: list[int] = []  # QUEUED evaluation runs, FIFO: placed within eval.slot_share
        self.on_eval_run_ended: Callable[[RolloutState, float], None] = lambda st, now: None  # the EvalBook's
        self.dropped: dict[str, int] = {}  # groups dropped since the last step, by reason (step metrics)
        self.groups_trained = 0  # consumed by finished steps (the staleness bound counts them)
        self.health = RunHealth(cfg.run.degrade_after_infra_errors, cfg.run.degrade_after_dropped_groups,
                                cfg.run.degraded_probe_s)
        self._next_group = 1
        self._next_rollout = 1

    # --- status changes: the one place each is checked and written ------------------------------------------
    def _set_rollout(self, st: RolloutState, status: RolloutStatus, now: float, health: bool = True,
                     **values) -> None:
        ROLLOUT.check(st.status, status, f"rollout {st.id}")  # before the tree rows are queued
        if status in ROLLOUT_TERMINAL:
            persist_tree(self.ledger, st.id, st.tree)  # queued right before the status: one transaction, idempotent
            values["ended_at"] = now
            if health:
                self.health.run_finished(status == RolloutStatus.INFRA_ERROR)
        self.ledger.transition(ROLLOUT, {"id": st.id}, st.status, status, f"rollout {st.id}", **values)
        st.status = status

    def _set_group(self, g: GroupState, status: GroupStatus, **values) -> None:
        self.ledger.transition(GROUP, {"id": g.id}, g.status, status, f"group {g.id}", **values)
        g.status = status

    # --- start-up -------------------------------------------------------------------------------------------
    def create(self, resumed: bool = False) -> None:
        """The suites' tasks into the ledger. Resumed: one that is not there yet is added (e.g. an evaluation
        suite set since); a task whose id now names another one is refused (the config's suites changed)."""
        if resumed:
            known = self.ledger.task_keys()
            changed = [f"{known[i + 1]} → {t.id}" for i, t in enumerate(self.tasks) if known.get(i + 1, t.id) != t.id]
            if changed:
                raise GyreError(f"the run's task suites changed since it started ({', '.join(changed[:3])}); resume "
                                "it with the config it started with, or start a new run")
        held = set(self.eval_tasks)
        for i, t in enumerate(self.tasks):
            own = self.cfg.eval.suite is not None and i in held  # a task of the evaluation suite of its own
            self.ledger.task(i + 1, self.cfg.eval.suite if own else self.cfg.tasks.suite, t.id,
                             t.model_dump(mode="json"), "eval" if i in held else "train")
        for line in self.refused if not resumed else ():
            self.ledger.event("task_refused", line, severity=Severity.WARNING)

    def recover(self) -> None:
        """Rebuild open groups, their rollouts and trees from the ledger and the segment file."""
        self.create(resumed=True)
        self._next_group = self.ledger.last_group_id() + 1
        self.groups_trained = self.ledger.groups_trained()
        self._next_rollout = self.ledger.last_rollout_id() + 1
        for g in self.ledger.open_groups():
            rows = self.ledger.group_runs(g.id)
            gs = GroupState(g.id, g.task_id - 1, [r.id for r in rows], g.status, g.admitted_version)
            self.groups[gs.id] = gs
            for r in rows:
                st = RolloutState(r.id, gs.id, r.status, r.cell_id, r.started_at, r.reward, r.worker, r.n_calls,
                                  r.prompt_tokens, r.completion_tokens, task_index=gs.task_index)
                if r.advantage is not None:
                    gs.advantages[r.id] = r.advantage
                # a RUNNING run's worker may be gone: check_stuck times it out if it never reports
                if st.status == RolloutStatus.QUEUED:
                    self.queue.append(st.id)
                self.rollouts[st.id] = st
        for eval_id in self.ledger.running_evals():
            self.recover_eval_runs(eval_id)  # before the segment scan: their trees come back with the rest
        for rid in self.ledger.context_limited():
            st = self.rollouts.get(rid)
            if st is not None:
                st.context_limited = True
        for _off, rec in self.segments.scan():
            st = self.rollouts.get(rec["rollout_id"])
            if st is not None and rec["call_index"] not in st.calls:
                st.calls.add(rec["call_index"])
                insert_payload(st.tree, rec)

    def _next_task(self) -> int:
        """Tasks in shuffled passes over the suite (an epoch each), not i.i.d. draws: every window of groups sees
        the suite evenly, so reward per step compares across the run (a restarted daemon starts a new pass)."""
        if not self._deck:
            self._deck = list(self.train_tasks)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    # --- counts for the scheduler ---------------------------------------------------------------------------
    def counts(self, in_step: frozenset[int] = frozenset()) -> dict[str, Any]:
        """What the scheduler's view needs; `in_step`: the groups of the step in flight (READY until it ends)."""
        c: dict = {"groups_open": 0, "groups_ready": 0, "groups_training": 0, "groups_trained": self.groups_trained,
                   "queued": len(self.queue), "running": 0, "open_versions": [], "ready_versions": []}
        for g in self.groups.values():
            if g.id in in_step:
                c["groups_training"] += 1
            elif g.status == GroupStatus.ADMITTED:
                c["groups_open"] += 1
                c["open_versions"].append(g.version)
            elif g.status == GroupStatus.READY:
                c["groups_ready"] += 1
                c["ready_versions"].append(g.version)
        c["open_versions"].sort()
        c["ready_versions"].sort()
        # the watermark counts training runs only: evaluation runs hold at most their share of the slots (take)
        by_cell, evals = self._running_by_cell()
        c["running"], c["running_by_cell"] = sum(by_cell.values()), by_cell
        c["eval_running"] = len(self.eval_queue) + sum(evals.values())
        return c

    def _running_by_cell(self) -> tuple[Counter, Counter]:
        """RUNNING training runs and evaluation runs per cell, in one pass."""
        train, evals = Counter(), Counter()
        for r in self.rollouts.values():
            if r.status == RolloutStatus.RUNNING:
                (train if r.eval_id is None else evals)[r.cell] += 1
        return train, evals

    def running_on(self, cell: int) -> int:
        return sum(1 for r in self.rollouts.values() if r.status == RolloutStatus.RUNNING and r.cell == cell)

    # --- admission ------------------------------------------------------------------------------------------
    def admit(self, n_groups: int, version: int, now: float) -> list[int]:
        made = []
        for _ in range(n_groups):
            ti = self._next_task()
            gid = self._next_group
            self._next_group += 1
            ids = list(range(self._next_rollout, self._next_rollout + self.cfg.tasks.group_size))
            self._next_rollout += len(ids)
            self.groups[gid] = GroupState(gid, ti, ids, version=version)
            self.ledger.transition(GROUP, {"id": gid}, None, GroupStatus.ADMITTED, f"group {gid}", task_id=ti + 1,
                                   size=len(ids), admitted_version=version, train_step=None, created_at=now,
                                   ready_at=None, n_valid=None, reward_mean=None, reward_std=None, drop_reason=None)
            for rid in ids:
                self.rollouts[rid] = RolloutState(rid, gid, task_index=ti)
                self.queue.append(rid)
                self.ledger.transition(ROLLOUT, {"id": rid}, None, RolloutStatus.QUEUED, f"rollout {rid}",
                                       group_id=gid, task_id=ti + 1, queued_at=now)
            made.append(gid)
        if made:
            self.ledger.event("groups_admitted", f"{len(made)} group(s) of {self.cfg.tasks.group_size} admitted "
                              f"at version {version}", data={"groups": made})
        return made

    # --- placement ------------------------------------------------------------------------------------------
    def take(self, worker_id: str, free_slots: int, cells: list[CellSlot], proxy_url: str | None,
             version: int, now: float) -> list[RolloutAssignment]:
        """Place queued runs on the least loaded cells. Evaluation runs first, each cell holding at most
        ⌈eval.slot_share·k⌉ of them; while some wait, training runs leave that share of every cell free."""
        out: list[RolloutAssignment] = []
        if proxy_url is None or not cells:
            return out
        k = self.cfg.cluster.rollouts_per_cell
        share = max(1, math.ceil(self.cfg.eval.slot_share * k))
        train, evals = self._running_by_cell()
        load = {c.id: train[c.id] + evals[c.id] for c in cells}
        ev = {c.id: evals[c.id] for c in cells}

        def place(queue: list[int], room: Callable[[int], int]) -> None:
            while queue and len(out) < free_slots:
                free = [c for c in load if room(c) > 0]
                if not free:
                    return
                cell = min(free, key=lambda c: load[c])
                st = self.rollouts[queue.pop(0)]
                out.append(self._start(st, cell, worker_id, proxy_url, version, now))
                load[cell] += 1
                ev[cell] += st.eval_id is not None

        place(self.eval_queue, lambda c: min(k - load[c], share - ev[c]))
        place(self.queue, lambda c: k - load[c] - (max(0, share - ev[c]) if self.eval_queue else 0))
        return out

    def _start(self, st: RolloutState, cell: int, worker_id: str, proxy_url: str, version: int,
               now: float) -> RolloutAssignment:
        from gyre_slurm.proxy.keys import make_key

        ws = self.run_dir / "workspaces" / f"r{st.id:06d}"
        self._set_rollout(st, RolloutStatus.RUNNING, now, cell_id=cell, worker=worker_id, started_at=now,
                          version_start=version, workspace=str(ws))
        st.cell, st.started_at, st.worker = cell, now, worker_id
        h = self.cfg.harness
        return RolloutAssignment(rollout_id=st.id, task=self.tasks[st.task_index].model_dump(mode="json"),
                                 api_key=make_key(self.token, st.id), base_url=f"{proxy_url}/v1", workspace=str(ws),
                                 timeout_s=h.timeout_s, harness=self.harness_argv, preset=h.preset,
                                 max_tokens=h.max_tokens, model_name=h.model_name, cli=self.harness_cli)

    def route(self, rollout_id: int, cells: list[CellSlot], version: int) -> Route:
        st = self.rollouts.get(rollout_id)
        if st is None or st.status != RolloutStatus.RUNNING:
            return Route(rollout_id=rollout_id, open=False)
        by_id = {c.id: c for c in cells}
        if st.cell not in by_id:  # its cell left the rollout pool: continue on the least loaded one
            if not cells:
                return Route(rollout_id=rollout_id, open=True)
            st.cell = min(by_id, key=self.running_on)
            self.ledger.rollout_cell(rollout_id, st.cell)
        c = by_id[st.cell]
        temperature = self.cfg.eval.temperature if st.eval_id is not None else None
        return Route(rollout_id=rollout_id, open=True, cell=c.id, engine_url=c.engine_url, weight_version=version,
                     temperature=temperature)

    def migrate(self, cell: int, cells: list[CellSlot]) -> int:
        """Move the runs of a cell leaving ROLLOUT onto the least loaded of `cells` (the elastic rule left them
        room): their next call, or the rest of a call the switch aborted, continues there from its exact ids."""
        if not cells:
            return 0  # no other cell serves: the runs wait for a route (the proxy asks again)
        load = {c.id: self.running_on(c.id) for c in cells}
        moved = 0
        for st in self.rollouts.values():
            if st.status == RolloutStatus.RUNNING and st.cell == cell:
                st.cell = min(load, key=lambda c: (load[c], c))
                load[st.cell] += 1
                self.ledger.rollout_cell(st.id, st.cell)
                moved += 1
        return moved

    # --- model calls ----------------------------------------------------------------------------------------
    def record_call(self, rec: CallRecord, now: float) -> CallAck:
        """Record a model call. A late record (its proxy or this daemon restarted before the ack, so the proxy
        sends it again, perhaps after its run ended) still joins its run's tree while nothing of the run is being
        trained: training waits for the records a proxy says it owes (RLLoop._records_owed). Later still, it is
        kept in the ledger alone, and its run is trained without it (a warning event)."""
        st = self.rollouts.get(rec.rollout_id)
        g = self.groups.get(st.group_id) if st is not None and st.group_id is not None else None
        if st is not None and st.status == RolloutStatus.QUEUED:  # never started: no call of it can be real
            return CallAck(rollout_id=rec.rollout_id, call_index=rec.call_index, rollout_open=False)
        if st is None or (st.status != RolloutStatus.RUNNING and (g is None or g.batched)
                          and st.eval_id is None):
            self._record_unheld(rec)
            return CallAck(rollout_id=rec.rollout_id, call_index=rec.call_index, rollout_open=False)
        if rec.call_index not in st.calls:
            payload = payload_of(rec)
            # the payload first: a full disk (DiskFull) leaves the tree and the ledger as they were
            segment = self.segments.append(payload)
            try:  # a record the tree cannot place is refused whole: its payload is cut off again
                insert_payload(st.tree, payload)
            except ValueError as e:
                self.segments.cut(segment[0])
                log.error("rollout %d call %d: not recorded: %s", rec.rollout_id, rec.call_index, e)
                return CallAck(rollout_id=rec.rollout_id, call_index=rec.call_index, rollout_open=True)
            st.calls.add(rec.call_index)
            st.n_calls, st.prompt_tokens, st.completion_tokens = self._write_call(
                rec, segment, (st.n_calls, st.prompt_tokens, st.completion_tokens))
        return CallAck(rollout_id=rec.rollout_id, call_index=rec.call_index,
                       rollout_open=st.status == RolloutStatus.RUNNING)

    def _write_call(self, rec: CallRecord, segment: tuple[int, int],
                    counters: tuple[int, int, int]) -> tuple[int, int, int]:
        """The model_calls row of a payload in the segment file (on disk before the row points at it), and the
        run's counters; the new counters."""
        off, length = segment
        prompt_tokens = rec.reused_tokens + len(rec.prompt_ids)
        n, p, c = counters[0] + 1, counters[1] + prompt_tokens, counters[2] + len(rec.output_ids)
        self.ledger.call_recorded(
            rec.rollout_id, rec.call_index, cell=rec.cell, weight_version=rec.weight_version, api=rec.api,
            branch_reason=rec.branch_reason, prompt_tokens=prompt_tokens, reused_tokens=rec.reused_tokens,
            completion_tokens=len(rec.output_ids), finish_reason=rec.finish_reason, started_at=rec.started_at,
            latency_s=rec.latency_s, segment=(off, length), counters=(n, p, c))
        return n, p, c

    def _record_unheld(self, rec: CallRecord) -> None:
        """A record for a run whose group is trained, being trained or dropped (its tree is gone or in use): into
        the ledger alone, once; nothing for a rollout this run never had. A trained run without it says so."""
        r = self.ledger.unheld_run(rec.rollout_id, rec.call_index)
        if r is None or r.seen:
            return
        self._write_call(rec, self.segments.append(payload_of(rec)), (r.n_calls, r.prompt_tokens, r.completion_tokens))
        if r.group_status not in (GroupStatus.DROPPED, None):  # trained, or in the step in flight
            self.ledger.event("call_after_training", f"rollout {rec.rollout_id} call {rec.call_index} came after "
                              "its run was batched for training: in the ledger, not in its training data",
                              severity=Severity.WARNING,
                              data={"rollout_id": rec.rollout_id, "call_index": rec.call_index})

    def context_limit(self, msg: ContextLimit, now: float) -> None:
        st = self.rollouts.get(msg.rollout_id)
        if st is None or st.status != RolloutStatus.RUNNING or st.context_limited:
            return
        st.context_limited = True  # kept in the ledger as an event: a restarted daemon reads it back
        self.ledger.event("context_limit", f"rollout {st.id} asked for {msg.prompt_tokens} prompt tokens; the "
                          f"model's context is {msg.limit}", severity=Severity.WARNING,
                          data={"rollout_id": st.id, "prompt_tokens": msg.prompt_tokens, "limit": msg.limit})

    # --- completion -----------------------------------------------------------------------------------------
    def done(self, msg: RolloutDone, now: float) -> GroupState | None:
        """Record a finished rollout; returns its group when that group just became terminal."""
        st = self.rollouts.get(msg.rollout_id)
        if st is None or st.status in ROLLOUT_TERMINAL:
            return None  # unknown or a replayed report
        status, reward, error = msg.status, msg.reward, msg.error
        rescored = (RolloutStatus.COMPLETED, RolloutStatus.TIMEOUT_SCORED, RolloutStatus.INFRA_ERROR)
        if st.context_limited and status in rescored and msg.score is not None:
            # the run hit the model's context (its harness then stopped or broke): scored from its workspace like a
            # timeout, or excluded with train.exclude_truncated (docs/algorithms.md §4.2)
            status, reward = RolloutStatus.TRUNCATED_CONTEXT, msg.score
            error = "the rollout hit the model's context length" + (f"; {error}" if error else "")
        elif not st.context_limited and never_called_the_model(msg, len(st.calls)):
            # a harness that never asked the model says nothing about the policy: excluded, with its log's end
            status, reward = RolloutStatus.INFRA_ERROR, None
            error = (f"harness never called the model; last lines of its log:\n{msg.harness_log or '(empty)'}"
                     + (f"\n{error}" if error else ""))[:MAX_ERROR_CHARS]
        self._set_rollout(st, status, now, reward=reward, error=error)  # IllegalTransition for a QUEUED one
        st.reward = reward
        return self._ended(st, now)

    def check_stuck(self, now: float) -> list[GroupState]:
        """A run whose worker never reported within its time budget (plus evaluation) is an infrastructure
        error: excluded from its group, never scored 0."""
        out = []
        for st in list(self.rollouts.values()):  # a group made terminal here may admit its replacement's runs
            if st.status != RolloutStatus.RUNNING or st.started_at is None:
                continue
            task = self.tasks[st.task_index]
            limit = ((task.timeout_s or self.cfg.harness.timeout_s)
                     + (self.cfg.harness.eval_retries + 1) * task.eval_timeout_s + 60.0)
            if now - st.started_at > limit:
                g = self._lost(st, f"no report from its worker within {limit:.0f} s", now)
                if g is not None:
                    out.append(g)
        return out

    def worker_restarted(self, worker_id: str, started_at: float, now: float) -> list[GroupState]:
        """Runs handed to `worker_id` before its process started died with the earlier process (their harnesses
        die with their worker): infrastructure errors now, not after check_stuck's time budget. Returns the groups
        that became terminal."""
        out = []
        for st in list(self.rollouts.values()):
            if st.status == RolloutStatus.RUNNING and st.worker == worker_id and (st.started_at or now) < started_at:
                # health=False: a crash, not a failing run (a worker that keeps crashing is the supervisor's to stop)
                g = self._lost(st, "its worker died (a new process of the worker asked for work)", now, health=False)
                if g is not None:
                    out.append(g)
        return out

    def abandon_running(self, why: str, now: float) -> int:
        """The run stops with its workers (scancel, gyre stop, a daemon job ending): the runs in flight will never
        report, so they are infrastructure errors now, not after check_stuck's time budget in the resumed run."""
        running = [st for st in self.rollouts.values() if st.status == RolloutStatus.RUNNING]
        for st in running:
            self._lost(st, why, now, health=False)  # the stop's doing, not a sign the run is failing
        return len(running)

    def _lost(self, st: RolloutState, why: str, now: float, health: bool = True) -> GroupState | None:
        self._set_rollout(st, RolloutStatus.INFRA_ERROR, now, health, reward=None, error=why)
        return self._ended(st, now)

    def _ended(self, st: RolloutState, now: float) -> GroupState | None:
        if st.eval_id is not None:  # an evaluation run: its evaluation, never a group
            self.on_eval_run_ended(st, now)
            return None
        return self._maybe_group_terminal(self.groups[st.group_id], now)

    # --- evaluation runs (coordinator/evals.py decides when and reads what they scored) ---------------------
    def add_eval_runs(self, eval_id: int, samples: int, now: float) -> list[int]:
        """`samples` QUEUED runs of every held-out task for the evaluation, in the ledger as kind 'eval'."""
        ids = []
        for _ in range(samples):  # round-robin over the tasks: an evaluation cut short still covers them all
            for ti in self.eval_tasks:
                rid = self._next_rollout
                self._next_rollout += 1
                self.rollouts[rid] = RolloutState(rid, None, eval_id=eval_id, task_index=ti)
                self.eval_queue.append(rid)
                self.ledger.transition(ROLLOUT, {"id": rid}, None, RolloutStatus.QUEUED, f"rollout {rid}",
                                       kind="eval", eval_id=eval_id, task_id=ti + 1, queued_at=now)
                ids.append(rid)
        return ids

    def recover_eval_runs(self, eval_id: int) -> None:
        """The runs of an evaluation still RUNNING in the ledger (a restarted daemon goes on with it); EvalBook
        finds them here by eval_id."""
        for r in self.ledger.eval_runs(eval_id):
            st = RolloutState(r.id, None, r.status, r.cell_id, r.started_at, r.reward, r.worker, r.n_calls,
                              r.prompt_tokens, r.completion_tokens, eval_id=eval_id, task_index=r.task_id - 1)
            self.rollouts[st.id] = st
            if st.status == RolloutStatus.QUEUED:
                self.eval_queue.append(st.id)

    def _maybe_group_terminal(self, g: GroupState, now: float) -> GroupState | None:
        runs = [self.rollouts[r] for r in g.rollouts]
        if g.status != GroupStatus.ADMITTED or any(r.status not in ROLLOUT_TERMINAL for r in runs):
            return None
        adv = group_advantages([(r.id, r.status, r.reward) for r in runs],
                               exclude_truncated=self.cfg.train.exclude_truncated)
        g.ready_at = now
        self._set_group(g, GroupStatus.DROPPED if adv.dropped else GroupStatus.READY, ready_at=now,
                        n_valid=adv.n_valid, reward_mean=adv.mean, reward_std=adv.std, drop_reason=adv.drop_reason)
        self.health.group_finished(adv.drop_reason if adv.dropped else "ready")
        if adv.dropped:
            self.dropped[adv.drop_reason] = self.dropped.get(adv.drop_reason, 0) + 1
            self.ledger.event("group_dropped", f"group {g.id}: {adv.drop_reason} ({adv.n_valid} valid runs)",
                              data={"group": g.id})
            self._release(g)
        else:
            g.advantages = dict(adv.advantages)
            for rid, a in adv.advantages.items():
                self.ledger.advantage(rid, a)
        return g

    def _release(self, g: GroupState) -> None:
        for rid in g.rollouts:
            self.rollouts.pop(rid, None)

    # --- training data --------------------------------------------------------------------------------------
    def ready_groups(self, exclude: frozenset[int] = frozenset()) -> list[GroupState]:
        """READY groups not in `exclude`, the oldest admitted first: the order steps take them in (what waits is
        what the staleness gate, scheduler/admission.py, allowed)."""
        return sorted((g for g in self.groups.values() if g.status == GroupStatus.READY and g.id not in exclude),
                      key=lambda g: (g.version, g.ready_at or 0, g.id))

    def build_batch(self, group_ids: list[int], step: int, version: int) -> TrainBatch:
        """The training data of these READY groups (a whole step's, or a streaming step's groups as they join)."""
        chosen = [self.groups[gid] for gid in group_ids]
        for g in chosen:
            g.batched = True
        samples: list[TrainSample] = []
        advantages: dict[int, float] = {}
        targets: dict[int, int] = {}
        rewards, stale = [], []
        for g in chosen:
            for rid, a in g.advantages.items():
                if self.rollouts[rid].eval_id is not None:  # cannot be (a group holds training runs): never train one
                    raise AssertionError(f"rollout {rid} is an evaluation run; it must never be trained")
                segs, n = self.rollouts[rid].tree.segments(self.cfg.train.max_paths_per_run,
                                                           self.cfg.train.max_targets_per_run)
                rewards.append(self.rollouts[rid].reward)
                if n == 0:
                    continue  # a run that made no model call has nothing to train
                advantages[rid], targets[rid] = a, n
                tree = self.rollouts[rid].tree
                oldest = min(v for node in tree.nodes() for v, t in zip(node.version, node.trainable, strict=True) if t)
                stale.append(version - oldest)  # versions between the oldest sampled token and the trained one
                samples += [TrainSample(rid, s.tokens, s.loss_mask, s.behav_logp) for s in segs]
        statuses = [self.rollouts[r].status for g in chosen for r in g.rollouts]
        n = max(1, len(statuses))
        meta = {"groups": [g.id for g in chosen], "reward_mean": sum(rewards) / max(1, len(rewards)),
                "n_runs": len(rewards), "n_rollouts": len(statuses), "created_at": time.time(),
                "frac_excluded_eval": statuses.count(RolloutStatus.EVAL_ERROR) / n,
                "frac_excluded_infra": statuses.count(RolloutStatus.INFRA_ERROR) / n,
                "frac_timeout_scored": statuses.count(RolloutStatus.TIMEOUT_SCORED) / n,
                "groups_dropped_small": self.dropped.pop("too_small", 0),
                "groups_dropped_zero_var": self.dropped.pop("zero_variance", 0),
                "frac_truncated_context": statuses.count(RolloutStatus.TRUNCATED_CONTEXT) / n,
                "staleness_mean": sum(stale) / max(1, len(stale)), "staleness_max": max(stale, default=0),
                # runs by versions between their oldest sampled token and the weights trained ({"0": 30, "1": 2})
                "staleness_hist": {str(k): stale.count(k) for k in sorted(set(stale))}}
        return TrainBatch(samples, advantages, targets, step, version, meta=meta)

    def mark_trained(self, group_ids: list[int], step: int) -> None:
        for gid in group_ids:
            self._set_group(self.groups[gid], GroupStatus.TRAINED, train_step=step)
            self.groups_trained += 1
            self._release(self.groups.pop(gid))
