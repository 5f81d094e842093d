"""Generation on the rollout engines: a finished prompt in; the sampled ids, their behaviour log-probs, the
weight version and the reply text out.

The engine is the one the daemon routes the rollout to (SGLang's native /generate with input_ids). When it is
gone, or aborts the request because its cell is switching to training, the generation CONTINUES on the engine of
the rollout's next route from the ids sampled so far, so a call records exactly what the policy sampled.

An abort answer of gyre's engine may carry the aborted part's KV cache, exported (meta_info.kv_handle,
transfer/kv.py): the proxy then asks the next engine to import it first (/import_kv), and the continuation prefills
only its last token instead of the whole prompt + kept ids. Any failure (no room, transfer failed, handle expired,
other weights) falls back to that re-prefill; both are counted (kv_migrations, kv_migration_fallbacks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gyre_slurm.engines.client import EngineClient, EngineError, EngineUnavailable, GenerateResult, SamplingParams
from gyre_slurm.protocol import ContextLimit, Route
from gyre_slurm.proxy.apierrors import ApiError, bad_request
from gyre_slurm.proxy.daemon_link import DaemonLink, RouteUnavailable
from gyre_slurm.proxy.sessions import Sessions
from gyre_slurm.proxy.tito import ChatRenderer

log = logging.getLogger("gyre.proxy")


@dataclass
class GenParams:
    """What every API's request says about generation, in one neutral form."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    prompt_param: str = "messages"  # where a too-long prompt is blamed


@dataclass
class Generation:
    prompt_ids: array
    output_ids: list[int]
    output_logprobs: list[float]
    text: str  # the reply without the stop token or stop string
    truncated: bool  # cut by max_tokens
    matched_stop: str | None  # the client's stop string that ended it
    cell: int | None
    weight_version: int
    started_at: float
    latency_s: float


@dataclass
class EngineCounters:
    engine_retries: int = 0
    continued_generations: int = 0  # calls continued on another engine from the ids kept at an abort
    mixed_version_calls: int = 0  # calls whose parts were sampled by different weight versions (oldest kept)
    kv_migrations: int = 0  # continuations that started from the aborted part's KV, imported (no re-prefill)
    kv_migration_fallbacks: int = 0  # continuations whose KV could not be migrated: they re-prefilled


def read_model_info(model_path: Path) -> tuple[int, str | None, list[int]]:
    """(context limit, model_type, eos ids) from config.json / generation_config.json."""
    cfg = json.loads((model_path / "config.json").read_text())
    text_cfg = cfg.get("text_config") or {}
    limit = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings") or 32768
    eos: list[int] = []
    gen = model_path / "generation_config.json"
    for source in (cfg, json.loads(gen.read_text()) if gen.is_file() else {}):
        ids = source.get("eos_token_id")
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in eos:
                eos.append(i)
    return int(limit), cfg.get("model_type"), eos


def served_version(result: GenerateResult, route: Route) -> int:
    """The weight version that sampled `result`; an engine without a gyre version label: what the daemon said it
    serves (-1: unknown)."""
    if result.weight_version is not None:
        return result.weight_version
    return route.weight_version if route.weight_version is not None else -1


