"""The TITO proxy end to end: a real proxy process, real HTTP, real ZeroMQ, the official openai client.

The test plays the daemon (a ZeroMQ ROUTER speaking gyre_slurm.protocol: answers RouteQuery, collects and acks
CallRecords) and serves SGLang's /generate with the real tiny model (transformers). Replies the conversation
needs (tool calls) are scripted: the engine then forces those ids and scores them with the model; other calls
are sampled from the model.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import httpx
import openai
import pytest

from gyre_slurm import spawn as spawning
from gyre_slurm.engines.client import EngineClient, SamplingParams
from gyre_slurm.harness.agent_spec import SYSTEM_PROMPT, TOOLS
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.protocol import CallAck, CallRecord
from gyre_slurm.proxy.keys import make_key

from .conftest import fill_disk, mount_tmpfs
from .proxy_world import (
    WEIGHT_VERSION,
    FakeDaemon,
    ProxyProc,
    TinyEngine,
    start_embedded_engine,
    wait_for,
)

SCRIPTED = (1, 2, 7)  # rollouts served by the scripted engine; all others by the real embedded engine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy")
    model_dir = create_tiny_model(tmp / "model", seed=0)
    engine_proc, engine_ready = start_embedded_engine(model_dir, tmp)  # starts while the rest is set up
    scripted = TinyEngine(model_dir)
    scripted_url, server = scripted.serve()
    run_dir = tmp / "run"
    mount_tmpfs(run_dir, "64m")  # a disk of its own, that a test fills
    daemon = FakeDaemon(run_dir, "")
    proxy = ProxyProc(run_dir, model_dir, tmp / "proxy.log")
    try:
        daemon.engine_url = spawning.wait_ready_file(engine_ready, engine_proc, what="the embedded engine",
                                                     timeout_s=60, log=tmp / "engine.log")["url"]
        for rid in SCRIPTED:
            daemon.engines[rid] = [scripted_url]
        proxy.start()
        yield type("World", (), {"engine": scripted, "daemon": daemon, "proxy": proxy, "run_dir": run_dir,
                                 "tok": scripted.tok, "model": scripted.model})
    finally:
        proxy.kill(signal.SIGTERM)
        engine_proc.terminate()
        engine_proc.wait(20)
        daemon.stop()
        server.should_exit = True
        subprocess.run(["umount", "-l", str(run_dir)], check=False)


def client(world, rollout_id: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=world.proxy.url + "/v1", api_key=make_key(world.daemon.token, rollout_id),
                         max_retries=0, timeout=60)


def tool_call_text(path: str, content: str) -> str:
    args = json.dumps({"path": path, "content": content}, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>'


def echo(msg) -> dict:
    """The assistant message as a harness sends it back (the reference one, plus reasoning_content)."""
    out = {"role": "assistant", "content": msg.content}
    if msg.model_extra.get("reasoning_content"):
        out["reasoning_content"] = msg.model_extra["reasoning_content"]
    if msg.tool_calls:
        out["tool_calls"] = [{"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                             for tc in msg.tool_calls]
    return out


def assert_extends(tok, prev: CallRecord, cur: CallRecord, messages: list[dict]) -> None:
    """cur.prompt = prev.prompt + prev.output + suffix, where the suffix is what the canonical render of the
    request adds after the previous call's text (the tiny tokenizer is byte-level: text ↔ ids is exact)."""
    head = prev.prompt_ids + prev.output_ids
    assert cur.prompt_ids[:len(head)] == head
    assert cur.reused_tokens == len(head) and cur.branch_reason is None
    canonical = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    head_text = tok.decode(head, skip_special_tokens=False)
    assert canonical.startswith(head_text)
    assert cur.prompt_ids[len(head):] == tok.encode(canonical[len(head_text):], add_special_tokens=False)


