"""Bad input at the proxy, fuzzed: every malformed request gets its API's own error shape and a 4xx status,
reaches neither the engine nor the daemon, and the proxy goes on serving.

Schema-driven: each API's request is described once as a tree of `Node`s (the JSON types a value may have, its
required fields, values of the right type that are still wrong). Hypothesis draws valid requests, then applies
exactly one mutation that the schema says makes it invalid: a value replaced by one of another JSON type, a
required field dropped, an out-of-range number or unknown enum string, an unknown model, a broken tool, a message
that breaks a role's rule. Arbitrary bytes, non-JSON and JSON that is not an object are thrown in too. All of it
goes over real HTTP to a real proxy process (the world of tests/test_proxy.py: a test-played daemon collecting
CallRecords, the scripted engine over the tiny model) with a valid key of a rollout that nothing else uses.

The proxy here answers only some model names (--served-model, repeated), so that unknown names exist.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gyre_slurm import cli
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.proxy import app as proxy_app
from gyre_slurm.proxy.apierrors import DEFAULT_SERVED_MODELS, ServedModels
from gyre_slurm.proxy.keys import make_key
from gyre_slurm.rundir import ControlInfo, write_control
from tests.test_proxy import FakeDaemon, ProxyProc, TinyEngine, wait_for

SERVED = ("policy", "policy-*", "claude-*")  # what this module's proxy answers to
FUZZ_RID = 60  # the rollout of every bad request; valid traffic never uses it
GOOD_RID = 61  # valid traffic between and after the bad requests
CONTEXT = 4096  # the tiny model's context length
ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}
EXAMPLES = int(os.environ.get("GYRE_FUZZ_EXAMPLES", "300"))  # per API and test; raise it to fuzz longer
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


# --- the world: tests/test_proxy.py's pieces, the proxy started with a narrowed --served-model list -------------
class ServedProxy(ProxyProc):
    options = ("--proxy-id", "fz", *(arg for name in SERVED for arg in ("--served-model", name)))


@dataclass
class World:
    engine: TinyEngine
    daemon: FakeDaemon
    proxy: ServedProxy
    http: httpx.Client
    log_path: Any

    def headers(self, api: str, rollout_id: int = FUZZ_RID) -> dict[str, str]:
        key = make_key(self.daemon.token, rollout_id)
        if api == "messages":
            return {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
        return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def post(self, api: str, content: bytes, rollout_id: int = FUZZ_RID) -> httpx.Response:
        return self.http.post(self.proxy.url + PATHS[api], content=content, headers=self.headers(api, rollout_id))

    def fuzz_receipts(self) -> list[tuple[int, int]]:
        return [k for k in list(self.daemon.receipts) if k[0] == FUZZ_RID]


@pytest.fixture(scope="module")
def fz(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model_dir = create_tiny_model(tmp / "model", seed=0)
    engine = TinyEngine(model_dir)
    engine_url, server = engine.serve()
    run_dir = tmp / "run"
    run_dir.mkdir()
    daemon = FakeDaemon(run_dir, engine_url)
    proxy = ServedProxy(run_dir, model_dir, tmp / "proxy.log")
    http = httpx.Client(timeout=30)
    try:
        proxy.start()
        yield World(engine, daemon, proxy, http, tmp / "proxy.log")
    finally:
        http.close()
        proxy.kill(signal.SIGTERM)
        daemon.stop()
        server.should_exit = True


# --- checks ------------------------------------------------------------------------------------------------------
def error_of(api: str, r: httpx.Response, status: int) -> dict[str, Any]:
    """The error in the API's own shape (asserted), as {message, type, param, code}."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    if api == "messages":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert set(err) == {"type", "message"} and err["type"] == ANTHROPIC_TYPES[status], body
        assert isinstance(err["message"], str) and err["message"], body
        return {**err, "param": None, "code": None}
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", body
    assert isinstance(err["message"], str) and err["message"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], str), body
    return err


def good_request(world: World, api: str) -> None:
    """A valid request on another rollout: the proxy still serves."""
    body: dict[str, Any] = {"model": "policy", "max_tokens": 3}
    if api == "completions":
        body["prompt"] = "ok"
    else:
        body["messages"] = [{"role": "user", "content": "still there?"}]
    r = world.post(api, json.dumps(body).encode(), GOOD_RID)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]


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
A_MESSAGE = N("dict", required=("role", "content"), role=N("str", bad=not_in("user", "assistant")),
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
             thinking=N("dict null"))
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


