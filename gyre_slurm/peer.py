"""The peer side of the daemon's ZeroMQ channel, shared by node agents, workers, proxies and the CLI, and the
channel's CURVE encryption (control.encrypt).

With encryption, control.json (mode 0600) holds two CURVE key pairs: the daemon's (its ROUTER is a CURVE server)
and the run's peers' one client pair. Every frame on the wire is encrypted, and the daemon's ZAP handler admits
only the run's client key, so a peer without control.json cannot even complete the handshake; the run token
inside each frame stays the second check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from gyre_slurm.errors import GyreError, ProtocolError
from gyre_slurm.protocol import Message, decode
from gyre_slurm.rundir import ControlInfo


def new_curve_keys() -> dict[str, str]:
    """The daemon's and the peers' CURVE key pairs, Z85 text, for control.json."""
    if not zmq.has("curve"):
        raise GyreError("control.encrypt needs libzmq with CURVE (libsodium); this pyzmq has none")
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {k: v.decode() for k, v in (("server_public", server_public), ("server_secret", server_secret),
                                       ("client_public", client_public), ("client_secret", client_secret))}


def serve_curve(sock: zmq.Socket, keys: dict[str, str], domain: str = "gyre") -> None:
    """Make the daemon's socket a CURVE server (before bind) that only the run's client key may reach."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys["server_secret"].encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


class _RunKeyOnly:
    """ZAP credentials: the run's client key, and no other."""

    def __init__(self, client_public: str) -> None:
        self.key = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def start_authenticator(ctx: zmq.Context, keys: dict[str, str], domain: str = "gyre"):
    """The daemon's ZAP handler (a thread): a CURVE handshake with any other client key is refused."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain, credentials_provider=_RunKeyOnly(keys["client_public"]))
    return auth


def connect_to_daemon(info: ControlInfo, role: str, linger_ms: int, immediate: bool = True) -> zmq.Socket:
    """A DEALER socket to the daemon of `info` (control.json), encrypted when the run's channel is. With
    `immediate`, nothing is queued while the daemon is away: stale heartbeats or requests are useless, and what a
    restarted daemon needs, peers send again when asked."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{role}:{os.getpid()}:{id(sock):x}".encode())
    sock.setsockopt(zmq.LINGER, linger_ms)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if info.curve:
        sock.setsockopt(zmq.CURVE_SERVERKEY, info.curve["server_public"].encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, info.curve["client_public"].encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, info.curve["client_secret"].encode())
    sock.connect(info.endpoint)
    return sock


def dispatcher(handlers: Mapping[type, Callable[[Any], None]], log: logging.Logger) -> Callable[[Message], None]:
    """A peer's handler table as `drain`'s handle: a message the peer has no handler for is ignored (and logged)."""
    def handle(msg: Message) -> None:
        handler = handlers.get(type(msg))
        if handler is None:
            log.debug("ignored %s from the daemon", type(msg).__name__)
        else:
            handler(msg)
    return handle


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