def test_multi_turn_tool_conversation_reuses_exact_ids(world):
    engine, daemon, tok = world.engine, world.daemon, world.tok
    assert {m.id for m in client(world, 1).models.list().data} == {"policy"}
    engine.script.extend([
        "I will write two files.\n" + tool_call_text("a.txt", "hello\n"),
        tool_call_text("b.txt", "x") + "\n" + tool_call_text("sub/c.txt", "ü"),
        "<think>\nall written\n</think>\n\ndone",
    ])
    c = client(world, 1)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "write the files"}]
    sent: list[list[dict]] = []
    for turn in range(5):
        sent.append([dict(m) for m in messages])
        resp = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0,
                                         max_tokens=160)
        msg = resp.choices[0].message
        if turn == 0:
            assert resp.choices[0].finish_reason == "tool_calls" and msg.content == "I will write two files."
            assert json.loads(msg.tool_calls[0].function.arguments) == {"path": "a.txt", "content": "hello\n"}
        if turn == 1:
            assert msg.content is None and [json.loads(t.function.arguments)["path"] for t in msg.tool_calls] == [
                "b.txt", "sub/c.txt"]
        if turn == 2:
            assert resp.choices[0].finish_reason == "stop" and msg.content == "done" and not msg.tool_calls
            assert msg.model_extra.get("reasoning_content") == "all written"
        assert resp.usage.prompt_tokens + resp.usage.completion_tokens == resp.usage.total_tokens
        messages.append(echo(msg))
        for tc in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": "wrote it"})
        if not msg.tool_calls:  # turn 3 is sampled from the model itself: arbitrary bytes, even broken UTF-8
            messages.append({"role": "user", "content": "check the files again"})

    wait_for(lambda: len(daemon.calls(1)) == 5, what="5 call records")
    recs = daemon.calls(1)
    assert [r.call_index for r in recs] == [0, 1, 2, 3, 4]
    assert recs[0].branch_reason is None and recs[0].reused_tokens == 0
    assert recs[0].prompt_ids == tok.apply_chat_template(sent[0], tools=TOOLS, add_generation_prompt=True,
                                                         return_dict=False)
    for k in range(1, 4):
        assert_extends(tok, recs[k - 1], recs[k], sent[k])
    # call 3 was sampled: its ids stay as sampled in call 4's prompt, whatever its text decodes to
    head = recs[3].prompt_ids + recs[3].output_ids
    assert recs[4].prompt_ids[:len(head)] == head and recs[4].branch_reason is None
    assert recs[4].prompt_ids[len(head):] == tok.encode("\n<|im_start|>user\ncheck the files again<|im_end|>\n"
                                                        "<|im_start|>assistant\n", add_special_tokens=False)
    for r, seen in zip(recs, engine.seen[-5:], strict=True):
        assert r.prompt_ids == seen  # what was recorded is what the engine was given
        assert len(r.output_logprobs) == len(r.output_ids) and all(lp <= 0 for lp in r.output_logprobs)
        assert r.api == "openai-chat" and r.weight_version == WEIGHT_VERSION and r.cell == 1
        assert r.latency_s > 0 and r.started_at > 0
    assert [r.finish_reason for r in recs[:3]] == ["tool_calls", "tool_calls", "stop"]
    health = world.proxy.health()
    assert health["canonical_mismatch"] == 0 and health["canonical_checked"] >= 2
    assert any(h.url == world.proxy.url for h in daemon.hellos)