# --- the fuzz tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", list(PATHS))
@FUZZ
@given(data=st.data())
def test_bad_requests_get_the_apis_error_and_change_nothing(fz, api, data):
    n_seen = len(fz.engine.seen)
    case = data.draw(bad_requests(api), label="case")
    event(case.kind)
    r = fz.post(api, json.dumps(case.body).encode())
    err = error_of(api, r, case.status)
    if case.status == 404:
        assert err["code"] in ("model_not_found", None) and err["param"] in ("model", None)
    if api != "messages" and case.where is not None:  # param names the place, or a place inside/around it
        param = err["param"] or ""
        assert param == case.where or param.startswith(case.where + ".") or case.where.startswith(param + "."), (
            case.what, err)
    assert len(fz.engine.seen) == n_seen, f"{case.what} reached the engine"
    assert not fz.fuzz_receipts()


@pytest.mark.parametrize("api", list(PATHS))
@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(data=st.data())
def test_garbage_bodies_get_the_apis_error(fz, api, data):
    n_seen = len(fz.engine.seen)
    body = data.draw(garbage | truncated(api), label="body")
    error_of(api, fz.post(api, body), 400)
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


def test_still_serving_after_the_fuzz(fz):
    for api in PATHS:
        good_request(fz, api)
    time.sleep(0.3)  # a stray record would have arrived by now
    assert not fz.fuzz_receipts()
    assert fz.proxy.health()["ok"]


# --- explicit cases ------------------------------------------------------------------------------------------------
def test_unknown_model_is_404_in_each_api_shape(fz):
    key, url = make_key(fz.daemon.token, FUZZ_RID), fz.proxy.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    user = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as e:
            oai.chat.completions.create(model="gpt-4o", messages=user, max_tokens=4, stream=stream)
        assert e.value.code == "model_not_found" and e.value.param == "model" and e.value.type == \
            "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as e:
            oai.completions.create(model="Policy", prompt="x", max_tokens=4, stream=stream)  # names are case-sensitive
        assert e.value.code == "model_not_found"
        with pytest.raises(anthropic.NotFoundError) as e:
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30).messages.create(
                model="m", max_tokens=4, messages=user, stream=stream)
        assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                           "message": e.value.body["error"]["message"]}}
    # the served names and patterns: /v1/models lists the plain ones; a harness's own name matches a pattern
    assert [m.id for m in oai.models.list().data] == ["policy"]
    good = anthropic.Anthropic(base_url=url, api_key=make_key(fz.daemon.token, GOOD_RID), max_retries=0, timeout=30)
    reply = good.messages.create(model="claude-harness-default", max_tokens=3, messages=user)
    assert reply.model == "claude-harness-default" and reply.usage.output_tokens > 0
    time.sleep(0.2)
    assert not fz.fuzz_receipts()


def test_served_models_option_and_flag(monkeypatch, tmp_path):
    assert DEFAULT_SERVED_MODELS == ("policy", "*")
    default = ServedModels(None)
    assert default.names == ["policy"] and "claude-sonnet-4-5" in default and "gpt-5-codex" in default
    narrow = ServedModels(["policy", "policy-*", "policy"])
    assert narrow.patterns == ("policy", "policy-*") and "policy-v3" in narrow and "m" not in narrow
    assert ServedModels("only").names == ["only"] and "other" not in ServedModels("only")
    with pytest.raises(ValueError):
        ServedModels([])
    # `gyre proxy --served-model`, repeatable; a run folder with control.json and no config.yaml
    write_control(tmp_path, ControlInfo(endpoint="tcp://127.0.0.1:1", port=1, token="t", daemon_pid=0,
                                        daemon_host="localhost", started_at=0.0))
    seen = []
    monkeypatch.setattr(proxy_app, "run_proxy", lambda *a, **kw: seen.append(kw["served_models"]))
    monkeypatch.setattr(logging, "basicConfig", lambda **_kw: None)  # keep pytest's handlers
    root_level = logging.getLogger().level
    base = ["proxy", "--run-dir", str(tmp_path), "--model-path", "m"]
    try:
        for extra in ([], ["--served-model", "policy"], ["--served-model", "policy", "--served-model", "claude-*"]):
            result = CliRunner().invoke(cli.app, [*base, *extra])
            assert result.exit_code == 0, result.output
    finally:
        logging.getLogger().setLevel(root_level)
    assert seen == [None, ["policy"], ["policy", "claude-*"]]


@pytest.mark.parametrize("api", list(PATHS))
@pytest.mark.parametrize("stream", [False, True])
def test_oversized_context_is_400_before_the_engine(fz, api, stream):
    n_seen = len(fz.engine.seen)
    long_text = "x" * (CONTEXT + 500)  # the tiny tokenizer is byte-level: one token per byte
    if api == "completions":
        bodies = [{"prompt": long_text, "max_tokens": 1}, {"prompt": [1] * CONTEXT, "max_tokens": 1},
                  {"prompt": "hi", "max_tokens": CONTEXT}]
    else:
        bodies = [{"messages": [{"role": "user", "content": long_text}], "max_tokens": 1},
                  {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}]
    for body in bodies:
        r = fz.post(api, json.dumps({"model": "policy", "stream": stream, **body}).encode())
        err = error_of(api, r, 400)  # JSON, also for a streamed request: nothing was streamed yet
        if api != "messages":
            assert err["code"] == "context_length_exceeded", err
            assert err["param"] == ("prompt" if api == "completions" else "messages"), err
        assert "maximum context length" in err["message"]
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


