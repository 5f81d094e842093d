"""Pure logic of the proxy: token-in/token-out prompt building, tool-call parsing, per-rollout keys.

Runs against the tiny model's real tokenizer and chat template (byte-level, Qwen3-style); the "model" is
played by encoding chosen replies, so every case is exact and fast.
"""

from __future__ import annotations

import json

import pytest

from gyre_slurm.harness.agent_spec import SYSTEM_PROMPT, TOOLS
from gyre_slurm.model.tiny import build_tokenizer
from gyre_slurm.proxy.keys import make_key, rollout_of
from gyre_slurm.proxy.tito import (
    CallState,
    ChatRenderer,
    build_prompt,
    canonical_mismatch,
    message_key,
    template_message,
    tools_key,
)
from gyre_slurm.proxy.toolcalls import get_parser, parse_qwen3, parser_for_model_type, parser_names


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(build_tokenizer())


def call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


class Session:
    """Plays harness + proxy bookkeeping: the model's reply is given as text, the harness echoes it back."""

    def __init__(self, renderer: ChatRenderer, tools=TOOLS, echo_reasoning: bool = True) -> None:
        self.r, self.tools, self.echo_reasoning = renderer, tools, echo_reasoning
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "write a.txt"}]
        self.prev: CallState | None = None
        self.plans = []

    def step(self, reply_text: str, finish: str = "stop", eos: bool = True):
        msgs = [template_message(m) for m in self.messages]
        plan = build_prompt(self.r, self.prev, msgs, self.tools)
        out = self.r.encode(reply_text) + ([self.r.eos_id] if eos else [])
        parsed = parse_qwen3(self.r.decode(out[:-1] if eos else out))
        reply = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
        if parsed.reasoning_content:
            reply["reasoning_content"] = parsed.reasoning_content
        reply = template_message(reply)
        self.prev = CallState([message_key(m) for m in msgs], tools_key(self.tools), reply, plan.prompt_ids, out,
                              "tool_calls" if parsed.tool_calls else finish)
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
    plan0 = build_prompt(renderer, None, [template_message(m) for m in s.messages], None)
    raw = [0xC3, ord("a"), 0xFF, renderer.eos_id]  # not UTF-8
    text = renderer.decode(raw[:-1])
    assert "\ufffd" in text and renderer.encode(text) != raw[:-1]
    reply = template_message({"role": "assistant", "content": text})
    prev = CallState([message_key(template_message(m)) for m in s.messages], tools_key(None), reply,
                     plan0.prompt_ids, raw, "stop")
    msgs = [template_message(m) for m in s.messages] + [reply, {"role": "user", "content": "go on", }]
    plan = build_prompt(renderer, prev, msgs, None)
    assert plan.branch_reason is None and plan.prompt_ids[:plan.reused_tokens] == plan0.prompt_ids + raw


def _state(renderer, msgs, tools=TOOLS, finish="stop", reply_text="ok", eos=True):
    msgs = [template_message(m) for m in msgs]
    prompt = renderer.canonical_ids(msgs, tools)
    out = renderer.encode(reply_text) + ([renderer.eos_id] if eos else [])
    reply = template_message({"role": "assistant", "content": reply_text})
    return CallState([message_key(m) for m in msgs], tools_key(tools), reply, prompt, out, finish), msgs, reply


BASE = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]


