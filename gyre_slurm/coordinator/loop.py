"""The RL loop inside the daemon: rollouts in, training steps out, weight versions published.

It answers workers (TakeRollout, RolloutDone), proxies (ProxyHello, RouteQuery, CallRecord) and the training
cells (StepOpen, TakeShard, ShardDone, TrainDone; the step's shards are in shard_queue.py), and after
every event asks the scheduling policy what to do next (admit groups, switch cells, train, finish), then does it.
Policy decisions are pure; everything with effects happens here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.coordinator.evals import EvalBook
from gyre_slurm.coordinator.proxies import WORKER_SILENT_S, ProxyBook, Silences
from gyre_slurm.coordinator.rollouts import CellSlot, RolloutBook
from gyre_slurm.coordinator.shard_queue import ShardQueue
from gyre_slurm.coordinator.steps import StepInFlight, data_metrics, merge_meta, overlap_seconds
from gyre_slurm.errors import DISK_FULL, ControlError, GyreError, IllegalTransition
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import (
    CallAck,
    CallRecord,
    DoneAck,
    JoinStep,
    LoadWeights,
    NoShard,
    NoWork,
    ProxyHello,
    RolloutAssignment,
    RolloutDone,
    Route,
    RouteQuery,
    ShardDone,
    ShardFailed,
    ShardRef,
    StepOpen,
    TakeRollout,
    TakeShard,
    TrainDone,
    TrainStep,
    WeightsHandle,
    WeightsReceived,
    WeightsRef,
    WireMessage,
)
from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import may_join
from gyre_slurm.scheduler.policy import Admit, CellView, Decision, Finish, Switch, Train, View, make_policy
from gyre_slurm.statuses import STEP, GroupStatus, RolloutStatus, Severity, StepStatus
from gyre_slurm.train.batch import write_batch

log = logging.getLogger("gyre.loop")
STEP_RETRIES = 2  # a step whose core lost a trainer rank runs again at most this often (then the run stops FAILED)
MAX_DROPPED_PER_STEP = 10  # × groups_per_step: dropped groups between two steps before the run stops FAILED


def _handle(ref: WeightsRef) -> list | None:
    """A published version's parts (WeightsHandles) as the ledger keeps them (None: receivers read the folder)."""
    return [h.model_dump(mode="json") for h in ref.parts] or None


