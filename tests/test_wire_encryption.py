"""control.encrypt: the daemon's channel under CURVE. Real processes (a daemon and its node agents) and a TCP relay
that records every byte between a peer and the daemon: with encryption the run token never crosses the wire in
clear and a peer without the run's keys cannot get an answer; without it, the token is there for anyone to read
(the control case)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from pathlib import Path

import pytest
import zmq

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run
from gyre_slurm.peer import connect_to_daemon
from gyre_slurm.protocol import Reply, StatusRequest, decode, encode
from gyre_slurm.rundir import read_control

from .conftest import q, write_config

pytestmark = pytest.mark.slow


class Relay:
    """127.0.0.1:port → the daemon's port, every byte kept."""

    def __init__(self, target: int) -> None:
        self.seen = bytearray()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.target = target
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


def _ask(info, timeout_s: float = 3.0) -> Reply | None:
    sock = connect_to_daemon(info, "cli", linger_ms=0, immediate=False)
    try:
        sock.send(encode(StatusRequest(), info.token))
        return decode(sock.recv(), info.token) if sock.poll(int(timeout_s * 1000)) else None
    finally:
        sock.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_the_channel_hides_the_run_token_and_admits_only_the_runs_peers(tmp_path: Path, encrypt: bool) -> None:
    path = write_config(tmp_path / "run.yaml", tmp_path / "state", control={"encrypt": encrypt})
    run = start_local_run(load_config(path), "enc")  # its agents registered through it
    try:
        info = read_control(run.run_dir)
        assert (info.curve is not None) == encrypt
        relay = Relay(info.port)
        via = dataclasses.replace(info, endpoint=f"tcp://127.0.0.1:{relay.port}")
        reply = _ask(via)
        assert reply is not None and reply.ok and reply.result["run_id"] == "enc"
        on_wire = bytes(relay.seen)
        assert len(on_wire) > 200
        assert (info.token.encode() in on_wire) is not encrypt  # in clear without encryption, never with it
        assert (b"agents_up" in on_wire) is not encrypt
        if encrypt:
            # the right server key but another client key: refused in the handshake; no key at all: no answer
            public, secret = zmq.curve_keypair()
            stranger = {**info.curve, "client_public": public.decode(), "client_secret": secret.decode()}
            assert _ask(dataclasses.replace(info, curve=stranger)) is None
            assert _ask(dataclasses.replace(info, curve=None)) is None
            assert _ask(info).ok  # and the run's own peers still get in
        assert q(run.run_dir, "SELECT count(*) FROM agents WHERE status = 'UP'") == [(2,)]
    finally:
        run.kill()
