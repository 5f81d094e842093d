"""The model thread: one thread owns the model and does all compute (it schedules generation, not cells).

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
from gyre_slurm.engines.sglang_weights import (
    TransferEngineSeed,
    WeightGroups,
    check_bucket,
    load_tensors,
    receive_bucket,
)
from gyre_slurm.engines.validation import (
    MEMORY_TAGS,
    BeginWeightUpdateBody,
    DestroyWeightsGroupBody,
    DistributedUpdateBody,
    GenerateInput,
    MemoryBody,
    PauseBody,
    UpdateWeightsBody,
    UpdateWeightsFromTransferEngineBody,
)
from gyre_slurm.model.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM, kv_bytes_per_token, read_safetensors
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.kv import KVExports, KVHandle, KVLayout, KVMigrationError, refusal, weights_digest
from gyre_slurm.transfer.weights import DTYPE_NAMES

log = logging.getLogger("gyre.engine")
WAIT_FOR_RUNNING = ("update_weights", "update_distributed")  # commands that wait for running requests to finish


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
    transfer_host: str = "127.0.0.1"  # this engine's address for the Transfer Engine (update_weights_te)
    kv_export_mb: int = 1024  # cap on KV exported for migration (transfer/kv.py) and not yet freed; 0: never export
    kv_export_ttl_s: float = 120.0  # how long an export waits for its importer
    device: str = "cpu"  # where the model and its KV live (tools/gpu_check.sh runs it on "cuda"); sampling stays on CPU
    # SGLang's weight-update sessions (/begin_weight_update ... /end_weight_update, outside which a distributed update
    # is refused); False: an SGLang build from before them (the routes 404, updates load directly)
    weight_sessions: bool = True


class EmbeddedEngine:
    """The model, its tokenizer and the thread that runs every request and control command."""

    def __init__(self, opts: EngineOptions):
        self.opts = opts
        self.model_path = str(Path(opts.model_path).resolve())
        self.weight_version = str(opts.weight_version)
        self.config = Qwen3Config.from_pretrained(self.model_path)
        self.device = torch.device(opts.device)
        self.model: Qwen3ForCausalLM | None = self._load(self.model_path)
        self.context_len = opts.context_length or self.config.max_position_embeddings
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_ids = frozenset(eos_ids(self.model_path, self.config, self.tokenizer))
        self.released: set[str] = set()
        self.dtype = dtype = self.model.model.embed_tokens.weight.dtype
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
        self._puller = None  # transfer.weights.WeightPuller, made by the first update over the Transfer Engine
        self.url: str | None = None  # where this engine is reached over HTTP (set by serve.py)
        self.kv_exports = KVExports(lambda: TransferAgent.shared(opts.transfer_host), opts.kv_export_mb << 20,
                                    opts.kv_export_ttl_s)
        self._weights_digest: str | None = None  # see weights_id
        self.weight_groups = WeightGroups()  # /init_weights_update_group's process groups (sglang_weights.py)
        self.seed = TransferEngineSeed()  # the weights as /remote_instance_transfer_engine_info serves them
        self.weight_session = False  # a /begin_weight_update session is open (EngineOptions.weight_sessions)
        self.stats = {"requests": 0, "generated_tokens": 0, "prefilled_tokens": 0, "cached_tokens": 0,
                      "aborted": 0, "weight_updates": 0, "kv_imports": 0, "kv_imported_tokens": 0}
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

    def abort(self, rid: str | None = None, abort_all: bool = False, export_kv: bool = False) -> int:
        """`export_kv`: the abort answers carry a KV handle (transfer/kv.py), for the call to continue elsewhere."""
        with self._cv:
            hit = list(self._by_rid.values()) if abort_all else [self._by_rid[rid]] if rid in self._by_rid else []
            for req in hit:
                req.aborted = True
                req.export_kv = req.export_kv or export_kv
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
            if cmd.kind in WAIT_FOR_RUNNING and cmd.payload.abort_all_requests:
                self.abort(abort_all=True)  # the aborted finish on the next iteration, then the update runs
                cmd.payload = cmd.payload.model_copy(update={"abort_all_requests": False})
                return
            # Weight updates wait for running requests (no admission meanwhile), unless generation is paused in
            # place (SGLang's in_place mode: frozen requests continue on the new weights); the rest run right away.
            if cmd.kind in WAIT_FOR_RUNNING and self._active and not self.paused:
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
                ids = req.prompt
                if req.inp.sampling.max_new_tokens == 0:
                    self._finish(req, {"type": "length", "length": 0})
                    continue
                req.ids = torch.tensor(ids, dtype=torch.int64)  # its KV is taken when its prefill starts
                req.reuse_hint = self.prefix.peek(ids, req.ids, self._donors(req))
            except Exception as exc:
                log.error("admitting %s failed:\n%s", req.inp.rid, traceback.format_exc())
                self._fail(req, exc)

    def _donors(self, req: Request) -> list[Donor]:
        return [Donor(r.ids, r.output_ids[len(r.prompt) - len(r.inp.input_ids):], r.cache) for r in self._active
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
        ids = req.prompt
        need = len(ids) + min(req.inp.sampling.max_new_tokens, 256)
        cache, reused = self.prefix.take(ids, req.ids, need, self._donors(req))
        if cache is None:
            cache = self.model.new_cache(need)
        req.cache, req.fed, req.cached_tokens = cache, reused, reused
        self.stats["cached_tokens"] += reused

    def _prefill_chunk(self, req: Request) -> None:
        if req.cache is None:
            self._take_cache(req)
        ids = req.prompt
        end = min(len(ids), req.fed + self.opts.chunked_prefill_size)
        chunk = torch.tensor([ids[req.fed : end]], dtype=torch.int64, device=self.device)
        last = end == len(ids)
        if last:
            logits = self.model(chunk, req.cache, last_only=True)
        else:  # KV only: no logits
            self.model.hidden_states(chunk, req.cache, keep="none")
        self.stats["prefilled_tokens"] += end - req.fed
        req.fed = end
        if last:
            self._accept([req], logits[:, -1])

    def _decode(self, reqs: list[Request]) -> None:
        tokens = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.int64, device=self.device)
        logits = self.model(tokens, [r.cache for r in reqs])
        self._accept(reqs, logits[:, -1])

    def _accept(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample one token per row, record it with its logprob, and finish rows that are done."""
        if logits.device.type != "cpu":  # the rows are small; the seeded per-request generators are CPU ones
            logits = logits.float().cpu()
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
        out = response(req, reason, self.tokenizer, self.weight_version)
        if req.cache is not None:
            if reason["type"] == "abort" and req.export_kv:
                out["meta_info"].update(self._export_kv(req))
            self.prefix.put(req.inp.input_ids + req.output_ids, req.cache)
            req.cache = None
        with self._cv:
            self._by_rid.pop(req.inp.rid, None)
        reply(req, (200, out))

    def _export_kv(self, req: Request) -> dict[str, Any]:
        """{"kv_handle": ...} for an aborted request's KV, or {"kv_export_error": why not}: never fails the abort."""
        if self.opts.kv_export_mb <= 0:
            return {"kv_export_error": "KV export is off on this engine (--kv-export-mb 0)"}
        try:
            handle = self.kv_exports.export(req.cache, req.inp.input_ids + req.output_ids, self.weight_version,
                                            self.weights_id(), self.url)
        except (KVMigrationError, TransferError) as exc:
            log.warning("request %s: no KV export: %s", req.inp.rid, exc)
            return {"kv_export_error": str(exc)}
        return {"kv_handle": handle.model_dump()}

    def weights_id(self) -> str:
        """The resident weights' digest (transfer/kv.py weights_digest), computed once per weight change."""
        if self._weights_digest is None and self.model is not None:
            self._weights_digest = weights_digest(self.model)
        return self._weights_digest or ""

    def kv_layout(self) -> KVLayout:
        c = self.config
        return KVLayout(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        dtype=DTYPE_NAMES[self.dtype])

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
        if cmd.kind in ("update_weights", "update_weights_te", "update_distributed", "resume"):
            self._weights_digest = None  # the weights may have changed: KV exports and imports digest them again
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
        message = self._weights_loaded(p.flush_cache, p.weight_version, "Succeeded to update model weights.")
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def _weights_loaded(self, flush_cache: bool, weight_version: str | None, message: str) -> str:
        """After new weights are in: the prefix cache (the old weights' KV) and the version label; the message."""
        if flush_cache:
            self.prefix.clear()
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {self.weight_version}."
        self.stats["weight_updates"] += 1
        return message

    def _cmd_update_weights_te(self, p: UpdateWeightsFromTransferEngineBody) -> Reply:
        """Pull a published version over the Transfer Engine into the resident model (calls in flight finish
        first: commands run between model steps), or the newest one after it where it was replaced before this
        read it (a cell slow to come back): the answer's version is the one served. A failed pull leaves the model
        serving what it had."""
        if self.model is None:
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": "Failed to update weights: weights are released (resume them first)"}
        from gyre_slurm.transfer.engine import TransferAgent, TransferError
        from gyre_slurm.transfer.weight_parts import pull_full
        from gyre_slurm.transfer.weights import WeightPuller

        try:
            if self._puller is None:
                self._puller = WeightPuller(TransferAgent.shared(self.opts.transfer_host), "engine")
            got = pull_full(self._puller, p.parts, at_least=True)  # a sliced version's parts put together
            report = got.report
            self.model.load_state(got.tensors, where=f"weights version {report.version}")
        except (TransferError, ValueError) as exc:
            msg = f"Failed to update weights: {exc}".replace("\n", " ")
            return 400, {"success": False, "message": msg, "num_paused_requests": 0}
        newer = report.version != p.parts[0].version
        path = (report.source or None) if newer else p.model_path
        if path is not None:  # a resume after a release reloads this version, not the one started with
            self.model_path = str(Path(path).resolve())
        label = str(report.version) if newer else p.weight_version
        message = self._weights_loaded(p.flush_cache, label, "Succeeded to update model weights over the Transfer "
                                       f"Engine (version {report.version}, {report.nbytes} bytes in "
                                       f"{report.seconds:.3f} s).")
        return 200, {"success": True, "num_paused_requests": 0, "bytes": report.nbytes, "seconds": report.seconds,
                     "version": report.version, "model_path": self.model_path, "message": message,
                     "parts": [[r.sender_rank or 0, r.nbytes, r.seconds] for r in got.reports]}

    def _cmd_release(self, p: MemoryBody) -> Reply:
        tags = set(p.tags or MEMORY_TAGS)
        with self._cv:  # atomic with submit(): no request slips in between the check and the release
            if self._active or (self._pending and not self.paused):  # SGLang lets paused waiting requests be
                raise bad_request("release_memory_occupation should be called only when server is idle.")
            self.released |= tags - {"cuda_graph"}
        if "kv_cache" in tags:
            self.prefix.clear()
        if "weights" in tags:
            self.seed.forget()  # its registration holds the tensors
            self.model = None
        gc.collect()  # free the weights now, not whenever the collector next runs
        return 200, None

    def _load(self, path: str) -> Qwen3ForCausalLM:
        return Qwen3ForCausalLM.from_pretrained(path).to(self.device).eval()

    def _cmd_resume(self, p: MemoryBody) -> Reply:
        tags = set(p.tags or MEMORY_TAGS)
        if "weights" in tags and self.model is None:
            self.model = self._load(self.model_path)
        self.released -= tags
        return 200, None

    def _cmd_pause(self, p: PauseBody) -> Reply:
        """SGLang's modes: abort returns every running and waiting request now (finish_reason abort); in_place
        freezes them with their KV; retract puts them back in the waiting queue (see _retract). Both keep them to
        continue after /continue_generation."""
        if p.mode == "abort":
            self.abort(abort_all=True, export_kv=p.export_kv)
            self._finish_aborted()
        elif p.mode == "retract":
            self._retract()
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _retract(self) -> None:
        """SGLang's retract: the running requests go back to the front of the waiting queue, their KV to the prefix
        LRU (where a release or a weight update meanwhile drops it), so nothing but finished KV stays held. Once
        admitted again, a request prefills its prompt and what it had sampled (from the LRU when still there) and
        samples on with its own generator; an abort while it waits answers with what it had sampled."""
        for req in self._active:
            if req.cache is not None:
                self.prefix.put(req.inp.input_ids + req.output_ids, req.cache)
            req.retracted = req.inp.input_ids + req.output_ids if req.output_ids else None
            req.cache, req.fed, req.ids = None, 0, None
        with self._cv:
            self._pending.extendleft(reversed(self._active))
        self._active.clear()

    # SGLang's session rule (python/sglang/srt/managers/scheduler_components/weight_updater.py): begin refuses an
    # open session, end a closed one, and the distributed update runs only inside one (update_weights_from_disk
    # needs none). SGLang asserts in its scheduler; here each refusal is a 400 with upstream's message.
    def _cmd_begin_weight_update(self, _: BeginWeightUpdateBody) -> Reply:
        if self.weight_session:
            return 400, {"success": False,
                         "message": "begin_weight_update called while a weight-update session is already open"}
        self.weight_session = True
        return 200, {"success": True, "message": "Success"}

    def _cmd_end_weight_update(self, _: None) -> Reply:
        if not self.weight_session:
            return 400, {"success": False, "message": "end_weight_update called without begin_weight_update"}
        self.weight_session = False
        return 200, {"success": True, "message": "Success"}

    def _cmd_update_distributed(self, p: DistributedUpdateBody) -> Reply:
        """One bucket of SGLang's distributed update: checked against the model, received from rank 0's broadcast
        (generation waits meanwhile, as in SGLang) and loaded only once all of it has arrived. Refused before
        anything is received outside a session (where sessions are on)."""
        if self.opts.weight_sessions and not self.weight_session:
            return 400, {"success": False,
                         "message": "update_weights_from_distributed requires an open begin_weight_update session"}
        if self.model is None:
            return 400, {"success": False, "message": "Failed to update parameter online: weights are released"}
        try:
            group, device = self.weight_groups.get(p.group_name)
            specs = check_bucket(self.model, p.names, p.dtypes, p.shapes)
        except ValueError as exc:  # refused before anything is received: the engine waits for no bytes
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}"}
        try:
            tensors = receive_bucket(group, specs, device)
        except Exception as exc:  # the trainer died or never broadcast: the group timed out
            msg = f"Failed to update parameter online: receiving failed: {type(exc).__name__}: {exc}"
            return 400, {"success": False, "message": msg.replace("\n", " ")}
        load_tensors(self.model, tensors)
        return 200, {"success": True, "message": self._weights_loaded(p.flush_cache, p.weight_version,
                                                                      "Succeeded to update parameter online.")}

    def _cmd_destroy_weights_group(self, p: DestroyWeightsGroupBody) -> Reply:
        return self.weight_groups.destroy(p.group_name)

    def _cmd_transfer_engine_info(self, rank: int) -> Reply:
        """SGLang's GET /remote_instance_transfer_engine_info for this engine's one rank, registering the weights
        with the Transfer Engine the first time (and again after a resume)."""
        if rank != 0:
            raise bad_request(f"Failed to get transfer engine info for rank {rank}")
        if self.model is None:
            raise self.released_error()
        try:
            session_id, weights = self.seed.info(self.model, self.opts.transfer_host)
        except TransferError as exc:
            raise bad_request(f"Failed to get transfer engine info for rank {rank}: {exc}") from None
        return 200, {"rank": rank, "remote_instance_transfer_engine_info": [session_id, weights]}

    def _cmd_continue(self, _: None) -> Reply:
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _cmd_import_kv(self, p: tuple[KVHandle, list[int], KVCache]) -> Reply:
        """Put a migrated KV (fetched and checked by /import_kv) into the prefix cache, after checking again, on
        the model thread, what may have changed meanwhile: weights, memory. A refusal leaves the cache as it was."""
        handle, ids, cache = p
        if self.released or self.model is None:
            raise self.released_error()
        # now=expires_at: the bytes were read and checked, a handle that expired since then is still good
        why = refusal(handle, ids, self.kv_layout(), self.weight_version, self.weights_id(), self.prefix.max_bytes,
                      now=handle.expires_at)
        if why is not None:
            raise EngineHTTPError(409, f"KV import refused: {why}")
        self.prefix.put(ids[:handle.tokens], cache)
        self.stats["kv_imports"] += 1
        self.stats["kv_imported_tokens"] += handle.tokens
        return 200, {"success": True, "imported_tokens": handle.tokens, "bytes": handle.nbytes,
                     "message": f"Imported the KV of {handle.tokens} tokens."}

    def _cmd_flush(self, _: None) -> Reply:
        self.prefix.clear()
        return 200, None
