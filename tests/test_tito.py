"""Pure logic of the proxy: token-in/token-out prompt building, tool-call parsing, per-rollout keys.

Runs against the tiny model's real tokenizer and chat template (byte-level, Qwen3-style); the "model" is
played by encoding chosen replies, so every case is exact and fast.
"""

from __future__ import annotations

import json

import pytest

from gyre_slurm.harness.agent_spec import SYSTEM_PROMPT, TOOLS
from gyre_slurm.model.tiny import build_tokenizer
from gyre_slurm.proxy.conversations import Conversations
from gyre_slurm.proxy.keys import make_key, rollout_of
from gyre_slurm.proxy.tito import (
    ChatRenderer,
    canonical_mismatch,
    message_key,
    reply_matches,
    same_message,
    template_message,
)
from gyre_slurm.proxy.toolcalls import get_parser, parse_qwen3, parser_for_model_type, parser_names


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(build_tokenizer())


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


class Plan:
    """A PromptPlan with the ids as a list (tests compare lists)."""

    def __init__(self, plan) -> None:
        self.raw = plan
        self.prompt_ids = plan.prompt_ids.tolist()
        self.reused_tokens, self.branch_reason, self.kind = plan.reused_tokens, plan.branch_reason, plan.kind
        self.parent_call = plan.parent_call


def commit(conv: Conversations, plan: Plan, reply: dict, out: list[int], finish: str = "stop") -> dict:
    index = commit.n = getattr(commit, "n", 0) + 1
    return conv.commit(plan.raw, reply, out, finish, index)


class Session:
    """Plays harness + proxy bookkeeping: the model's reply is given as text, the harness echoes it back."""

    def __init__(self, renderer: ChatRenderer, tools=TOOLS, echo_reasoning: bool = True,
                 conv: Conversations | None = None, system: str = SYSTEM_PROMPT, task: str = "write a.txt") -> None:
        self.r, self.tools, self.echo_reasoning = renderer, tools, echo_reasoning
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.conv = conv if conv is not None else Conversations()
        self.plans: list[Plan] = []

    def step(self, reply_text: str, finish: str = "stop", eos: bool = True, kind: str | None = None):
        msgs = [template_message(m) for m in self.messages]
        plan = Plan(self.conv.plan(self.r, msgs, self.tools, kind))
        out = self.r.encode(reply_text) + ([self.r.eos_id] if eos else [])
        parsed = parse_qwen3(self.r.decode(out[:-1] if eos else out))
        reply = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
        if parsed.reasoning_content:
            reply["reasoning_content"] = parsed.reasoning_content
        commit(self.conv, plan, template_message(reply), out, "tool_calls" if parsed.tool_calls else finish)
        self.plans.append(plan)
        echoed = {"role": "assistant", "content": parsed.content,
                  "tool_calls": [dict(tc, function=dict(tc["function"])) for tc in parsed.tool_calls]}
        if self.echo_reasoning and parsed.reasoning_content:
            echoed["reasoning_content"] = parsed.reasoning_content
        self.messages.append(echoed)
        return plan, parsed, out


