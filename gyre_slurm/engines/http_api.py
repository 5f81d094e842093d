"""The engine's HTTP face: SGLang's native routes (sglang/srt/entrypoints/http_server.py) over EmbeddedEngine.

Errors: 400 {"error": {"message": ...}} for a bad request, like SGLang's _create_error_response. Where SGLang has
no defined behaviour this engine answers 503 {"error": ...}: /generate while memory is released. weight_version is
a string in every response (SGLang's ServerArgs.weight_version is a str).

gyre's own routes and fields beside SGLang's (an SGLang server has none of them; their callers fall back):
- POST /update_weights_from_transfer_engine: pull a published weight version over the Transfer Engine (or the newest
  one published after it, where it was replaced before the engine read it: the answer's "version" and "model_path"
  say what it serves). The body's "parts" are the version's (one per sending rank of the core, pulled one by one
  and put together: transfer/weight_parts.py); the answer's "parts" say [rank, bytes, seconds] of each.
- export_kv in /pause_generation {"mode": "abort"} and /abort_request bodies: each aborted request's answer carries
  meta_info.kv_handle (or kv_export_error), its KV cache exported for migration (transfer/kv.py).
- POST /import_kv {"kv_handle", "input_ids"}: pull a handle's KV over the Transfer Engine into the prefix cache,
  so that a /generate of those ids prefills only its last token; 409 refused (other weights or layout, expired, no
  room, ids that differ), 502 the transfer failed, 503 memory released. The cache is untouched on any failure.
- POST /release_kv_export {"id"}: free an export now (the importer has it); exports are freed after their TTL
  anyway.
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

from gyre_slurm.engines.client import EngineClient, EngineError
from gyre_slurm.engines.errors import EngineHTTPError, error_body
from gyre_slurm.engines.inflight import CommandKind
from gyre_slurm.engines.model_thread import EmbeddedEngine
from gyre_slurm.engines.validation import (
    AbortBody,
    BeginWeightUpdateBody,
    DestroyWeightsGroupBody,
    DistributedUpdateBody,
    ImportKvBody,
    InitWeightsGroupBody,
    MemoryBody,
    PauseBody,
    ReleaseKvExportBody,
    UpdateWeightsBody,
    UpdateWeightsFromTransferEngineBody,
    WeightVersionBody,
    parse_generate,
    parse_json,
    validate,
)
from gyre_slurm.model.qwen3 import kv_bytes_per_token
from gyre_slurm.transfer.engine import TransferError
from gyre_slurm.transfer.kv import fetch, refusal, unpack

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
    add_kv_migration_routes(app, engine)
    add_sglang_weight_routes(app, engine)
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
        engine.abort(body.rid or None, body.abort_all, body.export_kv)
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

    @app.post("/update_weights_from_transfer_engine")
    async def update_weights_from_transfer_engine(request: HTTPRequest) -> JSONResponse:
        body = await read_body(request, UpdateWeightsFromTransferEngineBody)
        return await run_command(engine, "update_weights_te", body)

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


def add_kv_migration_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    """/import_kv and /release_kv_export (transfer/kv.py): a call aborted elsewhere continues here on its KV."""
    notices: set[asyncio.Task] = set()  # the exporters told that their export was imported

    @app.post("/import_kv")
    async def import_kv(request: HTTPRequest) -> JSONResponse:
        body = await read_body(request, ImportKvBody)
        handle, ids = body.kv_handle, body.input_ids
        if engine.released:
            raise engine.released_error()
        why = refusal(handle, ids, engine.kv_layout(), engine.weight_version, None, engine.prefix.max_bytes)
        if why is not None:  # checked before anything moves; the weights digest on the model thread
            raise EngineHTTPError(409, f"KV import refused: {why}")
        try:
            buf = await asyncio.to_thread(fetch, engine.kv_exports.agent, handle)
        except TransferError as exc:
            raise EngineHTTPError(502, f"KV import failed: {exc}") from None
        status, content = await engine.command("import_kv", (handle, ids, unpack(buf, handle.layout, handle.tokens)))
        if status == 200 and handle.url:
            task = asyncio.create_task(_release_export(handle.url, handle.id))
            notices.add(task)
            task.add_done_callback(notices.discard)
        return JSONResponse(content, status_code=status)

    @app.post("/release_kv_export")
    async def release_kv_export(request: HTTPRequest) -> dict[str, Any]:
        body = await read_body(request, ReleaseKvExportBody)
        return {"success": engine.kv_exports.release(body.id)}


async def _release_export(url: str, export_id: str) -> None:
    client = EngineClient(url, timeout_s=10)
    try:
        await client.release_kv_export(export_id)
    except EngineError as exc:  # it expires anyway
        log.info("could not tell %s that KV export %s was imported: %s", url, export_id, exc)
    finally:
        await client.aclose()


def add_sglang_weight_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    """SGLang's distributed weight update (gloo here), its weight-update sessions (python/sglang/srt/entrypoints/
    http_server.py; the rule in model_thread.py) and its remote-instance info (engines/sglang_weights.py)."""

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: HTTPRequest) -> JSONResponse:
        b = await read_body(request, InitWeightsGroupBody)  # joining waits for the trainer: off the model thread
        status, content = await asyncio.to_thread(engine.weight_groups.join, b.master_address, b.master_port,
                                                  b.rank_offset, b.world_size, b.group_name, b.backend)
        return JSONResponse(content, status_code=status)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: HTTPRequest) -> JSONResponse:
        return await run_command(engine, "update_distributed", await read_body(request, DistributedUpdateBody))

    if engine.opts.weight_sessions:  # off: a build from before the session API, where these routes 404
        @app.post("/begin_weight_update")
        async def begin_weight_update(request: HTTPRequest) -> JSONResponse:
            return await run_command(engine, "begin_weight_update",
                                     await read_body(request, BeginWeightUpdateBody, required=False))

        @app.post("/end_weight_update")
        async def end_weight_update() -> JSONResponse:
            return await run_command(engine, "end_weight_update")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: HTTPRequest) -> JSONResponse:
        body = await read_body(request, DestroyWeightsGroupBody, required=False)
        return await run_command(engine, "destroy_weights_group", body)

    @app.get("/remote_instance_transfer_engine_info")
    @app.get("/get_remote_instance_transfer_engine_info")  # SGLang's older name, which its own loader calls
    async def remote_instance_transfer_engine_info(request: HTTPRequest) -> JSONResponse:
        rank = request.query_params.get("rank", "")
        if not rank.isdigit():
            return JSONResponse(error_body("Missing or invalid rank parameter"), status_code=400)
        return await run_command(engine, "transfer_engine_info", int(rank))


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
                **engine.kv_exports.stats, "kv_exports_held": engine.kv_exports.held(),
                "kv_export_bytes": engine.kv_exports.bytes, "kv_export_max_bytes": engine.kv_exports.max_bytes,
                "torch_threads": torch.get_num_threads(),
            }],
            "version": "gyre-embedded-1",
        }
