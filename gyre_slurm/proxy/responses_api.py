"""OpenAI's Responses API, POST /v1/responses: requests, replies and stream events (what Codex CLI speaks).

A request's `input` items become chat-template messages the way openai_api.py's messages do: `instructions` and
system/developer messages a system message, a run of reasoning / assistant message / function_call items one
assistant message (the inverse of `reply`, so that an echoed turn renders to the exact ids the proxy produced and
the next call extends them), function_call_output items tool messages.

Tools: `function` tools go to the model. Codex (0.171) also declares tools of other types (`web_search`,
`namespace` groups of sub-agent functions, and in other configurations `local_shell`, `custom`, …) with every
request; the model cannot call those through this proxy, so they are dropped rather than refused, which lets
every Codex run work with its function tools. A request that could not work without them is refused with a 400
naming the type: one whose declared tools are all of other types, or whose tool_choice names one.

`store` and `previous_response_id`: nothing is stored beyond the rollout; the proxy keeps, per rollout, the
conversation (input and output) of the responses it produced recently, so that `previous_response_id` prepends it.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from gyre_slurm.proxy import sse
from gyre_slurm.proxy.apierrors import bad_request
from gyre_slurm.proxy.openai_api import Strict, check_schema, check_unique, load_json, validate
from gyre_slurm.proxy.tito import template_message

KEPT_RESPONSES = 256  # per proxy: the conversations previous_response_id can name


class _Part(Strict):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class _Message(Strict):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]


class _FunctionCall(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]


class _Reasoning(Strict):
    type: Literal["reasoning"]
    summary: list[_Part] = Field(default_factory=list)
    content: list[_Part] | None = None
    encrypted_content: str | None = None


class _Tool(Strict):
    type: str


class _FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    # accepted and not acted on; their types are still checked
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None


_ITEMS: dict[str, type[Strict]] = {"message": _Message, "function_call": _FunctionCall,
                                   "function_call_output": _FunctionCallOutput, "reasoning": _Reasoning}


def _text(parts: str | list[_Part]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.text if p.text is not None else (p.refusal or "") for p in parts)


def _reasoning_text(item: _Reasoning) -> str:
    if item.content:
        return _text(item.content)
    if item.summary:
        return "\n\n".join(p.text or "" for p in item.summary)
    return item.encrypted_content or ""  # the proxy's own: the text itself (see reply)


def _items(raw_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as template messages; a run of reasoning / assistant / function_call items is one turn."""
    if isinstance(raw_input, str):
        return [{"role": "user", "content": raw_input}]
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled

    def close() -> None:
        nonlocal turn
        if turn is not None:
            out.append(template_message(turn))
            turn = None

    for i, raw in enumerate(raw_input):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise bad_request(f"input.{i}.type: unsupported input item type {kind!r}", param=f"input.{i}.type")
        item: Any = validate(model, raw, prefix=f"input.{i}")
        if isinstance(item, _Message) and item.role != "assistant":
            close()
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, _FunctionCallOutput):
            close()
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            if turn is not None and (isinstance(item, _Reasoning) and (turn["content"] or turn["tool_calls"])
                                     or isinstance(item, _Message) and turn["tool_calls"]):
                close()  # a new turn starts
            if turn is None:
                turn = {"role": "assistant", "content": "", "tool_calls": []}
            if isinstance(item, _Reasoning):
                turn["reasoning_content"] = _reasoning_text(item)
            elif isinstance(item, _Message):
                turn["content"] += _text(item.content)
            else:
                turn["tool_calls"].append({"id": item.call_id, "type": "function",
                                           "function": {"name": item.name, "arguments": item.arguments}})
    close()
    return out


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The function tools in OpenAI's chat shape; other types dropped (module docstring)."""
    tools: list[dict[str, Any]] = []
    others: list[str] = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            others.append(t.type)
            continue
        fn = validate(_FunctionTool, t.model_dump(), prefix=f"tools.{i}")
        if fn.parameters is not None:
            check_schema(fn.parameters, f"tools.{i}.parameters", type_required=False)
        tools.append({"type": "function", "function": {"name": fn.name, "description": fn.description or "",
                                                       "parameters": fn.parameters or {"type": "object",
                                                                                      "properties": {}}}})
    if others and not tools:
        raise bad_request(f"tools: tool type {others[0]!r} is not supported by this proxy (only 'function' "
                          "tools reach the model)", param="tools")
    check_unique([t["function"]["name"] for t in tools])
    return tools or None


