"""OpenAI's Responses API (/v1/responses) end to end: the same world as tests/test_proxy.py (a real proxy process,
the test playing the daemon, a scripted engine over the real tiny model), driven by the official openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from gyre_slurm.harness.agent_spec import SYSTEM_PROMPT, TOOLS
from gyre_slurm.proxy.keys import make_key
from tests import test_proxy
from tests.proxy_world import wait_for
from tests.test_proxy import assert_extends, client, tool_call_text

world = test_proxy.world  # one per test module (module-scoped fixture)

CODEX_REQUEST = Path(__file__).parent / "fixtures" / "codex" / "first_request.json"
R_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
            "parameters": t["function"]["parameters"]} for t in TOOLS]


def scripted(world, rollout_id: int) -> None:
    world.daemon.engines[rollout_id] = [world.daemon.engines[1][0]]  # the scripted engine serves rollout 1


def echoed(resp) -> list[dict]:
    """A response's output items as a client sends them back in `input`."""
    return [item.model_dump(exclude_none=True) for item in resp.output]


def from_stream(events) -> tuple[list[str], object]:
    kinds, final = [], None
    for i, ev in enumerate(events):
        assert ev.sequence_number == i
        kinds.append(ev.type)
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    return kinds, final


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip_extends_ids(world, stream):
    engine, daemon, tok = world.engine, world.daemon, world.tok
    rid = 61 if stream else 62
    scripted(world, rid)
    c = client(world, rid)
    engine.script.extend(["<think>\nfirst a\n</think>\n\nWriting a.\n" + tool_call_text("a.txt", "hi"),
                          "All done."])
    kw = {"model": "policy", "tools": R_TOOLS, "max_output_tokens": 200}
    items: list[dict] = [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "input_text", "text": "write a file"}]}]
    if stream:
        kinds, r0 = from_stream(c.responses.create(input=items, instructions=SYSTEM_PROMPT, stream=True, **kw))
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        for k in ("response.output_text.delta", "response.output_text.done", "response.content_part.done",
                  "response.function_call_arguments.delta", "response.function_call_arguments.done",
                  "response.output_item.done"):
            assert k in kinds
    else:
        r0 = c.responses.create(input=items, instructions=SYSTEM_PROMPT, **kw)
    assert r0.status == "completed" and r0.id.startswith("resp_") and r0.object == "response"
    assert [o.type for o in r0.output] == ["reasoning", "message", "function_call"]
    assert r0.output_text == "Writing a."
    call = r0.output[2]
    assert call.name == "write_file" and json.loads(call.arguments) == {"path": "a.txt", "content": "hi"}
    assert r0.usage.total_tokens == r0.usage.input_tokens + r0.usage.output_tokens > 0
    items += [*echoed(r0), {"type": "function_call_output", "call_id": call.call_id, "output": "wrote"}]
    r1 = c.responses.create(input=items, instructions=SYSTEM_PROMPT, **kw)
    assert r1.output_text == "All done." and [o.type for o in r1.output] == ["message"]
    wait_for(lambda: len(daemon.calls(rid)) == 2, what="2 records")
    recs = daemon.calls(rid)
    assert all(r.api == "openai-responses" for r in recs)
    oai = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "system", "content": "Be brief."},
           {"role": "user", "content": "write a file"},
           {"role": "assistant", "content": "Writing a.", "reasoning_content": "first a", "tool_calls": [
               {"id": call.call_id, "type": "function", "function": {"name": "write_file",
                                                                     "arguments": call.arguments}}]},
           {"role": "tool", "tool_call_id": call.call_id, "content": "wrote"}]
    assert_extends(tok, recs[0], recs[1], oai)


def test_previous_response_id_prepends_the_conversation(world):
    engine, daemon = world.engine, world.daemon
    scripted(world, 63)
    c = client(world, 63)
    engine.script.extend(["Hello.", "Again."])
    r0 = c.responses.create(model="policy", input="hi", instructions="You are terse.", store=False)
    assert r0.output_text == "Hello."
    r1 = c.responses.create(model="policy", input="once more", instructions="You are terse.",
                            previous_response_id=r0.id)
    assert r1.output_text == "Again." and r1.previous_response_id == r0.id
    wait_for(lambda: len(daemon.calls(63)) == 2, what="2 records")
    prev, cur = daemon.calls(63)
    head = prev.prompt_ids + prev.output_ids
    assert cur.prompt_ids[:len(head)] == head and cur.reused_tokens == len(head)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="policy", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


def test_length_is_incomplete(world):
    engine = world.engine
    scripted(world, 64)
    engine.script.extend(["y" * 400])
    r = client(world, 64).responses.create(model="policy", input="go", max_output_tokens=10)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def _codex_body() -> dict:
    body = json.loads(CODEX_REQUEST.read_text())
    for item in body["input"]:  # the tiny model's context is 4096 tokens: shorten Codex's long instructions
        for part in item["content"]:
            part["text"] = part["text"][:300]
    for t in body["tools"]:
        if t["type"] == "function":
            t["description"] = t["description"][:60]
            t["parameters"] = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    return body


def test_the_captured_codex_request_is_served(world):
    engine, daemon = world.engine, world.daemon
    scripted(world, 65)
    engine.script.extend(["I will write it."])
    body = _codex_body()
    assert {t["type"] for t in body["tools"]} >= {"function", "namespace", "web_search"}
    headers = {"Authorization": f"Bearer {make_key(daemon.token, 65)}"}
    lines = []
    with httpx.stream("POST", world.proxy.url + "/v1/responses", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == "I will write it."
    # untrimmed, Codex's instructions outgrow the tiny model's context: a clear 400, not a crash
    full = httpx.post(world.proxy.url + "/v1/responses", content=CODEX_REQUEST.read_bytes(), headers=headers,
                      timeout=60)
    assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"
    assert full.json()["error"]["param"] == "input"
    assert world.proxy.health()["canonical_mismatch"] == 0


def test_non_function_tools_alone_are_refused(world):
    c = client(world, 66)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="policy", input="search", tools=[{"type": "web_search"}])
    assert "web_search" in e.value.body["message"] and e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="policy", input="x", tools=R_TOOLS, tool_choice={"type": "web_search"})
    assert "web_search" in e.value.body["message"]


def test_codex_echo_converts_to_the_reply_the_proxy_built():
    """Codex's second request (captured against a stub serving this module's replies): its echoed reasoning,
    message and function_call items become one assistant message, the template message of the reply."""
    from gyre_slurm.proxy import responses_api
    from gyre_slurm.proxy.tito import template_message

    body = (CODEX_REQUEST.parent / "second_request.json").read_bytes()
    _req, _history, messages, tools = responses_api.parse(body, responses_api.Kept(), 1)
    built = {"role": "assistant", "content": "Writing.", "reasoning_content": "think first", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "exec_command",
                                                             "arguments": json.dumps({"cmd": "echo hi > hello.txt"})}}]}
    assert messages[-2] == template_message(built)
    assert messages[-1]["role"] == "tool" and messages[-1]["tool_call_id"] == "call_abc"
    assert [m["role"] for m in messages[:2]] == ["system", "system"]  # Codex's developer messages
    assert {t["function"]["name"] for t in tools} >= {"exec_command", "write_stdin"}