class Kept:
    """What the parts of one generation sampled so far, with their log-probs and weight versions (over any number
    of aborts): the next engine gets prompt + kept ids, with max_new_tokens reduced by as many."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: set[int] = set()  # of the parts that produced kept ids
        self.continued = False
        self.kv: dict | str | None = None  # the last abort's KV handle, or why it has none (a failed export)

    def attempt(self, prompt_ids: array, sampling: SamplingParams) -> tuple[Sequence[int], SamplingParams]:
        """(input ids, sampling) of the next request: the prompt as it is while nothing is kept."""
        if not self.ids:
            return prompt_ids, sampling
        self.continued = True
        input_ids = prompt_ids + array(prompt_ids.typecode, self.ids) if isinstance(prompt_ids, array) \
            else list(prompt_ids) + self.ids
        return input_ids, replace(sampling, max_new_tokens=sampling.max_new_tokens - len(self.ids))

    def take(self, result: GenerateResult, version: int) -> None:
        """Keep what an answer sampled. An abort without a log-prob per id is dropped (the next part samples it
        again); any other answer without them is the engine's fault."""
        lps = result.output_logprobs
        meta = result.meta_info if result.finish_reason == "abort" else {}
        self.kv = meta.get("kv_handle") or meta.get("kv_export_error")
        if result.output_ids and (lps is None or len(lps) != len(result.output_ids)):
            if result.finish_reason != "abort":
                raise ApiError(502, "the engine returned no log-probability per output token", type="server_error",
                               code="engine_error")
            self.kv = None  # it covers ids that are not kept
        elif result.output_ids:
            self.ids += result.output_ids
            self.logprobs += lps
            self.versions.add(version)

    def finished(self, result: GenerateResult, attempt: SamplingParams, sampling: SamplingParams) -> bool:
        # an abort that raced the end (a stop token kept, or no tokens left) leaves nothing to continue
        return result.finish_reason != "abort" or bool(self.ids and self.ids[-1] in attempt.stop_token_ids) \
            or len(self.ids) >= sampling.max_new_tokens

    def result(self, last: GenerateResult, attempt: SamplingParams, version: int, n_prompt: int) -> GenerateResult:
        finish = last.finish_reason
        if finish == "abort":
            finish = "stop" if self.ids[-1] in attempt.stop_token_ids else "length"
        return replace(last, output_ids=self.ids, output_logprobs=self.logprobs, finish_reason=finish,
                       weight_version=min(self.versions or {version}), prompt_tokens=n_prompt)


