"""Anthropic's Messages API (/v1/messages): the request converted to chat-template messages, the reply and its
stream events in Anthropic's shape.

TITO across turns works as for OpenAI: the assistant turn a client echoes back (text, tool_use, thinking blocks)
converts to the same template message as the reply the proxy built, so message_key matches and the next call
extends the previous ids.

What Claude Code sends is accepted (tests/fixtures/claude_code/first_request.json): `role: "system"` messages
inside `messages` (rendered where they stand, as the template's system messages), cache_control on blocks, tools
and system blocks, thinking / context_management / output_config / metadata (their types checked, not acted on).
Images, documents and Anthropic's server tools (web search, …) are refused: the model reads text and calls only
the client's own tools. /v1/messages/count_tokens counts the prompt a call would get (count_request).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from gyre_slurm.proxy import sse
from gyre_slurm.proxy.apierrors import bad_request
from gyre_slurm.proxy.openai_api import (
    TOOL_NAME,
    TOP_K_MAX,
    KnownMessages,
    Strict,
    check_schema,
    check_unique,
    load_with_known,
)


class CacheControl(Strict):  # prompt caching: accepted on any block, tool or system block, not acted on
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class UnreadBlock(Strict):
    """Content the model cannot read: parsed only to be refused by name (_refuse_unread)."""
    type: Literal["image", "document", "search_result", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "container_upload"]


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | UnreadBlock,
                  Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation system messages
    content: str | list[Block]


class Tool(Strict):
    type: str | None = None  # only "custom": server tools (web_search_20250305, …) are refused in parse_messages
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for custom tools: a JSON schema of type "object"
    cache_control: CacheControl | None = None


class ThinkingConfig(Strict):  # the template decides whether the model thinks; kept for the client's sake
    type: Literal["adaptive", "enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class ContextManagement(Strict):  # e.g. {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    edits: list[dict[str, Any]] | None = None


class OutputConfig(Strict):  # e.g. {"effort": "high"}
    effort: str | None = None


class Metadata(Strict):
    user_id: str | None = None


class ToolChoice(Strict):
    type: Literal["auto", "none"]  # "any" / "tool" would need constrained decoding


class CountTokensRequest(Strict):
    """/v1/messages/count_tokens: a conversation, without what only generating needs."""
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # accepted and not acted on; their types are still checked
    thinking: ThinkingConfig | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)
    stream: bool | None = None
    metadata: Metadata | None = None  # accepted and not acted on, as service_tier
    service_tier: str | None = None


def new_tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _join(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    """The inverse of reply(): an echoed assistant turn as the template message the proxy made of its reply."""
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
        b.input, ensure_ascii=False)}} for b in blocks if isinstance(b, ToolUseBlock)]
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise bad_request("tool_result blocks belong in user messages", param="messages")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}  # "" with only tool calls
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = thinking
    return msg


def _refuse_unread(blocks: list[Any], i: int) -> None:
    for j, b in enumerate(blocks):
        if isinstance(b, UnreadBlock):
            raise bad_request(f"messages.{i}.content.{j}: {b.type} blocks are not supported: this proxy serves a "
                              "text-only model", param=f"messages.{i}.content.{j}.type")


BILLING_HEADER = "x-anthropic-billing-header:"


def _model_blocks(blocks: list[TextBlock]) -> list[TextBlock]:
    """The system blocks meant for the model: Claude Code's first block is a client attribution line for Anthropic's
    billing (`x-anthropic-billing-header: cc_version=…<hash>; …`) that differs from run to run; left in, it would
    keep two runs of one task from sharing a single prefix token, so every run would pay its whole ~19k-token
    prefill instead of reusing the engine's cached prefix."""
    return [b for b in blocks if not b.text.startswith(BILLING_HEADER)]


