"""One HTTP client for rollout engines: the embedded engine and a real SGLang server (same native routes).

Each route is described once, as a `Call` (method, path, JSON body, how to read the answer); `_send` runs a call
with `httpx.Client` and `_asend` with `httpx.AsyncClient`, so sync and async paths cannot drift apart.
`generate` is async (the proxy runs many at once); the control routes, used by node agents between rollouts,
are sync. Every failure is an `EngineError` with a one-line message that names the engine, the route, the status
and the engine's own error text.

Conventions carried over the wire (see engines/__init__.py for the SGLang sources):
- `output_ids` include a matched stop token (and `output_logprobs` its logprob); `text` does not.
- `weight_version` travels as a string (SGLang's type); gyre versions are integers, so the client parses it and
  reports None for a non-integer label such as SGLang's default "default".
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import numpy as np
import orjson

from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.report import TransferReport

FinishReason = Literal["stop", "length", "abort"]


class EngineError(GyreError):
    """The engine refused or failed a request, or answered with something that is not SGLang's shape."""


class EngineUnavailable(EngineError):
    """The engine cannot serve now: unreachable, timed out, starting, or its memory is released (503).
    Callers may retry elsewhere; a plain EngineError means the request itself was wrong."""


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's sampling_params (the subset gyre uses). temperature 0 is greedy; top_k -1 is the whole vocab."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # SGLang's sampling_seed: the same seed gives the same sample

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                               "top_p": self.top_p, "top_k": self.top_k}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float] | None  # one per output id (None when not requested)
    finish_reason: FinishReason
    weight_version: int | None
    prompt_tokens: int
    cached_tokens: int
    text: str
    matched: int | str | None = None  # the stop token id or stop string that ended generation
    meta_info: dict = field(default_factory=dict, repr=False)  # SGLang's meta_info as received


@dataclass(frozen=True)
class Call:
    """One request to one route and how to read its answer."""

    method: str
    path: str
    body: dict | None = None
    parse: Callable[[httpx.Response], Any] = lambda r: None
    timeout_s: float | None = None  # None: the client's default
    also: frozenset[int] = frozenset()  # statuses besides 200 that `parse` reads (a probe's 404)


class JsonIds(array):
    """Token ids that carry their JSON array text: a long prompt built from a stored history whose text was
    serialised before is not serialised again, and is copied once (the proxy's per-call cost stays flat)."""

    json: bytes | None = None

    @classmethod
    def extend_stored(cls, ids: array, n: int, text: bytes | bytearray, text_end: int, tail: list[int]) -> JsonIds:
        """ids[:n] + tail, where text[:text_end] is ids_json(ids[:n])."""
        out = cls(ids.typecode)
        out.frombytes(memoryview(ids)[:n].cast("B"))
        out.extend(tail)
        tail_text = ids_json(tail)
        head = memoryview(text)[:text_end if tail_text else max(0, text_end - 1)]  # no comma before "]"
        out.json = b"".join((b"[", head, tail_text[:-1], b"]"))
        return out


def ids_json(ids: Any) -> bytes:
    """Ids as stored JSON text: every id followed by a comma."""
    return (",".join(map(str, ids)) + ",").encode() if len(ids) else b""


def _default(o: Any) -> Any:
    if isinstance(o, JsonIds) and o.json is not None:
        return orjson.Fragment(o.json)
    if isinstance(o, array):  # token ids held compactly (a long rollout's prompt): serialised without a copy
        return np.frombuffer(o, dtype=np.dtype(o.typecode))
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _dumps(body: Any) -> bytes:
    # orjson: a 200k-token prompt is ~1 ms instead of ~15 ms with the json module (the proxy's per-call cost)
    return orjson.dumps(body, default=_default, option=orjson.OPT_SERIALIZE_NUMPY)


