"""The API calls: OpenAI /v1/chat/completions and /v1/completions (openai_api.py), /v1/responses
(responses_api.py), Anthropic /v1/messages and /v1/messages/count_tokens (anthropic_api.py), each optionally
streamed (sse.py), over one code path per kind of call: a chat turn (`chat_call`: the prompt reuses the exact ids
of the conversation it extends, conversations.py) or a token-in completion (`completion_call`); both generate
(generation.py), parse the reply and record the call (recording.py).

The API key names the rollout (keys.py); a finished rollout's key is refused.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from gyre_slurm.proxy import anthropic_api, openai_api, responses_api, sse
from gyre_slurm.proxy.apierrors import ApiError, ServedModels, bad_request
from gyre_slurm.proxy.conversations import KINDS, PromptPlan
from gyre_slurm.proxy.daemon_link import DaemonLink
from gyre_slurm.proxy.generation import Engines, Generation, GenParams
from gyre_slurm.proxy.keys import rollout_of
from gyre_slurm.proxy.recording import Recording, Taken
from gyre_slurm.proxy.sessions import Lineage, Sessions
from gyre_slurm.proxy.tito import ChatRenderer, canonical_mismatch, template_message
from gyre_slurm.proxy.toolcalls import Parser

log = logging.getLogger("gyre.proxy")


@dataclass
class ChatOutcome:
    message: dict[str, Any]  # OpenAI's assistant message (content, tool_calls, reasoning_content)
    finish_reason: str  # stop | tool_calls | length
    matched_stop: str | None
    n_prompt: int
    n_output: int
    started_at: float


def kind_hint(request: Request) -> str | None:
    """A harness that knows which agent is calling may say so (conversations.py: kinds)."""
    value = request.headers.get("x-gyre-branch-kind")
    if value is None:
        return None
    if value not in KINDS:
        raise bad_request(f"X-Gyre-Branch-Kind must be one of {', '.join(KINDS)}, not {value!r}")
    return value


class Calls:
    def __init__(self, link: DaemonLink, sessions: Sessions, engines: Engines, recording: Recording,
                 renderer: ChatRenderer, parse: Parser, served_models: ServedModels,
                 check_canonical: bool) -> None:
        self.link, self.sessions, self.engines, self.recording = link, sessions, engines, recording
        self.renderer, self.parse, self.served_models = renderer, parse, served_models
        self.check_canonical = check_canonical
        self.stats = recording.stats
        self.vocab = len(renderer.tok)  # token-in prompts are checked against it
        self.kept_responses = responses_api.Kept()  # for /v1/responses previous_response_id

    def authenticate(self, request: Request, check_open: bool = True) -> int:
        """The rollout the request's API key names (OpenAI's bearer token or Anthropic's x-api-key)."""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        rid = rollout_of(self.link.token, key.strip())
        if rid is None:
            raise ApiError(401, "Incorrect API key provided: this proxy serves per-rollout keys (gyre-r<id>-…)",
                           code="invalid_api_key")
        if check_open and self.link.is_closed(rid):
            self.sessions.drop(rid)
            raise ApiError(401, f"rollout {rid} is finished: its API key no longer works", code="rollout_closed")
        return rid

    # --- one code path per kind of call ---------------------------------------------------------------------------
    async def chat_call(self, rollout_id: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        params: GenParams, api: str, parse_tools: bool,
                        new_id: Callable[[], str] | None = None, kind_hint: str | None = None) -> ChatOutcome:
        """A chat turn for any chat-shaped API: messages (template_message shape) in, the assistant message out.
        The prompt reuses the exact ids of the deepest earlier call the conversation extends (conversations.py)."""
        session = self.sessions.touch(rollout_id)
        try:
            # on the event loop: it costs what the call adds (a thread hop would cost more under the GIL)
            plan = session.conv.plan(self.renderer, messages, tools, kind_hint)
        except TemplateError as e:  # the template's own checks (e.g. "No user query found in messages.")
            raise bad_request(f"the model's chat template cannot render these messages: {e}",
                              param="messages") from None
        gen = await self.engines.run(rollout_id, plan.prompt_ids, params)
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
        def take(index: int) -> Taken:
            delta = session.conv.delta(plan, reply, gen.output_ids, finish_reason, index)
            return Taken(delta, lambda: session.conv.apply(delta))

        call_index = self.recording.record(rollout_id, session, api, gen, lineage, finish_reason, take)
        if self.check_canonical and plan.reused_tokens:
            await self._check_canonical(rollout_id, call_index, plan, messages, tools)
        return ChatOutcome(message, finish_reason, gen.matched_stop, len(gen.prompt_ids), len(gen.output_ids),
                           gen.started_at)

    async def _check_canonical(self, rollout_id: int, call_index: int, plan: PromptPlan,
                               messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """A health metric: do the reused ids differ from what rendering the whole history would give?"""
        at = await asyncio.to_thread(canonical_mismatch, self.renderer, plan.prompt_ids.tolist(), messages, tools)
        self.stats.canonical_checked += 1
        if at is not None:
            self.stats.canonical_mismatch += 1
            log.info("rollout %d call %d: reused ids differ from the canonical render at char %d", rollout_id,
                     call_index, at)

    async def completion_call(self, rollout_id: int, prompt_ids: list[int],
                              params: GenParams) -> tuple[Generation, str]:
        """A token-in completion. Its TITO rule is the client's: the prompt ids are exactly what it sent (or its
        string, encoded without special tokens), never re-rendered. The record says how they relate to the
        rollout's previous completion: it extends prompt + output (reused), repeats the prompt (retry), or not
        (edit). Chat state is left alone: a completion does not extend or break a chat conversation."""
        session = self.sessions.touch(rollout_id)
        head, ids = session.completion_head, array("i", prompt_ids)
        if head is None:
            lineage = Lineage(ids, 0, None, None)
        elif len(ids) > len(head) and ids[:len(head)] == head:
            lineage = Lineage(ids, len(head), session.completion_call, None)
        elif session.completion_prompt_len == len(ids) and head[:len(ids)] == ids:
            lineage = Lineage(ids, len(ids), session.completion_call, "retry")
        else:
            lineage = Lineage(ids, 0, None, "edit")
        gen = await self.engines.run(rollout_id, ids, params)
        finish_reason = "length" if gen.truncated else "stop"

        def take(index: int) -> Taken:
            def apply() -> None:
                session.completion_head = ids + array("i", gen.output_ids)
                session.completion_prompt_len, session.completion_call = len(ids), index
            return Taken(None, apply)

        self.recording.record(rollout_id, session, "openai-completions", gen, lineage, finish_reason, take)
        return gen, finish_reason

    # --- the APIs -----------------------------------------------------------------------------------------------
    async def openai_chat(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req, messages = openai_api.parse_chat(await request.body(), self.sessions.touch(rollout_id).known)
        self.served_models.check(req.model)
        tools = [t.model_dump(mode="json") for t in req.tools] if req.tools else None
        params = GenParams(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.top_k,
                           req.stop_list(), "messages")
        out = await self.chat_call(rollout_id, messages, tools, params, "openai-chat", req.tool_choice != "none",
                                   kind_hint=kind_hint(request))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(out.started_at)
        usage = openai_api.usage(out.n_prompt, out.n_output)
        if req.stream:  # the call is already recorded: a client that leaves mid-stream changes nothing
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse.response(openai_api.chat_chunks(cid, created, req.model, out.message, out.finish_reason,
                                                       usage, include_usage))
        return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "message": out.message, "finish_reason": out.finish_reason,
                             "logprobs": None}], "usage": usage}

    async def openai_completions(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req = openai_api.parse_completion(await request.body(), vocab=self.vocab)
        self.served_models.check(req.model)
        prompt_ids = self.renderer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        params = GenParams(req.max_tokens, req.temperature, req.top_p, req.top_k, req.stop_list(), "prompt")
        gen, finish_reason = await self.completion_call(rollout_id, prompt_ids, params)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(gen.started_at)
        usage = openai_api.usage(len(gen.prompt_ids), len(gen.output_ids))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return sse.response(openai_api.completion_chunks(cid, created, req.model, gen.text, finish_reason, usage,
                                                             include_usage))
        return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "text": gen.text, "finish_reason": finish_reason, "logprobs": None}],
                "usage": usage}

    async def anthropic_messages(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req, messages, tools = anthropic_api.parse_messages(await request.body(),
                                                            self.sessions.touch(rollout_id).known_anthropic)
        self.served_models.check(req.model)
        params = GenParams(req.max_tokens, req.temperature, req.top_p, req.top_k, list(req.stop_sequences or []),
                           "messages")
        parse_tools = not (req.tool_choice and req.tool_choice.type == "none")
        out = await self.chat_call(rollout_id, messages, tools, params, "anthropic-messages", parse_tools,
                                   new_id=anthropic_api.new_tool_id, kind_hint=kind_hint(request))
        reply = anthropic_api.reply(req.model, out.message, out.finish_reason, out.matched_stop, out.n_prompt,
                                    out.n_output)
        if req.stream:  # recorded already, as for OpenAI
            return sse.response(anthropic_api.events(reply))
        return reply

    async def anthropic_count_tokens(self, request: Request) -> dict[str, Any]:
        """The prompt length the same /v1/messages call would get, from the same plan (the conversation's reused
        ids, or the template's render): no generation, nothing recorded or remembered."""
        rollout_id = self.authenticate(request)
        req, messages, tools = anthropic_api.count_request(await request.body())
        self.served_models.check(req.model)
        try:
            plan = self.sessions.touch(rollout_id).conv.plan(self.renderer, messages, tools, kind_hint(request))
        except TemplateError as e:
            raise bad_request(f"the model's chat template cannot render these messages: {e}",
                              param="messages") from None
        return {"input_tokens": len(plan.prompt_ids)}

    async def openai_responses(self, request: Request) -> dict[str, Any] | StreamingResponse:
        rollout_id = self.authenticate(request)
        req, history, messages, tools = responses_api.parse(await request.body(), self.kept_responses, rollout_id)
        self.served_models.check(req.model)
        params = GenParams(req.max_output_tokens, req.temperature, req.top_p, None, [], "input")
        out = await self.chat_call(rollout_id, messages, tools, params, "openai-responses", req.tool_choice != "none",
                                   kind_hint=kind_hint(request))
        reply = responses_api.reply(req, out.message, out.finish_reason, out.n_prompt, out.n_output, out.started_at)
        responses_api.keep_reply(self.kept_responses, rollout_id, reply, history, out.message)
        if req.stream:  # recorded already, as for OpenAI
            return sse.response(responses_api.events(reply))
        return reply
