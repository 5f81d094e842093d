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
from pathlib import Path

import zmq

from gyre_slurm.config import RunConfig, dump_config
from gyre_slurm.coordinator.cells import CellRegistry
from gyre_slurm.coordinator.loop import RLLoop
from gyre_slurm.errors import ControlError, GyreError, IllegalTransition, ProtocolError
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.peer import new_curve_keys, serve_curve, start_authenticator
from gyre_slurm.protocol import (
    MAX_FRAME_BYTES,
    CallAck,
    CallRecord,
    ContextLimit,
    Error,
    Heartbeat,
    Message,
    MicrobatchDone,
    MicrobatchFailed,
    ProxyHello,
    Register,
    Reply,
    Request,
    RolloutDone,
    RouteQuery,
    Shutdown,
    StepOpen,
    SwitchDone,
    TakeMicrobatch,
    TakeRollout,
    TrainDone,
    WeightsReceived,
    WireMessage,
    decode,
    encode,
    error_code,
)
from gyre_slurm.roles import TARGET_ROLES, Role
from gyre_slurm.rundir import ControlInfo, ledger_path, new_token, read_control, write_control
from gyre_slurm.slurm_jobs import JobWatch
from gyre_slurm.statuses import RUN, RunStatus

log = logging.getLogger("gyre.daemon")
LAUNCHER_EVENTS = ("process_restarted",)  # what a launcher may write to the ledger through the `event` request
# the RL loop's peers: workers, proxies, and training jobs (each on its own socket "train:<node>", answered by identity)
RL_MESSAGES = (TakeRollout, RolloutDone, ProxyHello, RouteQuery, CallRecord, TrainDone, ContextLimit, StepOpen,
               TakeMicrobatch, MicrobatchDone, MicrobatchFailed)


