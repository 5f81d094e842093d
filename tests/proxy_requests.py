"""Requests for the proxy's fuzz tests, described once per API as a tree of `Node`s: what a valid request is
(hypothesis strategies) and the mutations that each make one invalid (tests/test_proxy_fuzz.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from gyre_slurm.proxy.apierrors import ServedModels

SERVED = ("policy", "policy-*", "claude-*")  # what the fuzzed proxy answers to (--served-model)


CONTEXT = 4096  # the tiny model's context length


# --- the schema: what a valid request is, and what breaks it ------------------------------------------------------
JSON_TYPES = ("null", "bool", "int", "float", "str", "list", "dict")


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}[type(v)]


@dataclass
class Node:
    types: frozenset[str]  # the JSON types the value may have ("float" values take ints too)
    fields: dict[str, Node] = field(default_factory=dict)  # an object's known fields
    items: Node | None = None  # a list's items
    required: Callable[[dict], tuple[str, ...]] = lambda v: ()
    bad: st.SearchStrategy | None = None  # values of an allowed type that are still wrong


def N(types: str, *, items: Node | None = None, required: tuple[str, ...] | Callable = (),
      bad: st.SearchStrategy | None = None, **fields: Node) -> Node:
    req = required if callable(required) else (lambda v, r=required: r)
    return Node(frozenset(types.split()), fields, items, req, bad)


def not_in(*allowed: str) -> st.SearchStrategy:
    return st.text(max_size=12).filter(lambda s: s not in allowed)


def outside(lo: int, hi: int, *, open_lo: bool = False) -> st.SearchStrategy:
    """Numbers below [lo, hi] (or (lo, hi]) or above it, floats and ints."""
    def low(v: float) -> bool:
        return v <= lo if open_lo else v < lo

    floats = st.floats(allow_nan=False, allow_infinity=False)
    return st.one_of(floats.filter(low), floats.filter(lambda v: v > hi), st.integers(max_value=lo).filter(low),
                     st.integers(min_value=hi + 1), st.floats(max_value=lo - 1e-9, allow_infinity=False),
                     st.floats(min_value=hi + 1e-9, allow_infinity=False))


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
bad_tool_name = st.one_of(st.just(""), st.just("x" * 65), st.just("read file"), st.just("a.b"),
                          st.text(max_size=70).filter(lambda s: not TOOL_NAME.fullmatch(s)))
not_an_object_schema = st.one_of(
    st.sampled_from(["string", "array", "number", "integer", "boolean", "null", "Object"]).map(lambda t: {"type": t}),
    st.just({"type": "object", "properties": ["a"]}), st.just({"type": "object", "properties": {"a": 1}}),
    st.just({"type": "object", "required": "a"}), st.just({"type": "object", "required": [1]}))
bad_input_schema = not_an_object_schema | st.just({}) | st.just({"properties": {}})  # Anthropic: type required
bad_top_k = st.just(0) | st.integers(max_value=-2) | st.integers(min_value=(1 << 30) + 1)
not_one = st.integers().filter(lambda n: n != 1)
too_many_tokens = st.integers(min_value=CONTEXT) | st.just(10**30)  # the context check: 400 before the engine
FLOAT = "int float null"

SAMPLING = {"model": N("str", bad=st.just("")), "temperature": N(FLOAT, bad=outside(0, 2)),
            "top_p": N(FLOAT, bad=outside(0, 1, open_lo=True)), "top_k": N("int null", bad=bad_top_k),
            "stop": N("str list null", items=N("str", bad=st.just("")), bad=st.just("")),
            "n": N("int null", bad=not_one), "stream": N("bool null"),
            "stream_options": N("dict null", include_usage=N("bool null")), "seed": N("int null"),
            "user": N("str null"), "presence_penalty": N(FLOAT, bad=outside(-2, 2)),
            "frequency_penalty": N(FLOAT, bad=outside(-2, 2))}
OA_PART = N("dict", required=("type", "text"), type=N("str", bad=not_in("text")), text=N("str"))
OA_CALL = N("dict", required=("function",), id=N("str null"), type=N("str", bad=not_in("function")),
            function=N("dict", required=("name", "arguments"), name=N("str"), arguments=N("str")))
OA_MESSAGE = N("dict", required=("role",), role=N("str", bad=not_in("system", "developer", "user", "assistant",
                                                                    "tool")),
               content=N("str list null", items=OA_PART), tool_calls=N("list null", items=OA_CALL),
               tool_call_id=N("str null"), name=N("str null"), reasoning_content=N("str null"))
OA_TOOL = N("dict", required=("type", "function"), type=N("str", bad=not_in("function")),
            function=N("dict", required=("name",), name=N("str", bad=bad_tool_name), description=N("str null"),
                       parameters=N("dict null", bad=not_an_object_schema), strict=N("bool null")))
CHAT = N("dict", required=("model", "messages"), **SAMPLING,
         # max_tokens: a huge one would lose to a valid max_completion_tokens; the context check is tested there
         max_tokens=N("int null", bad=st.integers(max_value=0)),
         max_completion_tokens=N("int null", bad=st.integers(max_value=0) | too_many_tokens),
         messages=N("list", items=OA_MESSAGE, bad=st.just([])), tools=N("list null", items=OA_TOOL),
         tool_choice=N("str dict null", bad=not_in("auto", "none") | st.just({"type": "function"})),
         parallel_tool_calls=N("bool null"), logprobs=N("bool null"), response_format=N("dict null"))
COMPLETION = N("dict", required=("model", "prompt"), **SAMPLING,
               max_tokens=N("int null", bad=st.integers(max_value=0) | too_many_tokens),
               prompt=N("str list", items=N("int", bad=st.integers(max_value=-1) | st.integers(min_value=100_000)),
                        bad=st.just("") | st.just([])),
               echo=N("bool null", bad=st.just(True)), suffix=N("str null", bad=st.text(min_size=1, max_size=5)),
               best_of=N("int null", bad=not_one))

BLOCK_TYPES = ("text", "thinking", "tool_use", "tool_result")
BLOCK_FIELDS = {"text": ("type", "text"), "thinking": ("type", "thinking"), "tool_use": ("type", "id", "name", "input"),
                "tool_result": ("type", "tool_use_id")}
A_TEXT = N("dict", required=("type", "text"), type=N("str", bad=not_in("text")), text=N("str"))
A_BLOCK = N("dict", required=lambda v: BLOCK_FIELDS[v["type"]], type=N("str", bad=not_in(*BLOCK_TYPES)),
            text=N("str"), thinking=N("str"), signature=N("str null"), id=N("str"), name=N("str"), input=N("dict"),
            tool_use_id=N("str"), content=N("str list null", items=A_TEXT), is_error=N("bool null"))
A_MESSAGE = N("dict", required=("role", "content"), role=N("str", bad=not_in("user", "assistant", "system")),
              content=N("str list", items=A_BLOCK))
A_TOOL = N("dict", required=("name", "input_schema"), type=N("str null", bad=not_in("custom")),
           name=N("str", bad=bad_tool_name), description=N("str null"), input_schema=N("dict", bad=bad_input_schema))
MESSAGES = N("dict", required=("model", "messages", "max_tokens"), model=N("str", bad=st.just("")),
             max_tokens=N("int", bad=st.integers(max_value=0) | too_many_tokens),
             messages=N("list", items=A_MESSAGE, bad=st.just([])), system=N("str list null", items=A_TEXT),
             tools=N("list null", items=A_TOOL),
             tool_choice=N("dict null", required=("type",), type=N("str", bad=not_in("auto", "none"))),
             stop_sequences=N("list null", items=N("str", bad=st.just(""))),
             temperature=N(FLOAT, bad=outside(0, 1)), top_p=N(FLOAT, bad=outside(0, 1, open_lo=True)),
             top_k=N("int null", bad=bad_top_k), stream=N("bool null"), metadata=N("dict null"),
             thinking=N("dict null", required=("type",),
                        type=N("str", bad=not_in("adaptive", "enabled", "disabled"))))
SCHEMAS = {"chat": CHAT, "completions": COMPLETION, "messages": MESSAGES}


# --- valid requests ------------------------------------------------------------------------------------------------
text = st.text(max_size=12)
nonempty = st.text(min_size=1, max_size=12)
tool_name = st.from_regex(r"[a-zA-Z0-9_-]{1,16}", fullmatch=True)
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                         max_size=3), max_leaves=8)
object_schema = st.fixed_dictionaries({"type": st.just("object")}, optional={
    "properties": st.dictionaries(tool_name, st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"])}),
                                  max_size=2),
    "required": st.lists(tool_name, max_size=2)})
served_model = st.sampled_from(["policy", "policy-v2", "claude-harness-default"])
unserved_model = st.text(min_size=1, max_size=30).filter(lambda m: m not in ServedModels(SERVED))
sampling = {"temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True),
            "top_k": st.just(-1) | st.integers(1, 100), "stop": nonempty | st.lists(nonempty, max_size=3),
            "n": st.just(1), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
            "seed": st.integers(-(1 << 63), (1 << 63) - 1), "user": text, "presence_penalty": st.floats(-2, 2),
            "x-unknown-field": json_value}  # unknown fields are ignored

oa_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
oa_call = st.fixed_dictionaries({"id": nonempty, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": tool_name, "arguments": st.sampled_from(["{}", '{"path": "a"}', "not json"])})})
oa_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": text | oa_parts},
                          optional={"name": nonempty}),
    st.fixed_dictionaries({"role": st.just("assistant")}, optional={
        "content": st.none() | text | oa_parts, "tool_calls": st.lists(oa_call, max_size=2),
        "reasoning_content": text}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": nonempty, "content": text | oa_parts}))
oa_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": tool_name}, optional={"description": text, "parameters": object_schema | st.just({}),
                                   "strict": st.booleans()})})
oa_tools = st.lists(oa_tool, min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])
valid_chat = st.fixed_dictionaries({"model": served_model, "messages": st.lists(oa_message, min_size=1, max_size=4)},
                                   optional={**sampling, "max_tokens": st.integers(1, 64),
                                             "max_completion_tokens": st.integers(1, 64), "tools": oa_tools,
                                             "tool_choice": st.sampled_from(["auto", "none"]),
                                             "parallel_tool_calls": st.booleans()})
valid_completion = st.fixed_dictionaries(
    {"model": served_model, "prompt": nonempty | st.lists(st.integers(0, 200), min_size=1, max_size=8)},
    optional={**sampling, "max_tokens": st.integers(1, 64), "echo": st.just(False), "suffix": st.just(""),
              "best_of": st.just(1)})

a_text = st.fixed_dictionaries({"type": st.just("text"), "text": text},
                               optional={"cache_control": st.just({"type": "ephemeral"})})
a_thinking = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text},
                                   optional={"signature": st.none() | text})
a_tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": nonempty, "name": tool_name,
                                    "input": st.dictionaries(text, json_value, max_size=2)})
a_tool_result = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": nonempty}, optional={
    "content": st.none() | text | st.lists(a_text, max_size=2), "is_error": st.booleans()})
a_message = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": nonempty | st.lists(a_text | a_tool_result,
                                                                                   min_size=1, max_size=3)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": text | st.lists(
        a_text | a_thinking | a_tool_use, max_size=3)}))
a_tool = st.fixed_dictionaries({"name": tool_name, "input_schema": object_schema}, optional={
    "description": text, "type": st.just("custom"), "cache_control": st.just({"type": "ephemeral"})})
valid_messages = st.fixed_dictionaries(
    {"model": served_model, "max_tokens": st.integers(1, 64), "messages": st.lists(a_message, min_size=1, max_size=4)},
    optional={"system": text | st.lists(a_text, max_size=2),
              "tools": st.lists(a_tool, min_size=1, max_size=3, unique_by=lambda t: t["name"]),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "none"])}),
              "stop_sequences": st.lists(nonempty, max_size=3), "temperature": st.floats(0, 1),
              "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.just(-1) | st.integers(1, 100),
              "stream": st.booleans(), "metadata": st.fixed_dictionaries({"user_id": text}),
              "x-unknown-field": json_value})
VALID = {"chat": valid_chat, "completions": valid_completion, "messages": valid_messages}

VALUES = {"null": st.none(), "bool": st.booleans(),
          "int": st.integers() | st.sampled_from([0, -1, 2**63, 10**30]),
          "float": st.floats(allow_nan=False, allow_infinity=False), "str": text,
          "list": st.lists(json_value, max_size=3),
          "dict": st.dictionaries(st.text(max_size=6), json_value, max_size=3)}


# --- mutations: each makes a valid request invalid ----------------------------------------------------------------
def places(value: Any, node: Node, path: tuple = ()):
    """(path, value, node) for every value of the body that the schema knows."""
    yield path, value, node
    if isinstance(value, dict):
        for k, v in value.items():
            if k in node.fields:
                yield from places(v, node.fields[k], (*path, k))
    elif isinstance(value, list) and node.items is not None:
        for i, v in enumerate(value):
            yield from places(v, node.items, (*path, i))


def put(body: dict, path: tuple, value: Any) -> None:
    at = body
    for step in path[:-1]:
        at = at[step]
    at[path[-1]] = value


def dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


@dataclass
class Case:
    body: dict
    what: str
    status: int = 400
    kind: str = ""
    where: str | None = None  # where the error is (OpenAI's param is this place, inside it, or around it)


def special_cases(api: str, body: dict, draw) -> list[Case]:
    """Mutations that the per-value schema cannot say: a role's rules, duplicate tools, misplaced blocks."""
    if api == "chat":
        i = draw(st.integers(0, len(body["messages"]) - 1))
        role = draw(st.sampled_from(["system", "developer", "user", "tool"]))
        no_content = {"role": role, **({"tool_call_id": "c1"} if role == "tool" else {}),
                      **draw(st.sampled_from([{}, {"content": None}]))}
        misplaced = [(no_content, f"a {role} message without content"),
                     ({"role": "tool", "content": draw(text)}, "a tool message without tool_call_id"),
                     ({"role": "user", "content": "x", "tool_calls": [draw(oa_call)]}, "tool calls from a user")]
        tool = draw(oa_tool)
    elif api == "messages":
        i = draw(st.integers(0, len(body["messages"]) - 1))
        misplaced = [({"role": "user", "content": draw(st.sampled_from(["", []]))}, "an empty user message"),
                     ({"role": "user", "content": [draw(a_thinking | a_tool_use)]}, "assistant blocks from the user"),
                     ({"role": "assistant", "content": [draw(a_tool_result)]}, "a tool result from the assistant")]
        tool = draw(a_tool)
    else:
        return []
    cases = []
    for msg, what in misplaced:
        b = json.loads(json.dumps(body))
        b["messages"][i] = msg
        cases.append(Case(b, what, kind=what, where=f"messages.{i}"))
    cases.append(Case({**body, "tools": [*body.get("tools", []), tool, tool]}, "duplicate tools",
                      kind="duplicate tools", where="tools"))
    return cases


