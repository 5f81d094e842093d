"""What the real Claude Code CLI (v2.1.197) sends to /v1/messages, through a real proxy.

tests/fixtures/claude_code/first_request.json is the first /v1/messages body the CLI sent (`claude -p "write
hello.txt"`, captured by a throwaway HTTP server): POST /v1/messages?beta=true with anthropic-beta
claude-code-20250219, context-1m-2025-08-07, interleaved-thinking-2025-05-14, context-management-2025-06-27,
mid-conversation-system-2026-04-07, … It holds a `role: "system"` message inside `messages`, cache_control on system
and text blocks, thinking {type: adaptive}, context_management, output_config {effort}, metadata {user_id} and
stream: true. Same world as tests/test_proxy_apis.py (one proxy, a scripted engine and the real tiny model).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from gyre_slurm.proxy import anthropic_api
from gyre_slurm.proxy.keys import make_key
from tests import test_proxy
from tests.proxy_world import wait_for
from tests.test_proxy_apis import A_TOOLS, a_client, assert_chain, blocks, scripted

world = test_proxy.world

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code" / "first_request.json"
BETAS = ("claude-code-20250219,context-1m-2025-08-07,interleaved-thinking-2025-05-14,thinking-token-count-2026-05-13,"
         "context-management-2025-06-27,prompt-caching-scope-2026-01-05,mid-conversation-system-2026-04-07,"
         "effort-2025-11-24")
# what Claude Code adds to each request besides messages, tools and system
EXTRA = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
         "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
         "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s"})}}


def captured() -> dict:
    return json.loads(FIXTURE.read_text())


def headers(world, rollout_id: int) -> dict:
    return {"x-api-key": make_key(world.daemon.token, rollout_id), "anthropic-version": "2023-06-01",
            "anthropic-beta": BETAS, "content-type": "application/json"}


def fitted(body: dict) -> dict:
    """The captured request cut to fit the tiny model's 4096-token context, its shape kept: every system block
    (with its cache_control), every message (the mid-conversation system one too), two of its tools."""
    body = copy.deepcopy(body)
    for b in body["system"]:
        b["text"] = b["text"][:120]
    for m in body["messages"]:
        if isinstance(m["content"], str):
            m["content"] = m["content"][:200]
        else:
            for b in m["content"]:
                b["text"] = b["text"][:200]
    body["tools"] = [{**t, "description": t["description"][:100]} for t in body["tools"]
                     if t["name"] in ("Bash", "Write")]
    body["max_tokens"] = 32
    return body


def test_the_captured_request_has_what_claude_code_sends():
    body = captured()
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert any("cache_control" in b for b in body["system"]) and body["thinking"] == {"type": "adaptive"}
    for key in ("context_management", "output_config", "metadata"):
        assert key in body
    req, messages, tools = anthropic_api.parse_messages(json.dumps(body).encode())
    assert [m["role"] for m in messages] == ["system", "user", "system"]  # the system message where it stands
    assert messages[2]["content"] == body["messages"][1]["content"]
    assert len(tools) == len(body["tools"]) and req.stream


def test_the_billing_header_is_left_out_of_the_prompt():
    """Claude Code's first system block differs in every run (`cc_version=<version>.<hash>`): left in, no two runs
    would share a single prompt token in the engine's prefix cache."""
    body = captured()
    assert body["system"][0]["text"].startswith(anthropic_api.BILLING_HEADER)
    _, messages, _ = anthropic_api.parse_messages(json.dumps(body).encode())
    assert anthropic_api.BILLING_HEADER not in messages[0]["content"]
    assert messages[0]["content"] == "\n".join(b["text"] for b in body["system"][1:])


