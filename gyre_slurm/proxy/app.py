"""The TITO proxy's HTTP face: OpenAI- and Anthropic-compatible routes in front of the rollout engines, errors
answered in the shape of the API the client speaks, served by uvicorn on a socket the proxy binds itself.

What each call does is calls.py; the parts behind it are wired in service.py. Run: `gyre proxy --run-dir DIR
[--model-path DIR] [--host H] [--port 0] [--ready-file F]` (cli.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre_slurm.errors import DiskFull
from gyre_slurm.proxy.apierrors import ApiError
from gyre_slurm.proxy.service import Proxy
from gyre_slurm.spawn import read_ready_file, write_ready_file

log = logging.getLogger("gyre.proxy")


def create_app(run_dir: Path, model_path: Path, url: str, **options: Any) -> FastAPI:
    """The proxy as an ASGI app served at `url`; options go to Proxy (proxy_id, parser, served_models, …)."""
    proxy = Proxy(run_dir, model_path, url=url, **options)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async with proxy.serving():
            yield

    app = FastAPI(title="gyre TITO proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    add_error_handlers(app)
    add_routes(app, proxy)
    return app


def _shaped(request: Request, exc: ApiError) -> JSONResponse:
    # one line per refused call, so a harness that keeps failing shows why in the proxy's log; each API's clients
    # parse errors in their own shape
    log.warning("%s %s answered %d: %s", request.method, request.url.path, exc.status, exc.message[:300])
    if request.url.path.startswith("/v1/messages"):
        return exc.anthropic_response()
    return exc.response()


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _shaped(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # an unknown route or a wrong method, in the shape of the API the client speaks
        return _shaped(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                         type="invalid_request_error" if exc.status_code < 500 else "server_error",
                                         code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request: Request, _exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left mid-body: nobody to answer, nothing recorded

    @app.exception_handler(DiskFull)
    async def _full(request: Request, exc: DiskFull) -> JSONResponse:
        # the call could not be journaled, so it was not made: the client's retry makes it again
        log.error("call refused: %s", exc)
        return _shaped(request, ApiError(503, f"the run's disk is full, try again: {exc}", type="server_error"))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return _shaped(request, ApiError(500, f"proxy error: {type(exc).__name__}: {exc}", type="server_error"))


def add_routes(app: FastAPI, proxy: Proxy) -> None:
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.calls.openai_chat(request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.calls.openai_completions(request)

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.calls.anthropic_messages(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        return await proxy.calls.anthropic_count_tokens(request)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.calls.openai_responses(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        proxy.calls.authenticate(request, check_open=False)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "gyre"}
                                           for name in proxy.served_models.names]}

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> dict[str, Any]:
        return {"ok": True}  # clients probe their base URL before the first call (Claude Code: HEAD /)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return proxy.health()


def _advertised(host: str) -> str:
    host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"[{host}]" if ":" in host else host


def _listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket and the URL that reaches it (port 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP (else Nagle delays answers)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock, f"http://{_advertised(host)}:{sock.getsockname()[1]}"


def _last_port(ready_file: Path, host: str) -> int:
    """The port in the ready file of an earlier proxy, if this host can bind it now; else 0 (any)."""
    try:
        last = int(str((read_ready_file(ready_file) or {})["url"]).rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, last))
        return last
    except (KeyError, ValueError, IndexError, OSError):
        return 0


def run_proxy(run_dir: Path, model_path: Path, host: str = "127.0.0.1", port: int = 0,
              ready_file: Path | None = None, **options: Any) -> None:
    """Serve until SIGINT/SIGTERM. With port 0 the port of the ready file's last proxy is taken again when it is
    free (a restarted proxy keeps its address: harnesses in flight retry their call there), else any free one; the
    ready file gets {"url": ...}."""
    import uvicorn

    if port == 0 and ready_file is not None:
        port = _last_port(ready_file, host)
    sock, url = _listen(host, port)
    app = create_app(run_dir, model_path, url, **options)
    # Parsing a 200k-token request allocates ~10k containers: at Python's default thresholds that runs the cyclic
    # collector many times per request, over every history the proxy holds (6 ms of a 7 ms request, measured).
    # Fewer, larger young-generation passes, and start-up objects (tokenizer, template) frozen out of them.
    gc.set_threshold(100_000, 20, 20)
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=60))

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            log.info("proxy %s serving on %s", app.state.proxy.proxy_id, url)
            if ready_file is not None:
                write_ready_file(ready_file, {"url": url})
        await task

    asyncio.run(serve())