@st.composite
def bad_requests(draw, api: str) -> Case:
    body = draw(VALID[api])
    known = list(places(body, SCHEMAS[api]))
    kind = draw(st.sampled_from(["retype", "retype", "drop", "bad", "bad", "model", "special"]))
    if kind == "model":
        return Case({**body, "model": draw(unserved_model)}, "an unknown model", 404, "unknown model", "model")
    if kind == "special" and api != "completions":
        return draw(st.sampled_from(special_cases(api, body, draw)))
    if kind == "drop":
        fields = [(p, k) for p, v, n in known if isinstance(v, dict) for k in n.required(v)]
        path, key = draw(st.sampled_from(fields))
        b = json.loads(json.dumps(body))
        del _at(b, path)[key]
        return Case(b, f"{dotted((*path, key))} dropped", kind="required field dropped", where=dotted((*path, key)))
    if kind == "bad":
        path, _, node = draw(st.sampled_from([(p, v, n) for p, v, n in known if n.bad is not None]))
        value = draw(node.bad)
        b = json.loads(json.dumps(body))
        put(b, path, value)
        # too many tokens asked: the context check blames the prompt
        context = path[-1] in ("max_tokens", "max_completion_tokens") and value >= CONTEXT
        return Case(b, f"{dotted(path)}={value!r:.60}", kind="out of range" if context else "wrong value",
                    where=None if context else dotted(path))
    # retype: a value of a JSON type the schema does not allow there
    path, _, node = draw(st.sampled_from([(p, v, n) for p, v, n in known if p]))
    new_type = draw(st.sampled_from([t for t in JSON_TYPES if t not in node.types]))
    value = draw(VALUES[new_type])
    b = json.loads(json.dumps(body))
    put(b, path, value)
    return Case(b, f"{dotted(path)} as {new_type}", kind=f"wrong type: {new_type}", where=dotted(path))


