"""Turn generated text into an assistant message: content, reasoning_content and tool_calls.

One parser per model family, looked up by name in a registry ("qwen3" first), so that another family's tool
format is one registered function. Parsers are pure: text in, ParsedOutput out. They only shape the *reply*;
the token ids the model sampled are recorded and reused as they are, never re-encoded from this text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedOutput:
    content: str | None  # None only when there are tool calls and no other text (OpenAI's shape)
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False  # a tool-call block did not parse: its text was kept in content
    problems: list[str] = field(default_factory=list)  # why, one line per bad block


Parser = Callable[..., ParsedOutput]  # (text, *, parse_tools=True, new_id=None) -> ParsedOutput
_PARSERS: dict[str, Parser] = {}
# model_type in config.json -> parser name; families not listed fall back to the default
_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "qwen3", "qwen2_moe": "qwen3", "qwen3_next": "qwen3"}
DEFAULT_PARSER = "qwen3"


def register_parser(name: str) -> Callable[[Parser], Parser]:
    def deco(fn: Parser) -> Parser:
        _PARSERS[name] = fn
        return fn
    return deco


def get_parser(name: str) -> Parser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"no tool-call parser {name!r} (known: {', '.join(sorted(_PARSERS))})") from None


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def parser_for_model_type(model_type: str | None) -> str:
    return _MODEL_TYPES.get(model_type or "", DEFAULT_PARSER)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> tuple[str | None, str]:
    """(reasoning, rest). Handles templates whose generation prompt already opened the think block
    (the output then starts inside it and only the closing tag appears) and a block cut off by max_tokens."""
    stripped = text.lstrip()
    if stripped.startswith(open_tag):
        body = stripped[len(open_tag):]
        end = body.find(close_tag)
        if end < 0:  # truncated while thinking: all of it is reasoning
            return body.strip("\n"), ""
        return body[:end].strip("\n"), body[end + len(close_tag):].lstrip("\n")
    end = text.find(close_tag)
    if end >= 0 and open_tag not in text[:end]:
        return text[:end].strip("\n"), text[end + len(close_tag):].lstrip("\n")
    return None, text


def _tool_call(obj: Any, new_id: Callable[[], str]) -> tuple[dict[str, Any] | None, str]:
    """An OpenAI tool call from a decoded block, or (None, why not)."""
    if not isinstance(obj, dict):
        return None, "the block is not a JSON object"
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return None, "the block has no string 'name'"
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except ValueError:  # JSONDecodeError, or a number too long to convert
            return None, "'arguments' is a string that is not JSON"
    if not isinstance(args, dict):
        return None, "'arguments' is not a JSON object"
    return {"id": new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}, ""


_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_parser("qwen3")
def parse_qwen3(text: str, *, parse_tools: bool = True, new_id: Callable[[], str] | None = None) -> ParsedOutput:
    """Qwen3 / Hermes style: optional <think>…</think>, then text and `<tool_call>\\n{json}\\n</tool_call>` blocks."""
    new_id = new_id or new_call_id
    reasoning, rest = split_reasoning(text)
    if not parse_tools or "<tool_call>" not in rest:
        return ParsedOutput(content=rest, reasoning_content=reasoning)
    pieces: list[str] = []
    calls: list[dict[str, Any]] = []
    problems: list[str] = []
    pos = 0
    for m in _QWEN_BLOCK.finditer(rest):
        pieces.append(rest[pos:m.start()])
        pos = m.end()
        try:
            call, why = _tool_call(json.loads(m.group(1).strip()), new_id)
        except json.JSONDecodeError as e:
            call, why = None, f"invalid JSON: {e.msg} at {e.pos}"
        except ValueError as e:  # e.g. an integer longer than Python converts
            call, why = None, f"invalid JSON: {e}"
        if call is None:
            pieces.append(m.group(0))
            problems.append(why)
        else:
            calls.append(call)
    tail = rest[pos:]
    if "<tool_call>" in tail:  # opened but never closed (cut off by max_tokens or a stop string)
        problems.append("unclosed <tool_call> block")
    pieces.append(tail)
    if not calls:  # nothing parsed: the reply is the text exactly as generated
        return ParsedOutput(content=rest, reasoning_content=reasoning, malformed=True, problems=problems)
    content = "".join(pieces).strip()
    return ParsedOutput(content=content or None, reasoning_content=reasoning, tool_calls=calls,
                        malformed=bool(problems), problems=problems)
