"""A request read against what its rollout sent before: the byte fast path (only what follows the shared
messages is parsed) gives exactly what a parse from scratch gives, and falls back whenever it cannot be sure."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from gyre_slurm.proxy import anthropic_api, openai_api
from gyre_slurm.proxy.apierrors import ApiError
from gyre_slurm.proxy.known import common_prefix_len, message_ends

TRICKY = ['a "quoted" ]} {[ , : text', '"messages": [', "\\", "\u00e9\u4e2d", "", "x" * 70_000]


def chat_history(rng: random.Random, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "task"}]
    for i in range(turns):
        args = json.dumps({"cmd": rng.choice(TRICKY[:5])})
        call = {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": args}}
        msgs.append({"role": "assistant", "content": rng.choice([None, "ok"]), "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": rng.choice(TRICKY)})
    return msgs


SERIALISERS = {
    "python json (', ' and ': ')": lambda d: json.dumps(d).encode(),
    "compact": lambda d: orjson.dumps(d),
    "indented": lambda d: json.dumps(d, indent=1).encode(),
}


@pytest.mark.parametrize("dumps", SERIALISERS.values(), ids=SERIALISERS.keys())
def test_a_growing_history_reads_the_same_as_from_scratch(dumps) -> None:
    rng = random.Random(0)
    msgs = chat_history(rng, 12)
    known: openai_api.KnownMessages = []
    fast_calls = 0
    for n in range(3, len(msgs) + 1):
        body = dumps({"model": "policy", "messages": msgs[:n], "tools": [], "temperature": 1.0})
        fast = openai_api._load_tail(body, openai_api.ChatRequest, known) is not None if known else False
        fast_calls += fast
        req, got = openai_api.parse_chat(body, known)
        req0, want = openai_api.parse_chat(body)
        assert got == want and req.model_dump(exclude={"messages"}) == req0.model_dump(exclude={"messages"})
    assert fast_calls >= len(msgs) - 4  # every call after the first went the fast way
    assert sum(e.body is not None for e in known) == 1  # one body kept per conversation


def test_anthropic_bodies_take_the_fast_path_too() -> None:
    msgs = [{"role": "user", "content": "go"}]
    known: list = []
    for i in range(6):
        body = orjson.dumps({"model": "policy", "max_tokens": 8, "system": "s", "messages": msgs})
        got = anthropic_api.parse_messages(body, known)
        assert got[1] == anthropic_api.parse_messages(body)[1]
        msgs = msgs + [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "f",
                                                           "input": {"a": TRICKY[i % 5]}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "x"}]}]
    assert known[0].ends is not None and len(known[0].ends) == len(json.loads(body)["messages"])


def test_a_changed_or_odd_body_falls_back_and_is_checked() -> None:
    msgs = chat_history(random.Random(1), 4)
    known: openai_api.KnownMessages = []
    openai_api.parse_chat(orjson.dumps({"model": "policy", "messages": msgs}), known)
    # an earlier message changed: bytes differ there, so only the messages before it are known
    changed = [dict(m) for m in msgs] + [{"role": "user", "content": "more"}]
    changed[3] = {"role": "tool", "content": "no id"}
    with pytest.raises(ApiError) as e:
        openai_api.parse_chat(orjson.dumps({"model": "policy", "messages": changed}), known)
    assert e.value.param == "messages.3.tool_call_id"
    # a second "messages" key after the array: the parser keeps the last one, so must we
    body = orjson.dumps({"model": "policy", "messages": msgs + [{"role": "user", "content": "a"}]})
    twice = body[:-1] + b', "messages": [{"role": "user", "content": "only me"}]}'
    assert message_ends(twice) is None
    _, got = openai_api.parse_chat(twice, known)
    assert [m["content"] for m in got] == ["only me"]
    # an element that is not an object
    with pytest.raises(ApiError):
        openai_api.parse_chat(orjson.dumps({"model": "policy", "messages": msgs + ["text"]}), known)


def test_common_prefix_len() -> None:
    rng = random.Random(2)
    for _ in range(200):
        n = rng.choice([0, 1, 5, 70_000, 140_001])
        a = bytes(rng.getrandbits(1) for _ in range(min(n, 50))) + b"z" * max(0, n - 50)
        cut = rng.randint(0, n)
        b = a[:cut] + (b"!" if rng.random() < 0.5 else b"") + a[cut:]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        limit = rng.randint(0, len(a) + 2)
        assert common_prefix_len(a, b, limit) == min(want, limit)