class Daemon:
    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str, base_model: Path | None = None,
                 cell_jobs: bool = False, eval_only: int | None = None) -> None:
        self.cfg = cfg
        self.eval_only = eval_only  # `gyre eval` after the run: evaluate this version of the resumed run, then stop
        self.tracker = None  # tracking/tracker.py's Tracker when tracking.backends names any
        # cell_jobs (gyre submit): every cell is a Slurm job of its own, and SIGTERM (a requeue, a time limit)
        # suspends the daemon — agents keep running, the run stays RUNNING and resumes when the job restarts
        self.base_model = base_model  # version 0 of a new run: a ready checkpoint (the daemon never builds one)
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.ledger = LedgerWriter(ledger_path(self.run_dir), cfg.ledger.flush_interval_s, cfg.ledger.max_batch_rows)
        self.registry = CellRegistry(cfg, self.ledger, self._send, weights=lambda: self.loop.weights() if self.loop
                                     else None, cell_jobs=cell_jobs)
        self.watch: JobWatch | None = None
        self._suspend = False
        self.loop: RLLoop | None = None
        self.identities: dict[int, bytes] = {}
        self._acks: list[tuple[bytes, CallAck]] = []  # sent after the next commit (_send_acks)
        self._stop_reason: str | None = None
        self._failed = False  # the run ends FAILED, not STOPPED
        self.run_status = RunStatus.RUNNING  # or DEGRADED (as the ledger has it)
        self.resumed = False
        self.created_at = time.time()

    # --- start-up -----------------------------------------------------------------------------------------
    def _open_run(self, now: float) -> None:
        row = self.ledger.rows("SELECT created_at, daemon_starts, status FROM runs WHERE id = :id", id=self.run_id)
        job = os.environ.get("SLURM_JOB_ID")
        if row:
            self.resumed = True
            self.created_at = row[0]["created_at"]
            self.ledger.transition(RUN, {"id": self.run_id}, RunStatus(row[0]["status"]), RunStatus.RUNNING,
                                   f"run {self.run_id}", ended_at=None, daemon_starts=row[0]["daemon_starts"] + 1,
                                   degraded_reason=None,
                                   **({"slurm_job_id": job} if job else {}))  # the job it runs in now
            self.registry.recover(now)
            self.loop = self._make_loop()
            if self.loop:
                self.loop.recover()
                if row[0]["status"] in (RunStatus.STOPPED.value, RunStatus.FAILED.value) or self._was_suspended():
                    self._abandon_running(now)
            starts = row[0]["daemon_starts"] + 1
            self.ledger.event("daemon_restarted", f"daemon resumed from its ledger (start #{starts})",
                              severity="warning")
        else:  # its config.yaml is saved already, by whatever started it (run_context.RunContext.create)
            self.ledger.transition(RUN, {"id": self.run_id}, None, RunStatus.RUNNING, f"run {self.run_id}",
                                   name=self.cfg.run.name, policy=self.cfg.scheduler.policy,
                                   config=dump_config(self.cfg), created_at=now, ended_at=None, daemon_starts=1,
                                   slurm_job_id=job)
            self.registry.create(now)
            self.loop = self._make_loop()
            if self.loop:
                self.loop.create(now)
            self.ledger.event("run_started", f"run {self.run_id} started ({self.cfg.cluster.cells} cells)")
        self.ledger.flush()

    def _was_suspended(self) -> bool:
        last = self.ledger.scalar("SELECT kind FROM events WHERE kind IN ('daemon_suspended', 'daemon_restarted', "
                                  "'run_started') ORDER BY id DESC LIMIT 1")
        return last == "daemon_suspended"

    def _abandon_running(self, now: float) -> None:
        """The last daemon stopped cleanly or was suspended with its job, and the workers with it: the runs it left
        RUNNING will never report. (After a kill -9 they wait: their workers may still be alive.)"""
        n = self.loop.book.abandon_running("the run stopped while it ran; its worker stopped with it", now)
        if n:
            self.ledger.event("runs_abandoned", f"{n} runs were in flight when the run stopped: INFRA_ERROR, "
                              "excluded from their groups", severity="warning", data={"runs": n})

    def _make_loop(self) -> RLLoop | None:
        if self.cfg.cluster.engine == "none":
            return None  # control plane only: cells hold no engine or trainer
        loop = RLLoop(self.cfg, self.ledger, self.registry, self.run_dir, self.token, self._send, self.stop,
                      self.base_model, eval_only=self.eval_only)
        loop.on_health = self._health
        if self.cfg.tracking.backends:  # off: nothing imported, nothing read
            from gyre_slurm.tracking.tracker import Tracker

            tracker = self.tracker = Tracker.start(self.cfg.tracking, self.run_dir, self.run_id, dump_config(self.cfg),
                                                   warn=self._tracking_failed)
            # the tracker reads the step or evaluation back from the ledger: committed first
            loop.on_step_done = lambda step: (self.ledger.flush(), tracker.step_done(step))
            loop.evals.on_done = lambda eval_id: (self.ledger.flush(), tracker.eval_done(eval_id))
        return loop

    def _tracking_failed(self, line: str) -> None:
        """A tracker that failed is one warning and is off from then on; the run goes on (gyre export replays)."""
        log.warning("%s", line)
        self.ledger.event("tracking_failed", line, severity="warning")

    def _health(self, reason: str | None) -> None:
        """RUNNING ↔ DEGRADED as the run's health says (scheduler/health.py), with the reason in runs and events."""
        new = RunStatus.DEGRADED if reason else RunStatus.RUNNING
        if new == self.run_status:  # degraded still, for another reason
            self.ledger.update("runs", {"id": self.run_id}, degraded_reason=reason)
        else:
            self.ledger.transition(RUN, {"id": self.run_id}, self.run_status, new, f"run {self.run_id}",
                                   degraded_reason=reason)
        self.run_status = new
        if reason:
            log.error("run DEGRADED: %s; admitting only a probe group every %g s", reason,
                      self.cfg.run.degraded_probe_s)
            self.ledger.event("run_degraded", f"DEGRADED: {reason}; only a probe group every "
                              f"{self.cfg.run.degraded_probe_s:g} s until a good outcome", severity="error")
        else:
            log.info("run healthy again: admitting work")
            self.ledger.event("run_recovered", "the probe came back good: the run admits work again")

    def _bind(self) -> None:
        previous = self.previous
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.auth = None
        if self.curve:  # control.encrypt: every frame encrypted, and only the run's client key gets in
            self.auth = start_authenticator(self.ctx, self.curve)
            serve_curve(self.sock, self.curve)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises instead of vanishing
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted agent may reuse its identity
        self.sock.setsockopt(zmq.LINGER, 0)
        host = self.cfg.control.bind_host
        port = previous.port if previous else self.cfg.control.port
        if port and not self._try_bind(host, port):
            if self.cfg.control.port:  # a port the config names is the user's: never quietly another one
                raise GyreError(f"control.port {port} on {host} is in use")
            port = 0  # the old one is taken (a requeued job on another node): peers read the new one from control.json
        if not port:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        endpoint = f"tcp://{self.cfg.control.advertised()}:{port}"
        write_control(self.run_dir, ControlInfo(endpoint=endpoint, port=port, token=self.token, daemon_pid=os.getpid(),
                                                daemon_host=socket.gethostname(), started_at=time.time(),
                                                slurm_job_id=os.environ.get("SLURM_JOB_ID"), curve=self.curve))
        log.info("daemon of run %s listening on %s (%s)", self.run_id, endpoint, "resumed" if self.resumed else "new")

    def _try_bind(self, host: str, port: int) -> bool:
        try:
            self.sock.bind(f"tcp://{host}:{port}")
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            return False

    def start(self) -> None:
        try:
            self.previous = read_control(self.run_dir)
        except GyreError:
            self.previous = None
        self.token = self.previous.token if self.previous else new_token()
        # keys kept across restarts like the token (peers hold them); none when control.encrypt is off
        self.curve = ((self.previous.curve if self.previous and self.previous.curve else new_curve_keys())
                      if self.cfg.control.encrypt else None)
        self._open_run(time.time())
        self._bind()
        if self.registry.cell_jobs:
            cells = self.registry.cells
            self.watch = JobWatch(lambda: [c.slurm_job_id for c in list(cells.values()) if c.slurm_job_id],
                                  poll_s=self.cfg.slurm.poll_s).start()

    # --- sending ------------------------------------------------------------------------------------------
    def _send_to(self, identity: bytes, msg: WireMessage) -> None:
        if isinstance(msg, CallAck):  # acked once committed: a proxy forgets what it sees acked (_send_acks)
            self._acks.append((identity, msg))
            return
        self._send_now(identity, msg)

    def _send_acks(self) -> None:
        """The CallAcks of the frames just handled, after one commit of what they recorded: a call acked is a call
        in the ledger, whatever kills the daemon next."""
        if self._acks:
            self.ledger.flush()
            acks, self._acks = self._acks, []
            for identity, ack in acks:
                self._send_now(identity, ack)

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
            self.ledger.event("bad_message", f"from peer {identity[:32]!r}: {e}", severity="warning")
            self._send_to(identity, Error(code=error_code(e), message=str(e)))
            return
        try:
            self._dispatch(identity, msg, now)
        except ControlError as e:
            self._send_to(identity, Error(code="refused", message=str(e)))
        except IllegalTransition as e:  # a bug or a peer out of step: logged, never written, the daemon goes on
            log.error("%s (from %s)", e, msg.type)
            self.ledger.illegal_transition(e)
            self._send_to(identity, Error(code="illegal_transition", message=str(e)))

    def _dispatch(self, identity: bytes, msg: Message, now: float) -> None:
        if isinstance(msg, Register):
            self.identities[msg.node_index] = identity
            self._send_to(identity, self.registry.register(msg, now))
            if msg.role is None and self.loop is not None:  # a new agent process, not one that lost touch
                self.loop.core_restarted(msg.node_index, now)
        elif isinstance(msg, Heartbeat):
            answer = self.registry.heartbeat(msg, now)
            if answer is not None:
                self._send_to(identity, answer)
        elif isinstance(msg, SwitchDone):
            self.registry.switch_done(msg.node_index, msg.report, now)
        elif isinstance(msg, WeightsReceived):
            if self.loop is not None:
                self.loop.weights_received(msg, now)
        elif isinstance(msg, Request):
            self._send_to(identity, self.handle_request(msg, now))
        elif self.loop is not None and isinstance(msg, RL_MESSAGES):
            for answer in self._handle_rl(msg, now):
                self._send_to(identity, answer)
        else:
            self._send_to(identity, Error(code="unexpected", message=f"a daemon does not accept '{msg.type}'"))

    def _handle_rl(self, msg: WireMessage, now: float) -> list[WireMessage]:
        loop = self.loop
        assert loop is not None
        if isinstance(msg, TakeRollout):
            return loop.take(msg, now)
        if isinstance(msg, RolloutDone):
            if loop.done_waits(msg.rollout_id, now):
                return []  # unacked: its worker sends it again once the run's calls are in
            return [loop.rollout_done(msg, now)]
        elif isinstance(msg, ProxyHello):
            loop.proxy_hello(msg, now)
        elif isinstance(msg, RouteQuery):
            return [loop.route(msg)]
        elif isinstance(msg, CallRecord):
            return [loop.call(msg, now)]
        elif isinstance(msg, TrainDone):
            loop.train_done(msg, now)
        elif isinstance(msg, StepOpen):
            loop.step_open(msg)
        elif isinstance(msg, TakeMicrobatch):
            return [loop.take_microbatch(msg, now)]
        elif isinstance(msg, MicrobatchDone):
            loop.microbatch_done(msg, now)
        elif isinstance(msg, MicrobatchFailed):
            loop.microbatch_failed(msg)
        elif isinstance(msg, ContextLimit):
            loop.book.context_limit(msg, now)
        return []

    def handle_request(self, req: Request, now: float) -> Reply:
        try:
            if req.op == "ping":
                result = {"run_id": self.run_id, "pid": os.getpid(), "time": now}
            elif req.op == "status":
                result = {"run_id": self.run_id, **self.registry.snapshot()}
            elif req.op == "reassign":
                cell, role = _cell_arg(req), req.args.get("role")
                try:
                    target = Role(str(role).upper())
                except ValueError:
                    raise ControlError(f"unknown role {role!r}: use rollout or train") from None
                if target not in TARGET_ROLES:
                    raise ControlError(f"a cell can be reassigned to ROLLOUT or TRAIN, not {target.value}")
                switch_id = self.registry.pin(cell, target, now=now)
                self.ledger.flush()  # the caller may look the switch up in the ledger right away
                result = {"switch_id": switch_id, "pinned": True}
            elif req.op == "release":
                self.registry.release(_cell_arg(req), now=now)
                self.ledger.flush()
                result = {"pinned": False}
            elif req.op == "eval":
                version = req.args.get("version")
                if self.loop is None or (version is not None and (not isinstance(version, int)
                                                                  or isinstance(version, bool))):
                    raise ControlError("eval needs a run with an engine and an integer 'version' (or none)")
                result = {"eval": self.loop.evaluate(version, now), "version": self.loop.version}
                self.ledger.flush()
            elif req.op == "shutdown":
                self.stop("requested by the CLI")
                result = {"stopping": True}
            elif req.op == "event":  # a launcher's word for the ledger (the daemon is its one writer)
                kind, message = req.args.get("kind"), req.args.get("message")
                if kind not in LAUNCHER_EVENTS or not isinstance(message, str) or not 0 < len(message) <= 1000:
                    raise ControlError(f"event needs 'kind' (one of {', '.join(LAUNCHER_EVENTS)}) and a 'message' "
                                       "of 1-1000 characters")
                self.ledger.event(kind, message, severity="warning")
                self.ledger.flush()
                result = {"logged": True}
            elif req.op == "add_cells":
                n = req.args.get("n")
                if not isinstance(n, int) or isinstance(n, bool):
                    raise ControlError("add_cells needs an integer 'n'")
                result = {"cells": self.registry.add_cells(n, now)}
                self.ledger.flush()
            elif req.op == "cell_jobs":
                jobs = req.args.get("jobs")
                if not isinstance(jobs, dict) or not all(str(c).isdigit() and isinstance(j, str) and j.isdigit()
                                                         for c, j in jobs.items()):
                    raise ControlError("cell_jobs needs 'jobs': {cell: Slurm job id}")
                for cell, job in jobs.items():
                    self.registry.set_job(int(cell), job, "PENDING", now)
                self.ledger.flush()
                result = {"cells": sorted(int(c) for c in jobs)}
            else:  # unreachable: op is validated by the protocol
                raise ControlError(f"unknown op {req.op}")
            return Reply(req_id=req.req_id, ok=True, result=result)
        except ControlError as e:
            return Reply(req_id=req.req_id, ok=False, error=str(e))

    # --- loop ---------------------------------------------------------------------------------------------
    def stop(self, reason: str, failed: bool = False) -> None:
        if self._stop_reason is None:
            self._stop_reason, self._failed = reason, failed

    def _on_signal(self, sig: int) -> None:
        if self.registry.cell_jobs and sig == signal.SIGTERM:
            self._suspend = True  # Slurm ends the daemon's job (requeue, preemption, time limit): the run goes on
        self.stop(f"signal {signal.Signals(sig).name}")

    def _tick(self, now: float) -> None:
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
        while self._stop_reason is None:
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
                        continue
                    self.handle_frame(parts[0], parts[1])
                self._send_acks()
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
                              "RUNNING and resumes from the ledger when the job is requeued", severity="warning")
            self._close(linger_ms=0)
            return
        log.info("daemon stopping: %s", self._stop_reason)
        for ident in list(self.identities.values()):
            self._send_to(ident, Shutdown(reason=self._stop_reason or ""))
        self.registry.mark_stopped(now)
        end = RunStatus.FAILED if self._failed else RunStatus.STOPPED
        self.ledger.transition(RUN, {"id": self.run_id}, self.run_status, end, f"run {self.run_id}", ended_at=now)
        self.ledger.event("run_stopped", f"daemon stopped: {self._stop_reason}",
                          severity="error" if self._failed else "info")
        time.sleep(0.2)  # let the shutdown frames leave before the socket closes
        self._close(linger_ms=500)

    def _close(self, linger_ms: int) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.ledger.close()
        self.sock.close(linger=linger_ms)
        if self.auth is not None:
            self.auth.stop()


def _cell_arg(req: Request) -> int:
    cell = req.args.get("cell")
    if not isinstance(cell, int) or isinstance(cell, bool):
        raise ControlError(f"{req.op} needs an integer 'cell'")
    return cell


def run_daemon(cfg: RunConfig, run_dir: Path, run_id: str, base_model: Path | None = None,
               cell_jobs: bool = False, eval_only: int | None = None) -> None:
    d = Daemon(cfg, run_dir, run_id, base_model, cell_jobs=cell_jobs, eval_only=eval_only)
    d.start()
    d.serve()