def test_branch_reasons_over_http(world):
    daemon, engine = world.daemon, world.engine
    c = client(world, 2)
    base = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    engine.script.extend(["one", "two", "three"])
    r1 = c.chat.completions.create(model="m", messages=base, max_tokens=8)
    c.chat.completions.create(model="m", messages=base, max_tokens=8)  # the same request again
    c.chat.completions.create(model="m", messages=[base[0], {"role": "user", "content": "hello"}], max_tokens=8)
    cut = c.chat.completions.create(model="m", messages=base, max_tokens=2, temperature=0.0)  # sampled, cut short
    assert cut.choices[0].finish_reason == "length" and r1.choices[0].finish_reason == "stop"
    more = base + [{"role": "assistant", "content": cut.choices[0].message.content}, {"role": "user", "content": "go"}]
    c.chat.completions.create(model="m", messages=more, max_tokens=4)
    c.chat.completions.create(model="m", messages=[base[0], {"role": "user", "content": "summary"}], max_tokens=4)
    wait_for(lambda: len(daemon.calls(2)) == 6, what="6 records")
    # the fourth request is the first one again: a retry of call 0 (its prompt reused), not an edit
    assert [r.branch_reason for r in daemon.calls(2)] == [None, "retry", "edit", "retry", "truncated_parent",
                                                          "compaction"]
    assert [r.reused_tokens > 0 for r in daemon.calls(2)] == [False, True, False, True, False, False]
    assert [r.kind for r in daemon.calls(2)] == ["main", "main", "main_summary", "main", "main", "main_summary"]