class Kept:
    """The conversations of recent responses, for previous_response_id: (rollout, response id) → messages."""

    def __init__(self, size: int = KEPT_RESPONSES) -> None:
        self.size, self.store = size, OrderedDict()

    def get(self, rollout_id: int, response_id: str) -> list[dict[str, Any]]:
        got = self.store.get((rollout_id, response_id))
        if got is None:
            raise bad_request(f"previous_response_id: no response {response_id!r} in this rollout",
                              param="previous_response_id", code="previous_response_not_found")
        self.store.move_to_end((rollout_id, response_id))
        return got

    def put(self, rollout_id: int, response_id: str, messages: list[dict[str, Any]]) -> None:
        self.store[(rollout_id, response_id)] = messages
        while len(self.store) > self.size:
            self.store.popitem(last=False)


def parse(body: bytes, kept: Kept, rollout_id: int) -> tuple[ResponsesRequest, list[dict[str, Any]],
                                                             list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The request, the conversation to keep for it (without instructions), the messages to render, the tools."""
    req = validate(ResponsesRequest, load_json(body))
    if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") != "function":
        raise bad_request(f"tool_choice: tool type {req.tool_choice.get('type')!r} is not supported by this "
                          "proxy", param="tool_choice")
    if req.tool_choice not in (None, "auto", "none"):
        raise bad_request("tool_choice must be 'auto' or 'none'", param="tool_choice")
    tools = _tools(req)
    history = list(kept.get(rollout_id, req.previous_response_id)) if req.previous_response_id else []
    history += _items(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    return req, history, messages, tools


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reply(req: ResponsesRequest, message: dict[str, Any], finish_reason: str, n_prompt: int, n_output: int,
          created: float) -> dict[str, Any]:
    """The response object; its output items echoed back convert (_items) to the template message of `message`."""
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                                "content": [{"type": "reasoning_text", "text": text}]}
        if "reasoning.encrypted_content" in (req.include or []):
            item["encrypted_content"] = text  # nothing secret: the text, for clients that echo only this
        output.append(item)
    if message.get("content") or not message.get("tool_calls"):
        output.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message.get("content") or "",
                                    "annotations": [], "logprobs": []}]})
    for tc in message.get("tool_calls") or []:
        output.append({"id": new_id("fc"), "type": "function_call", "status": "completed", "call_id": tc["id"],
                       "name": tc["function"]["name"], "arguments": tc["function"]["arguments"]})
    incomplete = finish_reason == "length"
    return {"id": new_id("resp"), "object": "response", "created_at": int(created), "model": req.model,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
            "instructions": req.instructions, "output": output, "parallel_tool_calls": bool(
                req.parallel_tool_calls if req.parallel_tool_calls is not None else True),
            "tool_choice": req.tool_choice or "auto", "tools": [t.model_dump() for t in req.tools or []],
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": bool(req.store), "metadata": req.metadata,
            "reasoning": req.reasoning, "text": req.text or {"format": {"type": "text"}}, "truncation":
                req.truncation or "disabled", "user": req.user,
            "usage": {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": n_output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_prompt + n_output}}


def events(resp: dict[str, Any]) -> Iterator[bytes]:
    """A finished response as the Responses stream, in the order OpenAI sends it, each event numbered."""
    seq = 0

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        out = sse.event({"type": kind, "sequence_number": seq, **data}, kind)
        seq += 1
        return out

    head = {**resp, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield ev("response.created", response=head)
    yield ev("response.in_progress", response=head)
    for index, item in enumerate(resp["output"]):
        at = {"output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            yield ev("response.output_item.added", item={**item, "status": "in_progress", "content": []}, **at)
            ids = {"item_id": item["id"], **at, "content_index": 0}
            yield ev("response.content_part.added", part={**part, "text": ""}, **ids)
            for piece in sse.pieces(part["text"]):
                yield ev("response.output_text.delta", delta=piece, logprobs=[], **ids)
            yield ev("response.output_text.done", text=part["text"], logprobs=[], **ids)
            yield ev("response.content_part.done", part=part, **ids)
        elif item["type"] == "function_call":
            yield ev("response.output_item.added", item={**item, "status": "in_progress", "arguments": ""}, **at)
            for piece in sse.pieces(item["arguments"]):
                yield ev("response.function_call_arguments.delta", item_id=item["id"], delta=piece, **at)
            yield ev("response.function_call_arguments.done", item_id=item["id"], name=item["name"],
                     arguments=item["arguments"], **at)
        else:
            yield ev("response.output_item.added", item={**item, "content": []}, **at)
        yield ev("response.output_item.done", item=item, **at)
    yield ev("response.completed" if resp["status"] == "completed" else "response.incomplete", response=resp)


def keep_reply(kept: Kept, rollout_id: int, resp: dict[str, Any], history: list[dict[str, Any]],
               message: dict[str, Any]) -> None:
    kept.put(rollout_id, resp["id"], [*history, template_message(message)])

