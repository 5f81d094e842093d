"""The embedded rollout engine: a torch Qwen3 served over SGLang's native HTTP routes, with SGLang's JSON shapes.

The proxy and the node agents talk to it exactly as to an SGLang server (`engines/client.py` is the one client
for both), so everything above the engine is tested on CPU with the same wire format it meets on a cluster.

Process layout: an asyncio front end (FastAPI + uvicorn) parses and validates requests and parks each one on a
future; one model thread owns the model and does all compute. Each loop iteration it (1) finishes aborted
requests, (2) runs a queued control command (weights, memory, cache) when its preconditions hold, (3) admits
waiting requests, (4) prefills one chunk of one admitted prompt, (5) decodes one token for every running
request in a single batched forward. So a long prompt or a long generation never blocks short requests, and an
abort takes effect at the next token.

Prefix KV reuse: finished sequences' KV caches stay in an LRU bounded by tokens. A request whose input_ids start
with a cached sequence prefills only the rest (`cached_tokens` says how many were reused). An agent's next turn
extends its previous prompt + output, so it takes over the whole cached entry without copying.

SGLang behaviours followed (checked against sglang/srt: schedule_batch.py Req.check_finished and the FINISH_*
classes, detokenizer_manager.py trim_matched_stop, tokenizer_manager.py meta_info, entrypoints/http_server.py,
sampling/sampling_params.py):
- finish_reason is a dict: {"type": "stop", "matched": <token id | stop string>}, {"type": "length", "length": n},
  {"type": "abort", "message": ..., "status_code": null, "err_type": null}. The length check comes first: a stop
  token sampled as the max_new_tokens-th token finishes with "length".
- A matched stop token IS included in output_ids and in output_token_logprobs (its logprob is reported);
  `text` leaves it out. A matched stop string stays in output_ids (the tokens that produced it) and `text` is cut
  before it. `no_stop_trim` keeps both in text.
- `ignore_eos` disables every stop-token check (eos and stop_token_ids alike); stop strings still apply.
- temperature 0 means greedy (SGLang rewrites it as temperature 1 with top_k 1); top_k -1 means the whole vocab.
- output_token_logprobs are [[logprob, token_id, null], ...] (the text slot is filled with return_text_in_logprobs).
- Logprobs are of the sampled token under the model's distribution at temperature 1: log_softmax(logits), before
  temperature, top-k and top-p. SGLang by default returns log_softmax(logits / temperature) instead (still not
  renormalised for top-k/top-p) and returns the temperature-1 values when started with
  SGLANG_RETURN_ORIGINAL_LOGPROB=1 (`engines/sglang.py` sets it). At temperature 1 both agree.
  `--temp-scaled-logprobs` makes this engine return SGLang's default instead.
- /flush_cache always succeeds here (running requests never share cached KV); SGLang refuses it while busy.
- weight_version is a string in every response's meta_info (SGLang's ServerArgs.weight_version is a str).
- Errors: 400 {"error": {"message": ...}} for a bad request, like SGLang's _create_error_response.
  Where SGLang has no defined behaviour this engine answers 503 {"error": ...}: /generate while memory is released.
- release_memory_occupation needs an idle engine (SGLang asserts it): /pause_generation {"mode": "abort"} first
  (returns every request now with finish_reason abort; waiting requests may stay queued while paused), then
  /continue_generation after resuming. update_weights_from_disk waits for running requests to finish (SGLang's
  writer lock), or aborts them with abort_all_requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest  # module level: route annotations are resolved from module globals
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gyre_slurm.model.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM, kv_bytes_per_token, read_safetensors

log = logging.getLogger("gyre.engine")

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # cuda_graph is accepted and means nothing on CPU
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


class EngineHTTPError(Exception):
    """A request the engine refuses; `status` is the HTTP status, the message goes in {"error": {"message"}}."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def bad_request(message: str) -> EngineHTTPError:
    return EngineHTTPError(400, message)


# --- request parsing ---------------------------------------------------------------------------------------------

