"""The engine's HTTP face: SGLang's native routes (sglang/srt/entrypoints/http_server.py) over EmbeddedEngine.

Errors: 400 {"error": {"message": ...}} for a bad request, like SGLang's _create_error_response. Where SGLang has
no defined behaviour this engine answers 503 {"error": ...}: /generate while memory is released. weight_version is
a string in every response (SGLang's ServerArgs.weight_version is a str).
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import uuid
from typing import Any, TypeVar

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest  # module level: route annotations are resolved from module globals
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from gyre_slurm.engines.errors import EngineHTTPError, error_body
from gyre_slurm.engines.inflight import CommandKind
from gyre_slurm.engines.scheduler import EmbeddedEngine
from gyre_slurm.engines.validation import (
    AbortBody,
    MemoryBody,
    PauseBody,
    UpdateWeightsBody,
    WeightVersionBody,
    parse_generate,
    parse_json,
    validate,
)
from gyre_slurm.model.qwen3 import kv_bytes_per_token

log = logging.getLogger("gyre.engine")
M = TypeVar("M", bound=BaseModel)


async def read_body(request: HTTPRequest, model: type[M], required: bool = True) -> M:
    """The request's JSON body as `model`; a route whose body is optional reads an empty one as {}."""
    return validate(model, parse_json(await request.body(), required))


async def run_command(engine: EmbeddedEngine, kind: CommandKind, payload: Any = None) -> JSONResponse:
    status, content = await engine.command(kind, payload)
    return JSONResponse(content, status_code=status)


def build_app(engine: EmbeddedEngine, server_info: dict[str, Any] | None = None) -> FastAPI:
    app = FastAPI(title="gyre embedded engine", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(EngineHTTPError)
    async def _engine_error(_request: HTTPRequest, exc: EngineHTTPError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _unexpected(_request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.error("unhandled error:\n%s", traceback.format_exc())
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}"), status_code=500)

    add_generation_routes(app, engine)
    add_memory_and_weight_routes(app, engine)
    add_info_routes(app, engine, server_info or {})
    return app


def add_generation_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    """/generate and what starts, stops and aborts generation."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: HTTPRequest) -> JSONResponse:
        inp = parse_generate(parse_json(await request.body()), engine.config.vocab_size, engine.context_len,
                             engine.tokenizer is not None)
        fut = engine.submit(inp)
        while True:  # like SGLang, a client that hangs up aborts its request
            done, _ = await asyncio.wait({fut}, timeout=1.0)
            if done:
                break
            if await request.is_disconnected():
                engine.abort(inp.rid)
        status, content = fut.result()
        return JSONResponse(content, status_code=status)

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest) -> Response:
        body = await read_body(request, AbortBody, required=False)
        engine.abort(body.rid or None, body.abort_all)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest) -> JSONResponse:
        return await run_command(engine, "pause", await read_body(request, PauseBody, required=False))

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        return await run_command(engine, "continue")


def add_memory_and_weight_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    """What a role switch uses: weights from disk, memory release and resume, the prefix cache."""

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: HTTPRequest) -> JSONResponse:
        return await run_command(engine, "update_weights", await read_body(request, UpdateWeightsBody))

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: HTTPRequest) -> JSONResponse:
        return await run_command(engine, "release", await read_body(request, MemoryBody, required=False))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: HTTPRequest) -> JSONResponse:
        return await run_command(engine, "resume", await read_body(request, MemoryBody, required=False))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        await engine.command("flush")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest) -> dict[str, Any]:
        body = await read_body(request, WeightVersionBody)
        if body.abort_all_requests:
            engine.abort(abort_all=True)
        engine.weight_version = body.new_version
        return {"success": True, "message": f"Weight version updated to {engine.weight_version}",
                "new_version": engine.weight_version}


def add_info_routes(app: FastAPI, engine: EmbeddedEngine, server_info: dict[str, Any]) -> None:
    """Health and what the engine serves; server_info adds where it listens."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if engine.released or not engine.alive:
            return Response(status_code=503)
        inp = parse_generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                              "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}"}, engine.config.vocab_size,
                             engine.context_len, False)
        status, _ = await asyncio.wait_for(engine.submit(inp), timeout=20)
        return Response(status_code=200 if status == 200 else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return engine.info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {
            **server_info, **engine.info(),
            "random_seed": engine.opts.seed, "max_running_requests": engine.opts.max_running_requests,
            "chunked_prefill_size": engine.opts.chunked_prefill_size, "context_length": engine.context_len,
            "memory_released": sorted(engine.released), "paused": engine.paused,
            "temp_scaled_logprobs": engine.opts.temp_scaled_logprobs,
            "internal_states": [{
                **engine.stats, "running_requests": engine.running(), "prefix_cache_entries": len(
                    engine.prefix.entries), "prefix_cache_tokens": engine.prefix.tokens,
                "prefix_cache_bytes": engine.prefix.bytes, "prefix_cache_max_bytes": engine.prefix.max_bytes,
                "kv_bytes_per_token": kv_bytes_per_token(engine.config),
                "torch_threads": torch.get_num_threads(),
            }],
            "version": "gyre-embedded-1",
        }