def _at(body: dict, path: tuple) -> Any:
    for step in path:
        body = body[step]
    return body


SPECIAL_BODIES = [
    b"", b" ", b"null", b"true", b"0", b"-1.5", b'"a string"', b"[]", b"[{}]", b"\xff\xfe\x00", b"{", b"}",
    b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": NaN}',
    b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "top_p": Infinity}',
    b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "top_p": 1e999}',
    b'{"model": "policy", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4, "prompt": "x"}',
    b'{"model": "policy\\udfff", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "prompt": "x"}',
    b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "prompt": "x", "deep": '
    + b"[" * 200 + b"]" * 200 + b"}",
    b"[" * 100_000, b'{"a":' * 20_000, b'{"max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "policy", "model": 5, "messages": [], "prompt": ""}',
]
garbage = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=60).map(lambda s: s.encode()),
    (json_leaf | st.lists(json_value, max_size=3)).map(lambda v: json.dumps(v).encode()),  # not an object
    st.dictionaries(st.text(max_size=10), json_value, max_size=4).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(SPECIAL_BODIES),
)


@st.composite
def truncated(draw, api: str) -> bytes:
    """A valid request cut short: never JSON (the body is an object)."""
    data = json.dumps(draw(VALID[api])).encode()
    return data[:draw(st.integers(0, len(data) - 1))]