# SGLang fields that this engine accepts only at their default value (anything else is refused, not ignored).
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "stop_regex": None, "logit_bias": None, "custom_params": None, "stream_interval": None,
    "spaces_between_special_tokens": True,
}
_REQUEST_DEFAULTS: dict[str, Any] = {
    "stream": False, "text": None, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
    "return_hidden_states": False, "lora_path": None, "image_data": None, "input_embeds": None,
    "custom_logit_processor": None, "data_parallel_rank": None, "session_params": None, "bootstrap_host": None,
}
_REQUEST_IGNORED = {"log_metrics", "priority", "background", "return_prompt_token_ids"}


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # -1 = whole vocabulary
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    no_stop_trim: bool
    skip_special_tokens: bool
    seed: int | None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(sp: dict, key: str, default: float) -> float:
    v = sp.get(key)
    if v is None:
        return default
    if not _is_num(v) or not math.isfinite(v):
        raise bad_request(f"sampling_params.{key} must be a finite number, got {v!r}")
    return float(v)


def parse_sampling(sp: Any, prompt_len: int, context_len: int, has_tokenizer: bool) -> Sampling:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise bad_request("sampling_params must be an object")
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
             "no_stop_trim", "skip_special_tokens", "sampling_seed", *_SAMPLING_DEFAULTS}
    unknown = sorted(set(sp) - known)
    if unknown:
        raise bad_request(f"unknown sampling_params {unknown}")
    for key, default in _SAMPLING_DEFAULTS.items():
        if sp.get(key, default) not in (default, None):
            raise bad_request(f"sampling_params.{key}={sp[key]!r} is not supported by the embedded engine")
    max_new = sp.get("max_new_tokens", 128)
    if max_new is None:  # up to the context, as far as the length check below allows
        max_new = max(context_len - prompt_len - 1, 0)
    if not _is_int(max_new) or max_new < 0:
        raise bad_request(f"max_new_tokens must be at least 0, got {max_new!r}")
    temperature = _num(sp, "temperature", 1.0)
    if temperature < 0:
        raise bad_request(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = _num(sp, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}.")
    top_k = sp.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise bad_request(f"top_k must be -1 (disable) or at least 1, got {top_k!r}.")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of them")
    if stop and not has_tokenizer:
        raise bad_request(f"stop={stop!r} needs a tokenizer, and the model folder has no tokenizer.json")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise bad_request("stop_token_ids must be a list of integers")
    flags = {}
    for key, default in (("ignore_eos", False), ("no_stop_trim", False), ("skip_special_tokens", True)):
        v = sp.get(key, default)
        v = default if v is None else v
        if not isinstance(v, bool):
            raise bad_request(f"sampling_params.{key} must be a boolean")
        flags[key] = v
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("sampling_seed must be an integer")
    if max_new + prompt_len >= context_len:  # SGLang's rule and wording (tokenizer_manager._validate_one_request)
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You "
            f"requested a total of {max_new + prompt_len} tokens: {prompt_len} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages or the "
            f"completion to fit within the limit.")
    return Sampling(max_new, temperature, top_p, top_k, tuple(stop), frozenset(stop_ids), flags["ignore_eos"],
                    flags["no_stop_trim"], flags["skip_special_tokens"], seed)


@dataclass(frozen=True)
class GenerateInput:
    input_ids: list[int]
    sampling: Sampling
    rid: str
    return_logprob: bool
    return_text_in_logprobs: bool