def _system(blocks: list[Any], i: int) -> dict[str, Any]:
    """A system message inside `messages` (Claude Code's mid-conversation system), rendered where it stands."""
    if not all(isinstance(b, TextBlock) for b in blocks):
        raise bad_request(f"messages.{i}.content: system messages hold only text blocks", param=f"messages.{i}.content")
    return {"role": "system", "content": _join(blocks)}


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    """tool_result blocks become role=tool messages (Anthropic puts them first); text becomes one user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            content = b.content if isinstance(b.content, str) or b.content is None else _join(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content or ""})
        elif isinstance(b, TextBlock):
            texts.append(b.text)
        else:
            raise bad_request(f"{b.type} blocks belong in assistant messages", param="messages")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def parse_messages(body: bytes, known: KnownMessages | None = None) -> tuple[MessagesRequest, list[dict[str, Any]],
                                                                            list[dict[str, Any]] | None]:
    """The request, its messages in template_message shape, its tools in OpenAI's function shape. With `known`,
    messages equal to ones this rollout sent before are neither validated nor converted again."""
    req, messages, tools = _parse(body, MessagesRequest, known)
    assert isinstance(req, MessagesRequest)
    if req.top_k == 0:
        raise bad_request("top_k must be at least 1", param="top_k")
    if "" in (req.stop_sequences or []):
        raise bad_request("stop_sequences must not be empty strings", param="stop_sequences")
    return req, messages, tools


def count_request(body: bytes) -> tuple[CountTokensRequest, list[dict[str, Any]], list[dict[str, Any]] | None]:
    """/v1/messages/count_tokens: as parse_messages, for a request that generates nothing (and is not remembered)."""
    return _parse(body, CountTokensRequest, None)


def _check_tools(tools: list[Tool]) -> None:
    for i, t in enumerate(tools):
        if t.type not in (None, "custom"):
            raise bad_request(f"tools.{i}: server tools are not supported ({t.type!r}, {t.name!r}): this proxy runs "
                              "only the client's own (custom) tools", param=f"tools.{i}.type")
        if t.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema: Field required", param=f"tools.{i}.input_schema")
        check_schema(t.input_schema, f"tools.{i}.input_schema", type_required=True)
    check_unique([t.name for t in tools])


def _parse(body: bytes, model: type[CountTokensRequest], known: KnownMessages | None
           ) -> tuple[CountTokensRequest, list[dict[str, Any]], list[dict[str, Any]] | None]:
    got = load_with_known(body, model, known)
    req, k = got.req, got.k
    _check_tools(req.tools or [])
    for i, m in enumerate(req.messages, start=k):
        # an empty assistant turn is the proxy's own reply to an empty generation, echoed back: it stays valid
        if m.role != "assistant" and not m.content:
            raise bad_request(f"messages.{i}.content: {m.role} messages must have non-empty content",
                              param=f"messages.{i}.content")
    if k == 0 and all(m.role == "system" for m in req.messages):
        raise bad_request("messages: a conversation needs a user or assistant message (system messages alone "
                          "have nothing to answer)", param="messages")
    # per raw message: the template messages it became (a user turn may be several)
    converted = list(got.known_converted)
    for i, m in enumerate(req.messages, start=k):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        _refuse_unread(blocks, i)
        if m.role == "system":
            converted.append([_system(blocks, i)])
        else:
            converted.append([_assistant(blocks)] if m.role == "assistant" else _user(blocks))
    got.remember(known, body, converted)
    messages: list[dict[str, Any]] = []
    system = req.system if isinstance(req.system, str) or req.system is None else _join(_model_blocks(req.system))
    if system:
        messages.append({"role": "system", "content": system})
    for group in converted:
        messages.extend(group)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []]
    return req, messages, tools or None


def reply(model: str, message: dict[str, Any], finish_reason: str, matched_stop: str | None, n_prompt: int,
          n_output: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for tc in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                        # NaN / Infinity (the model's own JSON) as strings: a JSON reply cannot carry them
                        "input": json.loads(tc["function"]["arguments"], parse_constant=str)})
    if finish_reason == "length":
        stop_reason = "max_tokens"
    elif finish_reason == "tool_calls":
        stop_reason = "tool_use"
    else:
        stop_reason = "stop_sequence" if matched_stop is not None else "end_turn"
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason,
            "stop_sequence": matched_stop if stop_reason == "stop_sequence" else None,
            "usage": {"input_tokens": n_prompt, "output_tokens": n_output}}


def events(msg: dict[str, Any]) -> Iterator[bytes]:
    """A finished reply as Anthropic's stream: message_start, one start/delta…/stop run per content block,
    message_delta (stop_reason, usage), message_stop."""
    head = {**msg, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": msg["usage"]["input_tokens"], "output_tokens": 0}}
    yield sse.event({"type": "message_start", "message": head}, "message_start")
    for i, block in enumerate(msg["content"]):
        if block["type"] == "text":
            start, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p}
                                                           for p in sse.pieces(block["text"])]
        elif block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p} for p in sse.pieces(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p}
                      for p in sse.pieces(json.dumps(block["input"], ensure_ascii=False))]
        yield sse.event({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start")
        for d in deltas:
            yield sse.event({"type": "content_block_delta", "index": i, "delta": d}, "content_block_delta")
        yield sse.event({"type": "content_block_stop", "index": i}, "content_block_stop")
    yield sse.event({"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                        "stop_sequence": msg["stop_sequence"]},
                     "usage": {"output_tokens": msg["usage"]["output_tokens"]}}, "message_delta")
    yield sse.event({"type": "message_stop"}, "message_stop")
