"""The harness worker (`gyre worker`): takes rollouts from the daemon, runs each (rollout.py), reports it.

Rollouts run in threads; the ZeroMQ socket is used by the main loop only, results come back through a queue. A
RolloutDone is sent again until the daemon acks it (DoneAck, after its ledger flush), so a report sent to a
daemon that dies is not lost.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from gyre_slurm.beacon import Beacon
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.image_runtime import ImageRuntime
from gyre_slurm.harness.netrelay import ProxyBridge
from gyre_slurm.harness.sandbox import Limits, Sandbox
from gyre_slurm.peer import connect_to_daemon, drain
from gyre_slurm.protocol import (
    DoneAck,
    Error,
    NoWork,
    RolloutAssignment,
    RolloutDone,
    Shutdown,
    TakeRollout,
    WireMessage,
    WorkerHello,
    encode,
)
from gyre_slurm.rundir import read_control
from gyre_slurm.worker.rollout import Clock, execute_rollout, infra_error

log = logging.getLogger("gyre.worker")

ASK_TIMEOUT_S = 10.0  # no answer to a TakeRollout in this long (lost, daemon restarting): ask again
ASSIGN_SETTLE_S = 0.05  # after an assignment: let the rest of the daemon's burst land before asking again
ERROR_BACKOFF_S = 1.0  # after the daemon answered a TakeRollout with an Error
RESEND_AFTER_S = 5.0  # a RolloutDone without its DoneAck is sent again after this
STOP_GRACE_S = 15.0  # on shutdown: time to kill harnesses and send the last RolloutDone frames
HELLO_S = 2.0  # a WorkerHello this often: the daemon tells a worker silent past three missed (coordinator/proxies.py)


class HarnessWorker:
    def __init__(self, run_dir: Path, worker_id: str, concurrency: int, *, eval_retries: int = 1,
                 connect_wait_s: float = 120.0, sandbox: Sandbox | None = None, limits: Limits | None = None,
                 images: ImageRuntime | None = None, images_why: str = "no image runtime") -> None:
        if concurrency < 1:
            raise GyreError(f"--concurrency must be at least 1, got {concurrency}")
        self.run_dir = Path(run_dir)
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.eval_retries = eval_retries
        self.sandbox, self.limits = sandbox, limits
        self.images, self.images_why = images, images_why
        self._proxy_url: str | None = None  # the latest assignment's: where the bridge sends sandboxed harnesses
        # image runs always have a network of their own, whose one way out is this bridge
        own_net = images is not None or (sandbox is not None and sandbox.own_network)
        self.bridge = ProxyBridge(lambda: self._proxy_url) if own_net else None
        self._told_sandbox = False  # the first TakeRollout says how harnesses run here (the daemon logs it)
        self.started_at = time.time()  # every TakeRollout says it: runs given to an earlier process of ours are over
        info = read_control(self.run_dir, wait_s=connect_wait_s)
        self.token = info.token
        self._running: dict[int, threading.Event] = {}  # rollout id → its cancel event
        self._results: queue.Queue[RolloutDone] = queue.Queue()
        self._outbox: deque[RolloutDone] = deque()  # finished, not yet handed to the socket
        # sent, not yet acked (DoneAck): sent again until the daemon has it in its ledger (it may have died)
        self._unacked: dict[int, tuple[RolloutDone, float]] = {}
        self._asked_at: float | None = None  # a TakeRollout waits for its answer
        self._next_ask = 0.0
        self._stop: str | None = None
        # linger: the last RolloutDone frames still go out on close; immediate: a TakeRollout delivered late would
        # fetch work we no longer want, and an unsent RolloutDone stays in our outbox until a connection takes it
        self.sock = connect_to_daemon(info, f"worker:{worker_id}", linger_ms=2000)
        self._handlers: dict[type[WireMessage], Callable[[Any, float], None]] = {
            RolloutAssignment: self._on_assignment, DoneAck: self._on_done_ack, NoWork: self._on_no_work,
            Shutdown: self._on_shutdown, Error: self._on_error,
        }

    @property
    def free_slots(self) -> int:
        return self.concurrency - len(self._running)

    def stop(self, reason: str) -> None:
        if self._stop is None:
            self._stop = reason

    def _send(self, msg: WireMessage) -> bool:
        try:
            self.sock.send(encode(msg, self.token), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    # --- taking work ------------------------------------------------------------------------------------------
    def _maybe_ask(self, now: float) -> None:
        if self._asked_at is not None and now - self._asked_at > ASK_TIMEOUT_S:
            log.warning("no answer to TakeRollout in %.0f s: asking again", ASK_TIMEOUT_S)
            self._asked_at = None
        if self._asked_at is not None or self.free_slots <= 0 or now < self._next_ask:
            return
        told = None if self._told_sandbox or self.sandbox is None else self.sandbox.why
        if told is not None:
            told += f"; {self.images.why if self.images is not None else 'no image runtime: ' + self.images_why}"
        if self._send(TakeRollout(worker_id=self.worker_id, free_slots=self.free_slots, sandbox=told,
                                  worker_started_at=self.started_at)):
            self._asked_at, self._told_sandbox = now, True
        else:
            self._next_ask = now + 0.2  # daemon not connected (yet)

    def _on_message(self, msg: WireMessage) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from the daemon ignored", type(msg).__name__)
        else:
            handler(msg, time.monotonic())

    def _on_assignment(self, msg: RolloutAssignment, now: float) -> None:
        # the daemon answers a TakeRollout with up to free_slots assignments or one NoWork: the first one
        # answers the request, the rest of the burst is read before free slots are counted again
        self._asked_at, self._next_ask = None, now + ASSIGN_SETTLE_S
        self._start(msg)

    def _on_done_ack(self, msg: DoneAck, _now: float) -> None:
        self._unacked.pop(msg.rollout_id, None)

    def _on_no_work(self, msg: NoWork, now: float) -> None:
        self._asked_at, self._next_ask = None, now + msg.retry_after_s

    def _on_shutdown(self, msg: Shutdown, _now: float) -> None:
        self.stop(f"daemon shutdown: {msg.reason}")

    def _on_error(self, msg: Error, now: float) -> None:
        log.warning("daemon error: %s: %s", msg.code, msg.message)
        if self._asked_at is not None:
            self._asked_at, self._next_ask = None, now + ERROR_BACKOFF_S

    def _start(self, a: RolloutAssignment) -> None:
        if a.rollout_id in self._running:
            log.warning("rollout %d is already running here: repeated assignment ignored", a.rollout_id)
            return
        if self._stop is not None:  # arrived after we stopped: hand it straight back
            clock = Clock(time.time(), time.monotonic())
            self._outbox.append(infra_error(a, self.worker_id, clock, f"worker stopping ({self._stop}): not started"))
            return
        cancel = threading.Event()
        self._running[a.rollout_id] = cancel
        self._proxy_url = a.base_url
        log.info("rollout %d: task %s in %s", a.rollout_id, a.task.get("id"), a.workspace)
        threading.Thread(target=self._rollout_thread, args=(a, cancel), name=f"rollout-{a.rollout_id}",
                         daemon=True).start()

    def _rollout_thread(self, a: RolloutAssignment, cancel: threading.Event) -> None:
        clock = Clock(time.time(), time.monotonic())
        try:
            done = execute_rollout(a, self.worker_id, cancel, self.eval_retries, self.run_dir.parent,
                                   sandbox=self.sandbox, limits=self.limits,
                                   proxy_socket=self.bridge.path if self.bridge else None,
                                   images=self.images, images_why=self.images_why)
        except BaseException as e:  # one rollout's bug must neither kill the worker nor leave the rollout open
            log.exception("rollout %d failed inside the worker", a.rollout_id)
            done = infra_error(a, self.worker_id, clock, f"worker error: {type(e).__name__}: {e}")
        self._results.put(done)

    # --- reporting --------------------------------------------------------------------------------------------
    def _collect(self) -> None:
        while True:
            try:
                done = self._results.get_nowait()
            except queue.Empty:
                return
            self._running.pop(done.rollout_id, None)
            log.info("rollout %d: %s reward=%s", done.rollout_id, done.status, done.reward)
            self._outbox.append(done)

    def _flush(self, now: float) -> None:
        while self._outbox and self._send(self._outbox[0]):
            done = self._outbox.popleft()
            self._unacked[done.rollout_id] = (done, now)
        for rid, (done, sent_at) in list(self._unacked.items()):
            if now - sent_at > RESEND_AFTER_S and self._send(done):
                self._unacked[rid] = (done, now)

    def _receive(self) -> None:
        drain(self.sock, self.token, self._on_message, log)

    # --- loop -------------------------------------------------------------------------------------------------
    def serve(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda s, _f: self.stop(f"signal {signal.Signals(s).name}"))
        log.info("worker %s: %d slots", self.worker_id, self.concurrency)
        stop_deadline: float | None = None
        beacon = Beacon()  # its supervisor's sign that this loop turns
        next_hello = 0.0
        while True:
            beacon.beat()
            now = time.monotonic()
            if now >= next_hello:  # lost while the daemon is away: the next one goes 2 s later
                self._send(WorkerHello(worker_id=self.worker_id, running=len(self._running)))
                next_hello = now + HELLO_S
            self._collect()
            self._flush(now)
            if self._stop is not None:
                if stop_deadline is None:
                    log.info("worker stopping: %s; killing %d running harnesses", self._stop, len(self._running))
                    for cancel in self._running.values():
                        cancel.set()
                    stop_deadline = now + STOP_GRACE_S
                if (not self._running and not self._outbox and not self._unacked) or now > stop_deadline:
                    break
            else:
                self._maybe_ask(now)
            if self.sock.poll(timeout=50):
                self._receive()
        if self._outbox or self._running or self._unacked:
            log.warning("exiting with rollouts unreported: %s",
                        sorted({d.rollout_id for d in self._outbox} | set(self._running) | set(self._unacked)))
        self.sock.close()
        if self.bridge is not None:
            self.bridge.close()


def run_worker(run_dir: Path, worker_id: str, concurrency: int, eval_retries: int = 1,
               sandbox: Sandbox | None = None, limits: Limits | None = None,
               images: ImageRuntime | None = None, images_why: str = "no image runtime") -> None:
    if sandbox is not None:
        (log.info if sandbox.kind != "none" else log.warning)("%s", sandbox.why)
    log.info("%s", images.why if images is not None else f"no image runtime: {images_why}")
    HarnessWorker(run_dir, worker_id, concurrency, eval_retries=eval_retries, sandbox=sandbox, limits=limits,
                  images=images, images_why=images_why).serve()