def parse_generate(body: Any, vocab_size: int, context_len: int, has_tokenizer: bool) -> GenerateInput:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = {"input_ids", "sampling_params", "return_logprob", "rid", "return_text_in_logprobs",
             *_REQUEST_DEFAULTS, *_REQUEST_IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"unknown fields {unknown}")
    for key, default in _REQUEST_DEFAULTS.items():
        if body.get(key, default) not in (default, None):
            raise bad_request(f"{key}={body[key]!r} is not supported by the embedded engine (send one sequence of "
                              "input_ids, stream false)")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise bad_request("input_ids must be a non-empty list of token ids")
    if isinstance(ids[0], list):
        raise bad_request("batched input_ids are not supported: send one sequence per request")
    if not all(_is_int(t) for t in ids):
        raise bad_request("input_ids must be integers")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise bad_request(f"input_ids contain token ids outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_len:
        raise bad_request(f"The input ({len(ids)} tokens) is longer than the model's context length "
                          f"({context_len} tokens).")
    sampling = parse_sampling(body.get("sampling_params"), len(ids), context_len, has_tokenizer)
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise bad_request("rid must be a non-empty string (one request per call)")
    flags = {}
    for key in ("return_logprob", "return_text_in_logprobs"):
        v = body.get(key) or False
        if not isinstance(v, bool):
            raise bad_request(f"{key} must be a boolean")
        flags[key] = v
    return GenerateInput(ids, sampling, rid, flags["return_logprob"], flags["return_text_in_logprobs"])


# --- the model thread --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Request:
    inp: GenerateInput
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator
    created: float = field(default_factory=time.monotonic)
    cache: KVCache | None = None
    fed: int = 0  # prompt tokens whose KV is in the cache
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False
    finish: dict | None = None
    stop_len: int = 0  # longest stop string, in tokens: how much of the output tail to decode per check

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.inp.input_ids)


@dataclass(eq=False)
class Command:
    kind: str  # update_weights | release | resume | flush
    payload: dict
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor  # int64, the tokens whose KV the cache holds
    first: int
    cache: KVCache


