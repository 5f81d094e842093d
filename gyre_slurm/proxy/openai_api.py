"""OpenAI's wire format: /v1/chat/completions and /v1/completions requests, replies and stream chunks.

Requests are checked completely before anything else happens: a body that is not a JSON object, a value of the
wrong type or out of range anywhere, an unknown role, a tool without a valid name or schema: each is a 400 in
OpenAI's shape (Anthropic's, for /v1/messages, which uses the same helpers), with `param` naming the place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from gyre_slurm.proxy import sse
from gyre_slurm.proxy.apierrors import bad_request
from gyre_slurm.proxy.known import (
    SCAN_MAX_BYTES,
    Known,
    KnownMessages,
    byte_match,
    known_prefix,
    message_ends,
    remember,
    tail_ends,
)
from gyre_slurm.proxy.tito import template_message

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's and Anthropic's rule for tool (function) names
MAX_DEPTH = 100  # JSON nesting; deeper bodies would run the parser and the chat template out of stack
TOP_K_MAX = 1 << 30  # SGLang's own "whole vocabulary"


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are accepted and ignored


class _Function(Strict):
    name: str
    arguments: str


class _ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class _TextPart(Strict):
    type: Literal["text"]  # the policy reads text only
    text: str


class _Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # another name for reasoning_content (tito.template_message reads both)


class _FunctionDef(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type "object" (check_schema)
    strict: bool | None = None


class _ToolDef(Strict):
    type: Literal["function"]
    function: dict[str, Any]  # checked as _FunctionDef in parse_chat; kept as sent (the template renders it)


class StreamOptions(Strict):
    include_usage: bool | None = None


class _Sampling(Strict):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOP_K_MAX)  # not OpenAI's, but engines take it
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # accepted and not acted on; their types are still checked
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Any] | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _ids_in_vocabulary(cls, prompt: str | list[int], info: ValidationInfo) -> str | list[int]:
        """Token ids must name tokens of the policy's vocabulary (validation context: {"vocab": size})."""
        vocab = (info.context or {}).get("vocab")
        if vocab is not None and isinstance(prompt, list) and any(i < 0 or i >= vocab for i in prompt):
            raise PydanticCustomError("token_id_range", "token ids must be in [0, {vocab})", {"vocab": vocab})
        return prompt


