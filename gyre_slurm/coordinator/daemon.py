"""The coordinator daemon: the ledger's only writer and the run's single point of decision.

One thread, one ZeroMQ ROUTER socket for every peer (agents and CLI), an event loop that wakes on a message
or on the next timer (heartbeat check, switch timeouts, ledger flush). Started on an existing ledger it
resumes: the run token and port are kept, so agents reconnect on their own and re-register.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from gyre_slurm.beacon import Beacon
from gyre_slurm.config import RunConfig, dump_config
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.coordinator.disk_guard import DiskGuard, DiskWatch
from gyre_slurm.coordinator.loop import RLLoop
from gyre_slurm.errors import ControlError, DiskFull, GyreError, IllegalTransition, ProtocolError, disk_full
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.peer import new_curve_keys, serve_curve, start_authenticator
from gyre_slurm.protocol import (
    MAX_FRAME_BYTES,
    AddCellsRequest,
    CallAck,
    CallRecord,
    CellJobsRequest,
    ContextLimit,
    ControlRequest,
    Error,
    EvalRequest,
    EventRequest,
    Heartbeat,
    Message,
    PingRequest,
    ProxyHello,
    ReassignRequest,
    Register,
    ReleaseRequest,
    Reply,
    RolloutDone,
    RouteQuery,
    ShardDone,
    ShardFailed,
    Shutdown,
    ShutdownRequest,
    StatusRequest,
    StepOpen,
    SwitchDone,
    TakeRollout,
    TakeShard,
    TrainDone,
    WeightsReceived,
    WeightsRef,
    WireMessage,
    WorkerHello,
    decode,
    encode,
    error_code,
)
from gyre_slurm.rundir import ControlInfo, ledger_path, new_token, read_control, write_control
from gyre_slurm.slurm_jobs import JobWatch
from gyre_slurm.statuses import RUN, RunStatus, Severity

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from gyre_slurm.tracking.tracker import Tracker

log = logging.getLogger("gyre.daemon")
# A message's handler: (the peer's identity, the message, now) → what to answer it (none, one message or several)
Handler = Callable[[bytes, Message, float], WireMessage | Iterable[WireMessage] | None]


class Daemon:
    """A daemon ready to serve(): constructing it opens (or resumes) the run in its ledger and binds its socket."""

    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str, base_model: Path | None = None,
                 cell_jobs: bool = False, eval_only: int | None = None) -> None:
        self.cfg = cfg
        self.eval_only = eval_only  # `gyre eval` after the run: evaluate this version of the resumed run, then stop
        # cell_jobs (gyre submit): every cell is a Slurm job of its own, and SIGTERM (a requeue, a time limit)
        # suspends the daemon — agents keep running, the run stays RUNNING and resumes when the job restarts
        self.base_model = base_model  # version 0 of a new run: a ready checkpoint (the daemon never builds one)
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        try:
            previous = read_control(self.run_dir)
        except GyreError:
            previous = None
        self.token = previous.token if previous else new_token()
        # keys kept across restarts like the token (peers hold them); none when control.encrypt is off
        self.curve = ((previous.curve if previous and previous.curve else new_curve_keys())
                      if cfg.control.encrypt else None)
        guard = DiskGuard(self.run_dir)
        guard.make_reserve()  # a disk already full: the first tick says so
        self.ledger = self._open_ledger(guard)
        self.disk = DiskWatch(guard, self.ledger, self._degrade)
        self.registry = CellRegistry(cfg, self.ledger, self._send, weights=self._weights, cell_jobs=cell_jobs)
        self.identities: dict[int, bytes] = {}
        # CallAcks, and every answer while the ledger's disk is full: sent after the next commit (_send_held)
        self._held: list[tuple[bytes, WireMessage]] = []
        self._deferred: list[tuple[bytes, bytes]] = []  # frames a full disk stopped whole: handled first, later
        self._why: dict[str, str | None] = {"health": None, "disk": None}  # why the run is DEGRADED, by source
        self._stalled_since: float | None = None  # a full disk holds every frame since
        self._stop_reason: str | None = None
        self._failed = False  # the run ends FAILED, not STOPPED
        self._suspend = False
        self.run_status = RunStatus.RUNNING  # or DEGRADED (as the ledger has it)
        self.resumed = False  # both set from the ledger by _open_run
        self.created_at = time.time()
        # tracking/tracker.py's Tracker when tracking.backends names any (and the run has an RL loop to track)
        self.tracker = self._start_tracker() if cfg.tracking.backends and self._has_loop() else None
        self.loop = self._open_run(time.time())  # None: control plane only
        if self.ledger.full:  # resumed on a full disk: what it queued is written with the reserve's room
            guard.release()
            self.ledger.flush()
        self.sock, self.auth = self._socket()
        self.port = self._bind(previous)
        self.watch = (JobWatch(lambda: [c.slurm_job_id for c in list(self.registry.cells.values()) if c.slurm_job_id],
                               poll_s=cfg.slurm.poll_s).start() if cell_jobs else None)
        self._handlers = self._handler_table()

    # --- start-up -----------------------------------------------------------------------------------------
    def _open_ledger(self, guard: DiskGuard) -> Ledger:
        """Open (or create) the ledger; on a full disk once more with the reserve given up."""
        path, cfg = ledger_path(self.run_dir), self.cfg.ledger
        try:
            return Ledger(path, cfg.flush_interval_s, cfg.max_batch_rows)
        except Exception as e:
            if not disk_full(e) or not guard.release():
                raise
            log.error("the run's disk is full: its reserve given up to open the ledger")
            return Ledger(path, cfg.flush_interval_s, cfg.max_batch_rows)

    def _open_run(self, now: float) -> RLLoop | None:
        row = self.ledger.run(self.run_id)
        job = os.environ.get("SLURM_JOB_ID")
        if row:
            self.resumed = True
            self.created_at = row.created_at
            self.ledger.transition(RUN, {"id": self.run_id}, row.status, RunStatus.RUNNING,
                                   f"run {self.run_id}", ended_at=None, daemon_starts=row.daemon_starts + 1,
                                   degraded_reason=None,
                                   **({"slurm_job_id": job} if job else {}))  # the job it runs in now
            self.registry.recover(now)
            loop = self._make_loop()
            if loop:
                loop.recover()
                if row.status in (RunStatus.STOPPED, RunStatus.FAILED) or self.ledger.was_suspended():
                    self._abandon_running(loop, now)
            starts = row.daemon_starts + 1
            self.ledger.event("daemon_restarted", f"daemon resumed from its ledger (start #{starts})",
                              severity=Severity.WARNING)
        else:  # its config.yaml is saved already, by whatever started it (run_context.RunContext.create)
            self.ledger.transition(RUN, {"id": self.run_id}, None, RunStatus.RUNNING, f"run {self.run_id}",
                                   name=self.cfg.run.name, policy=self.cfg.scheduler.policy,
                                   config=dump_config(self.cfg), created_at=now, ended_at=None, daemon_starts=1,
                                   slurm_job_id=job)
            self.registry.create(now)
            loop = self._make_loop()
            if loop:
                loop.create(now)
            self.ledger.event("run_started", f"run {self.run_id} started ({self.cfg.cluster.cells} cells)")
        self.ledger.flush()
        return loop

    def _abandon_running(self, loop: RLLoop, now: float) -> None:
        """The last daemon stopped cleanly or was suspended with its job, and the workers with it: the runs it left
        RUNNING will never report. (After a kill -9 they wait: their workers may still be alive.)"""
        n = loop.book.abandon_running("the run stopped while it ran; its worker stopped with it", now)
        if n:
            self.ledger.event("runs_abandoned", f"{n} runs were in flight when the run stopped: INFRA_ERROR, "
                              "excluded from their groups", severity=Severity.WARNING, data={"runs": n})

    def _has_loop(self) -> bool:
        return self.cfg.cluster.engine != "none"  # else control plane only: cells hold no engine or trainer

    def _make_loop(self) -> RLLoop | None:
        if not self._has_loop():
            return None
        loop = RLLoop(self.cfg, self.ledger, self.registry, self.run_dir, self.token, self._send, self.stop,
                      self.base_model, eval_only=self.eval_only)
        loop.on_health = self._health
        loop.on_disk_full = lambda what: self.disk.full(what[:200], time.time())
        self.disk.loop = loop
        tracker = self.tracker
        if tracker is not None:  # hooked before the loop recovers: an evaluation may end in its recovery
            # the tracker reads the step or evaluation back from the ledger: committed first
            loop.on_step_done = lambda step: (self.ledger.flush(), tracker.step_done(step))
            loop.evals.on_done = lambda eval_id: (self.ledger.flush(), tracker.eval_done(eval_id))
        return loop

    def _weights(self) -> WeightsRef | None:
        """The version a cell entering ROLLOUT must serve."""
        return self.loop.weights() if self.loop is not None else None

    def _start_tracker(self) -> Tracker:
        from gyre_slurm.tracking.tracker import Tracker  # tracking off: nothing imported, nothing read

        return Tracker.start(self.cfg.tracking, self.run_dir, self.run_id, dump_config(self.cfg),
                             warn=self._tracking_failed)

    def _tracking_failed(self, line: str) -> None:
        """A tracker that failed is one warning and is off from then on; the run goes on (gyre export replays)."""
        log.warning("%s", line)
        self.ledger.event("tracking_failed", line, severity=Severity.WARNING)

    def _degrade(self, source: str, reason: str | None) -> None:
        """RUNNING ↔ DEGRADED as the run's health (scheduler/health.py) and its disk (disk_guard.py) say, with the
        reasons in runs."""
        self._why[source] = reason
        why = "; ".join(r for r in self._why.values() if r) or None
        new = RunStatus.DEGRADED if why else RunStatus.RUNNING
        if new == self.run_status:  # degraded still, for another reason
            self.ledger.degraded_reason(self.run_id, why)
        else:
            self.ledger.transition(RUN, {"id": self.run_id}, self.run_status, new, f"run {self.run_id}",
                                   degraded_reason=why)
        self.run_status = new

    def _health(self, reason: str | None) -> None:
        """The run's health changed: its status and an event."""
        self._degrade("health", reason)
        if reason:
            log.error("run DEGRADED: %s; admitting only a probe group every %g s", reason,
                      self.cfg.run.degraded_probe_s)
            self.ledger.event("run_degraded", f"DEGRADED: {reason}; only a probe group every "
                              f"{self.cfg.run.degraded_probe_s:g} s until a good outcome", severity=Severity.ERROR)
        else:
            log.info("run healthy again: admitting work")
            self.ledger.event("run_recovered", "the probe came back good: the run admits work again")

    def _socket(self) -> tuple[zmq.Socket, ThreadAuthenticator | None]:
        """The ROUTER every peer talks to, and with control.encrypt the authenticator that admits only the run's
        client key (every frame encrypted)."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        auth = None
        if self.curve:
            auth = start_authenticator(ctx, self.curve)
            serve_curve(sock, self.curve)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises instead of vanishing
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted agent may reuse its identity
        sock.setsockopt(zmq.LINGER, 0)
        return sock, auth

    def _bind(self, previous: ControlInfo | None) -> int:
        """Bind the socket (the previous daemon's port when it is free) and tell the peers in control.json."""
        host = self.cfg.control.bind_host
        port = previous.port if previous else self.cfg.control.port
        if port and not self._try_bind(host, port):
            if self.cfg.control.port:  # a port the config names is the user's: never quietly another one
                raise GyreError(f"control.port {port} on {host} is in use")
            port = 0  # the old one is taken (a requeued job on another node): peers read the new one from control.json
        if not port:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        endpoint = f"tcp://{self.cfg.control.advertised()}:{port}"
        write_control(self.run_dir, ControlInfo(endpoint=endpoint, port=port, token=self.token, daemon_pid=os.getpid(),
                                                daemon_host=socket.gethostname(), started_at=time.time(),
                                                slurm_job_id=os.environ.get("SLURM_JOB_ID"), curve=self.curve))
        log.info("daemon of run %s listening on %s (%s)", self.run_id, endpoint, "resumed" if self.resumed else "new")
        return port

    def _try_bind(self, host: str, port: int) -> bool:
        try:
            self.sock.bind(f"tcp://{host}:{port}")
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            return False

    # --- sending ------------------------------------------------------------------------------------------
    def _send_to(self, identity: bytes, msg: WireMessage) -> None:
        # acked once committed: a proxy forgets what it sees acked; on a full disk nothing is answered until the
        # ledger has it (a reply says what is written)
        if isinstance(msg, CallAck) or self._blocked():
            self._held.append((identity, msg))
            return
        self._send_now(identity, msg)

    def _send_held(self) -> None:
        """The CallAcks of the frames just handled (and what a full disk held back), after one commit of what they
        recorded: a call acked is a call in the ledger, whatever kills the daemon next."""
        if self._held:
            self.ledger.flush()
            if self._blocked():
                return
            held, self._held = self._held, []
            for identity, msg in held:
                self._send_now(identity, msg)

    def _send_now(self, identity: bytes, msg: WireMessage) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg, self.token)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("cannot send %s to %r: %s", msg.__class__.__name__, identity, e)

    def _send(self, node_index: int, msg: WireMessage) -> None:
        ident = self.identities.get(node_index)
        if ident is None:
            log.warning("no route to node %d for %s (it will get it when it registers)", node_index,
                        msg.__class__.__name__)
            return
        self._send_to(ident, msg)

    # --- handling -----------------------------------------------------------------------------------------
    def handle_frame(self, identity: bytes, frame: bytes) -> None:
        now = time.time()
        try:
            msg = decode(frame, self.token)
        except ProtocolError as e:
            log.warning("rejected a frame from %r: %s", identity, e)
            self.ledger.event("bad_message", f"from peer {identity[:32]!r}: {e}", severity=Severity.WARNING)
            self._send_to(identity, Error(code=error_code(e), message=str(e)))
            return
        try:
            self._dispatch(identity, msg, now)
        except DiskFull:  # a payload did not fit, before anything of the frame was applied: it waits
            self._deferred.append((identity, frame))
        except ControlError as e:
            self._send_to(identity, Error(code="refused", message=str(e)))
        except IllegalTransition as e:  # a bug or a peer out of step: logged, never written, the daemon goes on
            log.error("%s (from %s)", e, msg.type)
            self.ledger.illegal_transition(e)
            self._send_to(identity, Error(code="illegal_transition", message=str(e)))

    def _dispatch(self, identity: bytes, msg: Message, now: float) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._send_to(identity, Error(code="unexpected", message=f"a daemon does not accept '{msg.type}'"))
            return
        answers = handler(identity, msg, now)
        for answer in [answers] if isinstance(answers, WireMessage) else answers or ():
            self._send_to(identity, answer)

    def _handler_table(self) -> dict[type[WireMessage], Handler]:
        """Every message class the daemon accepts → its handler; a run without an RL loop (control plane only)
        refuses the RL loop's messages as unexpected."""
        control: dict[type[ControlRequest], Callable[[Any, float], dict[str, Any]]] = {
            PingRequest: self._ping, StatusRequest: self._status, ReassignRequest: self._reassign,
            ReleaseRequest: self._release, ShutdownRequest: self._shutdown_request, AddCellsRequest: self._add_cells,
            CellJobsRequest: self._cell_jobs, EventRequest: self._event, EvalRequest: self._eval,
        }
        table: dict[type[WireMessage], Handler] = {cls: partial(self._answer, fn) for cls, fn in control.items()}
        table |= {Register: self._register, Heartbeat: lambda _i, m, now: self.registry.heartbeat(m, now),
                  SwitchDone: lambda _i, m, now: self.registry.switch_done(m.node_index, m.report, now)}
        loop = self.loop
        if loop is not None:  # workers, proxies, and training jobs (each on its own socket "train:<node>")
            table |= {
                WeightsReceived: lambda _i, m, now: loop.weights_received(m, now),
                TakeRollout: lambda _i, m, now: loop.take(m, now),
                WorkerHello: lambda _i, m, now: loop.workers.heard(m.worker_id, now),
                RolloutDone: lambda _i, m, now: self._rollout_done(loop, m, now),
                ProxyHello: lambda _i, m, now: loop.proxy_hello(m, now),
                RouteQuery: lambda _i, m, _now: loop.route(m),
                CallRecord: lambda _i, m, now: loop.call(m, now),
                ContextLimit: lambda _i, m, now: loop.book.context_limit(m, now),
                TrainDone: lambda _i, m, now: loop.train_done(m, now),
                StepOpen: lambda _i, m, _now: loop.step_open(m),
                TakeShard: lambda _i, m, now: loop.take_shard(m, now),
                ShardDone: lambda _i, m, now: loop.shard_done(m, now),
                ShardFailed: lambda _i, m, _now: loop.shard_failed(m),
            }
        return table

    def _register(self, identity: bytes, msg: Register, now: float) -> WireMessage:
        self.identities[msg.node_index] = identity
        ack = self.registry.register(msg, now)
        if msg.role is None and self.loop is not None:  # a new agent process, not one that lost touch
            self.loop.core_restarted(msg.node_index, now)
        return ack

    @staticmethod
    def _rollout_done(loop: RLLoop, msg: RolloutDone, now: float) -> WireMessage | None:
        if loop.done_waits(msg.rollout_id, now):
            return None  # unacked: its worker sends it again once the run's calls are in
        return loop.rollout_done(msg, now)

    # --- control requests: each handler returns the Reply's result, or raises ControlError ----------------------
    def _answer(self, handle: Callable[[Any, float], dict[str, Any]], _identity: bytes, req: ControlRequest,
                now: float) -> Reply:
        try:
            return Reply(req_id=req.req_id, ok=True, result=handle(req, now))
        except ControlError as e:
            return Reply(req_id=req.req_id, ok=False, error=str(e))

    def _ping(self, _req: PingRequest, now: float) -> dict[str, Any]:
        return {"run_id": self.run_id, "pid": os.getpid(), "time": now}

    def _status(self, _req: StatusRequest, _now: float) -> dict[str, Any]:
        return {"run_id": self.run_id, **self.registry.snapshot()}

    def _reassign(self, req: ReassignRequest, now: float) -> dict[str, Any]:
        switch_id = self.registry.pin(req.cell, req.role, now=now)
        self.ledger.flush()  # the caller may look the switch up in the ledger right away
        return {"switch_id": switch_id, "pinned": True}

    def _release(self, req: ReleaseRequest, now: float) -> dict[str, Any]:
        self.registry.release(req.cell, now=now)
        self.ledger.flush()
        return {"pinned": False}

    def _eval(self, req: EvalRequest, now: float) -> dict[str, Any]:
        if self.loop is None:
            raise ControlError("eval needs a run with an engine")
        result = {"eval": self.loop.evaluate(req.version, now), "version": self.loop.version}
        self.ledger.flush()
        return result

    def _shutdown_request(self, _req: ShutdownRequest, _now: float) -> dict[str, Any]:
        self.stop("requested by the CLI")
        return {"stopping": True}

    def _event(self, req: EventRequest, _now: float) -> dict[str, Any]:
        self.ledger.event(req.kind, req.message, severity=Severity.WARNING)
        self.ledger.flush()
        return {"logged": True}

    def _add_cells(self, req: AddCellsRequest, now: float) -> dict[str, Any]:
        result = {"cells": self.registry.add_cells(req.n, now)}
        self.ledger.flush()
        return result

    def _cell_jobs(self, req: CellJobsRequest, now: float) -> dict[str, Any]:
        for cell, job in req.jobs.items():
            self.registry.set_job(cell, job, "PENDING", now)
        self.ledger.flush()
        return {"cells": sorted(req.jobs)}

    # --- loop ---------------------------------------------------------------------------------------------
    def stop(self, reason: str, failed: bool = False) -> None:
        if self._stop_reason is None:
            self._stop_reason, self._failed = reason, failed

    def _on_signal(self, sig: int) -> None:
        if self.registry.cell_jobs and sig == signal.SIGTERM:
            self._suspend = True  # Slurm ends the daemon's job (requeue, preemption, time limit): the run goes on
        self.stop(f"signal {signal.Signals(sig).name}")

    def _blocked(self) -> bool:
        """A full disk stopped a write: the ledger's rows wait in memory, or frames whose payload did not fit."""
        return self.ledger.full is not None or bool(self._deferred)

    def _stalled(self, now: float) -> bool:
        """Whether a full disk holds the daemon: nothing more is handled until what is queued is written and the
        frames it stopped whole are handled (in their order: a run's calls build on each other)."""
        if not self._blocked():
            return False
        self._stalled_since = self._stalled_since or now
        self.disk.full(str(self.ledger.full or "a model call's payload did not fit"), now)
        self.ledger.flush()
        if self.ledger.full is None:
            frames, self._deferred = self._deferred, []
            for i, (identity, frame) in enumerate(frames):
                self.handle_frame(identity, frame)
                if self._deferred:  # full again
                    self._deferred += frames[i + 1:]
                    break
            self._send_held()
        if self._blocked():
            return True
        log.warning("the ledger has room again: handling frames after %.0f s", now - self._stalled_since)
        self._stalled_since = None
        if self.loop is not None:  # frames from several peers waited: a run's report may come before its calls
            self.loop.proxies.hold(now)
        return False

    def _tick(self, now: float) -> None:
        self.disk.tick(now)
        try:
            self.registry.check_heartbeats(now)
            if self.watch is not None:
                self.registry.slurm_states(self.watch.states(), now)
            self.registry.check_switch_timeouts(now)
        except IllegalTransition as e:
            log.error("%s (timer)", e)
            self.ledger.illegal_transition(e)
        if self.loop is not None:
            self._schedule(now)
        wall = self.cfg.run.max_wall_s
        if wall is not None and now - self.created_at > wall:
            self.stop(f"max_wall_s ({wall:g} s) reached")

    def _schedule(self, now: float) -> None:
        try:
            self.loop.schedule(now)
        except IllegalTransition as e:
            log.error("%s (scheduler)", e)
            self.ledger.illegal_transition(e)

    def serve(self) -> None:
        """Run until stop() (signal, control request, wall-clock limit)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: self._on_signal(s))
        # Each model call allocates lists of thousands of ids (decoded, then packed into the trees' arrays): at
        # Python's default thresholds the cyclic collector would run every few calls over everything the daemon
        # holds. Fewer, larger young passes, and what start-up and the ledger's recovery built frozen out of them.
        gc.set_threshold(50_000, 20, 20)
        gc.freeze()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        tick_every = min(0.25, self.cfg.control.heartbeat_interval_s / 2)
        next_tick = time.monotonic()
        beacon = Beacon()  # its supervisor's sign that this loop turns (a SIGSTOPped daemon keeps its pid)
        while self._stop_reason is None:
            beacon.beat()
            if self._stalled(time.time()):
                time.sleep(0.5)  # the disk is full: peers' frames wait in the socket meanwhile
                continue
            wait = max(0.0, next_tick - time.monotonic())
            flush_in = self.ledger.seconds_until_due()
            if flush_in is not None:
                wait = min(wait, flush_in)
            try:
                events = dict(poller.poll(timeout=wait * 1000))
            except zmq.ZMQError as e:  # EINTR on a signal
                if e.errno != zmq.EINTR:
                    raise
                events = {}
            if self.sock in events:
                for _ in range(1000):  # drain what is there, bounded so timers still run
                    try:
                        parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(parts) != 2:
                        log.warning("dropped a message of %d parts", len(parts))
                        self.ledger.event("bad_message", f"a message of {len(parts)} parts (a peer sends one frame)",
                                          severity=Severity.WARNING)
                        continue
                    self.handle_frame(parts[0], parts[1])
                    if self._deferred:
                        break  # the disk is full: the frames after it wait in the socket
                self._send_held()
            if self.loop is not None and events:
                self._schedule(time.time())
            if time.monotonic() >= next_tick:
                self._tick(time.time())
                next_tick = time.monotonic() + tick_every
            if self.ledger.due():
                self.ledger.flush()
        self._shutdown()

    def _shutdown(self) -> None:
        now = time.time()
        if self.watch is not None:
            self.watch.stop()
        if self._suspend:
            log.info("daemon suspended (%s): the agents keep their roles; the run resumes when its job restarts",
                     self._stop_reason)
            self.ledger.event("daemon_suspended", f"daemon's Slurm job ended ({self._stop_reason}): the run stays "
                              "RUNNING and resumes from the ledger when the job is requeued", severity=Severity.WARNING)
            self._close(linger_ms=0)
            return
        log.info("daemon stopping: %s", self._stop_reason)
        for ident in list(self.identities.values()):
            self._send_to(ident, Shutdown(reason=self._stop_reason or ""))
        self.registry.mark_stopped(now)
        end = RunStatus.FAILED if self._failed else RunStatus.STOPPED
        self.ledger.transition(RUN, {"id": self.run_id}, self.run_status, end, f"run {self.run_id}", ended_at=now)
        self.ledger.event("run_stopped", f"daemon stopped: {self._stop_reason}",
                          severity=Severity.ERROR if self._failed else Severity.INFO)
        time.sleep(0.2)  # let the shutdown frames leave before the socket closes
        self._close(linger_ms=500)

    def _close(self, linger_ms: int) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.disk.probe.stop()
        self.ledger.close()
        self.sock.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()


def run_daemon(cfg: RunConfig, run_dir: Path, run_id: str, base_model: Path | None = None,
               cell_jobs: bool = False, eval_only: int | None = None) -> None:
    Daemon(cfg, run_dir, run_id, base_model, cell_jobs=cell_jobs, eval_only=eval_only).serve()