def test_branch_reasons(renderer):
    prev, msgs, reply = _state(renderer, BASE)
    nxt = msgs + [reply, {"role": "user", "content": "more"}]
    assert build_prompt(renderer, None, msgs, TOOLS).branch_reason is None
    assert build_prompt(renderer, prev, nxt, TOOLS).branch_reason is None

    # the exact previous request again: same prompt, a sibling reply
    retry = build_prompt(renderer, prev, msgs, TOOLS)
    assert retry == (prev.prompt_ids, len(prev.prompt_ids), "retry")

    # history rewritten: an earlier message, the echoed reply, or the tools
    for edited, tools in [
        ([BASE[0], {"role": "user", "content": "task!"}, reply, {"role": "user", "content": "more"}], TOOLS),
        (msgs + [dict(reply, content="OK"), {"role": "user", "content": "more"}], TOOLS),
        (nxt, None),
    ]:
        plan = build_prompt(renderer, prev, [template_message(m) for m in edited], tools)
        assert plan.branch_reason == "edit" and plan.reused_tokens == 0
        assert plan.prompt_ids == renderer.canonical_ids([template_message(m) for m in edited], tools)

    # history shrank: a summary replaced it
    long_prev, long_msgs, long_reply = _state(renderer, BASE + [{"role": "assistant", "content": "a"},
                                                                 {"role": "user", "content": "b"}])
    short = [BASE[0], {"role": "user", "content": "summary of the work so far"}]
    assert build_prompt(renderer, long_prev, short, TOOLS).branch_reason == "compaction"

    # the previous reply was cut by max_tokens: no extension across a missing stop token
    cut, msgs_c, reply_c = _state(renderer, BASE, finish="length", eos=False)
    plan = build_prompt(renderer, cut, msgs_c + [reply_c, {"role": "user", "content": "more"}], TOOLS)
    assert plan.branch_reason == "truncated_parent" and plan.reused_tokens == 0


def test_stopped_without_eos_closes_the_turn_as_context(renderer):
    prev, msgs, reply = _state(renderer, BASE, eos=False)  # e.g. a stop string ended the reply
    plan = build_prompt(renderer, prev, msgs + [reply, {"role": "user", "content": "more"}], TOOLS)
    assert plan.branch_reason is None
    assert plan.prompt_ids[plan.reused_tokens:][:2] == [renderer.eos_id] + renderer.encode("\n")


def test_template_that_rewrites_history_branches():
    tok = build_tokenizer()
    # like Qwen3's stock template: thinking is rendered only for the final assistant turn
    tok.chat_template = tok.chat_template.replace("{% if message.reasoning_content %}",
                                                  "{% if message.reasoning_content and loop.last %}")
    r = ChatRenderer(tok)
    msgs = [template_message(m) for m in BASE]
    reply = template_message({"role": "assistant", "content": "x", "reasoning_content": "why"})
    prev = CallState([message_key(m) for m in msgs], tools_key(None), reply, r.canonical_ids(msgs, None),
                     r.encode("<think>\nwhy\n</think>\n\nx") + [r.eos_id], "stop")
    plan = build_prompt(r, prev, msgs + [reply, {"role": "user", "content": "more"}], None)
    assert plan.branch_reason == "template_nonappend" and plan.reused_tokens == 0
    # a reply without thinking renders the same either way: it extends
    plain = template_message({"role": "assistant", "content": "x"})
    prev2 = CallState(prev.message_keys, prev.tools_key, plain, prev.prompt_ids, r.encode("x") + [r.eos_id], "stop")
    assert build_prompt(r, prev2, msgs + [plain, {"role": "user", "content": "more"}], None).branch_reason is None


def test_message_comparison_ignores_wire_keys_and_argument_spacing():
    ours = template_message({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": "x"}'}}]})
    echoed = template_message({"role": "assistant", "content": "", "index": 0, "refusal": None, "tool_calls": [
        {"id": "other", "type": "function", "index": 0, "function": {"name": "f", "arguments": '{"b":"x","a":1}'}}]})
    assert message_key(echoed) == message_key(ours)
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
    prev, msgs, reply = _state(r, BASE, tools=None)
    nxt = msgs + [reply, {"role": "user", "content": "more"}]
    plan = build_prompt(r, prev, nxt, None)
    assert plan.branch_reason is None and plan.prompt_ids == r.canonical_ids(nxt, None)
    # a template that refuses the dummy histories: no clean append can be shown, so a canonical branch
    tok.chat_template = ("{% if messages[0].content == '.' and messages|length > 2 %}{{ raise_exception('no') }}"
                         "{% endif %}" + tok.chat_template)
    r = ChatRenderer(tok)
    plan = build_prompt(r, prev, nxt, None)
    assert plan.branch_reason == "template_nonappend" and plan.prompt_ids == r.canonical_ids(nxt, None)