def test_the_captured_request_replayed_gets_an_answer(world):
    daemon = world.daemon
    # the CLI probes its base URL first; a refused probe would be a 404 in the proxy's log on every run
    assert httpx.head(world.proxy.url + "/").status_code == 200
    body = fitted(captured())
    url = world.proxy.url + "/v1/messages?beta=true"
    with httpx.stream("POST", url, content=json.dumps(body), headers=headers(world, 61), timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    kinds = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    r = httpx.post(url, content=json.dumps({**body, "stream": False}), headers=headers(world, 61), timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    wait_for(lambda: len(daemon.calls(61)) == 2, what="2 records")
    recs = daemon.calls(61)
    assert recs[1].prompt_ids == recs[0].prompt_ids and recs[1].branch_reason == "retry"
    prompt = world.tok.decode(recs[0].prompt_ids, skip_special_tokens=False)
    system2 = body["messages"][1]["content"]
    assert prompt.index(body["messages"][0]["content"][1]["text"]) < prompt.index(system2)
    # count_tokens for the same request: the recorded prompt length; the whole capture counts too (no generation)
    r = httpx.post(world.proxy.url + "/v1/messages/count_tokens?beta=true", headers=headers(world, 61),
                   content=json.dumps({k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}))
    assert r.status_code == 200 and r.json() == {"input_tokens": len(recs[0].prompt_ids)}, r.text
    full = {k: v for k, v in captured().items() if k not in ("max_tokens", "stream", "metadata")}
    r = httpx.post(world.proxy.url + "/v1/messages/count_tokens?beta=true", headers=headers(world, 61),
                   content=json.dumps(full), timeout=60)
    assert r.status_code == 200 and r.json()["input_tokens"] > 4096, r.text
    time.sleep(0.2)
    assert len(daemon.calls(61)) == 2


def test_mid_conversation_system_messages_extend_the_ids(world):
    engine, daemon = world.engine, world.daemon
    scripted(world, 62)
    c = a_client(world, 62)
    engine.script.extend(["<think>\nponder\n</think>\n\nHello there.", "Second answer.", "Third answer."])
    kw = {"model": "policy", "max_tokens": 64, "tools": A_TOOLS,
          "system": [{"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}]}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]
    assert c.messages.count_tokens(model="policy", messages=msgs, system=kw["system"],
                                   tools=A_TOOLS).input_tokens > 0
    r0 = c.messages.create(messages=msgs, extra_body=EXTRA, **kw)
    assert [b.type for b in r0.content] == ["thinking", "text"] and r0.content[1].text == "Hello there."
    msgs += [{"role": "assistant", "content": blocks(r0)},
             {"role": "system", "content": "Reminder: be brief."},
             {"role": "user", "content": "again"}]
    n1 = c.beta.messages.count_tokens(model="policy", messages=msgs, system=kw["system"], tools=A_TOOLS,
                                      betas=["mid-conversation-system-2026-04-07"]).input_tokens
    with c.messages.stream(messages=msgs, extra_body=EXTRA, extra_query={"beta": "true"},
                           extra_headers={"anthropic-beta": BETAS}, **kw) as stream:
        r1 = stream.get_final_message()
    assert blocks(r1) == [{"type": "text", "text": "Second answer."}]
    msgs += [{"role": "assistant", "content": blocks(r1)},
             {"role": "system", "content": [{"type": "text", "text": "Another note.",
                                             "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
             {"role": "user", "content": "last"}]
    n2 = c.messages.count_tokens(model="policy", messages=msgs, system=kw["system"], tools=A_TOOLS).input_tokens
    r2 = c.messages.create(messages=msgs, extra_body=EXTRA, **kw)
    assert blocks(r2) == [{"type": "text", "text": "Third answer."}]
    wait_for(lambda: len(daemon.calls(62)) == 3, what="3 records")
    recs = daemon.calls(62)
    assert_chain(world, recs)  # each prompt extends the previous prompt + output, token for token
    assert [len(r.prompt_ids) for r in recs[1:]] == [n1, n2] == [r1.usage.input_tokens, r2.usage.input_tokens]
    prompt = world.tok.decode(recs[2].prompt_ids, skip_special_tokens=False)
    at = [prompt.index(s) for s in ("Hello there.", "Reminder: be brief.", "again", "Second answer.",
                                    "Another note.", "last")]
    assert at == sorted(at)
    assert world.proxy.health()["canonical_mismatch"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_images_documents_and_server_tools_are_refused_by_name(world, stream):
    daemon, engine = world.daemon, world.engine
    n_seen = len(engine.seen)
    c = a_client(world, 63)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    for block, name in ((image, "image"), (document, "document")):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="policy", max_tokens=8, stream=stream, messages=[
                {"role": "user", "content": [{"type": "text", "text": "look"}, block]}])
        err = e.value.body["error"]
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
        assert f"{name} blocks are not supported" in err["message"] and "messages.0.content.1" in err["message"]
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="policy", max_tokens=8, stream=stream, tools=[*A_TOOLS, server_tool],
                          messages=[{"role": "user", "content": "search"}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and "web_search_20250305" in err["message"]
    assert "server tools are not supported" in err["message"]
    for body in ({"messages": [{"role": "user", "content": [image]}]},
                 {"messages": [{"role": "user", "content": "x"}], "tools": [server_tool]},
                 {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": [
                     {"type": "tool_result", "tool_use_id": "t"}]}]},
                 {"messages": [{"role": "system", "content": "only"}]},
                 {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}},
                 {"messages": [{"role": "user", "content": "x"}], "system": [
                     {"type": "text", "text": "s", "cache_control": {"type": "forever"}}]}):
        r = httpx.post(world.proxy.url + "/v1/messages/count_tokens?beta=true", json={"model": "policy", **body},
                       headers=headers(world, 63))
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    time.sleep(0.2)
    assert len(engine.seen) == n_seen and not daemon.calls(63)


def test_count_tokens_authenticates(world):
    r = httpx.post(world.proxy.url + "/v1/messages/count_tokens", json={
        "model": "policy", "messages": [{"role": "user", "content": "hi"}]}, headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