class Engines:
    """The rollout engines as the proxy calls them: routes from the daemon, one HTTP client per engine."""

    def __init__(self, link: DaemonLink, sessions: Sessions, renderer: ChatRenderer, max_context: int,
                 stop_token_ids: list[int], *, route_timeout_s: float, retry_s: float, timeout_s: float) -> None:
        self.link, self.sessions, self.renderer = link, sessions, renderer
        self.max_context, self.stop_token_ids = max_context, stop_token_ids
        self.route_timeout_s, self.retry_s, self.timeout_s = route_timeout_s, retry_s, timeout_s
        self.clients: dict[str, EngineClient] = {}
        self.counters = EngineCounters()

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    def client(self, url: str) -> EngineClient:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = EngineClient(url, timeout_s=self.timeout_s)
        return client

    async def route(self, rid: int, refresh: bool, deadline: float) -> Route:
        while True:
            try:
                route = await self.link.aroute(rid, self.route_timeout_s, refresh=refresh)
            except RouteUnavailable:
                raise ApiError(503, "no route to a rollout engine: the daemon did not answer", type="server_error",
                               code="no_route") from None
            if not route.open:
                self.sessions.drop(rid)
                raise ApiError(401, f"rollout {rid} is finished: its API key no longer works", code="rollout_closed")
            if route.engine_url:
                return route
            if time.monotonic() > deadline:  # open, but no rollout cell serves it right now
                raise ApiError(503, "no rollout engine is available", type="server_error", code="no_engine")
            await asyncio.sleep(0.5)
            refresh = True

    def sampling(self, params: GenParams, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens,
                              temperature=1.0 if params.temperature is None else params.temperature,
                              top_p=1.0 if params.top_p is None else params.top_p,
                              top_k=-1 if params.top_k is None else params.top_k, stop=tuple(params.stop),
                              stop_token_ids=tuple(self.stop_token_ids))

    async def run(self, rollout_id: int, prompt_ids: array, params: GenParams) -> Generation:
        """Generate for a finished prompt and decode the reply text (without the stop token or stop string)."""
        n_prompt = len(prompt_ids)
        # SGLang's rule: prompt + max_new_tokens must stay below the context length
        max_tokens = params.max_tokens or (self.max_context - n_prompt - 1)
        if max_tokens < 1 or n_prompt + max_tokens >= self.max_context:
            if n_prompt + 1 >= self.max_context:  # the history itself no longer fits: the run hit its context
                self.link.notify(ContextLimit(rollout_id=rollout_id, prompt_tokens=n_prompt, limit=self.max_context))
            raise bad_request(f"this model's maximum context length is {self.max_context} tokens; the prompt takes "
                              f"{n_prompt} tokens and {max_tokens} were asked for the completion",
                              param=params.prompt_param, code="context_length_exceeded")
        started_at, t0 = time.time(), time.monotonic()
        route, result = await self.generate(rollout_id, prompt_ids, self.sampling(params, max_tokens))
        latency = time.monotonic() - t0
        output_ids = result.output_ids  # one log-prob per id: Kept takes them only in pairs
        text_ids = output_ids[:-1] if output_ids and output_ids[-1] in self.stop_token_ids else output_ids
        text = self.renderer.decode(text_ids)
        matched = result.matched if isinstance(result.matched, str) and result.matched else None
        if matched is not None and matched in text:  # the stop string's tokens stay in the ids
            text = text[:text.rfind(matched)]
        # a stop token sampled as the last allowed token reads "length" in SGLang, but the turn is complete
        stopped = bool(output_ids) and output_ids[-1] in self.stop_token_ids
        return Generation(prompt_ids, output_ids, result.output_logprobs, text,
                          result.finish_reason == "length" and not stopped, matched, route.cell,
                          result.weight_version, started_at, latency)

    async def generate(self, rollout_id: int, prompt_ids: array,
                       sampling: SamplingParams) -> tuple[Route, GenerateResult]:
        """Generate on the rollout's engine; when the engine is gone or aborts the request, ask the daemon for a
        new route and continue there (Kept): an abort answer carries the ids sampled so far with their log-probs
        (as SGLang's does), so the result is exactly what the policy sampled, in the context it saw. An unreachable
        engine returns nothing: the retry continues from what was kept. Parts sampled by different weight versions
        record the oldest."""
        deadline = time.monotonic() + self.retry_s
        refresh, delay = False, 0.2
        kept = Kept()
        while True:
            route = await self.route(rollout_id, refresh, deadline)
            if route.temperature is not None and route.temperature != sampling.temperature:
                sampling = replace(sampling, temperature=route.temperature)  # the daemon's word: an evaluation run
            input_ids, attempt = kept.attempt(prompt_ids, sampling)
            if kept.kv is not None:
                kv, kept.kv = kept.kv, None
                await self._migrate(rollout_id, route.engine_url, kv, input_ids)
            try:
                result = await self.client(route.engine_url).generate(
                    input_ids, attempt, f"gyre-r{rollout_id}-{uuid.uuid4().hex[:12]}")
            except EngineUnavailable as e:
                problem = str(e)
            except EngineError as e:  # the engine refused what the proxy sent: not the harness's fault
                raise ApiError(502, f"the rollout engine refused the call: {e}", type="server_error",
                               code="engine_error") from None
            else:
                version = served_version(result, route)
                kept.take(result, version)
                if kept.finished(result, attempt, sampling):
                    self._count(rollout_id, kept)
                    return route, kept.result(result, attempt, version, len(prompt_ids))
                problem = f"the engine aborted the generation after {len(kept.ids)} tokens"
                # the engine answered: the retry window counts from here (a long generation may end in an abort)
                deadline = max(deadline, time.monotonic() + self.retry_s)
            if time.monotonic() + delay > deadline:
                raise ApiError(503, f"no rollout engine could serve the call: {problem}", type="server_error",
                               code="engine_unavailable")
            log.warning("rollout %d: %s; asking for a new route to continue", rollout_id, problem)
            self.counters.engine_retries += 1
            self.link.forget_route(rollout_id)
            await asyncio.sleep(delay)
            refresh, delay = True, min(delay * 2, 2.0)

    async def _migrate(self, rollout_id: int, url: str, kv: dict | str, input_ids: Sequence[int]) -> None:
        """Before a continuation: the engine at `url` imports the aborted part's KV; on failure the continuation
        re-prefills (counted, the reason logged)."""
        if isinstance(kv, str):
            why = f"the aborting engine exported no KV ({kv})"
        else:
            try:
                await self.client(url).import_kv(kv, input_ids)
            except EngineError as e:
                why = str(e)
            else:
                self.counters.kv_migrations += 1
                return
        self.counters.kv_migration_fallbacks += 1
        log.warning("rollout %d: KV migration failed, the continuation re-prefills: %s", rollout_id, why)

    def _count(self, rollout_id: int, kept: Kept) -> None:
        if kept.continued:
            self.counters.continued_generations += 1
        if len(kept.versions) > 1:
            self.counters.mixed_version_calls += 1
            log.info("rollout %d: one call sampled by weight versions %s; recorded as %d", rollout_id,
                     sorted(kept.versions), min(kept.versions))