def test_bad_requests_get_openai_errors_and_nothing_is_recorded(world):
    daemon = world.daemon
    n_records, n_seen = len(daemon.receipts), len(world.engine.seen)
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad_key = openai.OpenAI(base_url=world.proxy.url + "/v1", api_key="gyre-r3-" + "0" * 40, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.chat.completions.create(**good)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    other_run = openai.OpenAI(base_url=world.proxy.url + "/v1", api_key=make_key("another-run", 3), max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        other_run.chat.completions.create(**good)

    url, key = world.proxy.url + "/v1/chat/completions", make_key(daemon.token, 3)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    cases = [
        (b'{"model": "m", "messages": [', None),
        (b"[1, 2]", None),
        (json.dumps({**good, "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages.0.role"),
        (json.dumps({**good, "messages": []}).encode(), "messages"),
        (json.dumps({**good, "n": 2}).encode(), "n"),
        (json.dumps({**good, "stream": "yes"}).encode(), "stream"),
        (json.dumps({**good, "tool_choice": "required"}).encode(), "tool_choice"),
    ]
    for body, param in cases:
        r = httpx.post(url, content=body, headers=headers, timeout=30)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, (body, err)
    c = client(world, 3)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{**good, "max_tokens": 5000})  # the tiny model's context is 4096
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**{**good, "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 1})
    assert e.value.code == "context_length_exceeded"
    time.sleep(0.3)
    assert len(daemon.receipts) == n_records and len(world.engine.seen) == n_seen and not daemon.calls(3)
    assert c.chat.completions.create(**good).usage.prompt_tokens > 0  # still serving
    wait_for(lambda: len(daemon.calls(3)) == 1, what="the one good call's record")


def test_closed_rollout_key_stops_working(world):
    daemon = world.daemon
    msgs = [{"role": "user", "content": "hi"}]
    # closed by the daemon's ack of a call
    daemon.close_after_next_call.add(4)
    client(world, 4).chat.completions.create(model="m", messages=msgs, max_tokens=8)
    wait_for(lambda: 4 in daemon.closed and world.proxy.health()["pending_records"] == 0, what="the closing ack")
    n = len(daemon.receipts)
    with pytest.raises(openai.AuthenticationError) as e:
        client(world, 4).chat.completions.create(model="m", messages=msgs, max_tokens=8)
    assert e.value.code == "rollout_closed"
    # finished at the daemon while idle: the proxy asks about idle rollouts and frees their state
    client(world, 9).chat.completions.create(model="m", messages=msgs, max_tokens=4)
    sessions = world.proxy.health()["sessions"]
    daemon.closed.add(9)
    wait_for(lambda: world.proxy.health()["sessions"] == sessions - 1, what="the idle check", timeout=10)
    with pytest.raises(openai.AuthenticationError):
        client(world, 9).chat.completions.create(model="m", messages=msgs, max_tokens=4)
    assert len(daemon.calls(9)) == 1
    n = len(daemon.receipts)
    # unknown or finished at the daemon: the route says so
    daemon.closed.add(5)
    with pytest.raises(openai.AuthenticationError):
        client(world, 5).chat.completions.create(model="m", messages=msgs, max_tokens=8)
    time.sleep(0.2)
    assert len(daemon.receipts) == n


def test_engine_failure_reroutes(world):
    daemon, engine = world.daemon, world.engine
    # an engine that answers 503 (e.g. its memory is released for training), then one that is gone altogether
    daemon.engines[6] = [daemon.engines[1][0], "http://127.0.0.1:9", daemon.engine_url]
    engine.fail_next = 1
    retries = world.proxy.health()["engine_retries"]
    r = client(world, 6).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert daemon.route_queries.count(6) >= 3  # asked again after each failure
    assert world.proxy.health()["engine_retries"] == retries + 2
    wait_for(lambda: len(daemon.calls(6)) == 1, what="the record")
    assert daemon.calls(6)[0].weight_version == WEIGHT_VERSION


@pytest.mark.parametrize("stream", [False, True])
def test_aborted_generation_continues_on_another_cell(world, stream):
    """A cell leaving the rollout pool aborts its in-flight calls: the proxy continues each on the next cell from
    the exact ids sampled so far; the harness sees one ordinary reply, the record what the policy sampled."""
    daemon, engine, tok = world.daemon, world.engine, world.tok
    rollout = 20 + stream
    second_url, server = engine.serve()  # another cell: the same scripted engine at a second address
    try:
        daemon.engines[rollout] = [daemon.engines[1][0], second_url]
        reply = "continued from the ids kept at the abort"
        want = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        engine.script.append(reply)
        engine.abort_after.extend([5, 3])  # aborted twice: after 5 tokens, then 3 more
        before, n_seen = world.proxy.health(), len(engine.seen)
        msgs = [{"role": "user", "content": "go"}]
        c = client(world, rollout)
        if stream:
            chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=64, stream=True))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            assert finish == ["stop"]
        else:
            r = c.chat.completions.create(model="m", messages=msgs, max_tokens=64)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(want)
        assert text == reply
        wait_for(lambda: len(daemon.calls(rollout)) == 1, what="the record")
        rec = daemon.calls(rollout)[0]
        assert rec.output_ids == want and len(rec.output_logprobs) == len(want)
        assert engine.seen[n_seen:] == [rec.prompt_ids, rec.prompt_ids + want[:5], rec.prompt_ids + want[:8]]
        torch = pytest.importorskip("torch")  # each part scored in the context it was sampled in: one whole reply
        assert torch.allclose(torch.tensor(rec.output_logprobs), torch.tensor(engine._logprobs(rec.prompt_ids, want)),
                              atol=1e-4)
        assert rec.weight_version == WEIGHT_VERSION - 1  # parts from two versions: the oldest
        after = world.proxy.health()
        assert after["continued_generations"] == before["continued_generations"] + 1
        assert after["mixed_version_calls"] == before["mixed_version_calls"] + 1
        assert after["engine_retries"] == before["engine_retries"] + 2
    finally:
        server.should_exit = True


def test_real_engine_abort_answers_with_the_partial_output(world):
    """What the proxy continues from: the embedded engine paused in abort mode (a cell leaving the rollout pool)
    answers the running request with the ids sampled so far and their log-probs, as SGLang does."""
    url = world.daemon.engine_url
    eng = EngineClient(url)
    prompt = world.tok.encode("hello there", add_special_tokens=False)

    def generated() -> int:
        return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["generated_tokens"]

    async def scenario():
        start = generated()
        running = asyncio.create_task(eng.generate(prompt, SamplingParams(max_new_tokens=3000, ignore_eos=True)))
        await asyncio.to_thread(wait_for, lambda: generated() >= start + 8, 10, "tokens")
        await asyncio.to_thread(eng.pause_generation, "abort")
        try:
            return await asyncio.wait_for(running, 10)
        finally:
            await asyncio.to_thread(eng.continue_generation)
            await eng.aclose()

    res = asyncio.run(scenario())
    assert res.finish_reason == "abort" and res.meta_info["finish_reason"]["type"] == "abort"
    assert 8 <= len(res.output_ids) < 3000 and len(res.output_logprobs) == len(res.output_ids)
    assert res.weight_version == WEIGHT_VERSION
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        logits = world.model(torch.tensor([prompt + res.output_ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.output_logprobs), want, atol=1e-3)


def test_unacked_records_survive_a_proxy_restart(world):
    daemon, engine, proxy = world.daemon, world.engine, world.proxy
    daemon.acking = False
    engine.script.extend(["first\n" + tool_call_text("a", "1"), "second"])
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "go"}]
    resp = client(world, 7).chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=160)
    wait_for(lambda: (7, 0) in daemon.receipts, what="the record")
    assert proxy.health()["pending_records"] == 1
    proxy.kill(signal.SIGKILL)  # no goodbye: only the journal knows
    assert (world.run_dir / "proxy" / "journal-p0.bin").stat().st_size > 0
    daemon.acking = True
    before, url = daemon.receipts.count((7, 0)), proxy.url
    assert proxy.start() == url  # the restarted proxy took its port again: harnesses in flight retry there
    wait_for(lambda: daemon.receipts.count((7, 0)) > before, what="the replayed record")
    wait_for(lambda: proxy.health()["pending_records"] == 0, what="the ack of the replay")
    # the restarted proxy took the rollout over: the next call extends it and counts on
    tc = resp.choices[0].message.tool_calls[0]
    msgs += [echo(resp.choices[0].message), {"role": "tool", "tool_call_id": tc.id, "content": "ok"}]
    client(world, 7).chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=16)
    wait_for(lambda: len(daemon.calls(7)) == 2, what="the second record")
    first, second = daemon.calls(7)
    assert second.call_index == 1
    assert_extends(world.tok, first, second, msgs)


