"""The harness worker: takes rollouts from the daemon, runs the harness on each, scores the workspace.

One rollout = lay the task out in its workspace, run the harness command (any OpenAI-speaking program; it
gets the proxy's base URL and the rollout's key) under a wall-clock limit, then ALWAYS run the evaluator on
what the workspace holds (finished or timed out: partial scoring, ALGORITHMS.md §4.2), then report
RolloutDone. Rollouts run in threads; the ZeroMQ socket is used by the main loop only, results come back
through a queue. Run it as `python -m gyre_slurm.harness.worker RUN_DIR --worker-id ID --concurrency N`.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq
from pydantic import ValidationError

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.runner import HarnessError, HarnessResult, describe_exit, log_tail, run_harness
from gyre_slurm.harness.tasks import GYRE_DIR, TaskSpec, substitute
from gyre_slurm.harness.workspace import lay_out
from gyre_slurm.peer import connect_to_daemon, drain
from gyre_slurm.protocol import (
    DoneAck,
    Error,
    NoWork,
    RolloutAssignment,
    RolloutDone,
    RolloutStatus,
    Shutdown,
    TakeRollout,
    _Msg,
    encode,
)
from gyre_slurm.rundir import read_control
from gyre_slurm.scoring.evaluator import EvalResult, run_evaluator

log = logging.getLogger("gyre.worker")

HARNESS_LOG = "harness.log"
EVAL_LOG = "eval.log"
ASK_TIMEOUT_S = 10.0  # no answer to a TakeRollout in this long (lost, daemon restarting): ask again
ASSIGN_SETTLE_S = 0.05  # after an assignment: let the rest of the daemon's burst land before asking again
ERROR_BACKOFF_S = 1.0  # after the daemon answered a TakeRollout with an Error
RESEND_AFTER_S = 5.0  # a RolloutDone without its DoneAck is sent again after this
STOP_GRACE_S = 15.0  # on shutdown: time to kill harnesses and send the last RolloutDone frames
MAX_ERROR_CHARS = 2000


def classify(h: HarnessResult, ev: EvalResult, harness_log: str) -> tuple[RolloutStatus, float | None, str | None]:
    """(status, reward, error) of a rollout whose harness ran to an exit or a timeout and was then scored."""
    if not h.timed_out and h.exit_code != 0:
        # the harness broke (proxy refused it, crash): not the policy's doing, so excluded; the score is kept
        # in the text because it tells whether the agent had got anywhere
        scored = f"evaluator score {ev.score:g}" if ev.error is None else ev.error
        tail = harness_log or "(empty)"
        error = f"harness {describe_exit(h.exit_code)} ({scored}); last lines of {GYRE_DIR}/{HARNESS_LOG}:\n{tail}"
        return "INFRA_ERROR", None, error[:MAX_ERROR_CHARS]
    if ev.error is not None:
        return "EVAL_ERROR", None, ev.error[:MAX_ERROR_CHARS]
    return ("TIMEOUT_SCORED" if h.timed_out else "COMPLETED"), ev.score, None


@dataclass
class _Clock:
    started_at: float  # wall clock, for the ledger
    t0: float  # monotonic

    def since(self) -> float:
        return time.monotonic() - self.t0


def _infra(a: RolloutAssignment, worker_id: str, clock: _Clock, error: str, h: HarnessResult | None = None,
           eval_s: float = 0.0) -> RolloutDone:
    return RolloutDone(rollout_id=a.rollout_id, worker_id=worker_id, status="INFRA_ERROR", reward=None,
                       harness_exit=h.exit_code if h else None, timed_out=h.timed_out if h else False,
                       error=error[:MAX_ERROR_CHARS], started_at=clock.started_at,
                       harness_s=h.duration_s if h else clock.since(), eval_s=eval_s)


def execute_rollout(a: RolloutAssignment, worker_id: str, cancel: threading.Event | None = None,
                    eval_retries: int = 1) -> RolloutDone:
    """Run one rollout from start to report. Failures of the worker's own steps become INFRA_ERROR."""
    clock = _Clock(time.time(), time.monotonic())
    try:
        task = TaskSpec.model_validate(a.task)
    except ValidationError as e:
        first = e.errors()[0]
        return _infra(a, worker_id, clock, f"bad task in the assignment: {'.'.join(map(str, first['loc']))}: "
                                           f"{first['msg']}")
    ws = Path(a.workspace).resolve()
    try:
        lay_out(task, ws)
    except (GyreError, OSError) as e:
        return _infra(a, worker_id, clock, f"workspace: {e}")
    env = {"OPENAI_BASE_URL": a.base_url, "OPENAI_API_KEY": a.api_key, "GYRE_WORKSPACE": str(ws),
           "GYRE_ROLLOUT_ID": str(a.rollout_id)}
    harness_log = ws / GYRE_DIR / HARNESS_LOG
    if cancel is not None and cancel.is_set():  # stopped while the workspace was being laid out
        return _infra(a, worker_id, clock, "harness not started: the worker is shutting down")
    try:
        h = run_harness(substitute(a.harness, ws), ws, env, task.timeout_s or a.timeout_s, harness_log,
                        cancel=cancel)
    except HarnessError as e:
        return _infra(a, worker_id, clock, f"harness: {e}")
    if h.cancelled:
        return _infra(a, worker_id, clock, "harness killed: the worker is shutting down", h)
    ev = run_evaluator(task, ws, retries=eval_retries, cancel=cancel)
    (ws / GYRE_DIR / EVAL_LOG).write_text(f"attempts: {ev.attempts}\nscore: {ev.score}\nerror: {ev.error}\n"
                                          f"{ev.output}")
    if ev.cancelled:
        return _infra(a, worker_id, clock, "evaluator killed: the worker is shutting down", h, ev.duration_s)
    status, reward, error = classify(h, ev, log_tail(harness_log))
    return RolloutDone(rollout_id=a.rollout_id, worker_id=worker_id, status=status, reward=reward,
                       harness_exit=h.exit_code, timed_out=h.timed_out, error=error, started_at=clock.started_at,
                       harness_s=h.duration_s, eval_s=ev.duration_s, score=ev.score if ev.error is None else None)