def test_multi_turn_tool_conversation_extends_token_for_token(renderer):
    s = Session(renderer)
    nl = renderer.encode("\n")
    replies = [
        "<think>\nI need a file.\n</think>\n\nWriting it.\n" + call("write_file", path="a.txt", content="hi\n"),
        call("write_file", path="b.txt", content="x") + "\n" + call("write_file", path="c/d.txt", content="ü ✓"),
        "done",
        "<think>\nagain\n</think>\n\n" + call("write_file", path="a.txt", content="bye"),
    ]
    suffixes = [
        lambda p: [{"role": "tool", "tool_call_id": p.tool_calls[0]["id"], "content": "wrote 3 bytes to a.txt"}],
        lambda p: [{"role": "tool", "tool_call_id": tc["id"], "content": f"ok {i}"}
                   for i, tc in enumerate(p.tool_calls)],
        lambda p: [{"role": "user", "content": "now change a.txt"}],
        None,
    ]
    prev_prompt = prev_out = None
    for k, (text, suffix) in enumerate(zip(replies, suffixes, strict=True)):
        msgs_now = [template_message(m) for m in s.messages]
        plan, parsed, out = s.step(text)
        assert parsed.tool_calls or text == "done"
        if k == 0:
            assert plan.branch_reason is None and plan.reused_tokens == 0
        else:
            assert plan.branch_reason is None, f"call {k}"
            assert plan.reused_tokens == len(prev_prompt) + len(prev_out)
            suffix_ids = plan.prompt_ids[plan.reused_tokens:]
            assert plan.prompt_ids[:plan.reused_tokens] == prev_prompt + prev_out
            assert prev_out[-1] == renderer.eos_id and suffix_ids[:1] == nl  # β = "\n" after <|im_end|>
            tail = renderer.decode(suffix_ids)
            assert tail.startswith("\n<|im_start|>") and tail.endswith("<|im_start|>assistant\n")
        # health check: the reused ids decode to the canonical render of the same messages
        assert canonical_mismatch(renderer, plan.prompt_ids, msgs_now, TOOLS) is None
        assert plan.prompt_ids == renderer.canonical_ids(msgs_now, TOOLS)  # byte-level: also token for token
        prev_prompt, prev_out = plan.prompt_ids, out
        if suffix:
            s.messages += suffix(parsed)


def test_client_without_reasoning_still_extends(renderer):
    s = Session(renderer, echo_reasoning=False)
    _, parsed, _ = s.step("<think>\nhmm\n</think>\n\n" + call("write_file", path="a", content="b"))
    assert parsed.reasoning_content == "hmm" and "reasoning_content" not in s.messages[-1]
    s.messages.append({"role": "tool", "tool_call_id": "x", "content": "ok"})
    msgs = [template_message(m) for m in s.messages]
    plan, _, _ = s.step("done")
    assert plan.branch_reason is None and plan.reused_tokens > 0
    # the thinking the model sampled stays in the prompt, so the canonical render (without it) differs there
    at = canonical_mismatch(renderer, plan.prompt_ids, msgs, TOOLS)
    assert at is not None and renderer.decode(plan.prompt_ids)[at - 2:].startswith("<think>")  # "<t" is shared


def test_sampled_ids_are_never_reencoded(renderer):
    """A reply whose bytes are not valid UTF-8 decodes lossily; the next prompt still holds the sampled ids."""
    s = Session(renderer, tools=None)
    msgs = [template_message(m) for m in s.messages]
    plan0 = Plan(s.conv.plan(renderer, msgs, None))
    raw = [0xC3, ord("a"), 0xFF, renderer.eos_id]  # not UTF-8
    text = renderer.decode(raw[:-1])
    assert "\ufffd" in text and renderer.encode(text) != raw[:-1]
    reply = template_message({"role": "assistant", "content": text})
    commit(s.conv, plan0, reply, raw)
    plan = Plan(s.conv.plan(renderer, msgs + [reply, {"role": "user", "content": "go on"}], None))
    assert plan.branch_reason is None and plan.prompt_ids[:plan.reused_tokens] == plan0.prompt_ids + raw


def _state(renderer, msgs, tools=TOOLS, finish="stop", reply_text="ok", eos=True):
    """A rollout whose one call answered msgs with reply_text."""
    conv, msgs = Conversations(), [template_message(m) for m in msgs]
    plan = Plan(conv.plan(renderer, msgs, tools))
    out = renderer.encode(reply_text) + ([renderer.eos_id] if eos else [])
    reply = template_message({"role": "assistant", "content": reply_text})
    commit(conv, plan, reply, out, finish)
    return conv, msgs, reply, plan


BASE = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