def test_a_call_the_journal_cannot_take_is_refused_503_and_the_retry_is_the_sessions_first_call(world):
    """A full disk: the call cannot be journaled, so it is not made (503, nothing sent, the session unchanged);
    the client's retry with room is call 0 with no parent, not a child of a call the daemon never heard of."""
    # a prompt of over a page of ids: the record cannot fit in the slack of the journal's last page
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "go on " * 600}]
    filler = fill_disk(world.run_dir)
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(world, 11).chat.completions.create(model="m", messages=msgs, max_tokens=16)
        assert e.value.status_code == 503 and "disk is full" in str(e.value)
    finally:
        filler.unlink()
    assert world.daemon.calls(11) == []
    client(world, 11).chat.completions.create(model="m", messages=msgs, max_tokens=16)
    wait_for(lambda: len(world.daemon.calls(11)) == 1, what="the retry's record")
    (rec,) = world.daemon.calls(11)
    assert rec.call_index == 0 and rec.parent_call is None and rec.reused_tokens == 0


def test_sampled_conversation_on_the_real_engine(world):
    """The embedded engine samples (temperature 1); a stop string ends each reply without the EOS, so the turn is
    closed as context ("<|im_end|>\\n") and the sampled ids, stop string included, stay in the next prompt."""
    daemon, tok = world.daemon, world.tok
    c = client(world, 8)
    stops = [chr(b) for b in range(ord("a"), ord("z") + 1)] + [chr(b) for b in range(ord("A"), ord("Z") + 1)]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "begin"}]
    for turn in range(4):
        resp = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0,
                                         max_tokens=200, stop=stops)
        messages += [echo(resp.choices[0].message), {"role": "user", "content": f"turn {turn}"}]
    wait_for(lambda: len(daemon.calls(8)) == 4, what="4 records")
    recs = daemon.calls(8)
    for prev, cur, k in zip(recs, recs[1:], range(3), strict=False):
        assert prev.finish_reason == "stop" and prev.output_ids[-1] != tok.eos_token_id
        head = prev.prompt_ids + prev.output_ids
        assert cur.branch_reason is None and cur.prompt_ids[:len(head)] == head
        assert cur.prompt_ids[len(head):] == tok.encode(
            f"<|im_end|>\n<|im_start|>user\nturn {k}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    torch = pytest.importorskip("torch")
    for r in recs:  # the behaviour log-probs are the model's own (temperature 1) for the ids it sampled
        with torch.no_grad():
            logits = world.model(torch.tensor([r.prompt_ids + r.output_ids])).logits[0, len(r.prompt_ids) - 1:-1]
        want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.output_logprobs), want, atol=1e-3)
        assert r.weight_version == WEIGHT_VERSION


