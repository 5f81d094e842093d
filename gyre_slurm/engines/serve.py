"""Serving the embedded engine as a process (`gyre engine`): load the model, listen, announce, run until SIGTERM.

With --port 0 the engine picks a free port and says where it listens in its ready file (gyre_slurm.spawn), written
once uvicorn accepts connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from gyre_slurm.beacon import Beacon
from gyre_slurm.engines.http_api import build_app
from gyre_slurm.engines.model_thread import EmbeddedEngine, EngineOptions
from gyre_slurm.errors import GyreError, disk_full
from gyre_slurm.spawn import write_ready_file

log = logging.getLogger("gyre.engine")


def run_engine(opts: EngineOptions, host: str = "127.0.0.1", port: int = 0, ready_file: Path | None = None,
               threads: int = 1, log_level: str = "warning") -> None:
    """Serve until the process is told to stop. A model that cannot load is a GyreError (one line)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work
        torch.set_num_interop_threads(1)
    try:
        engine = EmbeddedEngine(opts)
    except (OSError, ValueError, KeyError) as exc:
        raise GyreError(f"cannot load model {opts.model_path}: {exc}".replace("\n", " ")) from None
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    where = {"host": host, "port": bound, "url": public_url(host, bound)}
    engine.url = where["url"]  # what its KV handles name it by (transfer/kv.py)
    engine.start()
    try:
        asyncio.run(serve(engine, sock, where, ready_file, log_level))
    finally:
        engine.stop()


def listen(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it a
    # JSON answer (headers and body written separately) waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def public_url(host: str, port: int) -> str:
    """Where others reach this engine: a wildcard address is announced as the host name."""
    public_host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{'[' + public_host + ']' if ':' in public_host else public_host}:{port}"


async def serve(engine: EmbeddedEngine, sock: socket.socket, where: dict[str, Any], ready_file: Path | None,
                log_level: str) -> None:
    """uvicorn on `sock`; `where` ({host, port, url}) goes into /get_server_info and the ready file's url."""
    import uvicorn

    url = where["url"]
    app = build_app(engine, where)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=30,
                                           timeout_graceful_shutdown=3))

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.01)
        while ready_file is not None:
            try:
                write_ready_file(ready_file, {"url": url, "pid": os.getpid(), "model_path": engine.model_path,
                                              "weight_version": engine.weight_version})
                break
            except OSError as e:  # a full disk: its agent waits for the file (up to its start timeout)
                if not disk_full(e):
                    raise
                await asyncio.sleep(1.0)
        log.warning("gyre embedded engine listening on %s", url)

    async def beat() -> None:  # its node agent's sign that the event loop turns (beacon.py; agent/engine_watch.py)
        beacon = Beacon()
        while True:
            beacon.beat()
            await asyncio.sleep(beacon.every_s)

    tasks = [asyncio.create_task(announce()), asyncio.create_task(beat())]
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in tasks:
            task.cancel()