def plan_of(renderer, conv, msgs, tools=TOOLS) -> Plan:
    return Plan(conv.plan(renderer, [template_message(m) for m in msgs], tools))


def test_branch_reasons(renderer):
    conv, msgs, reply, first = _state(renderer, BASE)
    nxt = msgs + [reply, {"role": "user", "content": "more"}]
    assert first.branch_reason is None and first.kind == "main"
    assert plan_of(renderer, conv, nxt).branch_reason is None

    # the exact previous request again: same prompt, a sibling reply
    retry = plan_of(renderer, conv, msgs)
    assert (retry.prompt_ids, retry.reused_tokens, retry.branch_reason) == (first.prompt_ids,
                                                                           len(first.prompt_ids), "retry")

    # history rewritten: an earlier message, the echoed reply, or the tools: a new root of the main agent
    for edited, tools in [
        ([BASE[0], {"role": "user", "content": "task!"}, reply, {"role": "user", "content": "more"}], TOOLS),
        (msgs + [dict(reply, content="OK"), {"role": "user", "content": "more"}], TOOLS),
        (nxt, None),
    ]:
        plan = plan_of(renderer, conv, edited, tools)
        assert (plan.branch_reason, plan.kind, plan.reused_tokens) == ("edit", "main_summary", 0)
        assert plan.prompt_ids == renderer.canonical_ids([template_message(m) for m in edited], tools)

    # history shrank: a summary replaced it
    long, _, _, _ = _state(renderer, BASE + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}])
    short = plan_of(renderer, long, [BASE[0], {"role": "user", "content": "summary of the work so far"}])
    assert (short.branch_reason, short.kind) == ("compaction", "main_summary")

    # another system prompt: a sub-agent
    sub = plan_of(renderer, conv, [{"role": "system", "content": "you search"}, {"role": "user", "content": "x"}])
    assert (sub.branch_reason, sub.kind) == ("new_agent", "subagent")

    # the previous reply was cut by max_tokens: no extension across a missing stop token
    cut, msgs_c, reply_c, _ = _state(renderer, BASE, finish="length", eos=False)
    plan = plan_of(renderer, cut, msgs_c + [reply_c, {"role": "user", "content": "more"}])
    assert plan.branch_reason == "truncated_parent" and plan.reused_tokens == 0


def test_stopped_without_eos_closes_the_turn_as_context(renderer):
    conv, msgs, reply, _ = _state(renderer, BASE, eos=False)  # e.g. a stop string ended the reply
    plan = plan_of(renderer, conv, msgs + [reply, {"role": "user", "content": "more"}])
    assert plan.branch_reason is None
    assert plan.prompt_ids[plan.reused_tokens:][:2] == [renderer.eos_id] + renderer.encode("\n")


def test_template_that_rewrites_history_is_spliced_after_the_turn_end():
    tok = build_tokenizer()
    # like Qwen3's stock template: thinking is rendered only for the final assistant turn
    tok.chat_template = tok.chat_template.replace("{% if message.reasoning_content %}",
                                                  "{% if message.reasoning_content and loop.last %}")
    r = ChatRenderer(tok)
    conv, msgs = Conversations(), [template_message(m) for m in BASE]
    first = Plan(conv.plan(r, msgs, None))
    reply = template_message({"role": "assistant", "content": "x", "reasoning_content": "why"})
    out = r.encode("<think>\nwhy\n</think>\n\nx") + [r.eos_id]
    commit(conv, first, reply, out)
    nxt = msgs + [reply, {"role": "user", "content": "more"}]
    plan = Plan(conv.plan(r, nxt, None))
    # the re-rendered turn lost its thinking, but the suffix is spliced after the turn's EOS: still an extension
    assert plan.branch_reason is None and plan.prompt_ids[:plan.reused_tokens] == first.prompt_ids + out
    canonical = r.canonical_ids(nxt, None)
    tail = canonical[canonical.index(r.eos_id, len(first.prompt_ids)) + 1:]
    assert plan.prompt_ids[plan.reused_tokens:] == tail