class RLLoop:
    def __init__(self, cfg: RunConfig, ledger: Ledger, registry: CellRegistry, run_dir: Path, token: str,
                 send: Callable[[int, WireMessage], None], stop: Callable[..., None],
                 base_model: Path | None, eval_only: int | None = None) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.registry = registry
        self.run_dir = run_dir
        self.send = send
        self.stop = stop
        sc = cfg.scheduler
        # without satellites a cell in TRAIN besides the core would only idle there: elastic moves the core alone
        self.policy = make_policy(sc.policy, max_staleness=sc.max_staleness, train_cells=sc.train_cells,
                                  max_train_cells=sc.max_train_cells if cfg.train.satellites else 1)
        self.draining: set[int] = set()  # release: drain — cells leaving ROLLOUT once their runs end
        self.finishing = False
        self.book = RolloutBook(cfg, ledger, run_dir, token)
        self.evals = EvalBook(cfg, ledger, self.book)
        self.eval_only = eval_only  # `gyre eval` after the run: serve this version, evaluate it, stop
        self._eval_only_id: int | None = None
        self.degraded: str | None = None  # why the run is DEGRADED (scheduler/health.py), None while healthy
        self.paused: str | None = None  # why no group is admitted and no step starts or grows (a full disk)
        self.on_disk_full: Callable[[str], None] = lambda what: None  # a peer's write found the disk full
        self._dropped_before = 0  # groups dropped this step before the run last recovered (not held against it)
        self.on_health: Callable[[str | None], None] = lambda reason: None  # the daemon writes the run's status
        self.on_step_done: Callable[[int], None] = lambda step: None  # the trackers (the ledger holds the step)
        self.base_model = base_model  # version 0, a ready checkpoint (None on resume: the ledger knows the last)
        self.version = 0
        self.weights_path = self.base_model
        self.steps_done = 0
        self.training: StepInFlight | None = None
        self.proxies = ProxyBook()
        # a worker's runs go on if it comes back, else book.check_stuck ends them past their time budget
        self.workers = Silences("worker", WORKER_SILENT_S, "its runs wait for it")
        self.step_started_at: float | None = None  # first admission of the step's groups
        self.weights_parts: list[WeightsHandle] = []  # the current version in the core's memory (mooncake)
        self.grad_endpoints: list[str] = []  # the core's gradient receivers by rank (StepOpen), for JoinStep
        self.shards = ShardQueue(ledger, run_dir)
        # a step's attempt: what a training job of an earlier attempt sends is not for this one. 1000 per daemon
        # start, so the retries of one daemon (a core that died mid-step) never meet the numbers of the next
        self.attempt = max(1, ledger.daemon_starts()) * 1000
        self._retries: dict[int, int] = {}  # step → times it ran again after a retryable failure (this daemon)

    # --- start-up -------------------------------------------------------------------------------------------
    def create(self, now: float) -> None:
        if self.base_model is None:
            raise GyreError("a new run needs its version-0 checkpoint (gyre daemon resolves it from model.path)")
        self.book.create()
        self.ledger.version_published(0, None, str(self.base_model), now)

    def recover(self) -> None:
        self.book.recover()
        self.evals.recover()
        self.proxies.hold(time.time())
        last = self.ledger.weight_version()
        if last:
            self.version, self.weights_path = last.version, Path(last.location)
            self.weights_parts = [WeightsHandle.model_validate(h) for h in last.handle or []]
        self.steps_done = self.ledger.steps_done()
        if self.eval_only is not None:  # `gyre eval` after the run: the engines serve that version
            self.eval_only, self.weights_path = self.evals.snapshot(self.eval_only)
            self.version, self.weights_parts = self.eval_only, []
        # a step in flight when the daemon died is run again from its groups (still READY in the ledger)
        self.shards.recover(time.time())
        for step in self.ledger.running_steps():
            self._set_step(step, StepStatus.RUNNING, StepStatus.FAILED, ended_at=time.time(),
                           metrics={"error": "the daemon stopped during the step; it is run again"})

    def _set_step(self, step: int, src: StepStatus | None, dst: StepStatus, **values) -> None:
        """The one place a training step's status is checked and written (src None: a new row)."""
        self.ledger.transition(STEP, {"step": step}, src, dst, f"training step {step}", **values)

    def weights(self) -> WeightsRef:
        return WeightsRef(version=self.version, path=str(self.weights_path), parts=self.weights_parts)

    # --- workers --------------------------------------------------------------------------------------------
    def _slots(self, for_new_runs: bool = False) -> list[CellSlot]:
        """ROLLOUT cells with an engine; a draining cell serves its own runs to the end but takes no new one."""
        return [CellSlot(c, url) for c, url in self.registry.rollout_slots()
                if not (for_new_runs and c in self.draining)]

    def take(self, msg: TakeRollout, now: float) -> list[WireMessage]:
        if msg.sandbox is not None:
            self.ledger.event("sandbox", f"worker {msg.worker_id}: {msg.sandbox}",
                              severity=Severity.WARNING if msg.sandbox.startswith("NO SANDBOX") else Severity.INFO)
        if msg.worker_started_at is not None:
            for g in self.book.worker_restarted(msg.worker_id, msg.worker_started_at, now):
                log.warning("group %d terminal: worker %s was restarted", g.id, msg.worker_id)
        got: list[RolloutAssignment] = self.book.take(msg.worker_id, msg.free_slots, self._slots(True),
                                                      self.proxies.url(),
                                                      self.version, now)
        if not got:
            return [NoWork(retry_after_s=0.2)]
        # RUNNING is in the ledger before a worker starts the run: a daemon restarted later never meets a report
        # of a run it still has QUEUED (an illegal transition), nor hands the run out twice
        self.ledger.flush()
        return list(got)

    def rollout_done(self, msg: RolloutDone, now: float) -> DoneAck:
        try:
            g = self.book.done(msg, now)
        except IllegalTransition as e:  # e.g. a report of a run this daemon never handed out: it can never apply
            log.error("%s (from worker %s)", e, msg.worker_id)
            self.ledger.illegal_transition(e)
            g = None  # acked all the same, so the worker stops sending it
        if g is not None:
            log.info("group %d %s", g.id, g.status)
        self.ledger.flush()  # in the ledger before the worker forgets it (a replay is acked, not applied twice)
        return DoneAck(rollout_id=msg.rollout_id)

    # --- proxies --------------------------------------------------------------------------------------------
    def proxy_hello(self, msg: ProxyHello, now: float) -> None:
        if self.proxies.hello(msg, now):
            self.ledger.event("proxy_up", f"proxy {msg.proxy_id} at {msg.url}")

    def _records_owed(self, now: float) -> str | None:
        """Why a step must wait for model calls still on their way (None: it need not): a run trained without its
        last calls would be trained on a trajectory it did not have."""
        why, owed = self.proxies.owed(now)
        if why is not None:
            return why
        held = [g.id for g in self.book.groups.values() if g.status == GroupStatus.READY and owed & set(g.rollouts)]
        return f"groups {held} wait for model calls their proxy has not delivered yet" if held else None

    def done_waits(self, rollout_id: int, now: float) -> bool:
        """Whether a run's report waits (unacked: its worker sends it again in a few seconds) because calls of the
        run may still come: judged without them, a run would look as if it never called the model."""
        st = self.book.rollouts.get(rollout_id)
        if st is None or st.status != RolloutStatus.RUNNING:
            return False  # a replay of a report already applied, or one for a run we do not have: answered now
        why, owed = self.proxies.owed(now)
        return why is not None or rollout_id in owed

    def route(self, msg: RouteQuery) -> Route:
        return self.book.route(msg.rollout_id, self._slots(), self.version)

    def call(self, msg: CallRecord, now: float) -> CallAck:
        return self.book.record_call(msg, now)

    # --- training -------------------------------------------------------------------------------------------
    def _start_training(self, decision: Train, now: float) -> None:
        """Open a step at the current version: its groups join now (B ready ones) or, streaming, as they become
        ready (`_stream_groups`); the core is told at once and pulls the shards as they are queued."""
        step = self.steps_done
        self._dropped_before = 0  # the step's drops are counted out of book.dropped as its groups join
        path = self.run_dir / "batches" / f"step-{step:05d}" / "batch.msgpack"
        for old in path.parent.glob("shard-*.msgpack"):
            old.unlink()  # an earlier attempt's: what the folder holds is what this attempt trains
        out_dir = self.run_dir / "weights" / f"v{self.version + 1:05d}"
        # a step starts with the first admission of its groups, so ended_at - started_at is the whole cycle
        row = dict(policy=self.policy.name, version_in=self.version, version_out=None,
                   started_at=self.step_started_at or now, ended_at=None, n_groups=0, n_runs=0,
                   n_cells=len(decision.cells), tokens_trained=0, reward_mean=None, loss=None, train_s=None,
                   metrics=None, rollout_s=(now - self.step_started_at) if self.step_started_at else None)
        # a step retried after a daemon restart is FAILED in the ledger and RUNNING again
        self._set_step(step, self.ledger.step_status(step), StepStatus.RUNNING, **row)
        t = self.training = StepInFlight(step, [], now, path, {}, self.attempt, target=decision.groups)
        first = [g.id for g in self.book.ready_groups()[:decision.groups]]
        sharded = self.cfg.train.minibatches == 1
        refs: list[ShardRef] = []
        if not sharded:  # several optimizer steps per batch cannot take other cells' gradients: the core alone
            batch = self.book.build_batch(first, step, self.version)
            write_batch(path, batch)
            self._joined(first, batch.meta, len(batch.runs()), sum(batch.targets_per_run.values()))
            self._seal(now)
        else:
            self.shards.start(step, self.attempt)
            refs = self._stream_groups(now) if self.cfg.streaming else self._join(first, now)
        self.send(self.registry.core_node(), TrainStep(
            step=step, version_in=self.version, batch_path=str(path), out_dir=str(out_dir), attempt=self.attempt,
            shards=refs, sharded=sharded, seal=self.shards.seal))
        log.info("step %d opens at version %d: %d of %d groups in, %d shards%s", step, self.version, len(t.groups),
                 t.target, len(refs), "" if t.sealed_at else " (streaming: the rest join as they become ready)")

    def _join(self, group_ids: list[int], now: float) -> list[ShardRef]:
        """Groups join the open step: their data is split into shards and queued; B in, the step is sealed."""
        t = self.training
        assert t is not None and group_ids
        part = self.book.build_batch(group_ids, t.step, self.version)
        # without satellites one shard holds the groups: nobody shares it, so no round trip per shard
        per_shard = self.cfg.train.shard_runs if self.cfg.train.satellites else max(1, len(part.runs()))
        refs = self.shards.add(part, per_shard, now)
        self._joined(group_ids, part.meta, len(part.runs()), sum(part.targets_per_run.values()))
        if t.full:
            self._seal(now)
        return refs

    def _joined(self, group_ids: list[int], meta: dict, n_valid: int, tokens: int) -> None:
        t = self.training
        t.groups += group_ids
        t.metas.append(meta)
        t.n_valid += n_valid
        t.tokens += tokens

    def _stream_groups(self, now: float) -> list[ShardRef]:
        """A streaming step takes each ready group the staleness gate lets in (admission.may_join), oldest first,
        while it holds fewer than B; a group whose runs' last model calls are still on their way waits."""
        t = self.training
        if t is None or t.sealed_at is not None:
            return []
        why, owed = self.proxies.owed(now)
        if why is not None:
            return []
        taken: list[int] = []
        in_step = frozenset(t.groups)
        ready = self.book.ready_groups(in_step)
        waiting = [g.version for g in self.book.groups.values() if g.status == GroupStatus.ADMITTED]
        for i, g in enumerate(ready):
            others = waiting + [o.version for o in ready[i + 1:]]
            if owed & set(g.rollouts) or not may_join(self.version, t.target, len(t.groups) + len(taken), g.version,
                                                       others, self.cfg.scheduler.max_staleness):
                break  # oldest first: a younger group never overtakes one that waits
            taken.append(g.id)
        return self._join(taken, now) if taken else []

    def _seal(self, now: float) -> None:
        """The step's last group is in: its data's figures go to its row, and the core learns its normaliser."""
        t = self.training
        t.sealed_at = now
        meta = merge_meta(t.metas)
        t.data_metrics = data_metrics(meta)
        if self.shards.step == t.step:
            self.shards.seal_step(t.n_valid)
        self.ledger.step_sealed(t.step, len(t.groups), meta["n_runs"], t.tokens, meta["reward_mean"])

    def train_done(self, msg: TrainDone, now: float) -> None:
        t = self.training
        if t is None or msg.step != t.step or msg.attempt != t.attempt:
            return  # a late or replayed report, or one of a step an earlier daemon started
        if not msg.ok and msg.retry and (msg.error or "").startswith(DISK_FULL):
            self._retry_step(t, f"the core could not write it ({msg.error}); it runs again when the disk has room",
                             now)
            self.on_disk_full(msg.error or DISK_FULL)  # no step starts until then (`paused`)
            return
        if not msg.ok and msg.retry and self._retries.get(t.step, 0) < STEP_RETRIES:
            self._retries[t.step] = self._retries.get(t.step, 0) + 1
            self._retry_step(t, f"the core failed it ({msg.error}); it is run again from its groups", now)
            return
        self.training = None
        if not msg.ok or msg.weights is None:
            self.shards.close(False, now, f"the step failed: {msg.error}")
            self._set_step(t.step, StepStatus.RUNNING, StepStatus.FAILED, ended_at=now, metrics={"error": msg.error})
            self.ledger.event("train_failed", f"step {t.step}: {msg.error}", severity=Severity.ERROR)
            self.stop(f"training step {t.step} failed: {msg.error}", failed=True)
            return
        cells = self.shards.done_by()
        busy = self.shards.busy_intervals()
        self.shards.close(True, now)
        self.version, self.weights_path = msg.weights.version, Path(msg.weights.path)
        self.weights_parts = msg.weights.parts
        self.ledger.version_published(self.version, t.step, msg.weights.path, now, _handle(msg.weights))
        m = {**t.data_metrics, **msg.metrics, **self._overlap(t, busy, now)}
        extra = {"n_cells": len(cells)} if cells else {}  # the cells whose gradients made the step
        self._set_step(t.step, StepStatus.RUNNING, StepStatus.DONE, version_out=self.version, ended_at=now,
                       train_s=now - t.sent_at, loss=m.get("loss"),
                       tokens_trained=int(m.get("tokens_trained", 0)) or None, metrics=m, **extra)
        self.book.mark_trained(t.groups, t.step)
        self._push_weights()
        self.steps_done += 1
        self.step_started_at = None
        self.ledger.event("step_done", f"step {t.step} done: version {self.version}, loss {m.get('loss', 0):.4g}")
        self.on_step_done(t.step)

    def _overlap(self, t: StepInFlight, busy: list[tuple[float, float]], now: float) -> dict[str, float]:
        """How much of the step's training ran while runs were rolling out (v_step_overlap): training is the time
        its shards were being computed, then the core's optimizer step and save (the last shard's end to now)."""
        end = max((b for _, b in busy), default=t.sent_at)
        training = [*busy, (end, now)]
        self.ledger.flush()  # the runs' start and end times of this step's span are in the ledger
        runs = self.ledger.runs_between(t.sent_at, now)
        train_s, overlap_s = overlap_seconds(training, [(a, b or now) for a, b in runs])
        share = overlap_s / train_s if train_s else 0.0
        return {"train_busy_s": train_s, "overlap_s": overlap_s, "overlap_share": share,
                "open_s": (t.sealed_at or now) - t.sent_at}

    def core_restarted(self, node_index: int, now: float) -> None:
        """A new agent process on the core cell: the step in flight died with the old one (its trainer ran there).
        The step runs again from its groups, still READY, under a new attempt (the policy decides Train again)."""
        t = self.training
        if t is None or node_index // self.cfg.cluster.nodes_per_cell != self.cfg.cluster.core_cell:
            return
        self._retry_step(t, f"the core's agent (node {node_index}) died during the step; it is run again from "
                            "its groups", now)

    def _retry_step(self, t: StepInFlight, why: str, now: float) -> None:
        """The step in flight failed and runs again from its groups, still READY, under a new attempt."""
        self.training = None
        self.shards.close(False, now, why)
        self._set_step(t.step, StepStatus.RUNNING, StepStatus.FAILED, ended_at=now, metrics={"error": why})
        self.ledger.event("step_retried", f"step {t.step}: {why}", severity=Severity.WARNING)
        self.attempt += 1

    def step_open(self, msg: StepOpen) -> None:
        """The core runs the step: satellites can send it gradients now (JoinStep goes out in `_tend_step`)."""
        if self.shards.current(msg.step, msg.attempt):
            self.shards.endpoint, self.grad_endpoints = msg.grad_endpoint, msg.grad_endpoints
            w = msg.weights
            if w is not None and w.parts and w.version == self.version and w.parts != self.weights_parts:
                # the first time the core publishes this version (the base model, after a daemon restart), or again
                # from new ranks (a core rank died: its part went with it)
                self.weights_parts = w.parts
                self.ledger.version_handle(w.version, _handle(w))

    def weights_received(self, msg: WeightsReceived, now: float) -> None:
        for t in msg.transfers:
            self.ledger.weight_transfer(now, t.version, msg.cell, t.receiver, t.transport, t.nbytes, t.seconds, t.ok,
                                        t.error, t.sender_rank)
            if not t.ok:
                self.ledger.event("weights_failed", f"{t.receiver} did not get version {t.version} over "
                                  f"{t.transport}: {t.error}", severity=Severity.WARNING)
            elif t.asked is not None:  # the row holds the version it loaded (and its engine reports it with calls)
                self.ledger.event("weights_newer", f"{t.receiver} was sent version {t.asked}, which was replaced "
                                  f"before it read it: it loaded version {t.version}", cell_id=msg.cell,
                                  data={"asked": t.asked, "loaded": t.version, "receiver": t.receiver})

    def take_shard(self, msg: TakeShard, now: float) -> WireMessage:
        cell = msg.node_index // self.cfg.cluster.nodes_per_cell
        state = self.registry.cells.get(cell)
        is_core = cell == self.cfg.cluster.core_cell
        if not self.shards.current(msg.step, msg.attempt) or state is None:
            return NoShard(step=msg.step, step_over=True)  # over, another attempt, or a step without shards
        if not is_core and state.role != Role.TRAIN:
            return NoShard(step=msg.step, step_over=True)  # pulled back or DOWN: its shards went back
        return self.shards.take(cell, is_core, now)

    def shard_done(self, msg: ShardDone, now: float) -> None:
        if self.shards.current(msg.step, msg.attempt):
            self.shards.done(msg.shard, msg.by_cell, now)

    def shard_failed(self, msg: ShardFailed) -> None:
        cell = msg.node_index // self.cfg.cluster.nodes_per_cell
        if self.shards.current(msg.step, msg.attempt) and cell != self.cfg.cluster.core_cell:  # the core: TrainDone
            self.shards.give_back(msg.shard, cell, msg.error)

    def _tend_step(self) -> None:
        """Satellites follow the cells' roles: one that left TRAIN (pulled back, DOWN) gives its shards back, and
        one in TRAIN that is not in the step yet (it just switched, or came back) is asked to join."""
        q = self.shards
        if q.step is None:
            return
        for cell in self.registry.cells.values():
            if cell.id == self.cfg.cluster.core_cell:
                continue  # the core's shards are the step itself: it holds them while it runs
            if cell.role != Role.TRAIN:
                if cell.id in q.joined or cell.id in q.holders():
                    going = f" → {cell.switch.to_role.value}" if cell.switch else ""
                    q.requeue(cell.id, f"cell {cell.id} is {cell.role.value}{going}")
            elif (self.cfg.train.satellites and q.endpoint is not None and cell.id not in q.joined | q.dropped
                  and self.registry.cell_up(cell.id)):
                q.joined.add(cell.id)
                join = JoinStep(step=q.step, attempt=q.attempt, version_in=self.version, weights=self.weights(),
                                grad_endpoint=q.endpoint, grad_endpoints=self.grad_endpoints)
                self.send(self.registry.nodes_of(cell.id)[0], join)

    def _push_weights(self) -> None:
        """The cells that kept rolling out (or are on their way back) serve the new version from now on."""
        msg = LoadWeights(weights=self.weights())
        for cell in self.registry.cells.values():
            going = cell.switch.to_role if cell.switch is not None else None
            if cell.role == Role.ROLLOUT or going == Role.ROLLOUT:
                for n in self.registry.nodes_of(cell.id):
                    self.send(n, msg)

    # --- scheduling -----------------------------------------------------------------------------------------
    def _cell_view(self, cell, running: int) -> CellView:
        role, target = cell.role, cell.switch.to_role if cell.switch else None
        if cell.id in self.draining:  # out of the rollout pool already: the policy counts it as on its way
            role, target = Role.SWITCHING, Role.TRAIN
        return CellView(cell.id, role, cell.id == self.cfg.cluster.core_cell, running, target=target,
                        pinned=cell.pinned)

    def view(self) -> View:
        c = self.book.counts(frozenset(self.training.groups) if self.training else frozenset())
        by_cell = c["running_by_cell"]  # one pass over the rollouts, not one per cell
        return View(tuple(self._cell_view(cell, by_cell[cell.id]) for cell in self.registry.cells.values()),
                    groups_per_step=self.cfg.tasks.groups_per_step, groups_open=c["groups_open"],
                    groups_ready=c["groups_ready"], groups_training=c["groups_training"],
                    groups_trained=c["groups_trained"], queued=c["queued"],
                    running=c["running"], eval_running=c["eval_running"],
                    runs_per_cell=self.cfg.cluster.rollouts_per_cell,
                    runs_per_group=self.cfg.tasks.group_size,
                    training=self.training is not None, step_cells=self._step_cells(),
                    steps_done=self.steps_done, max_steps=self.cfg.train.steps,
                    version=self.version, open_versions=tuple(c["open_versions"]),
                    ready_versions=tuple(c["ready_versions"]), streaming=self.cfg.streaming)

    def _step_cells(self) -> tuple[int, ...]:
        """The core while a step runs, and the cells holding its shards."""
        if self.training is None:
            return ()
        return tuple(sorted({self.cfg.cluster.core_cell} | self.shards.holders()))

    def _record(self, d: Decision, v: View, now: float) -> None:
        """Every decision in the ledger (v_policy_decisions) with the numbers it was made on."""
        kind = {Admit: "admit", Switch: "switch", Train: "train", Finish: "finish"}[type(d)]
        short = {Role.ROLLOUT: "R", Role.TRAIN: "T", Role.DOWN: "D"}
        roles = " ".join(f"S>{short[c.target]}" if c.role == Role.SWITCHING and c.target else short.get(c.role, "S")
                         for c in v.cells)
        cells = list(d.cells) if isinstance(d, Switch | Train) else None
        reason = d.reason if isinstance(d, Switch | Finish) else (
            f"{d.groups} groups fit the staleness bound" if isinstance(d, Admit) else
            "a group ready, gate open: the step opens, its groups join as they become ready" if v.streaming
            else "B groups ready, gate open")
        self.ledger.policy_decision(now, policy=self.policy.name, kind=kind, cells=cells,
                                    role=d.role if isinstance(d, Switch) else None,
                                    groups=d.groups if isinstance(d, Admit | Train) else None, reason=reason,
                                    watermark=v.watermark, capacity=len(v.with_role(Role.ROLLOUT)) * v.runs_per_cell,
                                    queued=v.queued, running=v.running, groups_ready=v.groups_ready,
                                    groups_open=v.groups_open, version=v.version, roles=roles)

    def _switch(self, cell: int, role: Role, reason: str, now: float) -> None:
        if role == Role.TRAIN and self.book.running_on(cell):
            if self.cfg.scheduler.release == "drain":
                self.draining.add(cell)
                self.ledger.event("cell_draining", f"cell {cell}: no new runs; it switches to TRAIN when its "
                                  f"{self.book.running_on(cell)} runs end", cell_id=cell)
                return
            others = [c for c in self._slots(True) if c.id != cell]
            moved = self.book.migrate(cell, others)
            self.ledger.event("runs_migrated", f"cell {cell} → TRAIN: {moved} runs continue on other cells from "
                              f"their exact ids", cell_id=cell, data={"runs": moved})
        try:
            self.registry.request_switch(cell, role, reason=f"scheduler:{self.policy.name}: {reason}", now=now)
        except ControlError as e:  # e.g. the cell went DOWN since the view was built: the next view sees it
            log.warning("switch of cell %d not started: %s", cell, e)

    def _drained(self, now: float) -> None:
        for cell in sorted(self.draining):
            state = self.registry.cells[cell]
            if state.role != Role.ROLLOUT or state.pinned:  # went DOWN or was pinned by hand: the drain is off
                self.draining.discard(cell)
            elif not self.book.running_on(cell):
                self.draining.discard(cell)
                self._switch(cell, Role.TRAIN, "drained", now)

    def _too_many_dropped(self) -> bool:
        """Groups dropped and refilled between two steps past MAX_DROPPED_PER_STEP·B: the policy has collapsed (every
        run of a group scores the same) or the suite cannot be learned; refilling for ever would hide it. While the
        run is DEGRADED its probe groups do not count, nor do the groups dropped before it recovered."""
        dropped = sum(self.book.dropped.values()) - self._dropped_before
        if self.finishing or self.degraded is not None \
                or dropped < MAX_DROPPED_PER_STEP * self.cfg.tasks.groups_per_step:
            return False
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.book.dropped.items()))
        msg = (f"{dropped} groups dropped since step {self.steps_done} began ({why}): every run of a group scored "
               f"alike; the policy has collapsed or the suite is too hard or too easy for it")
        self.ledger.event("groups_dropped", msg, severity=Severity.ERROR)
        self.finishing = True
        self.stop(msg, failed=True)
        return True

    def _check_health(self) -> None:
        reason = self.book.health.reason()
        if reason != self.degraded:
            self.degraded = reason
            if reason is None:
                self.book.health.healthy_again()
                self._dropped_before = sum(self.book.dropped.values())
            self.on_health(reason)

    def evaluate(self, version: int | None, now: float) -> int:
        """An evaluation on demand (`gyre eval`) of the version the engines serve now."""
        if version is not None and version != self.version:
            raise ControlError(f"version {version} is not the one the rollout engines serve now ({self.version}): "
                               f"evaluate {self.version} now, or version {version} after the run (gyre eval RUN "
                               f"--version {version})")
        return self.evals.start(self.version, "manual", now)

    def _schedule_evals(self, finishing: bool, now: float) -> None:
        """Start a scheduled evaluation that is due, and give its runs a rollout cell when the run has none left
        (after the last step, or `gyre eval` after the run); while training goes on the policy keeps them."""
        if self.eval_only is not None:
            if self._eval_only_id is None:
                self._eval_only_id = self.evals.start(self.version, "manual", now)
            elif self._eval_only_id not in self.evals.open and not self.finishing:
                self.finishing = True
                self.stop(f"evaluation {self._eval_only_id} of version {self.version} done")
        else:
            reason = self.evals.due(self.version, self.steps_done, finishing)
            if reason is not None:
                self.evals.start(self.version, reason, now)
        if (self.evals.queued() and not self._slots(True) and self.training is None
                and (self.eval_only is not None or self.steps_done >= self.cfg.train.steps)):
            for cell in self.registry.cells.values():
                if cell.role == Role.TRAIN and not cell.pinned and cell.switch is None:
                    self._switch(cell.id, Role.ROLLOUT, "evaluation runs wait for a rollout cell", now)

    def schedule(self, now: float) -> None:
        for kind, message in self.proxies.silences(now) + self.workers.check(now):
            self.ledger.event(kind, message, severity=Severity.WARNING)
        for g in self.book.check_stuck(now):
            log.warning("group %d terminal after a lost worker", g.id)
        if self.eval_only is not None:
            self._schedule_evals(False, now)  # no policy: nothing is admitted or trained
            return
        if self._too_many_dropped():
            return
        self._schedule_evals(False, now)
        self._drained(now)
        self._check_health()
        v = self.view()
        for d in self.policy.decide(v):
            if isinstance(d, Finish) and self.finishing:
                continue
            if isinstance(d, Finish) and self.evals.enabled:
                self._schedule_evals(True, now)  # the last version's evaluation, if not done yet
                if self.evals.open:
                    continue  # the run stops once its evaluations are done
            if isinstance(d, Admit | Train) and self.paused is not None:
                continue  # the disk is full: a group's calls, a step's batch and weights would not fit
            if isinstance(d, Admit) and self.degraded is not None:
                if not self.book.health.may_probe(now):
                    continue  # failing: no more work than a probe now and then
                d = Admit(groups=1)
            if isinstance(d, Train) and not self.registry.cell_up(self.cfg.cluster.core_cell):
                continue  # a restarted daemon: the step waits until the core's agents are back (TrainStep goes there)
            if isinstance(d, Train) and self._records_owed(now):
                continue  # a run's last calls are still on their way: its trajectory is not whole yet
            self._record(d, v, now)
            if isinstance(d, Admit):
                if self.step_started_at is None:
                    self.step_started_at = now
                self.book.admit(d.groups, self.version, now)
            elif isinstance(d, Switch):
                for cell in d.cells:
                    self._switch(cell, d.role, d.reason, now)
            elif isinstance(d, Train):
                self._start_training(d, now)
            elif isinstance(d, Finish):
                self.finishing = True
                self.stop(d.reason)
        if self.paused is None:
            self._stream_groups(now)
        self._tend_step()
