"""The peer side of the daemon's ZeroMQ channel, shared by node agents, workers, proxies and the CLI."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import zmq

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import Message, decode


def connect_to_daemon(endpoint: str, role: str, linger_ms: int, immediate: bool = True) -> zmq.Socket:
    """A DEALER socket to the daemon. With `immediate`, nothing is queued while the daemon is away: stale
    heartbeats or requests are useless, and what a restarted daemon needs, peers send again when asked."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{role}:{os.getpid()}:{id(sock):x}".encode())
    sock.setsockopt(zmq.LINGER, linger_ms)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.connect(endpoint)
    return sock


def drain(sock: zmq.Socket, token: str, handle: Callable[[Message], None], log: logging.Logger) -> None:
    """Handle every frame waiting on the socket; a frame that does not decode is logged and dropped."""
    while True:
        try:
            frame = sock.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = decode(frame, token)
        except ProtocolError as e:
            log.warning("dropped a frame from the daemon: %s", e)
            continue
        handle(msg)
