"""Anthropic's Messages API (/v1/messages): the request converted to chat-template messages, the reply and its
stream events in Anthropic's shape.

TITO across turns works as for OpenAI: the assistant turn a client echoes back (text, tool_use, thinking blocks)
converts to the same template message as the reply the proxy built, so message_key matches and the next call
extends the previous ids.
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


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


Block = Annotated[TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    type: Literal["custom"] | None = None  # server tools (web search, …) are Anthropic's own
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON schema of type "object" (check_schema)


class ToolChoice(Strict):
    type: Literal["auto", "none"]  # "any" / "tool" would need constrained decoding


class MessagesRequest(Strict):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)
    stream: bool | None = None
    # accepted and not acted on; their types are still checked
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
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
    got = load_with_known(body, MessagesRequest, known)
    req, k = got.req, got.k
    if req.top_k == 0:
        raise bad_request("top_k must be at least 1", param="top_k")
    if "" in (req.stop_sequences or []):
        raise bad_request("stop_sequences must not be empty strings", param="stop_sequences")
    for i, t in enumerate(req.tools or []):
        check_schema(t.input_schema, f"tools.{i}.input_schema", type_required=True)
    check_unique([t.name for t in req.tools or []])
    for i, m in enumerate(req.messages, start=k):
        # an empty assistant turn is the proxy's own reply to an empty generation, echoed back: it stays valid
        if m.role == "user" and not m.content:
            raise bad_request(f"messages.{i}.content: user messages must have non-empty content",
                              param=f"messages.{i}.content")
    # per raw message: the template messages it became (a user turn may be several)
    converted = list(got.known_converted)
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        converted.append([_assistant(blocks)] if m.role == "assistant" else _user(blocks))
    got.remember(known, body, converted)
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": req.system if isinstance(req.system, str)
                         else _join(req.system)})
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
