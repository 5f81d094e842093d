"""The RL loop inside the daemon: rollouts in, training steps out, weight versions published.

It answers workers (TakeRollout, RolloutDone), proxies (ProxyHello, RouteQuery, CallRecord) and the core
cell (TrainDone), and after every event asks the scheduling policy what to do next (admit groups, switch cells,
train, finish), then does it. Policy decisions are pure; everything with effects happens here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.coordinator.rollouts import CellSlot, RolloutBook
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.model.store import ensure_model
from gyre_slurm.protocol import (
    CallAck,
    CallRecord,
    DoneAck,
    NoWork,
    ProxyHello,
    RolloutAssignment,
    RolloutDone,
    Route,
    RouteQuery,
    TakeRollout,
    TrainDone,
    TrainStep,
    WeightsRef,
    _Msg,
)
from gyre_slurm.scheduler.policy import Admit, CellView, Finish, Switch, Train, View, make_policy
from gyre_slurm.train.batch import write_batch

log = logging.getLogger("gyre.loop")


@dataclass
class StepInFlight:
    step: int
    groups: list[int]
    sent_at: float
    batch_path: Path
    data_metrics: dict[str, float]  # exclusions and drops of the step's data, logged with the trainer's metrics


class RLLoop:
    def __init__(self, cfg: RunConfig, ledger: LedgerWriter, registry: CellRegistry, run_dir: Path, token: str,
                 send: Callable[[int, _Msg], None], stop: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.registry = registry
        self.run_dir = run_dir
        self.send = send
        self.stop = stop
        self.policy = make_policy(cfg.scheduler.policy)
        self.book = RolloutBook(cfg, ledger, run_dir, token)
        self.base_model = ensure_model(cfg)
        self.version = 0
        self.weights_path = self.base_model
        self.steps_done = 0
        self.training: StepInFlight | None = None
        self.proxies: dict[str, tuple[str, float]] = {}
        self.step_started_at: float | None = None  # first admission of the step's groups

    # --- start-up -------------------------------------------------------------------------------------------
    def create(self, now: float) -> None:
        self.book.create()
        self.ledger.insert("weight_versions", version=0, step=None, created_at=now, published_at=now,
                           location=str(self.base_model), transport="file")

    def recover(self) -> None:
        self.book.recover()
        row = self.ledger.rows("SELECT version, location FROM weight_versions ORDER BY version DESC LIMIT 1")
        if row:
            self.version, self.weights_path = row[0]["version"], Path(row[0]["location"])
        self.steps_done = self.ledger.scalar("SELECT count(*) FROM train_steps WHERE status = 'DONE'") or 0
        # a step in flight when the daemon died is run again from its groups (still READY in the ledger)
        self.ledger.update("train_steps", {"status": "RUNNING"}, status="FAILED", ended_at=time.time())

    def weights(self) -> WeightsRef:
        return WeightsRef(version=self.version, path=str(self.weights_path))

    # --- workers --------------------------------------------------------------------------------------------
    def _slots(self) -> list[CellSlot]:
        return [CellSlot(c, url) for c, url in self.registry.rollout_slots()]

    def _proxy_url(self) -> str | None:
        live = [(seen, url) for url, seen in self.proxies.values()]
        return max(live)[1] if live else None

    def take(self, msg: TakeRollout, now: float) -> list[_Msg]:
        got: list[RolloutAssignment] = self.book.take(msg.worker_id, msg.free_slots, self._slots(), self._proxy_url(),
                                                      self.version, now)
        return list(got) if got else [NoWork(retry_after_s=0.2)]

    def rollout_done(self, msg: RolloutDone, now: float) -> DoneAck:
        g = self.book.done(msg, now)
        if g is not None:
            log.info("group %d %s", g.id, g.status)
        self.ledger.flush()  # in the ledger before the worker forgets it (a replay is acked, not applied twice)
        return DoneAck(rollout_id=msg.rollout_id)

    # --- proxies --------------------------------------------------------------------------------------------
    def proxy_hello(self, msg: ProxyHello, now: float) -> None:
        if msg.proxy_id not in self.proxies:
            self.ledger.event("proxy_up", f"proxy {msg.proxy_id} at {msg.url}")
        self.proxies[msg.proxy_id] = (msg.url, now)

    def route(self, msg: RouteQuery) -> Route:
        return self.book.route(msg.rollout_id, self._slots(), self.version)

    def call(self, msg: CallRecord, now: float) -> CallAck:
        return self.book.record_call(msg, now)

    # --- training -------------------------------------------------------------------------------------------
    def _start_training(self, decision: Train, now: float) -> None:
        step = self.steps_done
        batch, groups = self.book.build_batch(decision.groups, step, self.version)
        path = self.run_dir / "batches" / f"step-{step:05d}.msgpack"
        write_batch(path, batch)
        out_dir = self.run_dir / "weights" / f"v{self.version + 1:05d}"
        # a step starts with the first admission of its groups, so ended_at - started_at is the whole cycle
        row = dict(policy=self.policy.name, version_in=self.version, version_out=None, status="RUNNING",
                   started_at=self.step_started_at or now, ended_at=None, n_groups=len(groups),
                   n_runs=batch.meta["n_runs"],
                   n_cells=len(decision.cells), tokens_trained=sum(batch.targets_per_run.values()),
                   reward_mean=batch.meta["reward_mean"], loss=None, train_s=None, metrics=None,
                   rollout_s=(now - self.step_started_at) if self.step_started_at else None)
        if self.ledger.scalar("SELECT count(*) FROM train_steps WHERE step = :s", s=step):
            self.ledger.update("train_steps", {"step": step}, **row)  # retried after a daemon restart
        else:
            self.ledger.insert("train_steps", step=step, **row)
        data_metrics = {k: v for k, v in batch.meta.items() if k.startswith(("frac_", "groups_dropped", "staleness"))}
        self.training = StepInFlight(step, groups, now, path, data_metrics)
        self.send(self.registry.core_node(), TrainStep(step=step, version_in=self.version, batch_path=str(path),
                                                       out_dir=str(out_dir)))
        log.info("step %d: training on %d groups (%d runs with targets)", step, len(groups), len(batch.advantages))

    def train_done(self, msg: TrainDone, now: float) -> None:
        t = self.training
        if t is None or msg.step != t.step:
            return  # a late or replayed report
        self.training = None
        if not msg.ok or msg.weights is None:
            self.ledger.update("train_steps", {"step": t.step, "status": "RUNNING"}, status="FAILED", ended_at=now,
                               metrics={"error": msg.error})
            self.ledger.event("train_failed", f"step {t.step}: {msg.error}", severity="error")
            self.stop(f"training step {t.step} failed: {msg.error}")
            return
        self.version, self.weights_path = msg.weights.version, Path(msg.weights.path)
        self.ledger.insert("weight_versions", version=self.version, step=t.step, created_at=now, published_at=now,
                           location=msg.weights.path, transport="file")
        m = {**t.data_metrics, **msg.metrics}
        self.ledger.update("train_steps", {"step": t.step, "status": "RUNNING"}, status="DONE",
                           version_out=self.version, ended_at=now, train_s=now - t.sent_at, loss=m.get("loss"),
                           tokens_trained=int(m.get("tokens_trained", 0)) or None, metrics=m)
        self.book.mark_trained(t.groups, t.step)
        self.steps_done += 1
        self.step_started_at = None
        self.ledger.event("step_done", f"step {t.step} done: version {self.version}, loss {m.get('loss', 0):.4g}")

    # --- scheduling -----------------------------------------------------------------------------------------
    def view(self) -> View:
        c = self.book.counts()
        cells = tuple(CellView(cell.id, cell.role, cell.id == self.cfg.cluster.core_cell,
                               self.book.running_on(cell.id)) for cell in self.registry.cells.values())
        return View(cells, c["groups_open"], c["groups_ready"], self.cfg.tasks.groups_per_step, c["queued"],
                    c["running"], self.training is not None, self.steps_done, self.cfg.train.steps)

    def schedule(self, now: float) -> None:
        for g in self.book.check_stuck(now):
            log.warning("group %d terminal after a lost worker", g.id)
        for d in self.policy.decide(self.view()):
            if isinstance(d, Admit):
                if self.step_started_at is None:
                    self.step_started_at = now
                self.book.admit(d.groups, self.version, now)
            elif isinstance(d, Switch):
                for cell in d.cells:
                    self.registry.request_switch(cell, d.role, reason=f"scheduler:{self.policy.name}", now=now)
            elif isinstance(d, Train):
                self._start_training(d, now)
            elif isinstance(d, Finish):
                self.stop(d.reason)