def parse_weight_version(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_text(resp: httpx.Response) -> str:
    """The engine's message from either of SGLang's error shapes, FastAPI's, or the raw body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])
    return resp.text


class EngineClient:
    """`EngineClient("http://host:port")` for an embedded engine or an SGLang server."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._sync: httpx.Client | None = None
        self._async: httpx.AsyncClient | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self.weight_sessions: bool | None = None  # whether the server has /begin_weight_update (None: not probed)

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    # --- routes (each defined once) ------------------------------------------------------------------------------

    def generate_call(self, input_ids: list[int] | array, sampling: SamplingParams, rid: str | None = None,
                      return_logprob: bool = True) -> Call:
        ids = input_ids if isinstance(input_ids, array) else list(input_ids)
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling.to_json(),
                                "return_logprob": return_logprob, "stream": False}
        if rid is not None:
            body["rid"] = rid
        return Call("POST", "/generate", body, self._parse_generate)

    def _parse_generate(self, resp: httpx.Response) -> GenerateResult:
        try:
            out = resp.json()
            meta = out["meta_info"]
            output_ids = [int(t) for t in out.get("output_ids", out.get("token_ids", []))]
            reason = meta["finish_reason"]
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind not in ("stop", "length", "abort"):
                raise ValueError(f"finish_reason {reason!r}")
            logprobs = None
            if "output_token_logprobs" in meta:
                triples = meta["output_token_logprobs"]
                if [int(t[1]) for t in triples] != output_ids:
                    raise ValueError("output_token_logprobs do not match output_ids")
                logprobs = [float(t[0]) for t in triples]
            return GenerateResult(
                output_ids=output_ids, output_logprobs=logprobs, finish_reason=kind,
                weight_version=parse_weight_version(meta.get("weight_version")),
                prompt_tokens=int(meta.get("prompt_tokens", 0)), cached_tokens=int(meta.get("cached_tokens") or 0),
                text=out.get("text") or "", matched=reason.get("matched") if isinstance(reason, dict) else None,
                meta_info=meta)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise EngineError(f"engine {self.base_url}: POST /generate: unexpected answer ({exc}): "
                              f"{_one_line(resp.text, 200)}") from None

    def update_weights_call(self, path: str, weight_version: int | str, abort_all_requests: bool = False,
                            flush_cache: bool = True) -> Call:
        body = {"model_path": str(path), "weight_version": str(weight_version),
                "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}
        return Call("POST", "/update_weights_from_disk", body, self._parse_success)

    def update_weights_from_transfer_engine(self, parts: list[WeightsHandle], weight_version: int | str,
                                            flush_cache: bool = True, model_path: str | None = None) \
            -> list[TransferReport]:
        """The engine pulls the version the core published, part by part (gyre's route; the embedded engine serves
        it: transfer/weight_parts.py), or the newest one published after it where that version was replaced before
        the engine read it: one report per part (sender_rank: the core rank that published it), whose version is
        the one it serves now (also its weight_version) and source that version's snapshot folder.
        `model_path`: the version's snapshot folder, which a resume after a memory release reloads."""
        body = {"parts": [h.model_dump(mode="json") for h in parts], "weight_version": str(weight_version),
                "flush_cache": flush_cache, "model_path": model_path}

        def parse(resp: httpx.Response) -> list[TransferReport]:
            self._parse_success(resp)
            body = resp.json()
            version = int(body.get("version", parts[0].version))
            source = str(body.get("model_path") or model_path or "")
            got = body.get("parts") or [[h.rank, h.nbytes, float(body.get("seconds", 0.0))] for h in parts]
            return [TransferReport("mooncake", version, int(n), float(s), source=source, sender_rank=int(rank))
                    for rank, n, s in got]

        return self._send(Call("POST", "/update_weights_from_transfer_engine", body, parse))

    def _parse_success(self, resp: httpx.Response) -> str:
        body = resp.json()
        if not body.get("success"):
            raise EngineError(f"engine {self.base_url}: {resp.request.url.path}: {_one_line(str(body.get('message')))}")
        return str(body.get("message", ""))

    @staticmethod
    def release_call(tags: list[str] | None = None) -> Call:
        return Call("POST", "/release_memory_occupation", {"tags": tags} if tags else {})

    @staticmethod
    def resume_call(tags: list[str] | None = None) -> Call:
        return Call("POST", "/resume_memory_occupation", {"tags": tags} if tags else {})

    @staticmethod
    def pause_call(mode: str = "abort", export_kv: bool = False) -> Call:
        return Call("POST", "/pause_generation", {"mode": mode, **({"export_kv": True} if export_kv else {})})

    @staticmethod
    def continue_call() -> Call:
        return Call("POST", "/continue_generation", {})

    @staticmethod
    def abort_call(rid: str | None = None, abort_all: bool = False, export_kv: bool = False) -> Call:
        if rid is None and not abort_all:
            raise ValueError("abort needs a rid or abort_all=True")
        return Call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all,
                                               **({"export_kv": True} if export_kv else {})})

    @staticmethod
    def import_kv_call(handle: dict, input_ids: list[int] | array) -> Call:
        return Call("POST", "/import_kv", {"kv_handle": handle, "input_ids": input_ids}, parse=lambda r: r.json())

    @staticmethod
    def release_kv_export_call(export_id: str) -> Call:
        return Call("POST", "/release_kv_export", {"id": export_id}, parse=lambda r: bool(r.json()["success"]))

    @staticmethod
    def model_info_call() -> Call:
        return Call("GET", "/get_model_info", parse=lambda r: r.json())

    @staticmethod
    def health_call(timeout_s: float = 5.0, path: str = "/health") -> Call:
        return Call("GET", path, timeout_s=timeout_s)

    def init_weights_group_call(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str) -> Call:
        body = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size), "group_name": group_name, "backend": backend}
        return Call("POST", "/init_weights_update_group", body, self._parse_success)

    def update_distributed_call(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                                weight_version: int | str | None = None, flush_cache: bool = True,
                                abort_all_requests: bool = False) -> Call:
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return Call("POST", "/update_weights_from_distributed", body, self._parse_success)

    def begin_weight_update_call(self, selector: str | None = None) -> Call:
        def parse(resp: httpx.Response) -> bool:
            if resp.status_code == 404:  # a build from before the session API: updates load directly
                return False
            self._parse_success(resp)
            return True

        # {} unless asked: upstream's BeginWeightUpdateReqInput defaults selector to "all"; builds that backported the
        # routes take other fields, and an empty body is what each of them accepts
        return Call("POST", "/begin_weight_update", {"selector": selector} if selector else {}, parse,
                    also=frozenset({404}))

    def end_weight_update_call(self) -> Call:
        return Call("POST", "/end_weight_update", {}, self._parse_success)

    def destroy_weights_group_call(self, group_name: str) -> Call:
        return Call("POST", "/destroy_weights_update_group", {"group_name": group_name}, self._parse_success)

    def transfer_engine_info_call(self, rank: int = 0) -> Call:
        def parse(resp: httpx.Response) -> tuple[str, dict[str, tuple[int, int, int]]]:
            info = resp.json()["remote_instance_transfer_engine_info"]
            if isinstance(info, dict):  # a newer SGLang's tagged shape
                info = (info["session_id"], info["weights_info_dict"])
            session_id, weights = info
            return str(session_id), {n: (int(w[0]), int(w[1]), int(w[2])) for n, w in weights.items()}

        return Call("GET", f"/remote_instance_transfer_engine_info?rank={int(rank)}", parse=parse)

    # --- the API ---------------------------------------------------------------------------------------------------

    async def generate(self, input_ids: list[int] | array, sampling: SamplingParams, rid: str | None = None,
                       return_logprob: bool = True) -> GenerateResult:
        return await self._asend(self.generate_call(input_ids, sampling, rid, return_logprob))

    def update_weights_from_disk(self, path: str, weight_version: int | str, abort_all_requests: bool = False,
                                 flush_cache: bool = True) -> str:
        """Load the weights of a Hugging Face folder and set the weight version; returns the engine's message."""
        return self._send(self.update_weights_call(path, weight_version, abort_all_requests, flush_cache))

    def release_memory(self, tags: list[str] | None = None, abort_first: bool = False,
                       export_kv: bool = False) -> None:
        """Drop weights and KV caches (tags: weights, kv_cache; default all). The engine must be idle (SGLang
        asserts it); `abort_first` pauses generation in abort mode first, which returns every in-flight request
        with finish_reason 'abort' and holds new ones until `resume_memory()` continues generation. `export_kv`
        (gyre's engine): each of those answers carries a KV handle, for the call to continue elsewhere on it."""
        if abort_first:
            self._send(self.pause_call("abort", export_kv))
        self._send(self.release_call(tags))

    def resume_memory(self, tags: list[str] | None = None, continue_generation: bool = True) -> None:
        """Reload what was released; when everything is back (tags None) also continue a paused generation, unless
        `continue_generation` is False: a caller that loads another version next continues after it, so that no
        call is served by the weights the resume brought back (agent/backend.py)."""
        self._send(self.resume_call(tags))
        if tags is None and continue_generation:
            self._send(self.continue_call())

    def pause_generation(self, mode: str = "abort") -> None:
        """abort: return every request now (finish_reason 'abort'); in_place: freeze them with their KV; retract:
        back to the waiting queue, their KV freed (recomputed when they resume). Both continue with
        continue_generation; new requests wait meanwhile."""
        self._send(self.pause_call(mode))

    def continue_generation(self) -> None:
        self._send(self.continue_call())

    def abort(self, rid: str | None = None, abort_all: bool = False, export_kv: bool = False) -> None:
        """Abort one request (it returns what it generated, finish_reason 'abort') or all of them; `export_kv`: as
        in release_memory."""
        self._send(self.abort_call(rid, abort_all, export_kv))

    async def import_kv(self, handle: dict, input_ids: list[int] | array) -> dict:
        """Pull a KV handle (an abort answer's meta_info.kv_handle) into this engine's prefix cache, for a call
        continued with `input_ids` (which start with the ids the handle covers). Raises EngineError (refused:
        other weights, expired, no room; EngineUnavailable: the transfer failed or memory is released)."""
        return await self._asend(self.import_kv_call(handle, input_ids))

    async def release_kv_export(self, export_id: str) -> bool:
        """Free one of this engine's KV exports now (its importer has it); False: already gone."""
        return await self._asend(self.release_kv_export_call(export_id))

    def model_info(self) -> dict:
        return self._send(self.model_info_call())

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> str:
        """The engine joins a weight-update process group (the trainer, rank 0, hosts its store at master_address:
        master_port and must join meanwhile: this returns once the group is formed). See sglang_weights.py."""
        return self._send(self.init_weights_group_call(master_address, master_port, rank_offset, world_size,
                                                       group_name, backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group",
                                        weight_version: int | str | None = None, flush_cache: bool = True,
                                        abort_all_requests: bool = False) -> str:
        """The engine receives these tensors from rank 0's broadcasts (which must run meanwhile) and loads them."""
        return self._send(self.update_distributed_call(names, dtypes, shapes, group_name, weight_version,
                                                       flush_cache, abort_all_requests))

    def begin_weight_update(self, selector: str | None = None) -> bool:
        """Open a weight-update session (SGLang's /begin_weight_update, python/sglang/srt/entrypoints/http_server.py):
        recent builds refuse /update_weights_from_distributed and /update_weights_from_tensor outside one
        (managers/scheduler_components/weight_updater.py). True: a session is open, close it with
        `end_weight_update`; False: the server predates sessions (404) and loads updates directly. The answer is
        probed by the first call and kept in `weight_sessions` (one client per server start: a new start, perhaps
        of another build, gets a new client)."""
        if self.weight_sessions is False:
            return False
        self.weight_sessions = self._send(self.begin_weight_update_call(selector))
        return self.weight_sessions

    def end_weight_update(self) -> str:
        """Close the session `begin_weight_update` opened (SGLang finalises the loaded weights here)."""
        return self._send(self.end_weight_update_call())

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        return self._send(self.destroy_weights_group_call(group_name))

    def remote_instance_transfer_engine_info(self, rank: int = 0) -> tuple[str, dict[str, tuple[int, int, int]]]:
        """(Transfer Engine session id, {parameter: (address, numel, element_size)}) of one of the engine's ranks."""
        return self._send(self.transfer_engine_info_call(rank))

    def health(self) -> bool:
        try:
            self._send(self.health_call())
        except EngineError:
            return False
        return True

    def health_generate(self, timeout_s: float = 30.0) -> bool:
        """GET /health_generate: 200 once the engine has generated a token (SGLang runs a one-token request;
        /health answers 200 before the model can serve)."""
        try:
            self._send(self.health_call(timeout_s, "/health_generate"))
        except EngineError:
            return False
        return True

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until /health answers 200 (an SGLang server answers 503 while it starts)."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"engine {self.base_url} not ready after {timeout_s:.0f} s")
            time.sleep(0.1)

    # --- transport -------------------------------------------------------------------------------------------------

    def _request_args(self, call: Call) -> dict[str, Any]:
        args: dict[str, Any] = {"timeout": call.timeout_s or self.timeout_s}
        if call.body is not None:
            args["content"] = _dumps(call.body)
            args["headers"] = {"content-type": "application/json"}
        return args

    def _check(self, call: Call, resp: httpx.Response) -> Any:
        if resp.status_code != 200 and resp.status_code not in call.also:
            where = f"engine {self.base_url}: {call.method} {call.path} -> {resp.status_code}"
            cls = EngineUnavailable if resp.status_code in (502, 503, 504) else EngineError
            raise cls(f"{where}: {_one_line(_error_text(resp))}")
        try:
            return call.parse(resp)
        except EngineError:
            raise
        except ValueError as exc:
            raise EngineError(f"engine {self.base_url}: {call.method} {call.path}: unreadable answer ({exc}): "
                              f"{_one_line(resp.text, 200)}") from None

    def _transport_error(self, call: Call, exc: httpx.HTTPError) -> EngineError:
        return EngineUnavailable(f"engine {self.base_url}: {call.method} {call.path}: "
                                 f"{type(exc).__name__}: {_one_line(str(exc)) or 'no answer'}")

    def _send(self, call: Call) -> Any:
        if self._sync is None:
            self._sync = httpx.Client(base_url=self.base_url)
        try:
            resp = self._sync.request(call.method, call.path, **self._request_args(call))
        except httpx.HTTPError as exc:
            raise self._transport_error(call, exc) from None
        return self._check(call, resp)

    async def _asend(self, call: Call) -> Any:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:  # an AsyncClient belongs to one event loop
            self._async = httpx.AsyncClient(base_url=self.base_url,
                                            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
            self._async_loop = loop
        try:
            resp = await self._async.request(call.method, call.path, **self._request_args(call))
        except httpx.HTTPError as exc:
            raise self._transport_error(call, exc) from None
        return self._check(call, resp)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Call", "EngineClient", "EngineError", "EngineUnavailable", "FinishReason", "GenerateResult",
           "SamplingParams", "parse_weight_version"]
