"""The proxy's other API faces end to end: OpenAI streaming, OpenAI /v1/completions, Anthropic /v1/messages.

Same world as tests/test_proxy.py (its fixture and helpers, imported): a real proxy process, the test playing the
daemon, a scripted engine over the real tiny model; driven by the official openai and anthropic clients.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from gyre_slurm.harness.agent_spec import SYSTEM_PROMPT, TOOLS
from gyre_slurm.proxy.keys import make_key
from tests import test_proxy
from tests.proxy_world import wait_for
from tests.test_proxy import assert_extends, client, tool_call_text

world = test_proxy.world  # the same world, one per test module (module-scoped fixture)

A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def scripted(world, rollout_id: int) -> None:
    world.daemon.engines[rollout_id] = [world.daemon.engines[1][0]]  # the scripted engine serves rollout 1


def assert_chain(world, recs) -> None:
    """Every call's prompt ids extend the previous call's prompt + output token for token."""
    for prev, cur in zip(recs, recs[1:], strict=False):
        head = prev.prompt_ids + prev.output_ids
        assert cur.prompt_ids[:len(head)] == head and cur.reused_tokens == len(head) and cur.branch_reason is None


def reassemble(stream) -> tuple[dict, str, list]:
    """An OpenAI chat stream put back together: (message, finish_reason, usage chunks)."""
    content, reasoning, calls, finish, usages = "", "", {}, None, []
    for i, chunk in enumerate(stream):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        if not chunk.choices:
            continue
        delta, choice = chunk.choices[0].delta, chunk.choices[0]
        if i == 0:
            assert delta.role == "assistant"
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    tool_calls = [calls[k] for k in sorted(calls)]
    return {"content": content or None, "reasoning": reasoning or None, "tool_calls": tool_calls}, finish, usages


def plain(msg) -> dict:
    return {"content": msg.content, "reasoning": (msg.model_extra or {}).get("reasoning_content"),
            "tool_calls": [{"name": tc.function.name, "arguments": tc.function.arguments}
                           for tc in msg.tool_calls or []]}


def test_openai_stream_matches_non_stream_and_extends(world):
    engine, daemon, tok = world.engine, world.daemon, world.tok
    scripted(world, 21)
    c = client(world, 21)
    reply0 = "Writing.\n" + tool_call_text("a.txt", "hello " * 20) + "\n" + tool_call_text("b.txt", "ü")
    engine.script.extend([reply0, reply0, "<think>\nall good, " + "x" * 60 + "\n</think>\n\ndone " * 5])
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "write"}]
    kw = {"model": "policy", "tools": TOOLS, "max_tokens": 300}
    full = c.chat.completions.create(messages=messages, **kw)
    streamed, finish, usages = reassemble(c.chat.completions.create(messages=messages, stream=True, **kw))
    assert finish == full.choices[0].finish_reason == "tool_calls" and not usages
    assert {**streamed, "tool_calls": [{k: v for k, v in t.items() if k != "id"} for t in streamed["tool_calls"]]} \
        == plain(full.choices[0].message)
    assert all(t["id"].startswith("call_") for t in streamed["tool_calls"])
    # the streamed reply echoed back extends the streamed call
    sent = [*messages, {"role": "assistant", "content": streamed["content"], "tool_calls": [
        {"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}}
        for t in streamed["tool_calls"]]}] + [{"role": "tool", "tool_call_id": t["id"], "content": "ok"}
                                             for t in streamed["tool_calls"]]
    last, finish, usages = reassemble(c.chat.completions.create(
        messages=sent, stream=True, stream_options={"include_usage": True}, **kw))
    assert finish == "stop" and last["reasoning"].startswith("all good") and last["content"].startswith("done")
    assert len(usages) == 1 and usages[0].total_tokens == usages[0].prompt_tokens + usages[0].completion_tokens
    wait_for(lambda: len(daemon.calls(21)) == 3, what="3 records")
    recs = daemon.calls(21)
    assert [r.branch_reason for r in recs] == [None, "retry", None] and recs[0].output_ids == recs[1].output_ids
    assert usages[0].prompt_tokens == len(recs[2].prompt_ids)
    assert_extends(tok, recs[1], recs[2], sent)
    assert all(r.api == "openai-chat" for r in recs)


def test_client_leaving_mid_stream_breaks_nothing(world):
    engine, daemon = world.engine, world.daemon
    scripted(world, 22)
    engine.script.extend(["y" * 1500, "short"])
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000, "stream": True}
    headers = {"Authorization": f"Bearer {make_key(daemon.token, 22)}"}
    with httpx.stream("POST", world.proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix("data: "))["object"] == "chat.completion.chunk"
    wait_for(lambda: len(daemon.calls(22)) == 1, what="the record")
    reply = client(world, 22).chat.completions.create(
        model="m", messages=[*body["messages"], {"role": "assistant", "content": "y" * 1500},
                             {"role": "user", "content": "again"}], max_tokens=20)
    assert reply.choices[0].message.content == "short"
    wait_for(lambda: len(daemon.calls(22)) == 2, what="the second record")
    assert_chain(world, daemon.calls(22))
    assert world.proxy.health()["ok"]


def test_openai_completions_are_token_in(world):
    engine, daemon, tok = world.engine, world.daemon, world.tok
    scripted(world, 23)
    c = client(world, 23)
    engine.script.extend(["def f():", "    return 1", "    return 1"])
    prompt = "# a function\n"
    r1 = c.completions.create(model="m", prompt=prompt, max_tokens=20)
    assert r1.choices[0].text == "def f():" and r1.choices[0].finish_reason == "stop"
    wait_for(lambda: len(daemon.calls(23)) == 1, what="the record")
    first = daemon.calls(23)[0]
    assert first.prompt_ids == tok.encode(prompt, add_special_tokens=False) and first.api == "openai-completions"
    ids = first.prompt_ids + first.output_ids + tok.encode("\n", add_special_tokens=False)
    r2 = c.completions.create(model="m", prompt=ids, max_tokens=20)
    chunks = list(c.completions.create(model="m", prompt=ids, max_tokens=20, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r2.choices[0].text == "    return 1"
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: len(daemon.calls(23)) == 3, what="3 records")
    recs = daemon.calls(23)
    assert recs[1].prompt_ids == ids and recs[1].reused_tokens == len(first.prompt_ids + first.output_ids)
    assert [r.branch_reason for r in recs] == [None, None, "retry"]


def a_client(world, rollout_id: int) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=world.proxy.url, api_key=make_key(world.daemon.token, rollout_id),
                               max_retries=0, timeout=60)


def blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def test_anthropic_multi_turn_with_tools_reuses_ids(world):
    engine, daemon, tok = world.engine, world.daemon, world.tok
    scripted(world, 24)
    c = a_client(world, 24)
    turn1 = "<think>\nnext one\n</think>\n\n" + tool_call_text("b.txt", "x")
    engine.script.extend(["Writing a.\n" + tool_call_text("a.txt", "hi"), turn1, turn1, "All done."])
    kw = {"model": "policy", "max_tokens": 200, "tools": A_TOOLS, "system": SYSTEM_PROMPT}
    msgs = [{"role": "user", "content": "write two files"}]
    oai = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "write two files"}]
    r0 = c.messages.create(messages=msgs, **kw)
    assert r0.stop_reason == "tool_use" and r0.type == "message" and r0.role == "assistant"
    assert [b.type for b in r0.content] == ["text", "tool_use"] and r0.content[0].text == "Writing a."
    assert r0.content[1].input == {"path": "a.txt", "content": "hi"} and r0.content[1].id.startswith("toolu_")
    assert r0.usage.input_tokens > 0 and r0.usage.output_tokens > 0
    use = r0.content[1]
    msgs += [{"role": "assistant", "content": blocks(r0)},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "wrote"}]}]
    oai += [{"role": "assistant", "content": "Writing a.", "tool_calls": [{"id": use.id, "type": "function",
             "function": {"name": "write_file", "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "wrote"}]
    full = c.messages.create(messages=msgs, **kw)
    with c.messages.stream(messages=msgs, **kw) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.stop_reason == full.stop_reason == "tool_use"
    strip = [{k: v for k, v in b.items() if k != "id"} for b in blocks(streamed)]
    assert strip == [{k: v for k, v in b.items() if k != "id"} for b in blocks(full)]
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"] and streamed.content[0].thinking == "next one"
    use = streamed.content[1]
    msgs += [{"role": "assistant", "content": blocks(streamed)},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": [{"type": "text", "text": "wrote"}]},
                                          {"type": "text", "text": "finish up"}]}]
    oai += [{"role": "assistant", "content": None, "reasoning_content": "next one", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "write_file", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "wrote"}, {"role": "user", "content": "finish up"}]
    last = c.messages.create(messages=msgs, stop_sequences=["never"], **kw)
    assert last.stop_reason == "end_turn" and blocks(last) == [{"type": "text", "text": "All done."}]
    wait_for(lambda: len(daemon.calls(24)) == 4, what="4 records")
    recs = daemon.calls(24)
    assert [r.branch_reason for r in recs] == [None, None, "retry", None]
    assert all(r.api == "anthropic-messages" for r in recs)
    assert_extends(tok, recs[0], recs[1], oai[:4])
    assert_extends(tok, recs[2], recs[3], oai)
    assert world.proxy.health()["canonical_mismatch"] == 0


def test_a_branching_harness_through_both_clients_is_token_exact(world):
    """A Claude Code-like rollout through the official clients: the main agent (OpenAI, streaming) delegates to a
    sub-agent (Anthropic, its own system prompt), resumes, writes a summary, restarts from it (compaction) and
    retries. Every recorded call's whole prompt is what the engine received, its output what the engine sampled;
    kinds, branch reasons and parents say which conversation each call continued."""
    engine, daemon, tok = world.engine, world.daemon, world.tok
    scripted(world, 26)
    oc, ac = client(world, 26), a_client(world, 26)
    summary = "Summary: a.txt holds x; the reviewer found it fine."
    replies = ["Delegating.\n" + tool_call_text("a.txt", "x"), "Looks fine to me.", summary, "done", "done again"]
    engine.script.extend(replies)
    seen_before = len(engine.seen)
    main = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "write a.txt, get it reviewed"}]
    m0, _, _ = reassemble(oc.chat.completions.create(model="policy", messages=main, tools=TOOLS, max_tokens=200,
                                                     stream=True))
    sub = ac.messages.create(model="policy", max_tokens=100, system="You review files.",
                             messages=[{"role": "user", "content": "review a.txt"}])
    assert blocks(sub) == [{"type": "text", "text": "Looks fine to me."}]
    call = m0["tool_calls"][0]
    main += [{"role": "assistant", "content": m0["content"], "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "wrote a.txt; review: fine"}]
    r2 = oc.chat.completions.create(model="policy", messages=main, tools=TOOLS, max_tokens=200)
    assert r2.choices[0].message.content == summary
    restart = [main[0], {"role": "user", "content": "Continue from this summary of the session so far:\n" + summary}]
    for _ in range(2):  # the second is a retry of the same request
        oc.chat.completions.create(model="policy", messages=restart, tools=TOOLS, max_tokens=50)
    wait_for(lambda: len(daemon.calls(26)) == 5, what="5 records")
    recs = daemon.calls(26)
    assert [r.kind for r in recs] == ["main", "subagent", "main", "main_summary", "main_summary"]
    assert [r.branch_reason for r in recs] == [None, "new_agent", None, "compaction", "retry"]
    assert [r.parent_call for r in recs] == [None, None, 0, None, 3]
    assert [r.api for r in recs] == ["openai-chat", "anthropic-messages"] + ["openai-chat"] * 3
    # token-exact against the engine: what it was sent, what it sampled (the records carry only new ids)
    assert [r.prompt_ids for r in recs] == engine.seen[seen_before:seen_before + 5]
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert [r.output_ids for r in recs] == [tok.encode(t, add_special_tokens=False) + [eos] for t in replies]
    assert recs[2].prompt_ids[:recs[2].reused_tokens] == recs[0].prompt_ids + recs[0].output_ids
    assert daemon.deltas[(26, 2)].prompt_ids.tolist() == recs[2].prompt_ids[recs[2].reused_tokens:]
    assert recs[4].prompt_ids == recs[3].prompt_ids and recs[4].reused_tokens == len(recs[3].prompt_ids)


def test_bad_requests_in_each_api_shape(world):
    daemon, engine = world.daemon, world.engine
    url = world.proxy.url
    n_receipts, n_seen = len(daemon.receipts), len(engine.seen)
    bad_key = "gyre-r25-" + "0" * 40
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key=bad_key, max_retries=0).chat.completions.create(
            stream=True, **chat)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key=bad_key, max_retries=0).completions.create(
            model="m", prompt="x")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key=bad_key, max_retries=0).messages.create(**chat)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}
    r = httpx.post(url + "/v1/messages", json=chat, headers={"Authorization": f"Bearer {bad_key}",
                                                             "anthropic-version": "2023-06-01"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"

    key = make_key(daemon.token, 25)
    openai_cases = {
        "/v1/chat/completions": [json.dumps({**chat, "stream": "yes"}), json.dumps({**chat, "stream_options": 3})],
        "/v1/completions": ["{", json.dumps({"model": "m", "prompt": []}), json.dumps({"model": "m", "prompt": [-1]}),
                            json.dumps({"model": "m", "prompt": "x", "echo": True}),
                            json.dumps({"model": "m", "prompt": "x", "max_tokens": 5000})],
    }
    for path, bodies in openai_cases.items():
        for body in bodies:
            r = httpx.post(url + path, content=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, body)
    user = [{"role": "user", "content": "hi"}]
    anthropic_cases = [
        "[1]",
        json.dumps({"model": "m", "messages": user}),  # max_tokens is required
        json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
        json.dumps({"model": "m", "max_tokens": 4, "messages": user, "tool_choice": {"type": "any"}}),
        json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}),
        json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        json.dumps({"model": "m", "max_tokens": 5000, "messages": user}),
    ]
    for body in anthropic_cases:
        r = httpx.post(url + "/v1/messages", content=body, headers={"x-api-key": key,
                                                                   "anthropic-version": "2023-06-01"}, timeout=30)
        assert r.status_code == 400, body
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", body
        assert r.json()["error"]["message"], body
    with pytest.raises(anthropic.BadRequestError):
        a_client(world, 25).messages.create(model="m", max_tokens=4, messages=user, extra_body={"temperature": 1.5})
    # an unknown route or a wrong method: still the API's own shape
    r = httpx.post(url + "/v1/embeddings", headers={"authorization": f"Bearer {key}"}, json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(url + "/v1/messages", headers={"x-api-key": key})
    assert r.status_code == 405 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    time.sleep(0.3)
    assert len(daemon.receipts) == n_receipts and len(engine.seen) == n_seen and not daemon.calls(25)