class PrefixCache:
    """LRU of finished sequences' KV caches, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.tokens = 0
        self._ids = itertools.count()

    def put(self, tokens: list[int], cache: KVCache) -> None:
        n = cache.length
        if n == 0 or n > self.max_tokens:
            return
        self.entries[next(self._ids)] = _Entry(torch.tensor(tokens[:n], dtype=torch.int64), tokens[0], cache)
        self.tokens += n
        while self.tokens > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old.cache.length

    def take(self, input_ids: list[int], ids: torch.Tensor) -> tuple[KVCache | None, int]:
        """The KV of the longest cached prefix of input_ids (at most len - 1 tokens: one must be computed)."""
        limit = len(input_ids) - 1
        best_key, best = None, 0
        for key, e in self.entries.items():
            if e.first != input_ids[0]:
                continue
            n = min(e.cache.length, limit)
            if n <= best:
                continue
            eq = e.tokens[:n] == ids[:n]
            m = n if bool(eq.all()) else int(torch.argmin(eq.to(torch.int8)))
            if m > best:
                best_key, best = key, m
        if best_key is None:
            return None, 0
        entry = self.entries[best_key]
        if best == entry.cache.length or (best == limit and best == entry.cache.length - 1):
            # The request extends (nearly) the whole entry: take it over instead of copying.
            del self.entries[best_key]
            self.tokens -= entry.cache.length
            entry.cache.length = best
            return entry.cache, best
        self.entries.move_to_end(best_key)
        return entry.cache.copy_prefix(best), best

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


@dataclass
class EngineOptions:
    model_path: str
    weight_version: str = "0"
    seed: int = 0
    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    prefix_cache_tokens: int = 1 << 16
    context_length: int | None = None
    temp_scaled_logprobs: bool = False


class EmbeddedEngine:
    """The model, its tokenizer and the thread that runs every request and control command."""

    def __init__(self, opts: EngineOptions):
        self.opts = opts
        self.model_path = str(Path(opts.model_path).resolve())
        self.weight_version = str(opts.weight_version)
        self.config = Qwen3Config.from_pretrained(self.model_path)
        self.model: Qwen3ForCausalLM | None = Qwen3ForCausalLM.from_pretrained(self.model_path).eval()
        self.context_len = opts.context_length or self.config.max_position_embeddings
        self.tokenizer = _load_tokenizer(self.model_path)
        self.eos_ids = frozenset(_eos_ids(self.model_path, self.config, self.tokenizer))
        self.released: set[str] = set()
        self.prefix = PrefixCache(opts.prefix_cache_tokens)
        self._cv = threading.Condition()
        self._pending: deque[Request] = deque()
        self._active: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._commands: deque[Command] = deque()
        self._counter = itertools.count()
        self._stopped = False
        self._aborts = False  # set by abort(): wakes the model thread even while paused
        self.paused = False  # /pause_generation: nothing is admitted or stepped until /continue_generation
        self.stats = {"requests": 0, "generated_tokens": 0, "prefilled_tokens": 0, "cached_tokens": 0,
                      "aborted": 0, "weight_updates": 0}
        self._thread = threading.Thread(target=self._run, name="gyre-engine-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # called from the asyncio thread ------------------------------------------------------------------------------

    def released_error(self) -> EngineHTTPError:
        return EngineHTTPError(503, f"memory is released ({', '.join(sorted(self.released))}): "
                                    "call /resume_memory_occupation before /generate")

    def submit(self, inp: GenerateInput) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        seed = inp.sampling.seed if inp.sampling.seed is not None else self.opts.seed * 1_000_003 + next(
            self._counter)
        req = Request(inp, loop, loop.create_future(), torch.Generator().manual_seed(seed))
        with self._cv:  # the release command checks idleness and marks memory released under the same lock
            if self.released:
                raise self.released_error()
            if inp.rid in self._by_rid:
                raise bad_request(f"Duplicate request ID detected: {inp.rid}")
            self._by_rid[inp.rid] = req
            self._pending.append(req)
            self._cv.notify()
        return req.future

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        with self._cv:
            hit = list(self._by_rid.values()) if abort_all else [self._by_rid[rid]] if rid in self._by_rid else []
            for req in hit:
                req.aborted = True
            self._aborts = self._aborts or bool(hit)
            self._cv.notify()
        return len(hit)

    def command(self, kind: str, payload: dict | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        cmd = Command(kind, payload or {}, loop, loop.create_future())
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()
        return cmd.future

    def running(self) -> int:
        with self._cv:
            return len(self._by_rid)

    # the model thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopped or self._commands or self._aborts
                               or (not self.paused and (self._pending or self._active))):
                        self._cv.wait()
                    if self._stopped:
                        return
                try:
                    self._step()
                except Exception as exc:  # never let the thread die: fail what was in flight, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    for req in list(self._active):
                        self._fail(req, exc)

    def _finish_aborted(self) -> None:
        for req in [r for r in self._active if r.aborted]:
            self._finish(req, dict(ABORTED))
        with self._cv:
            self._aborts = False
            for req in [r for r in self._pending if r.aborted]:
                self._pending.remove(req)
                self._reply(req, (200, self._response(req, {**ABORTED, "message": "Abort in waiting queue"})))
                self._by_rid.pop(req.inp.rid, None)

    def _step(self) -> None:
        self._finish_aborted()
        with self._cv:
            cmd = self._commands[0] if self._commands else None
        blocked = False
        if cmd is not None:
            if cmd.kind == "update_weights" and cmd.payload.get("abort_all_requests"):
                self.abort(abort_all=True)
                cmd.payload["abort_all_requests"] = False  # done; the aborted finish on the next iteration
                return
            # Weight updates wait for running requests (no admission meanwhile), unless generation is paused in
            # place (SGLang's in_place mode: frozen requests continue on the new weights); the rest run right away.
            if cmd.kind == "update_weights" and self._active and not self.paused:
                blocked = True
            else:
                with self._cv:
                    self._commands.popleft()
                self._run_command(cmd)
                return
        if self.paused:
            return
        if not blocked:
            self._admit()
        prefilling = [r for r in self._active if r.prefilling]
        if prefilling:
            self._prefill_chunk(prefilling[0])
        decoding = [r for r in self._active if not r.prefilling]
        if decoding:
            self._decode(decoding)

    def _admit(self) -> None:
        while len(self._active) < self.opts.max_running_requests:
            with self._cv:
                if not self._pending:
                    return
                req = self._pending.popleft()
            self._active.append(req)
            try:
                if self.released:  # queued while paused, then memory was released: cannot run here
                    raise self.released_error()
                ids = req.inp.input_ids
                if req.inp.sampling.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                    continue
                cache, reused = self.prefix.take(ids, torch.tensor(ids, dtype=torch.int64))
                if cache is None:
                    cache = self.model.new_cache(len(ids) + min(req.inp.sampling.max_new_tokens, 256))
                req.cache, req.fed, req.cached_tokens = cache, reused, reused
                self.stats["cached_tokens"] += reused
            except Exception as exc:
                log.error("admitting %s failed:\n%s", req.inp.rid, traceback.format_exc())
                self._fail(req, exc)

    def _prefill_chunk(self, req: Request) -> None:
        ids = req.inp.input_ids
        end = min(len(ids), req.fed + self.opts.chunked_prefill_size)
        chunk = torch.tensor([ids[req.fed : end]], dtype=torch.int64)
        logits = self.model(chunk, req.cache, last_only=True)
        self.stats["prefilled_tokens"] += end - req.fed
        req.fed = end
        if end == len(ids):
            self._accept([req], logits[:, -1])

    def _decode(self, reqs: list[Request]) -> None:
        tokens = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.int64)
        logits = self.model(tokens, [r.cache for r in reqs])
        self._accept(reqs, logits[:, -1])

    def _accept(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample one token per row, record it with its logprob, and finish rows that are done."""
        toks, lps = sample(logits, [r.inp.sampling for r in reqs], [r.generator for r in reqs],
                           self.opts.temp_scaled_logprobs)
        self.stats["generated_tokens"] += len(reqs)
        for req, tok, lp in zip(reqs, toks, lps, strict=True):
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            reason = self._check_finished(req)
            if reason is not None:
                self._finish(req, reason)

    def _check_finished(self, req: Request) -> dict | None:
        """SGLang's order (Req.check_finished): length, then stop tokens (unless ignore_eos), then stop strings."""
        s, out = req.inp.sampling, req.output_ids
        if len(out) >= s.max_new_tokens:
            return {"type": "length", "length": s.max_new_tokens}
        last = out[-1]
        if not s.ignore_eos and (last in s.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if s.stop:
            if not req.stop_len:
                req.stop_len = max(len(self.tokenizer.encode(x, add_special_tokens=False).ids) for x in s.stop)
            tail = self.tokenizer.decode(out[-(req.stop_len + 1):], skip_special_tokens=False)
            for stop in s.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish = reason
        self._active.remove(req)
        if reason["type"] == "abort":
            self.stats["aborted"] += 1
        self.stats["requests"] += 1
        if req.cache is not None:
            self.prefix.put(req.inp.input_ids + req.output_ids, req.cache)
            req.cache = None
        with self._cv:
            self._by_rid.pop(req.inp.rid, None)
        self._reply(req, (200, self._response(req, reason)))

    def _fail(self, req: Request, exc: Exception) -> None:
        if req in self._active:
            self._active.remove(req)
        req.cache = None
        with self._cv:
            self._by_rid.pop(req.inp.rid, None)
        if isinstance(exc, EngineHTTPError):
            self._reply(req, (exc.status, {"error": {"message": str(exc)}}))
        else:
            self._reply(req, (500, {"error": {"message": f"engine error: {type(exc).__name__}: {exc}"}}))

    @staticmethod
    def _reply(target: Request | Command, value: Any) -> None:
        def settle(fut=target.future):
            if not fut.done():
                fut.set_result(value)

        with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is waiting
            target.loop.call_soon_threadsafe(settle)

    def _response(self, req: Request, reason: dict) -> dict:
        s, out = req.inp.sampling, req.output_ids
        text = ""
        if self.tokenizer is not None:
            ids = out[:-1] if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) \
                and not s.no_stop_trim else out
            text = self.tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens)
            matched = reason.get("matched")
            if isinstance(matched, str) and not s.no_stop_trim and matched in text:
                text = text[: text.index(matched)]
        meta: dict[str, Any] = {
            "id": req.inp.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.inp.input_ids),
            "weight_version": self.weight_version,
        }
        if req.inp.return_logprob:
            texts = [None] * len(out)
            if req.inp.return_text_in_logprobs and self.tokenizer is not None:
                texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in out]
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(req.logprobs, out, texts, strict=True)]
        meta.update(completion_tokens=len(out), cached_tokens=req.cached_tokens,
                    e2e_latency=time.monotonic() - req.created)
        return {"text": text, "output_ids": list(out), "meta_info": meta}

    # control commands (model thread) -----------------------------------------------------------------------------

    def _run_command(self, cmd: Command) -> None:
        try:
            result = getattr(self, f"_cmd_{cmd.kind}")(cmd.payload)
        except EngineHTTPError as exc:
            result = (exc.status, {"error": {"message": str(exc)}})
        except Exception as exc:
            log.error("command %s failed:\n%s", cmd.kind, traceback.format_exc())
            result = (500, {"error": {"message": f"{cmd.kind} failed: {type(exc).__name__}: {exc}"}})
        self._reply(cmd, result)

    def _cmd_update_weights(self, p: dict) -> tuple[int, dict]:
        path = str(Path(p["model_path"]).resolve())
        try:
            config = Qwen3Config.from_pretrained(path)
            if "weights" in self.released:  # nothing resident to update: the weights load on resume
                if self.config.differences(config):
                    raise ValueError(f"{path}: config differs from the loaded model")
                read_safetensors(path)
            else:
                self.model.load_weights(path)
        except Exception as exc:
            msg = f"Failed to update weights: {type(exc).__name__}: {exc}".replace("\n", " ")
            return 400, {"success": False, "message": msg, "num_paused_requests": 0}
        self.model_path = path
        if p.get("flush_cache", True):
            self.prefix.clear()
        message = "Succeeded to update model weights."
        if p.get("weight_version") is not None:
            self.weight_version = str(p["weight_version"])
            message += f" Weight version updated to {self.weight_version}."
        self.stats["weight_updates"] += 1
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def _cmd_release(self, p: dict) -> tuple[int, Any]:
        tags = set(p.get("tags") or MEMORY_TAGS)
        with self._cv:  # atomic with submit(): no request slips in between the check and the release
            if self._active or (self._pending and not self.paused):  # SGLang lets paused waiting requests be
                raise bad_request("release_memory_occupation should be called only when server is idle.")
            self.released |= tags - {"cuda_graph"}
        if "kv_cache" in tags:
            self.prefix.clear()
        if "weights" in tags:
            self.model = None
        gc.collect()  # free the weights now, not whenever the collector next runs
        return 200, None

    def _cmd_resume(self, p: dict) -> tuple[int, Any]:
        tags = set(p.get("tags") or MEMORY_TAGS)
        if "weights" in tags and "weights" in self.released:
            self.model = Qwen3ForCausalLM.from_pretrained(self.model_path).eval()
        self.released -= tags
        return 200, None

    def _cmd_pause(self, p: dict) -> tuple[int, Any]:
        """SGLang's modes: abort returns every running and waiting request now (finish_reason abort); in_place
        and retract keep them (here both keep their KV) to continue after /continue_generation."""
        if p.get("mode", "abort") == "abort":
            self.abort(abort_all=True)
            self._finish_aborted()
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _cmd_continue(self, p: dict) -> tuple[int, Any]:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _cmd_flush(self, p: dict) -> tuple[int, Any]:
        self.prefix.clear()
        return 200, None

    def info(self) -> dict:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "context_length": self.context_len, "vocab_size": self.config.vocab_size,
            "eos_token_ids": sorted(self.eos_ids), "engine": "gyre-embedded",
        }


