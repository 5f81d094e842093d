"""OpenAI's wire format: /v1/chat/completions and /v1/completions requests, replies and stream chunks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gyre_slurm.proxy import sse
from gyre_slurm.proxy.apierrors import bad_request
from gyre_slurm.proxy.tito import template_message


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are accepted and ignored


class _Function(Strict):
    name: str
    arguments: str


class _ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class _Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _ToolDef(Strict):
    type: Literal["function"]
    function: dict[str, Any]


class StreamOptions(Strict):
    include_usage: bool | None = None


class _Sampling(Strict):
    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None  # not OpenAI's, but engines take it
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    tools: list[_ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def load_json(body: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object")
    return raw


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], raw: dict[str, Any]) -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", param=where) from None


def _check_common(req: _Sampling) -> None:
    if req.n not in (None, 1):
        raise bad_request("only n=1 is supported", param="n")


def parse_chat(body: bytes) -> tuple[ChatRequest, list[dict[str, Any]]]:
    raw = load_json(body)
    req = validate(ChatRequest, raw)
    _check_common(req)
    if req.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice must be 'auto' or 'none'", param="tool_choice")
    messages = []
    for m in raw["messages"]:
        tm = template_message(m)
        if tm["role"] == "developer":  # OpenAI's newer name for the system role
            tm["role"] = "system"
        messages.append(tm)
    return req, messages


def parse_completion(body: bytes) -> CompletionRequest:
    req = validate(CompletionRequest, load_json(body))
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