TOOL_CASES = {
    "chat": [
        ({"type": "function", "function": {"name": "read file"}}, "tools.0.function.name"),
        ({"type": "function", "function": {"name": "x" * 65}}, "tools.0.function.name"),
        ({"type": "function", "function": {"description": "no name"}}, "tools.0.function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
         "tools.0.function.parameters.type"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "tools.0.function.parameters"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}},
         "tools.0.function.parameters.properties"),
        ({"type": "function", "function": {"name": "f", "description": 3}}, "tools.0.function.description"),
        ({"type": "code_interpreter", "function": {"name": "f"}}, "tools.0.type"),
        ({"name": "f", "parameters": {"type": "object"}}, "tools.0.type"),  # Anthropic's shape sent to OpenAI
    ],
    "messages": [
        ({"name": "read file", "input_schema": {"type": "object"}}, None),
        ({"name": "f", "input_schema": {"properties": {}}}, None),  # Anthropic requires type: object
        ({"name": "f", "input_schema": {"type": "string"}}, None),
        ({"name": "f"}, None),
        ({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}, None),  # a server tool
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, None),  # OpenAI's shape
    ],
}


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_invalid_tool_schemas(fz, api):
    n_seen = len(fz.engine.seen)
    base = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for tool, param in TOOL_CASES[api]:
        err = error_of(api, fz.post(api, json.dumps({**base, "tools": [tool]}).encode()), 400)
        if param is not None:
            assert err["param"] == param, (tool, err)
    ok = {"type": "function", "function": {"name": "f"}} if api == "chat" else {
        "name": "f", "input_schema": {"type": "object"}}
    err = error_of(api, fz.post(api, json.dumps({**base, "tools": [ok, ok]}).encode()), 400)
    assert "unique" in err["message"]
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


# --- clients that leave -----------------------------------------------------------------------------------------
def test_clients_leaving_mid_stream_or_mid_request(fz):
    """tests/test_proxy_apis.py covers a chat stream left after its first chunk; here: the other two APIs' streams,
    a client that gives up while the engine generates, and one that leaves halfway through sending its body."""
    engine, daemon = fz.engine, fz.daemon
    rid = 62
    key = make_key(daemon.token, rid)
    engine.script.extend(["y" * 1200, "z" * 1200])
    streams = [("messages", {"model": "policy", "max_tokens": 1500, "stream": True,
                             "messages": [{"role": "user", "content": "go"}]}),
               ("completions", {"model": "policy", "max_tokens": 1500, "stream": True, "prompt": "go"})]
    for n, (api, body) in enumerate(streams, start=1):
        with fz.http.stream("POST", fz.proxy.url + PATHS[api], json=body, headers=fz.headers(api, rid)) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            next(r.iter_lines())
        wait_for(lambda n=n: len(daemon.calls(rid)) == n, what="the streamed call's record")
    # a client that gives up while the engine is still generating
    engine.script.append("w" * 2000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fz.proxy.url + PATHS["chat"], headers=fz.headers("chat", rid), timeout=httpx.Timeout(30, read=0.05),
                   json={"model": "policy", "max_tokens": 2500, "messages": [{"role": "user", "content": "slow"}]})
    # a client that leaves halfway through its body
    host, port = httpx.URL(fz.proxy.url).host, httpx.URL(fz.proxy.url).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 500\r\n\r\n{\"model\": \"pol")
    # the proxy goes on: the rollout's next call works, and its records are one per finished generation, in order
    wait_for(lambda: len(daemon.calls(rid)) == 3, what="the abandoned generation's record")
    oai = openai.OpenAI(base_url=fz.proxy.url + "/v1", api_key=key, max_retries=0, timeout=30)
    reply = oai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}], max_tokens=3)
    assert reply.usage.completion_tokens > 0
    wait_for(lambda: len(daemon.calls(rid)) == 4, what="the next call's record")
    assert [r.call_index for r in daemon.calls(rid)] == [0, 1, 2, 3]
    assert [r.api for r in daemon.calls(rid)] == ["anthropic-messages", "openai-completions", "openai-chat",
                                                  "openai-chat"]
    good_request(fz, "chat")


def crashes(log: str) -> list[str]:
    """The exception line of every traceback in the proxy's log (the 500 handler logs one for every crash)."""
    out, lines = [], log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            out.append(next((x for x in lines[i + 1:] if x and not x[0].isspace()), "?"))
    return out


def test_no_request_crashed_the_proxy(fz):
    """Last: nothing above made the proxy crash, not even the client that left mid-body."""
    good_request(fz, "messages")
    assert crashes(fz.log_path.read_text()) == [], fz.log_path.read_text()[-3000:]