def _rec(rollout_id: int, call_index: int, n: int = 3) -> CallRecord:
    return CallRecord(rollout_id=rollout_id, call_index=call_index, api="openai-chat", prompt_ids=list(range(n)),
                      output_ids=[7, 8], output_logprobs=[-0.5, -0.25], weight_version=1, finish_reason="stop",
                      started_at=1.0, latency_s=0.1)


def test_journal_replay_torn_tail_and_compaction(tmp_path, monkeypatch):
    from gyre_slurm.errors import GyreError
    from gyre_slurm.proxy.journal import Journal, journal_path

    j = Journal(tmp_path, "px")
    with pytest.raises(GyreError, match="another proxy"):
        Journal(tmp_path, "px")
    for c in range(3):
        j.record(_rec(1, c), {"step": c})
    j.record(_rec(2, 0), None)
    assert j.ack(CallAck(rollout_id=1, call_index=0, rollout_open=True))
    assert j.ack(CallAck(rollout_id=1, call_index=1, rollout_open=True))
    assert not j.ack(CallAck(rollout_id=1, call_index=1, rollout_open=True))  # a duplicate ack
    j.ack(CallAck(rollout_id=2, call_index=0, rollout_open=False))
    j.close()
    # a crash in the middle of the next append: half a record at the end of the file
    path = journal_path(tmp_path, "px")
    with open(path, "ab") as f:
        f.write(msgpack_half_record())
    j = Journal(tmp_path, "px")
    assert [(r.rollout_id, r.call_index) for r in j.pending()] == [(1, 2)]
    assert j.is_closed(2) and not j.is_closed(1)
    # an open rollout's calls all come back, in order, with their conversation deltas (replayed on restart)
    assert set(j.restored) == {1} and j.restored[1].next_call_index == 3
    assert [(rec, st) for rec, st in j.restored[1].calls] == [(_rec(1, c), {"step": c}) for c in range(3)]
    j.close()
    # compaction keeps only what is still needed, however often it runs: every call of an open rollout (each
    # record holds only what its call added), un-acked records, closed markers; nothing of closed rollouts
    monkeypatch.setattr(Journal, "COMPACT_SLACK_BYTES", 1)
    j = Journal(tmp_path, "px")
    for c in range(3, 40):
        j.record(_rec(1, c, n=50), {"step": c})
        j.ack(CallAck(rollout_id=1, call_index=c, rollout_open=True))
    assert [(r.rollout_id, r.call_index) for r in j.pending()] == [(1, 2)]
    j.close()
    j = Journal(tmp_path, "px")
    assert j.restored[1].next_call_index == 40 and [r.call_index for r in j.pending()] == [2] and j.is_closed(2)
    assert [rec.call_index for rec, _ in j.restored[1].calls] == list(range(40))
    j.ack(CallAck(rollout_id=1, call_index=2, rollout_open=False))  # the rollout ends
    j.close()
    j = Journal(tmp_path, "px")
    assert not j.restored and not j.pending() and j.is_closed(1)
    j.close()
    assert path.stat().st_size < 100  # two closed markers


def msgpack_half_record() -> bytes:
    import msgpack

    whole = msgpack.packb({"k": "rec", "rec": _rec(1, 3).model_dump(mode="json"), "st": None, "acked": False})
    return whole[: len(whole) // 2]