def sample(logits: torch.Tensor, params: list[Sampling], generators: list[torch.Generator],
           temp_scaled_logprobs: bool = False) -> tuple[list[int], list[float]]:
    """One token per row by inverse-CDF sampling with one uniform draw from the row's own generator, so a seeded
    request samples the same way whatever else shares its batch. Returns the tokens and their logprobs."""
    vocab = logits.shape[-1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logp = torch.log_softmax(scaled if temp_scaled_logprobs else logits, dim=-1)
    if all(p.greedy for p in params):
        tok = logits.argmax(dim=-1, keepdim=True)
    else:
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(logits.dtype)
        top_k = [1 if p.greedy else (p.top_k if p.top_k > 0 else vocab) for p in params]
        top_p = [p.top_p for p in params]
        if max(top_k) >= vocab and min(top_p) >= 1.0:
            probs = torch.softmax(scaled, dim=-1)
            cdf = probs.cumsum(dim=-1)
            choice = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
            tok = choice
        else:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            rank = torch.arange(vocab)
            drop = rank[None, :] >= torch.tensor(top_k)[:, None]
            # top-p keeps the smallest head of the sorted distribution whose mass reaches p (the first always stays)
            drop |= (probs.cumsum(dim=-1) - probs) > torch.tensor(top_p, dtype=probs.dtype)[:, None]
            probs = probs.masked_fill(drop, 0.0)
            cdf = probs.cumsum(dim=-1)
            kept = (~drop).sum(dim=-1, keepdim=True)
            choice = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1, keepdim=True)
            tok = order.gather(1, torch.minimum(choice, kept - 1))
    lp = logp.gather(1, tok).clamp(min=torch.finfo(logp.dtype).min)
    return tok[:, 0].tolist(), lp[:, 0].tolist()


