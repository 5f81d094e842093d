"""The proxy's link to the daemon: one ZeroMQ DEALER, owned by one background thread.

HTTP handlers never touch the socket. They ask for routes (RouteQuery → Route, cached per rollout) through
futures and hand call records over through a queue; the thread sends, receives, says ProxyHello every
`hello_interval_s`, re-asks unanswered route queries, and re-sends journaled records the daemon has not acked.
Like the node agent, the socket uses IMMEDIATE: nothing is queued for a daemon that is not connected; what
matters is in the journal and goes out again once it is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import zmq

from gyre_slurm.peer import connect_to_daemon, dispatcher, drain
from gyre_slurm.protocol import (
    MAX_FRAME_BYTES,
    CallAck,
    CallRecord,
    Error,
    ProxyHello,
    Route,
    RouteQuery,
    WireMessage,
    encode,
)
from gyre_slurm.proxy.journal import Journal
from gyre_slurm.rundir import read_control

log = logging.getLogger("gyre.proxy.link")


class RouteUnavailable(Exception):
    """The daemon did not answer a route query in time."""


class DaemonLink:
    RESEND_PER_TICK = 32

    def __init__(self, run_dir: Path, proxy_id: str, journal: Journal, *, url: str = "",
                 hello_interval_s: float = 2.0, route_retry_s: float = 1.0, resend_after_s: float = 3.0,
                 connect_wait_s: float = 120.0) -> None:
        self.info = info = read_control(Path(run_dir), wait_s=connect_wait_s)
        self.endpoint, self.token = info.endpoint, info.token
        self.proxy_id, self.url, self.journal = proxy_id, url, journal
        self.hello_interval_s, self.route_retry_s, self.resend_after_s = hello_interval_s, route_retry_s, resend_after_s
        self._lock = threading.Lock()
        self._routes: dict[int, Route] = {}
        self._waiting: dict[int, list[tuple[Future, float]]] = {}  # rollout -> (future, deadline)
        self._asked: dict[int, float] = {}  # rollout -> when its RouteQuery was last sent (0: not yet)
        self._sent: dict[tuple[int, int], float] = {}  # record -> when it was last sent
        self._outbox: queue.SimpleQueue[WireMessage] = queue.SimpleQueue()  # records, then best-effort notices
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="daemon-link", daemon=True)
        self.n_acks = 0
        self._on_closed: Callable[[int], None] = lambda rollout_id: None  # start() says whom to tell
        self._handlers: dict[type[WireMessage], Callable[[Any], None]] = {  # what else the daemon sends is ignored
            Route: self._on_route, CallAck: self._on_ack, Error: self._on_error,
        }
        self._dispatch = dispatcher(self._handlers, log)

    # --- called from any thread ---------------------------------------------------------------------------------
    def start(self, on_closed: Callable[[int], None]) -> None:
        """Run the link's thread; it calls `on_closed(rollout_id)` when it learns that a rollout closed."""
        self._on_closed = on_closed
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        with self._wake_lock:  # never write to a closed descriptor number: the OS may have reused it
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: the thread is awake anyway

    def route(self, rollout_id: int, timeout_s: float = 10.0, refresh: bool = False) -> Future:
        """A future Route for the rollout: cached unless refresh (e.g. its engine failed)."""
        fut: Future = Future()
        with self._lock:
            if refresh:
                self._routes.pop(rollout_id, None)
            cached = self._routes.get(rollout_id)
            if cached is not None:
                fut.set_result(cached)
                return fut
            self._waiting.setdefault(rollout_id, []).append((fut, time.monotonic() + timeout_s))
            self._asked.setdefault(rollout_id, 0.0)
        self._wake()
        return fut

    async def aroute(self, rollout_id: int, timeout_s: float = 10.0, refresh: bool = False) -> Route:
        return await asyncio.wrap_future(self.route(rollout_id, timeout_s, refresh))

    def forget_route(self, rollout_id: int) -> None:
        with self._lock:
            self._routes.pop(rollout_id, None)

    def submit(self, rec: CallRecord, state: dict | None = None) -> None:
        """Journal the record (durable before it leaves), then send it."""
        self.journal.record(rec, state)
        self._outbox.put(rec)
        self._wake()

    def notify(self, msg: WireMessage) -> None:
        """Send a notice (not journaled: lost if the daemon is away)."""
        self._outbox.put(msg)
        self._wake()

    def is_closed(self, rollout_id: int) -> bool:
        return self.journal.is_closed(rollout_id)

    # --- the thread ---------------------------------------------------------------------------------------------
    def _send(self, sock: zmq.Socket, msg: WireMessage) -> bool:
        frame = encode(msg, self.token)
        if len(frame) > MAX_FRAME_BYTES:  # the daemon would drop the connection: keep it in the journal only
            log.error("%s of %d bytes is over the protocol's %d-byte frame limit: not sent (kept in %s)",
                      type(msg).__name__, len(frame), MAX_FRAME_BYTES, self.journal.path)
            return True
        try:
            sock.send(frame, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False  # not connected (IMMEDIATE) or the send queue is full: try again later

    def _on_route(self, msg: Route) -> None:
        with self._lock:
            waiters = self._waiting.pop(msg.rollout_id, [])
            self._asked.pop(msg.rollout_id, None)
            if msg.open:
                self._routes[msg.rollout_id] = msg
            else:
                self._routes.pop(msg.rollout_id, None)
        if not msg.open:
            self.journal.close_rollout(msg.rollout_id)
            self._closed(msg.rollout_id)
        for fut, _ in waiters:
            if not fut.done():
                fut.set_result(msg)

    def _on_ack(self, msg: CallAck) -> None:
        self.n_acks += 1
        self.journal.ack(msg)
        self._sent.pop((msg.rollout_id, msg.call_index), None)
        if not msg.rollout_open:
            self.forget_route(msg.rollout_id)
            self._closed(msg.rollout_id)

    @staticmethod
    def _on_error(msg: Error) -> None:
        log.warning("daemon error: %s: %s", msg.code, msg.message)

    def _closed(self, rollout_id: int) -> None:
        try:
            self._on_closed(rollout_id)
        except Exception:  # the proxy's business; the link must live on
            log.exception("on_closed(%d) failed", rollout_id)

    def _tick(self, sock: zmq.Socket, now: float) -> None:
        # new records first: they were journaled, a failed send is retried from the journal below
        while True:
            try:
                rec = self._outbox.get_nowait()
            except queue.Empty:
                break
            sent = self._send(sock, rec)
            if isinstance(rec, CallRecord):
                if sent:
                    self._sent[(rec.rollout_id, rec.call_index)] = now
            elif not sent:  # a notice: kept until the daemon is connected
                self._outbox.put(rec)
                break
        budget = self.RESEND_PER_TICK  # a slow daemon is not flooded with megabyte-sized records
        for rec in self.journal.pending():
            key = (rec.rollout_id, rec.call_index)
            if now - self._sent.get(key, -1e9) < self.resend_after_s:
                continue
            if budget == 0 or not self._send(sock, rec):
                break
            self._sent[key] = now
            budget -= 1
        expired: list[Future] = []
        with self._lock:
            for rid, waiters in list(self._waiting.items()):
                alive = [(f, d) for f, d in waiters if d > now and not f.done()]
                expired += [f for f, d in waiters if d <= now and not f.done()]
                if alive:
                    self._waiting[rid] = alive
                else:
                    self._waiting.pop(rid)
                    self._asked.pop(rid, None)
            ask = [rid for rid, at in self._asked.items() if now - at >= self.route_retry_s]
        for rid in ask:
            if self._send(sock, RouteQuery(rollout_id=rid)):
                with self._lock:
                    if rid in self._asked:
                        self._asked[rid] = now
        for f in expired:
            f.set_exception(RouteUnavailable("the daemon did not answer the route query in time"))

    def _run(self) -> None:
        sock = connect_to_daemon(self.info, f"proxy:{self.proxy_id}", linger_ms=0)  # un-acked: in the journal
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_hello = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))
                if self._wake_r in events:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                if sock in events:
                    drain(sock, self.token, self._dispatch, log)
                now = time.monotonic()
                if now >= next_hello and self.url:
                    owed = sorted({r.rollout_id for r in self.journal.pending()})
                    self._send(sock, ProxyHello(proxy_id=self.proxy_id, url=self.url, owed=owed))
                    next_hello = now + self.hello_interval_s
                self._tick(sock, now)
        except Exception:
            log.exception("the daemon link failed")
            raise
        finally:
            sock.close()
