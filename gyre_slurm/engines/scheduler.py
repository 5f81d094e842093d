"""The generation scheduler: one model thread owns the model and does all compute.

The asyncio front end parks each request on a future (`submit`) and queues control commands (`command`). Each
loop iteration the model thread (1) finishes aborted requests, (2) runs a queued control command (weights, memory,
cache, pause) when its preconditions hold, (3) admits waiting requests, (4) prefills one chunk of one admitted
prompt (in turn the oldest and the one closest to done: see _next_prefill), (5) decodes one token for every running
request in a single batched forward. So a long prompt or a long generation never blocks short requests (a
30k-token prompt is ~60 chunks, each followed by a decode step of the others), and an abort takes effect at the
next token. A prompt's reusable KV (prefix_cache.py: the LRU of finished sequences, or a running request's) is
taken when its first chunk is due, so prompts admitted together with a shared prefix compute it once.

Control commands follow SGLang: release_memory_occupation needs an idle engine (SGLang asserts it), so a caller
pauses in abort mode first; update_weights_from_disk waits for running requests (SGLang's writer lock) unless
generation is paused in place, or aborts them with abort_all_requests; /flush_cache always succeeds here (running
requests never share cached KV), where SGLang refuses it while busy.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gyre_slurm.engines.errors import EngineHTTPError, bad_request, error_body
from gyre_slurm.engines.inflight import Command, CommandKind, Reply, Request, reply
from gyre_slurm.engines.model_files import eos_ids, load_tokenizer
from gyre_slurm.engines.outputs import ABORTED, finish_reason, response
from gyre_slurm.engines.prefix_cache import Donor, PrefixCache, common_prefix
from gyre_slurm.engines.sampling import sample
from gyre_slurm.engines.validation import (
    MEMORY_TAGS,
    GenerateInput,
    MemoryBody,
    PauseBody,
    UpdateWeightsBody,
)
from gyre_slurm.model.qwen3 import Qwen3Config, Qwen3ForCausalLM, kv_bytes_per_token, read_safetensors

log = logging.getLogger("gyre.engine")


@dataclass
class EngineOptions:
    model_path: str
    weight_version: str = "0"
    seed: int = 0
    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    prefix_cache_tokens: int = 1 << 18  # the LRU's budget: this many tokens' worth of KV bytes
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
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_ids = frozenset(eos_ids(self.model_path, self.config, self.tokenizer))
        self.released: set[str] = set()
        dtype = self.model.model.embed_tokens.weight.dtype
        self.prefix = PrefixCache(opts.prefix_cache_tokens * kv_bytes_per_token(self.config, dtype))
        self._cv = threading.Condition()
        self._pending: deque[Request] = deque()
        self._active: list[Request] = []
        self._by_rid: dict[str, Request] = {}
        self._commands: deque[Command] = deque()
        self._counter = itertools.count()
        self._stopped = False
        self._aborts = False  # set by abort(): wakes the model thread even while paused
        self.paused = False  # /pause_generation: nothing is admitted or stepped until /continue_generation
        self._prefill_turn = 0  # see _next_prefill
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

    def submit(self, inp: GenerateInput) -> asyncio.Future[Reply]:
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

    def command(self, kind: CommandKind, payload: Any = None) -> asyncio.Future[Reply]:
        loop = asyncio.get_running_loop()
        cmd = Command(kind, payload, loop, loop.create_future())
        with self._cv:
            self._commands.append(cmd)
            self._cv.notify()
        return cmd.future

    def running(self) -> int:
        with self._cv:
            return len(self._by_rid)

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "context_length": self.context_len, "vocab_size": self.config.vocab_size,
            "eos_token_ids": sorted(self.eos_ids), "engine": "gyre-embedded",
        }

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
                reason = {**ABORTED, "message": "Abort in waiting queue"}
                reply(req, (200, response(req, reason, self.tokenizer, self.weight_version)))
                self._by_rid.pop(req.inp.rid, None)

    def _step(self) -> None:
        self._finish_aborted()
        with self._cv:
            cmd = self._commands[0] if self._commands else None
        blocked = False
        if cmd is not None:
            if cmd.kind == "update_weights" and cmd.payload.abort_all_requests:
                self.abort(abort_all=True)  # the aborted finish on the next iteration, then the update runs
                cmd.payload = cmd.payload.model_copy(update={"abort_all_requests": False})
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
            req = self._next_prefill(prefilling)
            try:
                self._prefill_chunk(req)
            except Exception as exc:  # one prompt's failure (e.g. out of memory) is its own
                log.error("prefill of %s failed:\n%s", req.inp.rid, traceback.format_exc())
                self._fail(req, exc)
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
                if self.released or self.model is None:  # queued while paused, then memory was released
                    raise self.released_error()
                ids = req.inp.input_ids
                if req.inp.sampling.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                    continue
                req.ids = torch.tensor(ids, dtype=torch.int64)  # its KV is taken when its prefill starts
                req.reuse_hint = self.prefix.peek(ids, req.ids, self._donors(req))
            except Exception as exc:
                log.error("admitting %s failed:\n%s", req.inp.rid, traceback.format_exc())
                self._fail(req, exc)

    def _donors(self, req: Request) -> list[Donor]:
        return [Donor(r.ids, r.output_ids, r.cache) for r in self._active
                if r is not req and r.cache is not None and r.cache.length > 0 and r.ids is not None]

    def _next_prefill(self, prefilling: list[Request]) -> Request:
        """The prompt that gets this step's chunk: in turn the oldest and the one with the fewest tokens left. So
        a later turn whose history is cached (one chunk to compute) does not wait behind a cold 30k-token prompt,
        and the long prompt still gets every other step. A prompt that has not started and shares more than a chunk
        with one under way waits until that one has computed the shared part, then copies it."""
        ready = [r for r in prefilling if not self._awaits_shared_prefix(r, prefilling)] or prefilling
        self._prefill_turn ^= 1
        if self._prefill_turn:
            return min(ready, key=lambda r: len(r.inp.input_ids) - (r.fed if r.cache is not None else r.reuse_hint))
        return ready[0]

    def _awaits_shared_prefix(self, req: Request, prefilling: list[Request]) -> bool:
        if req.cache is not None or req.ids is None:
            return False
        for other in prefilling:
            if other is req or other.cache is None or other.ids is None:
                continue
            shared = common_prefix(req.ids, other.ids, min(len(req.ids), len(other.ids)) - 1)
            if other.fed < shared and shared - req.reuse_hint >= self.opts.chunked_prefill_size:
                return True
        return False

    def _take_cache(self, req: Request) -> None:
        """The longest reusable KV for the prompt, from the LRU or from a running request, or a fresh cache.

        Done when the request's prefill starts rather than when it is admitted, so that requests admitted together
        with a shared prefix (a group's rollouts) reuse the KV the first of them computed."""
        ids = req.inp.input_ids
        need = len(ids) + min(req.inp.sampling.max_new_tokens, 256)
        cache, reused = self.prefix.take(ids, req.ids, need, self._donors(req))
        if cache is None:
            cache = self.model.new_cache(need)
        req.cache, req.fed, req.cached_tokens = cache, reused, reused
        self.stats["cached_tokens"] += reused

    def _prefill_chunk(self, req: Request) -> None:
        if req.cache is None:
            self._take_cache(req)
        ids = req.inp.input_ids
        end = min(len(ids), req.fed + self.opts.chunked_prefill_size)
        chunk = torch.tensor([ids[req.fed : end]], dtype=torch.int64)
        last = end == len(ids)
        if last:
            logits = self.model(chunk, req.cache, last_only=True)
        else:  # KV only: no logits
            self.model.hidden_states(chunk, req.cache)
        self.stats["prefilled_tokens"] += end - req.fed
        req.fed = end
        if last:
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
            reason = finish_reason(req, self.eos_ids, self.tokenizer)
            if reason is not None:
                self._finish(req, reason)

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
        reply(req, (200, response(req, reason, self.tokenizer, self.weight_version)))

    def _fail(self, req: Request, exc: Exception) -> None:
        if req in self._active:
            self._active.remove(req)
        req.cache = None
        with self._cv:
            self._by_rid.pop(req.inp.rid, None)
        if isinstance(exc, EngineHTTPError):
            reply(req, (exc.status, exc.body()))
        else:
            reply(req, (500, error_body(f"engine error: {type(exc).__name__}: {exc}")))

    # control commands (model thread) -----------------------------------------------------------------------------

    def _run_command(self, cmd: Command) -> None:
        try:
            result = getattr(self, f"_cmd_{cmd.kind}")(cmd.payload)
        except EngineHTTPError as exc:
            result = (exc.status, exc.body())
        except Exception as exc:
            log.error("command %s failed:\n%s", cmd.kind, traceback.format_exc())
            result = (500, error_body(f"{cmd.kind} failed: {type(exc).__name__}: {exc}"))
        reply(cmd, result)

    def _cmd_update_weights(self, p: UpdateWeightsBody) -> Reply:
        path = str(Path(p.model_path).resolve())
        try:
            config = Qwen3Config.from_pretrained(path)
            if self.model is None:  # nothing resident to update: the weights load on resume
                if self.config.differences(config):
                    raise ValueError(f"{path}: config differs from the loaded model")
                read_safetensors(path)
            else:
                self.model.load_weights(path)
        except Exception as exc:
            msg = f"Failed to update weights: {type(exc).__name__}: {exc}".replace("\n", " ")
            return 400, {"success": False, "message": msg, "num_paused_requests": 0}
        self.model_path = path
        if p.flush_cache:
            self.prefix.clear()
        message = "Succeeded to update model weights."
        if p.weight_version is not None:
            self.weight_version = p.weight_version
            message += f" Weight version updated to {self.weight_version}."
        self.stats["weight_updates"] += 1
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def _cmd_release(self, p: MemoryBody) -> Reply:
        tags = set(p.tags or MEMORY_TAGS)
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

    def _cmd_resume(self, p: MemoryBody) -> Reply:
        tags = set(p.tags or MEMORY_TAGS)
        if "weights" in tags and self.model is None:
            self.model = Qwen3ForCausalLM.from_pretrained(self.model_path).eval()
        self.released -= tags
        return 200, None

    def _cmd_pause(self, p: PauseBody) -> Reply:
        """SGLang's modes: abort returns every running and waiting request now (finish_reason abort); in_place
        and retract keep them (here both keep their KV) to continue after /continue_generation."""
        if p.mode == "abort":
            self.abort(abort_all=True)
            self._finish_aborted()
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _cmd_continue(self, _: None) -> Reply:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _cmd_flush(self, _: None) -> Reply:
        self.prefix.clear()
        return 200, None
