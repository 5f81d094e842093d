"""The TITO proxy's HTTP face: OpenAI- and Anthropic-compatible APIs in front of the rollout engines.

APIs: OpenAI /v1/chat/completions and /v1/completions (openai_api.py), Anthropic /v1/messages
(anthropic_api.py); each may stream (sse.py). All of them share one generate + parse + record path.

The API key names the rollout (proxy/keys.py). Each call's prompt ids reuse the exact ids of the rollout's
previous call where the conversation extends it (proxy/tito.py); the engine's native /generate is called with
input_ids and return_logprob; the output is parsed into content / reasoning / tool calls for the harness, and
the exact ids, behaviour log-probs and weight version go to the daemon as a CallRecord (journaled first,
proxy/recorder.py, proxy/router.py).

Run: python -m gyre_slurm.proxy.app --run-dir DIR --model-path DIR [--host H] [--port 0] [--ready-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import time
import uuid
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gyre_slurm.engines.client import EngineClient, EngineError, EngineUnavailable, GenerateResult, SamplingParams
from gyre_slurm.protocol import CallRecord, ContextLimit, Route
from gyre_slurm.proxy import anthropic_api, openai_api, sse
from gyre_slurm.proxy.apierrors import ApiError, ServedModels, bad_request
from gyre_slurm.proxy.conversations import KINDS, Conversations
from gyre_slurm.proxy.keys import rollout_of
from gyre_slurm.proxy.recorder import Recorder
from gyre_slurm.proxy.router import DaemonLink, RouteUnavailable
from gyre_slurm.proxy.tito import ChatRenderer, canonical_mismatch, template_message
from gyre_slurm.proxy.toolcalls import get_parser, parser_for_model_type

log = logging.getLogger("gyre.proxy")


# --- per-rollout state ----------------------------------------------------------------------------------------
@dataclass
class Session:
    conv: Conversations = field(default_factory=Conversations)  # chat calls (any chat-shaped API): what TITO extends
    next_index: int = 0
    used_at: float = field(default_factory=time.monotonic)
    completion_head: array | None = None  # the last /v1/completions call's prompt + output ids
    completion_prompt_len: int = 0
    completion_call: int | None = None  # its call index
    # recent requests' messages, per API (each converts them its own way): see openai_api.load_with_known
    known: openai_api.KnownMessages = field(default_factory=list)
    known_anthropic: openai_api.KnownMessages = field(default_factory=list)


@dataclass
class Lineage:
    """How a call's prompt relates to earlier calls: what the record carries instead of the whole prompt."""

    prompt_ids: array  # the whole prompt
    reused_tokens: int  # its first ids are the parent call's prompt ∥ output (or prompt, for a retry)
    parent_call: int | None
    branch_reason: str | None
    kind: str = "main"


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
class ChatOutcome:
    message: dict[str, Any]  # OpenAI's assistant message (content, tool_calls, reasoning_content)
    finish_reason: str  # stop | tool_calls | length
    matched_stop: str | None
    n_prompt: int
    n_output: int
    started_at: float