class HarnessWorker:
    def __init__(self, run_dir: Path, worker_id: str, concurrency: int, *, eval_retries: int = 1,
                 connect_wait_s: float = 120.0) -> None:
        if concurrency < 1:
            raise GyreError(f"--concurrency must be at least 1, got {concurrency}")
        self.run_dir = Path(run_dir)
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.eval_retries = eval_retries
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
        self.sock = connect_to_daemon(info.endpoint, f"worker:{worker_id}", linger_ms=2000)

    @property
    def free_slots(self) -> int:
        return self.concurrency - len(self._running)

    def stop(self, reason: str) -> None:
        if self._stop is None:
            self._stop = reason

    def _send(self, msg: _Msg) -> bool:
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
        if self._send(TakeRollout(worker_id=self.worker_id, free_slots=self.free_slots)):
            self._asked_at = now
        else:
            self._next_ask = now + 0.2  # daemon not connected (yet)

    def _on_message(self, msg: _Msg) -> None:
        now = time.monotonic()
        if isinstance(msg, RolloutAssignment):
            # the daemon answers a TakeRollout with up to free_slots assignments or one NoWork: the first one
            # answers the request, the rest of the burst is read before free slots are counted again
            self._asked_at, self._next_ask = None, now + ASSIGN_SETTLE_S
            self._start(msg)
        elif isinstance(msg, DoneAck):
            self._unacked.pop(msg.rollout_id, None)
        elif isinstance(msg, NoWork):
            self._asked_at, self._next_ask = None, now + msg.retry_after_s
        elif isinstance(msg, Shutdown):
            self.stop(f"daemon shutdown: {msg.reason}")
        elif isinstance(msg, Error):
            log.warning("daemon error: %s: %s", msg.code, msg.message)
            if self._asked_at is not None:
                self._asked_at, self._next_ask = None, now + ERROR_BACKOFF_S
        else:
            log.warning("unexpected %s from the daemon ignored", type(msg).__name__)

    def _start(self, a: RolloutAssignment) -> None:
        if a.rollout_id in self._running:
            log.warning("rollout %d is already running here: repeated assignment ignored", a.rollout_id)
            return
        if self._stop is not None:  # arrived after we stopped: hand it straight back
            clock = _Clock(time.time(), time.monotonic())
            self._outbox.append(_infra(a, self.worker_id, clock, f"worker stopping ({self._stop}): not started"))
            return
        cancel = threading.Event()
        self._running[a.rollout_id] = cancel
        log.info("rollout %d: task %s in %s", a.rollout_id, a.task.get("id"), a.workspace)
        threading.Thread(target=self._rollout_thread, args=(a, cancel), name=f"rollout-{a.rollout_id}",
                         daemon=True).start()

    def _rollout_thread(self, a: RolloutAssignment, cancel: threading.Event) -> None:
        clock = _Clock(time.time(), time.monotonic())
        try:
            done = execute_rollout(a, self.worker_id, cancel, self.eval_retries)
        except BaseException as e:  # one rollout's bug must neither kill the worker nor leave the rollout open
            log.exception("rollout %d failed inside the worker", a.rollout_id)
            done = _infra(a, self.worker_id, clock, f"worker error: {type(e).__name__}: {e}")
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
        while True:
            now = time.monotonic()
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


def run_worker(run_dir: Path, worker_id: str, concurrency: int, eval_retries: int = 1) -> None:
    HarnessWorker(run_dir, worker_id, concurrency, eval_retries=eval_retries).serve()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre_slurm.harness.worker", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="the run folder (state/<run>), which holds control.json")
    ap.add_argument("--worker-id", default=f"{socket.gethostname()}-{os.getpid()}")
    ap.add_argument("--concurrency", type=int, default=1, help="rollouts run at the same time")
    ap.add_argument("--eval-retries", type=int, default=1, help="re-evaluations of an evaluator error")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_worker(a.run_dir, a.worker_id, a.concurrency, a.eval_retries)
    except GyreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