def test_message_comparison_ignores_wire_keys_and_argument_spacing():
    ours = template_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": "x"}'}}]})
    echoed = template_message({"role": "assistant", "content": "", "index": 0, "refusal": None, "tool_calls": [
        {"id": "other", "type": "function", "index": 0, "function": {"name": "f", "arguments": '{"b":"x","a":1}'}}]})
    assert same_message(message_key(echoed), message_key(ours))
    assert reply_matches(message_key(echoed), message_key(dict(ours, reasoning_content="hidden")))
    assert not same_message(message_key(echoed), message_key(dict(ours, content="x")))
    parts = template_message({"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]})
    assert parts["content"] == "ab"


# --- tool-call parsing -------------------------------------------------------------------------------------------
def test_qwen3_parser_splits_reasoning_content_and_calls():
    ids = iter(f"call_{i}" for i in range(10))
    text = ("<think>\nplan it\n</think>\n\nSure.\n" + call("write_file", path="a", content="1") + "\n"
            + call("write_file", path="b", content="ü"))
    p = parse_qwen3(text, new_id=lambda: next(ids))
    assert p.reasoning_content == "plan it" and p.content == "Sure." and not p.malformed
    assert [tc["id"] for tc in p.tool_calls] == ["call_0", "call_1"]
    assert p.tool_calls[1] == {"id": "call_1", "type": "function",
                               "function": {"name": "write_file", "arguments": '{"path": "b", "content": "ü"}'}}
    only = parse_qwen3(call("write_file", path="a", content="1"))
    assert only.content is None and len(only.tool_calls) == 1 and only.reasoning_content is None
    plain = parse_qwen3("just text\n")
    assert plain.content == "just text\n" and plain.tool_calls == [] and not plain.malformed


def test_qwen3_parser_keeps_malformed_blocks_as_content():
    bad = "<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"path\": \n</tool_call>"
    p = parse_qwen3("I try.\n" + bad)
    assert p.malformed and p.tool_calls == [] and p.content == "I try.\n" + bad and "invalid JSON" in p.problems[0]
    mixed = parse_qwen3(call("write_file", path="a", content="1") + "\n" + bad)
    assert mixed.malformed and len(mixed.tool_calls) == 1 and mixed.content == bad
    for block in ['<tool_call>\n["x"]\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>',
                  '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', "<tool_call>\n{\"name\": \"f\""]:
        q = parse_qwen3(block)
        assert q.malformed and q.tool_calls == [] and q.content == block, block
    # arguments given as a JSON string are accepted and normalised
    s = parse_qwen3('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>')
    assert s.tool_calls[0]["function"]["arguments"] == '{"a": 1}'


def test_qwen3_parser_edge_cases():
    assert parse_qwen3("<think>\nstill thinking", ).reasoning_content == "still thinking"
    opened_by_template = parse_qwen3("reasoning here\n</think>\n\nanswer")
    assert (opened_by_template.reasoning_content, opened_by_template.content) == ("reasoning here", "answer")
    off = parse_qwen3(call("f", a=1), parse_tools=False)  # tool_choice "none"
    assert off.tool_calls == [] and off.content == call("f", a=1)
    assert get_parser("qwen3") is parse_qwen3 and "qwen3" in parser_names()
    assert parser_for_model_type("qwen3_moe") == "qwen3"
    with pytest.raises(KeyError, match="known: .*qwen3"):
        get_parser("nope")


# --- keys ----------------------------------------------------------------------------------------------------------
def test_keys_round_trip_and_reject_forgeries():
    key = make_key("secret", 42)
    assert key.startswith("gyre-r42-") and len(key.split("-")[-1]) == 40
    assert rollout_of("secret", key) == 42
    assert rollout_of("other-run", key) is None
    forged = "gyre-r43-" + key.split("-")[-1]
    assert rollout_of("secret", forged) is None
    for junk in ["", None, "sk-abc", key + "0", key.upper(), "gyre-r042-" + key.split("-")[-1], "gyre-r-1-x"]:
        assert rollout_of("secret", junk) is None
    assert rollout_of("secret", make_key("secret", 0)) == 0
    with pytest.raises(ValueError):
        make_key("secret", -1)


def test_template_checks_are_met_by_the_dummy_history_or_mean_a_branch():
    tok = build_tokenizer()
    tok.chat_template = ("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                         + tok.chat_template)
    r = ChatRenderer(tok)
    assert r.turn_end == "<|im_end|>\n"
    conv, msgs, reply, _ = _state(r, BASE, tools=None)
    nxt = msgs + [reply, {"role": "user", "content": "more"}]
    plan = plan_of(r, conv, nxt, None)
    assert plan.branch_reason is None and plan.prompt_ids == r.canonical_ids(nxt, None)
    # a template that refuses the dummy histories: no clean append can be shown, so a canonical branch
    tok.chat_template = ("{% if messages[0].content == '.' and messages|length > 2 %}{{ raise_exception('no') }}"
                         "{% endif %}" + tok.chat_template)
    r = ChatRenderer(tok)
    plan = plan_of(r, conv, nxt, None)
    assert plan.branch_reason == "template_nonappend" and plan.prompt_ids == r.canonical_ids(nxt, None)


# --- request parsing with what the rollout sent before ---------------------------------------------------------
def test_known_messages_are_not_parsed_again_but_new_ones_are_checked():
    import orjson

    from gyre_slurm.proxy import openai_api
    from gyre_slurm.proxy.apierrors import ApiError

    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]

    def body(msgs):
        return orjson.dumps({"model": "policy", "messages": msgs})

    known: openai_api.KnownMessages = []
    _, first = openai_api.parse_chat(body(base), known)
    assert len(known) == 1 and known[0].converted == first and known[0].ends is not None
    good = base + [{"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    _, with_known = openai_api.parse_chat(body(good), known)
    assert with_known == openai_api.parse_chat(body(good))[1]  # the same messages as a parse from scratch
    assert with_known[0] is first[0]  # the known ones taken as they were
    for bad, param in [(good + [{"role": "tool", "content": "x"}], "messages.4.tool_call_id"),
                       (good + [{"role": "robot", "content": "x"}], "messages.4.role"),
                       (good + [{"role": "user", "content": 5}], "messages.4.content")]:
        with pytest.raises(ApiError) as e:
            openai_api.parse_chat(body(bad), known)
        assert e.value.status == 400 and e.value.param == param, (bad[-1], e.value.param)
    # a changed earlier message is not "known": it is checked again
    changed = [base[0], {"role": "user", "content": None}, *good[2:]]
    with pytest.raises(ApiError) as e:
        openai_api.parse_chat(body(changed), known)
    assert e.value.param == "messages.1.content"


def test_known_anthropic_messages_convert_the_same():
    import orjson

    from gyre_slurm.proxy import anthropic_api
    from gyre_slurm.proxy.apierrors import ApiError

    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}]
    more = msgs + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "done"},
                                                {"type": "text", "text": "next"}]}]

    def body(m):
        return orjson.dumps({"model": "policy", "max_tokens": 8, "system": "s", "messages": m})

    known: list = []
    anthropic_api.parse_messages(body(msgs), known)
    _, with_known, _ = anthropic_api.parse_messages(body(more), known)
    assert with_known == anthropic_api.parse_messages(body(more))[1]
    assert [m["role"] for m in with_known] == ["system", "user", "assistant", "tool", "user"]
    with pytest.raises(ApiError) as e:
        anthropic_api.parse_messages(body(more + [{"role": "user", "content": ""}]), known)
    assert e.value.param == "messages.3.content"