async def iterate(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    # an async body keeps the stream on the event loop (a sync iterator would take a worker thread per chunk)
    for chunk in chunks:
        yield chunk


@dataclass
class Stats:
    calls: int = 0
    branches: Counter = field(default_factory=Counter)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    canonical_checked: int = 0
    canonical_mismatch: int = 0
    malformed_tool_calls: int = 0
    engine_retries: int = 0
    continued_generations: int = 0  # calls continued on another engine from the ids kept at an abort
    mixed_version_calls: int = 0  # calls whose parts were sampled by different weight versions (oldest kept)


def _read_model_info(model_path: Path) -> tuple[int, str | None, list[int]]:
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


class Proxy:
    def __init__(self, run_dir: Path, model_path: Path, *, proxy_id: str | None = None, parser: str | None = None,
                 served_models: Iterable[str] | None = None, check_canonical: bool = False,
                 route_timeout_s: float = 10.0,
                 engine_retry_s: float = 60.0, engine_timeout_s: float = 3600.0,
                 template_kwargs: dict[str, Any] | None = None, hello_interval_s: float = 2.0,
                 idle_check_s: float = 300.0) -> None:
        from transformers import AutoTokenizer

        self.run_dir, self.model_path = Path(run_dir), Path(model_path)
        self.proxy_id = proxy_id or socket.gethostname()
        # fnmatch patterns of the model names answered (default: any; apierrors.DEFAULT_SERVED_MODELS)
        self.served_models = ServedModels(served_models)
        self.check_canonical = check_canonical
        self.route_timeout_s, self.engine_retry_s = route_timeout_s, engine_retry_s
        self.engine_timeout_s = engine_timeout_s
        self.hello_interval_s = hello_interval_s
        self.idle_check_s = idle_check_s
        self._sweeper: asyncio.Task | None = None
        self.renderer = ChatRenderer(AutoTokenizer.from_pretrained(self.model_path), template_kwargs)
        self.max_context, model_type, eos = _read_model_info(self.model_path)
        self.stop_token_ids = eos or [self.renderer.eos_id]
        self.parse = get_parser(parser or parser_for_model_type(model_type))
        self.url = ""
        self.sessions: dict[int, Session] = {}
        self.stats = Stats()
        self.recorder: Recorder | None = None
        self.link: DaemonLink | None = None
        self.engines: dict[str, EngineClient] = {}

    # --- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.recorder = Recorder(self.run_dir, self.proxy_id)
        for rid, r in self.recorder.restored.items():  # a restarted proxy keeps extending open rollouts
            session = self.sessions[rid] = Session(next_index=r.next_call_index)
            for rec, delta in r.calls:  # replayed in call order: the conversations come back as they were
                if delta is not None:
                    session.conv.apply({**delta, "tail": rec.prompt_ids, "output_ids": rec.output_ids})
        self.recorder.restored = {}
        self.link = DaemonLink(self.run_dir, self.proxy_id, self.recorder, url=self.url,
                               hello_interval_s=self.hello_interval_s)
        loop = asyncio.get_running_loop()
        self.link.on_closed = lambda rid: loop.call_soon_threadsafe(self.sessions.pop, rid, None)
        self.link.start()
        self._sweeper = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """A rollout's last call is usually acked while it is still open, so the proxy would never hear that it
        ended: ask the daemon about rollouts idle for a while; a closed one's state is dropped (on_closed)."""
        while True:
            await asyncio.sleep(self.idle_check_s / 4)
            now = time.monotonic()
            idle = [rid for rid, s in list(self.sessions.items()) if now - s.used_at > self.idle_check_s]
            for rid in idle:
                with contextlib.suppress(RouteUnavailable):
                    await self.link.aroute(rid, self.route_timeout_s, refresh=True)
                if rid in self.sessions:
                    self.sessions[rid].used_at = now

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for client in self.engines.values():
            await client.aclose()
        if self.link is not None:
            self.link.stop()
        if self.recorder is not None:
            self.recorder.close()

    def set_url(self, url: str) -> None:
        self.url = url
        if self.link is not None:
            self.link.url = url

    # --- auth -----------------------------------------------------------------------------------------------------
    def authenticate(self, request: Request, check_open: bool = True) -> int:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        rid = rollout_of(self.link.token, key.strip())
        if rid is None:
            raise ApiError(401, "Incorrect API key provided: this proxy serves per-rollout keys (gyre-r<id>-…)",
                           code="invalid_api_key")
        if check_open and self.link.is_closed(rid):
            self.sessions.pop(rid, None)
            raise ApiError(401, f"rollout {rid} is finished: its API key no longer works", code="rollout_closed")
        return rid

    # --- engine -----------------------------------------------------------------------------------------------
    async def _route(self, rid: int, refresh: bool, deadline: float) -> Route:
        while True:
            try:
                route = await self.link.aroute(rid, self.route_timeout_s, refresh=refresh)
            except RouteUnavailable:
                raise ApiError(503, "no route to a rollout engine: the daemon did not answer", type="server_error",
                               code="no_route") from None
            if not route.open:
                self.sessions.pop(rid, None)
                raise ApiError(401, f"rollout {rid} is finished: its API key no longer works", code="rollout_closed")
            if route.engine_url:
                return route
            if time.monotonic() > deadline:  # open, but no rollout cell serves it right now
                raise ApiError(503, "no rollout engine is available", type="server_error", code="no_engine")
            await asyncio.sleep(0.5)
            refresh = True

    def _engine(self, url: str) -> EngineClient:
        client = self.engines.get(url)
        if client is None:
            client = self.engines[url] = EngineClient(url, timeout_s=self.engine_timeout_s)
        return client

    async def _generate(self, rollout_id: int, prompt_ids: array,
                        sampling: SamplingParams) -> tuple[Route, GenerateResult]:
        """Generate on the rollout's engine; when the engine is gone or aborts the request (its cell is switching
        to training), ask the daemon for a new route and CONTINUE there: an abort answer carries the ids sampled so
        far with their log-probs (as SGLang's does); they are kept, the next engine gets prompt + kept ids with
        max_new_tokens reduced by as many, and the result is kept + continuation, i.e. exactly what the policy
        sampled, in the context it saw (over any number of aborts). An unreachable engine returns nothing: the
        retry continues from what was kept. Parts sampled by different weight versions record the oldest."""
        deadline = time.monotonic() + self.engine_retry_s
        refresh, delay = False, 0.2
        kept_ids: list[int] = []
        kept_lps: list[float] = []
        versions: set[int] = set()  # of the parts that produced kept ids
        continued = False
        while True:
            route = await self._route(rollout_id, refresh, deadline)
            rid = f"gyre-r{rollout_id}-{uuid.uuid4().hex[:12]}"
            input_ids, attempt = prompt_ids, sampling
            if kept_ids:
                input_ids = prompt_ids + array(prompt_ids.typecode, kept_ids) if isinstance(prompt_ids, array) \
                    else list(prompt_ids) + kept_ids
                attempt = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(kept_ids))
                continued = True
            try:
                result = await self._engine(route.engine_url).generate(input_ids, attempt, rid)
            except EngineUnavailable as e:
                problem = str(e)
            except EngineError as e:  # the engine refused what the proxy sent: not the harness's fault
                raise ApiError(502, f"the rollout engine refused the call: {e}", type="server_error",
                               code="engine_error") from None
            else:
                version = result.weight_version
                if version is None:  # an engine without a gyre version label: what the daemon said it serves
                    version = route.weight_version if route.weight_version is not None else -1
                lps = result.output_logprobs
                if result.output_ids and (lps is None or len(lps) != len(result.output_ids)):
                    if result.finish_reason != "abort":
                        raise ApiError(502, "the engine returned no log-probability per output token",
                                       type="server_error", code="engine_error")
                elif result.output_ids:
                    kept_ids += result.output_ids
                    kept_lps += lps
                    versions.add(version)
                done = result.finish_reason != "abort" or (kept_ids and kept_ids[-1] in attempt.stop_token_ids) \
                    or len(kept_ids) >= sampling.max_new_tokens  # an abort that raced the end: nothing is left
                if done:
                    finish = result.finish_reason
                    if finish == "abort":
                        finish = "stop" if kept_ids[-1] in attempt.stop_token_ids else "length"
                    if continued:
                        self.stats.continued_generations += 1
                    if len(versions) > 1:
                        self.stats.mixed_version_calls += 1
                        log.info("rollout %d: one call sampled by weight versions %s; recorded as %d", rollout_id,
                                 sorted(versions), min(versions))
                    return route, replace(result, output_ids=kept_ids, output_logprobs=kept_lps,
                                          finish_reason=finish, weight_version=min(versions or {version}),
                                          prompt_tokens=len(prompt_ids))
                problem = f"the engine aborted the generation after {len(kept_ids)} tokens"
                # the engine answered: the retry window counts from here (a long generation may end in an abort)
                deadline = max(deadline, time.monotonic() + self.engine_retry_s)
            if time.monotonic() + delay > deadline:
                raise ApiError(503, f"no rollout engine could serve the call: {problem}", type="server_error",
                               code="engine_unavailable")
            log.warning("rollout %d: %s; asking for a new route to continue", rollout_id, problem)
            self.stats.engine_retries += 1
            self.link.forget_route(rollout_id)
            await asyncio.sleep(delay)
            refresh, delay = True, min(delay * 2, 2.0)

    # --- the call: one code path for every API (generate, parse, record) ------------------------------------
    def _sampling(self, params: GenParams, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_tokens,
                              temperature=1.0 if params.temperature is None else params.temperature,
                              top_p=1.0 if params.top_p is None else params.top_p,
                              top_k=-1 if params.top_k is None else params.top_k, stop=tuple(params.stop),
                              stop_token_ids=tuple(self.stop_token_ids))

    async def _run_engine(self, rollout_id: int, prompt_ids: array, params: GenParams) -> Generation:
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
        route, result = await self._generate(rollout_id, prompt_ids, self._sampling(params, max_tokens))
        latency = time.monotonic() - t0
        output_ids = result.output_ids
        if result.output_logprobs is None or len(result.output_logprobs) != len(output_ids):
            raise ApiError(502, "the engine returned no log-probability per output token", type="server_error",
                           code="engine_error")
        text_ids = output_ids[:-1] if output_ids and output_ids[-1] in self.stop_token_ids else output_ids
        text = self.renderer.decode(text_ids)
        matched = result.matched if isinstance(result.matched, str) and result.matched else None
        if matched is not None and matched in text:  # the stop string's tokens stay in the ids
            text = text[:text.rfind(matched)]
        # a stop token sampled as the last allowed token reads "length" in SGLang, but the turn is complete
        stopped = bool(output_ids) and output_ids[-1] in self.stop_token_ids
        version = result.weight_version
        if version is None:  # an engine without a gyre version label: what the daemon said it serves
            version = route.weight_version if route.weight_version is not None else -1
        return Generation(prompt_ids, output_ids, result.output_logprobs, text,
                          result.finish_reason == "length" and not stopped, matched, route.cell, version,
                          started_at, latency)

    async def _record(self, rollout_id: int, session: Session, api: str, gen: Generation, lineage: Lineage,
                      finish_reason: str, commit: Callable[[int], dict[str, Any] | None]) -> int:
        """Hand the call to the daemon (journaled first). `commit(call_index)` takes the call into the session's
        conversations and returns the delta that a restarted proxy replays (None for completions)."""
        call_index = session.next_index  # taken at completion: records reach the daemon in index order
        session.next_index += 1
        delta = commit(call_index)
        # the record carries only what is new: the daemon has the parent's ids (ALGORITHMS.md §2.5)
        rec = CallRecord(rollout_id=rollout_id, call_index=call_index, api=api,
                         prompt_ids=lineage.prompt_ids[lineage.reused_tokens:].tolist(),
                         output_ids=gen.output_ids, output_logprobs=gen.output_logprobs,
                         weight_version=gen.weight_version, cell=gen.cell, finish_reason=finish_reason,
                         started_at=gen.started_at, latency_s=gen.latency_s, reused_tokens=lineage.reused_tokens,
                         parent_call=lineage.parent_call, branch_reason=lineage.branch_reason, kind=lineage.kind)
        journal_state = None
        if delta is not None:  # its ids are the record's
            journal_state = {k: v for k, v in delta.items() if k not in ("tail", "output_ids")}
        self.link.submit(rec, journal_state)  # an append to the journal (flushed, not synced): no thread hop
        self._count(lineage, rollout_id, call_index)
        return call_index

    def _session(self, rollout_id: int) -> Session:
        session = self.sessions.setdefault(rollout_id, Session())
        session.used_at = time.monotonic()
        return session

    @staticmethod
    def kind_hint(request: Request) -> str | None:
        """A harness that knows which agent is calling may say so (conversations.py: kinds)."""
        value = request.headers.get("x-gyre-branch-kind")
        if value is None:
            return None
        if value not in KINDS:
            raise bad_request(f"X-Gyre-Branch-Kind must be one of {', '.join(KINDS)}, not {value!r}")
        return value

    async def chat_call(self, rollout_id: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        params: GenParams, api: str, parse_tools: bool,
                        new_id: Callable[[], str] | None = None, kind_hint: str | None = None) -> ChatOutcome:
        """A chat turn for any chat-shaped API: messages (template_message shape) in, the assistant message out.
        The prompt reuses the exact ids of the deepest earlier call the conversation extends (conversations.py)."""
        session = self._session(rollout_id)
        try:
            # on the event loop: it costs what the call adds (a thread hop would cost more under the GIL)
            plan = session.conv.plan(self.renderer, messages, tools, kind_hint)
        except TemplateError as e:  # the template's own checks (e.g. "No user query found in messages.")
            raise bad_request(f"the model's chat template cannot render these messages: {e}",
                              param="messages") from None
        gen = await self._run_engine(rollout_id, plan.prompt_ids, params)
        parsed = self.parse(gen.text, parse_tools=parse_tools and bool(tools), new_id=new_id)
        if parsed.malformed:
            self.stats.malformed_tool_calls += 1
            log.info("rollout %d: a tool call did not parse (%s); returned as text", rollout_id,
                     "; ".join(parsed.problems))
        finish_reason = "length" if gen.truncated else ("tool_calls" if parsed.tool_calls else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        reply = template_message(message)
        lineage = Lineage(plan.prompt_ids, plan.reused_tokens, plan.parent_call, plan.branch_reason, plan.kind)
        call_index = await self._record(
            rollout_id, session, api, gen, lineage, finish_reason,
            lambda index: session.conv.commit(plan, reply, gen.output_ids, finish_reason, index))
        if self.check_canonical and plan.reused_tokens:
            at = await asyncio.to_thread(canonical_mismatch, self.renderer, plan.prompt_ids.tolist(), messages,
                                         tools)
            self.stats.canonical_checked += 1
            if at is not None:
                self.stats.canonical_mismatch += 1
                log.info("rollout %d call %d: reused ids differ from the canonical render at char %d", rollout_id,
                         call_index, at)
        return ChatOutcome(message, finish_reason, gen.matched_stop, len(gen.prompt_ids), len(gen.output_ids),
                           gen.started_at)

    async def completion_call(self, rollout_id: int, prompt_ids: list[int],
                              params: GenParams) -> tuple[Generation, str]:
        """A token-in completion. Its TITO rule is the client's: the prompt ids are exactly what it sent (or its
        string, encoded without special tokens), never re-rendered. The record says how they relate to the
        rollout's previous completion: it extends prompt + output (reused), repeats the prompt (retry), or not
        (edit). Chat state is left alone: a completion does not extend or break a chat conversation."""
        session = self._session(rollout_id)
        head, ids = session.completion_head, array("i", prompt_ids)
        if head is None:
            lineage = Lineage(ids, 0, None, None)
        elif len(ids) > len(head) and ids[:len(head)] == head:
            lineage = Lineage(ids, len(head), session.completion_call, None)
        elif session.completion_prompt_len == len(ids) and head[:len(ids)] == ids:
            lineage = Lineage(ids, len(ids), session.completion_call, "retry")
        else:
            lineage = Lineage(ids, 0, None, "edit")
        gen = await self._run_engine(rollout_id, ids, params)
        finish_reason = "length" if gen.truncated else "stop"

        def commit(index: int) -> None:
            session.completion_head = ids + array("i", gen.output_ids)
            session.completion_prompt_len, session.completion_call = len(ids), index

        await self._record(rollout_id, session, "openai-completions", gen, lineage, finish_reason, commit)
        return gen, finish_reason

    # --- the APIs -------------------------------------------------------------------------------------------
    async def openai_chat(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req, messages = openai_api.parse_chat(await request.body(), self._session(rollout_id).known)
        self.served_models.check(req.model)
        tools = [t.model_dump(mode="json") for t in req.tools] if req.tools else None
        params = GenParams(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.top_k,
                           req.stop_list(), "messages")
        out = await self.chat_call(rollout_id, messages, tools, params, "openai-chat", req.tool_choice != "none",
                                   kind_hint=self.kind_hint(request))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(out.started_at)
        usage = openai_api.usage(out.n_prompt, out.n_output)
        if req.stream:  # the call is already recorded: a client that leaves mid-stream changes nothing
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                iterate(openai_api.chat_chunks(cid, created, req.model, out.message, out.finish_reason, usage,
                                               include_usage)), media_type="text/event-stream", headers=sse.HEADERS)
        return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "message": out.message, "finish_reason": out.finish_reason,
                             "logprobs": None}], "usage": usage}

    async def openai_completions(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req = openai_api.parse_completion(await request.body())
        self.served_models.check(req.model)
        if isinstance(req.prompt, str):
            prompt_ids = self.renderer.encode(req.prompt)
        else:
            vocab = len(self.renderer.tok)
            if any(i < 0 or i >= vocab for i in req.prompt):
                raise bad_request(f"prompt: token ids must be in [0, {vocab})", param="prompt")
            prompt_ids = list(req.prompt)
        params = GenParams(req.max_tokens, req.temperature, req.top_p, req.top_k, req.stop_list(), "prompt")
        gen, finish_reason = await self.completion_call(rollout_id, prompt_ids, params)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(gen.started_at)
        usage = openai_api.usage(len(gen.prompt_ids), len(gen.output_ids))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                iterate(openai_api.completion_chunks(cid, created, req.model, gen.text, finish_reason, usage,
                                                     include_usage)), media_type="text/event-stream",
                headers=sse.HEADERS)
        return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "text": gen.text, "finish_reason": finish_reason, "logprobs": None}],
                "usage": usage}

    async def anthropic_messages(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req, messages, tools = anthropic_api.parse_messages(await request.body(),
                                                            self._session(rollout_id).known_anthropic)
        self.served_models.check(req.model)
        params = GenParams(req.max_tokens, req.temperature, req.top_p, req.top_k, list(req.stop_sequences or []),
                           "messages")
        parse_tools = not (req.tool_choice and req.tool_choice.type == "none")
        out = await self.chat_call(rollout_id, messages, tools, params, "anthropic-messages", parse_tools,
                                   new_id=anthropic_api.new_tool_id, kind_hint=self.kind_hint(request))
        reply = anthropic_api.reply(req.model, out.message, out.finish_reason, out.matched_stop, out.n_prompt,
                                    out.n_output)
        if req.stream:  # recorded already, as for OpenAI
            return StreamingResponse(iterate(anthropic_api.events(reply)), media_type="text/event-stream",
                                     headers=sse.HEADERS)
        return reply

    def _count(self, lineage: Lineage, rollout_id: int, call_index: int) -> None:
        self.stats.calls += 1
        self.stats.prompt_tokens += len(lineage.prompt_ids)
        self.stats.reused_tokens += lineage.reused_tokens
        if lineage.branch_reason is not None:
            self.stats.branches[lineage.branch_reason] += 1
            log.info("rollout %d call %d: new branch (%s, %s)", rollout_id, call_index, lineage.branch_reason,
                     lineage.kind)

    def health(self) -> dict[str, Any]:
        s = self.stats
        return {"ok": True, "proxy_id": self.proxy_id, "url": self.url, "sessions": len(self.sessions),
                "calls": s.calls,
                "branches": dict(s.branches), "reused_tokens": s.reused_tokens, "prompt_tokens": s.prompt_tokens,
                "canonical_checked": s.canonical_checked, "canonical_mismatch": s.canonical_mismatch,
                "malformed_tool_calls": s.malformed_tool_calls, "engine_retries": s.engine_retries,
                "continued_generations": s.continued_generations, "mixed_version_calls": s.mixed_version_calls,
                "pending_records": self.recorder.n_pending() if self.recorder else 0,
                "acks": self.link.n_acks if self.link else 0}


def create_app(run_dir: Path, model_path: Path, **options: Any) -> FastAPI:
    """The proxy as an ASGI app; options go to Proxy (proxy_id, parser, served_models, check_canonical, …)."""
    proxy = Proxy(run_dir, model_path, **options)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    app = FastAPI(title="gyre TITO proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy

    def _shaped(request: Request, exc: ApiError) -> JSONResponse:
        # each API's clients parse errors in their own shape
        if request.url.path.startswith("/v1/messages"):
            return exc.anthropic_response()
        return exc.response()

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

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return _shaped(request, ApiError(500, f"proxy error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.openai_chat(request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.openai_completions(request)

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> dict[str, Any] | StreamingResponse:
        return await proxy.anthropic_messages(request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        proxy.authenticate(request, check_open=False)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "gyre"}
                                           for name in proxy.served_models.names]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return proxy.health()

    return app


def _advertised(host: str) -> str:
    host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"[{host}]" if ":" in host else host


def run_proxy(run_dir: Path, model_path: Path, host: str = "127.0.0.1", port: int = 0,
              ready_file: Path | None = None, **options: Any) -> None:
    """Serve until SIGINT/SIGTERM. With port 0 a free port is taken; the ready file gets {"url": ...}."""
    import uvicorn

    app = create_app(run_dir, model_path, **options)
    # Parsing a 200k-token request allocates ~10k containers: at Python's default thresholds that runs the cyclic
    # collector many times per request, over every history the proxy holds (6 ms of a 7 ms request, measured).
    # Fewer, larger young-generation passes, and start-up objects (tokenizer, template) frozen out of them.
    gc.set_threshold(100_000, 20, 20)
    gc.freeze()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP (else Nagle delays answers)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    url = f"http://{_advertised(host)}:{sock.getsockname()[1]}"
    app.state.proxy.set_url(url)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=60))

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            log.info("proxy %s serving on %s", app.state.proxy.proxy_id, url)
            if ready_file is not None:
                Path(ready_file).parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(f"{ready_file}.tmp{os.getpid()}")
                tmp.write_text(json.dumps({"url": url}))
                os.replace(tmp, ready_file)
        await task

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gyre-proxy", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", type=Path)
    p.add_argument("--proxy-id", help="stable name of this proxy (its journal); default: the host name")
    p.add_argument("--parser", help="tool-call parser (default: from the model's config.json)")
    p.add_argument("--served-model", action="append", dest="served_models", metavar="NAME",
                   help="a model name (or fnmatch pattern) to answer; repeat for more; the plain names are what "
                        "/v1/models lists; other names get 404 (default: policy and any other name)")
    p.add_argument("--check-canonical", action="store_true",
                   help="compare every reused prompt with the canonical render (a health metric; costs CPU)")
    p.add_argument("--idle-check-s", type=float, default=300.0,
                   help="ask the daemon whether rollouts idle this long are still open (their state is freed)")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
    run_proxy(a.run_dir, a.model_path, a.host, a.port, a.ready_file, proxy_id=a.proxy_id, parser=a.parser,
              served_models=a.served_models, check_canonical=a.check_canonical, idle_check_s=a.idle_check_s)


if __name__ == "__main__":
    main()