def _load_tokenizer(path: str):
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _eos_ids(path: str, config: Qwen3Config, tokenizer) -> set[int]:
    """Like SGLang: the config's eos ids, the generation config's, and the tokenizer's eos token."""
    ids = set(config.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    tok_cfg = Path(path) / "tokenizer_config.json"
    if tokenizer is not None and tok_cfg.exists():
        eos_tok = json.loads(tok_cfg.read_text()).get("eos_token")
        eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
        if isinstance(eos_tok, str) and tokenizer.token_to_id(eos_tok) is not None:
            ids.add(tokenizer.token_to_id(eos_tok))
    return ids


# --- HTTP --------------------------------------------------------------------------------------------------------

def build_app(engine: EmbeddedEngine, server_info: dict | None = None):
    app = FastAPI(title="gyre embedded engine", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    @app.exception_handler(EngineHTTPError)
    async def _engine_error(_request, exc: EngineHTTPError):
        return error(exc.status, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.error("unhandled error:\n%s", traceback.format_exc())
        return error(500, f"{type(exc).__name__}: {exc}")

    async def body_of(request: HTTPRequest, required: bool = True) -> dict:
        raw = await request.body()
        if not raw.strip():
            if required:
                raise bad_request("the request needs a JSON body")
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"malformed JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    async def run_command(kind: str, payload: dict | None = None):
        status, content = await engine.command(kind, payload)
        return JSONResponse(content, status_code=status)

    def memory_tags(body: dict) -> dict:
        tags = body.get("tags")
        if tags is not None and (not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS)):
            raise bad_request(f"tags must be a list drawn from {list(MEMORY_TAGS)}")
        return {"tags": tags}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: HTTPRequest):
        inp = parse_generate(await body_of(request), engine.config.vocab_size, engine.context_len,
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

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: HTTPRequest):
        body = await body_of(request)
        if not isinstance(body.get("model_path"), str) or not body["model_path"]:
            raise bad_request("model_path (a string) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise bad_request(f"load_format {body['load_format']!r} is not supported (auto, safetensors)")
        version = body.get("weight_version")
        if isinstance(version, bool) or not isinstance(version, (str, int, type(None))):
            raise bad_request("weight_version must be a string")
        return await run_command("update_weights", {
            "model_path": body["model_path"], "weight_version": version,
            "abort_all_requests": bool(body.get("abort_all_requests")),
            "flush_cache": body.get("flush_cache", True) is not False,
        })

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: HTTPRequest):
        return await run_command("release", memory_tags(await body_of(request, required=False)))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: HTTPRequest):
        return await run_command("resume", memory_tags(await body_of(request, required=False)))

    @app.post("/abort_request")
    async def abort_request(request: HTTPRequest):
        body = await body_of(request, required=False)
        rid, abort_all = body.get("rid") or None, body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise bad_request("abort_request takes {rid: str} or {abort_all: true}")
        engine.abort(rid, abort_all)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await engine.command("flush")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: HTTPRequest):
        body = await body_of(request, required=False)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise bad_request(f"mode must be abort, retract or in_place, got {mode!r}")
        return await run_command("pause", {"mode": mode})

    @app.post("/continue_generation")
    async def continue_generation():
        return await run_command("continue")

    @app.post("/update_weight_version")
    async def update_weight_version(request: HTTPRequest):
        body = await body_of(request)
        if body.get("new_version") is None:
            raise bad_request("new_version is required")
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True)
        engine.weight_version = str(body["new_version"])
        return {"success": True, "message": f"Weight version updated to {engine.weight_version}",
                "new_version": engine.weight_version}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        if engine.released or not engine.alive:
            return Response(status_code=503)
        inp = GenerateInput([0], parse_sampling({"max_new_tokens": 1, "temperature": 0}, 1, engine.context_len,
                                                False), f"HEALTH_CHECK_{uuid.uuid4().hex}", False, False)
        status, _ = await asyncio.wait_for(engine.submit(inp), timeout=20)
        return Response(status_code=200 if status == 200 else 503)

    @app.get("/get_model_info")
    async def get_model_info():
        return engine.info()

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/get_server_info")
    async def get_server_info():
        return {
            **(server_info or {}), **engine.info(),
            "random_seed": engine.opts.seed, "max_running_requests": engine.opts.max_running_requests,
            "chunked_prefill_size": engine.opts.chunked_prefill_size, "context_length": engine.context_len,
            "memory_released": sorted(engine.released), "paused": engine.paused,
            "temp_scaled_logprobs": engine.opts.temp_scaled_logprobs,
            "internal_states": [{
                **engine.stats, "running_requests": engine.running(), "prefix_cache_entries": len(
                    engine.prefix.entries), "prefix_cache_tokens": engine.prefix.tokens,
                "kv_bytes_per_token": kv_bytes_per_token(engine.config),
                "torch_threads": torch.get_num_threads(),
            }],
            "version": "gyre-embedded-1",
        }

    return app