# --- reading and checking a request body ---------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _bad_text(s: str) -> bool:
    """A lone surrogate (JSON's "\\ud800"): no tokenizer or UTF-8 reply can carry it."""
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_values(raw: Any, leaves: bool = True) -> None:
    """Every string is valid Unicode, every number finite (when `leaves`: orjson has checked both already),
    nothing nested deeper than MAX_DEPTH (no recursion)."""
    stack = [(raw, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels")
        for k, v in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
            elif leaves and (isinstance(k, str) and _bad_text(k) or isinstance(v, str) and _bad_text(v)):
                raise bad_request("the request body has a string that is not valid Unicode (a lone surrogate)")
            elif leaves and isinstance(v, float) and not math.isfinite(v):
                raise bad_request("the request body has a number too large for a float")


def _load(body: bytes) -> tuple[dict[str, Any], bool]:
    """The body as a JSON object, and whether its strings and numbers still need checking."""
    leaves = False
    try:  # orjson: a 200k-token history parses in ~1 ms (json: ~5 ms), the proxy's cost per call
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:  # orjson is stricter (64-bit integers): the json module decides
        leaves = True
        try:
            raw = json.loads(body, parse_constant=_no_constant)
        except RecursionError:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels") from None
        except ValueError as e:  # not JSON, not UTF-8/16/32, NaN or Infinity, an integer of more than 4300 digits
            raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    return raw, leaves


def load_json(body: bytes) -> dict[str, Any]:
    raw, leaves = _load(body)
    _check_values(raw, leaves)
    return raw


M = TypeVar("M", bound=BaseModel)


def _where(raw: Any, loc: tuple[Any, ...], missing: bool) -> list[str]:
    """An error's place in the body. Pydantic's loc also names union members ("str", "list[…]") and tagged-union
    tags; those are the steps that do not lead into the body, so following the body drops them."""
    out, at = [], raw
    for i, step in enumerate(loc):
        inside = (isinstance(at, dict) and isinstance(step, str) and step in at) or (
            isinstance(at, list) and isinstance(step, int) and 0 <= step < len(at))
        if inside:
            at = at[step]
        elif not (missing and i == len(loc) - 1):  # a union member or tag; else the field that is not there
            continue
        out.append(str(step))
    return out


def validate(model: type[M], raw: dict[str, Any], prefix: str = "", context: dict[str, Any] | None = None) -> M:
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as e:
        # the deepest place wins (a union's members each report; the one that got furthest says most)
        errs = e.errors()
        places = [([prefix] if prefix else []) + _where(raw, tuple(err["loc"]), err["type"] == "missing")
                  for err in errs]
        deepest = max(places, key=len)
        msgs = list(dict.fromkeys(err["msg"] for err, w in zip(errs, places, strict=True) if w == deepest))
        where = ".".join(deepest)
        raise bad_request(f"{where or 'body'}: {' or '.join(msgs)}", param=where or None) from None


def check_schema(schema: Any, where: str, *, type_required: bool) -> None:
    """A tool's input schema: a JSON-schema object (type "object"; properties an object; required names)."""
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: a tool's input schema must be a JSON object", param=where)
    kind = schema.get("type")
    if kind != "object" and (kind is not None or type_required):
        raise bad_request(f"{where}.type: a tool's input schema must have type 'object', not {kind!r}",
                          param=f"{where}.type")
    props = schema.get("properties")
    if props is not None and not (isinstance(props, dict) and all(isinstance(v, (dict, bool))
                                                                  for v in props.values())):
        raise bad_request(f"{where}.properties: must map names to JSON schemas", param=f"{where}.properties")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise bad_request(f"{where}.required: must be a list of property names", param=f"{where}.required")


def check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise bad_request(f"tools.{i}: tool names must be unique; {name!r} is given twice", param="tools")
        seen.add(name)


def _check_common(req: _Sampling) -> None:
    if req.n not in (None, 1):
        raise bad_request("only n=1 is supported", param="n")
    if req.top_k == 0:
        raise bad_request("top_k must be -1 (the whole vocabulary) or at least 1", param="top_k")
    if "" in req.stop_list():
        raise bad_request("stop strings must not be empty", param="stop")


@dataclass
class Loaded:
    """A request body read against what the rollout sent before (proxy/known.py)."""

    raw: dict[str, Any]  # the body, its messages whole
    req: Any  # the request validated; its `messages` holds only the raw messages after the first k
    k: int  # leading raw messages sent before: neither checked nor validated again
    prior: Known | None  # whose they were (prior.converted[:k] is what they became)
    head: int = -1  # where this body's messages array and messages end, when the next request may use them
    ends: list[int] | None = None
    grew_from: Known | None = None  # the entry this body extends byte for byte

    @property
    def known_converted(self) -> list[Any]:
        return self.prior.converted[:self.k] if self.prior is not None else []

    def remember(self, known: KnownMessages | None, body: bytes, converted: list[Any]) -> None:
        entry = Known(self.raw["messages"], converted, body if self.ends is not None else None, self.head, self.ends)
        remember(known, entry, self.grew_from)


def _load_tail(body: bytes, model: type[M], known: KnownMessages | None) -> Loaded | None:
    """The fast path: parse only what follows the messages the body shares, byte for byte, with a known one."""
    match = byte_match(body, known)
    if match is None:
        return None
    e, k, p = match
    tail_ends_ = tail_ends(body, p + 1)
    if tail_ends_ is None:
        return None
    raw_tail, leaves = _load(body[:e.head + 1] + body[p + 1:])  # the body with its first k messages cut out
    tail = raw_tail.get("messages")
    if not isinstance(tail, list) or len(tail) != len(tail_ends_):
        return None
    _check_values(raw_tail, leaves)
    try:
        req = model.model_validate(raw_tail)
    except ValidationError:
        return None  # validated again whole, so that the error names the right place
    raw = {**raw_tail, "messages": e.raw_msgs[:k] + tail}
    return Loaded(raw, req, k, e, e.head, e.ends[:k] + tail_ends_, e)


def load_with_known(body: bytes, model: type[M], known: KnownMessages | None) -> Loaded:
    """The request, read against what this rollout sent before: its first k raw messages equal ones sent before
    and are neither checked nor validated again (the request's `messages` holds only the rest)."""
    fast = _load_tail(body, model, known) if known else None
    if fast is not None:
        return fast
    raw, leaves = _load(body)
    k, prior = known_prefix(raw.get("messages"), known)
    scanned = message_ends(body) if not known or len(body) <= SCAN_MAX_BYTES else None
    if scanned is not None and len(scanned[1]) != len(raw.get("messages") or ()):
        scanned = None
    head, ends = scanned if scanned is not None else (-1, None)
    if k:
        tail = raw["messages"][k:]
        _check_values({key: v for key, v in raw.items() if key != "messages"}, leaves)
        _check_values(tail, leaves)
        try:
            return Loaded(raw, model.model_validate({**raw, "messages": tail}), k, prior, head, ends)
        except ValidationError:
            pass  # validated again whole below, so that the error names the right place
    _check_values(raw, leaves)
    return Loaded(raw, validate(model, raw), 0, None, head, ends)


def parse_chat(body: bytes, known: KnownMessages | None = None) -> tuple[ChatRequest, list[dict[str, Any]]]:
    """The request and its messages in template_message shape. With `known`, messages equal to ones this rollout
    sent before are neither validated nor converted again: the cost of a call is what it adds."""
    got = load_with_known(body, ChatRequest, known)
    raw, req, k = got.raw, got.req, got.k
    _check_common(req)
    if req.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice must be 'auto' or 'none'", param="tool_choice")
    for i, t in enumerate(req.tools or []):
        fn = validate(_FunctionDef, t.function, prefix=f"tools.{i}.function")
        if fn.parameters is not None:
            check_schema(fn.parameters, f"tools.{i}.function.parameters", type_required=False)
    check_unique([t.function["name"] for t in req.tools or []])
    messages = list(got.known_converted)
    for i, (m, sent) in enumerate(zip(req.messages, raw["messages"][k:], strict=True), start=k):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"messages.{i}.content: a {m.role} message needs content",
                              param=f"messages.{i}.content")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                              param=f"messages.{i}.tool_call_id")
        if m.tool_calls and m.role != "assistant":
            raise bad_request(f"messages.{i}.tool_calls: only assistant messages make tool calls",
                              param=f"messages.{i}.tool_calls")
        tm = template_message(sent)
        if tm["role"] == "developer":  # OpenAI's newer name for the system role
            tm["role"] = "system"
        messages.append(tm)
    got.remember(known, body, messages)
    return req, messages