def _write_ready(path: str, info: dict) -> None:
    """Atomically: the spawner polls for this file and must never read half of it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gyre_slurm.engines.embedded", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", required=True, help="Hugging Face Qwen3 folder (config.json + *.safetensors)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (see --ready-file)")
    ap.add_argument("--weight-version", default="0", help="reported in every response's meta_info")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (per-request sampling_seed overrides)")
    ap.add_argument("--ready-file", help='written atomically once listening: {"url": ..., "pid": ...}')
    ap.add_argument("--threads", type=int, default=1, help="torch threads (machines are shared; default 1)")
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--chunked-prefill-size", type=int, default=512, help="prompt tokens per prefill step")
    ap.add_argument("--prefix-cache-tokens", type=int, default=1 << 16, help="LRU budget of reusable KV")
    ap.add_argument("--context-length", type=int, help="default: the config's max_position_embeddings")
    ap.add_argument("--temp-scaled-logprobs", action="store_true",
                    help="return log_softmax(logits / temperature) like SGLang's default, not temperature-1 ones")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    with contextlib.suppress(RuntimeError):  # only settable before any parallel work
        torch.set_num_interop_threads(1)
    try:
        engine = EmbeddedEngine(EngineOptions(
            model_path=args.model_path, weight_version=args.weight_version, seed=args.seed,
            max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
            prefix_cache_tokens=args.prefix_cache_tokens, context_length=args.context_length,
            temp_scaled_logprobs=args.temp_scaled_logprobs))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: cannot load model {args.model_path}: {exc}", file=sys.stderr)
        return 2
    engine.start()

    import uvicorn

    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it a
    # JSON answer (headers and body written separately) waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    public_host = socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{'[' + public_host + ']' if ':' in public_host else public_host}:{port}"
    app = build_app(engine, {"host": args.host, "port": port, "url": url})
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                           timeout_keep_alive=30, timeout_graceful_shutdown=3))

    async def serve() -> None:
        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.01)
            if args.ready_file:
                _write_ready(args.ready_file, {"url": url, "pid": os.getpid(), "model_path": engine.model_path,
                                               "weight_version": engine.weight_version})
            log.warning("gyre embedded engine listening on %s", url)

        task = asyncio.create_task(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            task.cancel()
            engine.stop()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EmbeddedEngine", "EngineHTTPError", "EngineOptions", "GenerateInput", "PrefixCache", "Sampling",
           "build_app", "main", "parse_generate", "parse_sampling", "sample"]