def parse_completion(body: bytes, vocab: int | None = None) -> CompletionRequest:
    """The request; with `vocab`, a prompt of token ids is checked against the vocabulary's size."""
    req = validate(CompletionRequest, load_json(body), context={"vocab": vocab})
    _check_common(req)
    if req.echo:
        raise bad_request("echo=true is not supported", param="echo")
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of")
    return req


def usage(n_prompt: int, n_output: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_output, "total_tokens": n_prompt + n_output}


def chat_chunks(cid: str, created: int, model: str, message: dict[str, Any], finish_reason: str,
                usage_: dict[str, int], include_usage: bool) -> Iterator[bytes]:
    """A finished chat reply as chat.completion.chunk events, in the order OpenAI sends them."""
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return sse.event(out)

    yield chunk({"role": "assistant", "content": ""})
    for piece in sse.pieces(message.get("reasoning_content")):
        yield chunk({"reasoning_content": piece})
    for piece in sse.pieces(message.get("content")):
        yield chunk({"content": piece})
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc["function"]
        yield chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in sse.pieces(fn["arguments"]):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    yield chunk({}, finish_reason)
    if include_usage:
        yield sse.event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [], "usage": usage_})
    yield sse.DONE


def completion_chunks(cid: str, created: int, model: str, text: str, finish_reason: str,
                      usage_: dict[str, int], include_usage: bool) -> Iterator[bytes]:
    def chunk(piece: str, finish: str | None = None) -> bytes:
        out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return sse.event(out)

    for piece in sse.pieces(text):
        yield chunk(piece)
    yield chunk("", finish_reason)
    if include_usage:
        yield sse.event({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [], "usage": usage_})
    yield sse.DONE
