"""Where requests attach in a rollout's conversations, with the REAL Qwen3 tokenizer and chat template.

A scripted harness plays Claude Code's habits (thinking, tool calls, a sub-agent with its own system prompt,
compaction into a summary, a retry); the "model" is played by chosen output ids, some of them deliberately not
the tokenizer's own encoding of their text (sampled ids are never re-encoded). Every prompt is checked token for
token, and the calls are inserted into a RunTree to check the tree's shape and kinds.
"""

from __future__ import annotations

import json

import orjson
import pytest

from gyre_slurm.engines.client import _dumps
from gyre_slurm.model.qwen3_tokenizer import load_qwen3_tokenizer
from gyre_slurm.proxy.conversations import Conversations
from gyre_slurm.proxy.tito import ChatRenderer, template_message
from gyre_slurm.proxy.toolcalls import parse_qwen3
from gyre_slurm.trajectory.segments import whole_prompts
from gyre_slurm.trajectory.tree import RunTree

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
    {"type": "function", "function": {
        "name": "task", "description": "start a sub-agent",
        "parameters": {"type": "object", "properties": {"prompt": {"type": "string"}}, "required": ["prompt"]}}}]
MAIN_SYS = "You are a coding agent working in a repository."
SUB_SYS = "You are a search sub-agent. Answer with file paths only."


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(load_qwen3_tokenizer())


def tool_call(name: str, **args) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


class Harness:
    """Claude Code-like bookkeeping over one rollout's Conversations, recording what a proxy would send."""

    def __init__(self, r: ChatRenderer) -> None:
        self.r, self.conv = r, Conversations()
        self.records: list[dict] = []  # what the daemon receives (prompt after the reused ids)
        self.prompts: list[list[int]] = []  # the engine's whole prompts

    def call(self, messages: list[dict], out_text: str, split_odd: bool = False, finish: str = "stop",
             kind: str | None = None) -> tuple[dict, object]:
        msgs = [template_message(m) for m in messages]
        plan = self.conv.plan(self.r, msgs, TOOLS, kind)
        out = self.r.encode(out_text)
        if split_odd:  # the model sampled "H" "AV" "ING" where the tokenizer would say "HAV" "ING"
            out = self.r.encode("H") + self.r.encode("AV") + self.r.encode("ING " + out_text)
        out.append(self.r.eos_id)
        parsed = parse_qwen3(self.r.decode(out[:-1]), new_id=lambda: f"call_{len(self.records)}")
        reply = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            reply["tool_calls"] = parsed.tool_calls
        if parsed.reasoning_content is not None:
            reply["reasoning_content"] = parsed.reasoning_content
        index = len(self.records)
        self.conv.commit(plan, template_message(reply), out, "tool_calls" if parsed.tool_calls else finish, index)
        self.records.append({"call_index": index, "parent_call": plan.parent_call,
                             "reused_tokens": plan.reused_tokens, "prompt_ids": plan.prompt_ids[plan.reused_tokens:]
                             .tolist(), "output_ids": out, "output_logprobs": [-0.5] * len(out), "kind": plan.kind,
                             "branch_reason": plan.branch_reason})
        self.prompts.append(plan.prompt_ids.tolist())
        # what goes to the engine: the ids' JSON, taken from the line's stored text where it was serialised before
        assert orjson.loads(_dumps({"input_ids": plan.prompt_ids}))["input_ids"] == self.prompts[-1]
        echoed = {"role": "assistant", "content": parsed.content or ""}
        if parsed.tool_calls:
            echoed["tool_calls"] = parsed.tool_calls
        return echoed, plan

    def tree(self) -> RunTree:
        t = RunTree()
        for rec in self.records:
            t.insert_call(rec["prompt_ids"], rec["output_ids"], rec["output_logprobs"], 1, kind=rec["kind"],
                          call_index=rec["call_index"], parent_call=rec["parent_call"], reused=rec["reused_tokens"])
        return t


def test_qwen3_tool_loop_with_thinking_extends_token_for_token(renderer):
    h = Harness(renderer)
    msgs = [{"role": "system", "content": MAIN_SYS}, {"role": "user", "content": "fix the failing test"}]
    turns = [
        ("<think>\nLook at the tests first.\n</think>\n\n" + tool_call("bash", cmd="pytest -x"), True),
        ("<think>\nThe import is wrong.\n</think>\n\n" + tool_call("bash", cmd="sed -i s/a/b/ x.py"), False),
        ("Fixed: the import named the wrong module.", False),
    ]
    for k, (text, odd) in enumerate(turns):
        echoed, plan = h.call(msgs, text, split_odd=odd)
        if k:
            prev = h.prompts[k - 1] + h.records[k - 1]["output_ids"]
            assert plan.branch_reason is None and plan.parent_call == k - 1 and plan.reused_tokens == len(prev)
            assert h.prompts[k][:len(prev)] == prev  # the sampled ids, not a re-encoding of their text
            # the suffix is exactly what Qwen3's own template writes after the previous turn's <|im_end|>
            canonical = renderer.render([template_message(m) for m in msgs], TOOLS, add_generation_prompt=True)
            suffix_text = renderer.decode(h.prompts[k][len(prev):])
            assert suffix_text.startswith("\n<|im_start|>") and canonical.endswith(suffix_text)
            assert renderer.encode(suffix_text[1:]) == h.prompts[k][len(prev) + 1:]
        msgs.append(echoed)
        if k == 0:
            msgs.append({"role": "tool", "tool_call_id": "call_0", "content": "1 failed: ImportError"})
        elif k == 1:
            msgs.append({"role": "tool", "tool_call_id": "call_1", "content": ""})
    odd = renderer.encode("H") + renderer.encode("AV")
    assert h.records[0]["output_ids"][:3] == odd + renderer.encode("ING")[:1] and \
        renderer.encode("HAV") != odd  # the case that re-tokenisation would have broken
    # a user message after thinking turns: Qwen3 strips earlier <think> from its canonical render, TITO keeps it
    msgs.append({"role": "user", "content": "also run the linter"})
    _, plan = h.call(msgs, "Running it.")
    assert plan.branch_reason is None and plan.parent_call == 2
    assert "Look at the tests first." in renderer.decode(h.prompts[3])
    assert "Look at the tests first." not in renderer.render([template_message(m) for m in msgs], TOOLS, True)
    assert whole_prompts(h.records) == dict(enumerate(h.prompts))


def test_subagent_compaction_and_retry_make_the_expected_tree(renderer):
    h = Harness(renderer)
    main = [{"role": "system", "content": MAIN_SYS}, {"role": "user", "content": "find and fix the bug"}]
    e, _ = h.call(main, tool_call("task", prompt="find where parse() is defined"))               # 0 main
    main += [e]
    sub = [{"role": "system", "content": SUB_SYS}, {"role": "user", "content": "find where parse() is defined"}]
    e2, p = h.call(sub, tool_call("bash", cmd="grep -rn 'def parse'"))                           # 1 sub-agent
    assert (p.kind, p.branch_reason, p.parent_call) == ("subagent", "new_agent", None)
    sub += [e2, {"role": "tool", "tool_call_id": "call_1", "content": "src/p.py:3:def parse():"}]
    _, p = h.call(sub, "src/p.py")                                                                # 2 sub-agent
    assert (p.kind, p.branch_reason, p.parent_call) == ("subagent", None, 1)
    main += [{"role": "tool", "tool_call_id": "call_0", "content": "src/p.py"}]
    e, p = h.call(main, tool_call("bash", cmd="cat src/p.py"))                                    # 3 main resumes
    assert (p.kind, p.branch_reason, p.parent_call) == ("main", None, 0)  # extends its own ids, not a branch
    main += [e, {"role": "tool", "tool_call_id": "call_3", "content": "def parse(): return 1/0"}]
    # a retry of the same request (the harness did not like the answer): a sibling of call 4
    _, p4 = h.call(main, "The bug is a division by zero.")                                       # 4 main
    _, p5 = h.call(main, "parse() divides by zero; I will fix it.")                              # 5 retry
    assert (p5.branch_reason, p5.parent_call, p5.reused_tokens) == ("retry", 4, len(h.prompts[4]))
    main += [{"role": "assistant", "content": "parse() divides by zero; I will fix it."}]
    # compaction: the harness asks for a summary (an append: still main) ...
    summary = "Summary: parse() in src/p.py divides by zero; the fix is to return 1 instead."
    _, p = h.call(main + [{"role": "user", "content": "Summarise the conversation so far."}], summary)  # 6
    assert (p.kind, p.branch_reason, p.parent_call) == ("main", None, 5)
    # ... then restarts from it: a new root that quotes the model's summary is the main agent's summary branch
    compacted = [{"role": "system", "content": MAIN_SYS},
                 {"role": "user", "content": "This session continues a previous one.\n" + summary}]
    e, p = h.call(compacted, tool_call("bash", cmd="sed -i 's|1/0|1|' src/p.py"))                # 7
    assert (p.kind, p.branch_reason, p.parent_call) == ("main_summary", "compaction", None)
    compacted += [e, {"role": "tool", "tool_call_id": "call_7", "content": ""}]
    _, p = h.call(compacted, "Done.")                                                             # 8
    assert (p.kind, p.branch_reason, p.parent_call) == ("main_summary", None, 7)
    # the sub-agent compacts too: same system prompt, fewer messages than its line
    _, p = h.call([sub[0], {"role": "user", "content": "(summary) parse is in src/p.py"}], "src/p.py")  # 9
    assert (p.kind, p.branch_reason) == ("subagent_summary", "compaction")
    # a header can always say which agent is calling
    _, p = h.call([{"role": "system", "content": "title generator"}, {"role": "user", "content": "t"}], "Fix",
                  kind="main")
    assert p.kind == "main"

    tree = h.tree()
    roots = list(tree.root.children.values())
    leaves = tree.leaves()
    # leaves: call 4 (the retried answer), call 6 (the summary request), the header-tagged call 10, the compacted
    # main (8), the sub-agent (2), the compacted sub-agent (9)
    assert sorted(lf.kind for lf in leaves) == ["main", "main", "main", "main_summary", "subagent",
                                                "subagent_summary"]
    # five conversations start from scratch (main, sub-agent, compacted main and sub-agent, the tagged call); in
    # the token trie they share only "<|im_start|>system\n"
    assert [r["call_index"] for r in h.records if r["parent_call"] is None] == [0, 1, 7, 9, 10]
    assert len(roots) == 1 and renderer.decode(roots[0].tokens) == "<|im_start|>system\n"
    for rec, prompt in zip(h.records, h.prompts, strict=True):  # (I4): every call's prompt is a path prefix
        node = tree._marks[2 * rec["call_index"] + 1][0]
        path = [t for n in tree.path(node) for t in n.tokens]
        assert path == prompt
    # Jmax picks by kind first: the main paths, then main_summary, then the sub-agent's, then its summary
    segs, n_claimed = tree.segments(max_paths=5)
    assert [s.kind for s in segs] == ["main", "main", "main", "main_summary", "subagent"]
    assert n_claimed < tree.n_trainable()  # the sub-agent summary's targets are the bounded-sampling cost
    all_segs, n_all = tree.segments()
    assert n_all == tree.n_trainable() and len(all_segs) == 6


def test_replaying_the_deltas_rebuilds_the_conversations(renderer):
    h = Harness(renderer)
    deltas = []
    orig = h.conv.commit

    def keep(*a, **k):
        deltas.append(orig(*a, **k))
        return deltas[-1]

    h.conv.commit = keep
    msgs = [{"role": "system", "content": MAIN_SYS}, {"role": "user", "content": "go"}]
    e, _ = h.call(msgs, tool_call("bash", cmd="ls"))
    msgs += [e, {"role": "tool", "tool_call_id": "call_0", "content": "a b"}]
    h.call([{"role": "system", "content": SUB_SYS}, {"role": "user", "content": "x"}], "y")
    e, _ = h.call(msgs, tool_call("bash", cmd="cat a"))
    msgs += [e, {"role": "tool", "tool_call_id": "call_2", "content": "A"}]
    # a restarted proxy: the journal holds each delta without its ids, the records hold the ids
    fresh = Conversations()
    for d, rec in zip(deltas, h.records, strict=True):
        journaled = json.loads(json.dumps({k: v for k, v in d.items() if k not in ("tail", "output_ids")}))
        fresh.apply({**journaled, "tail": rec["prompt_ids"], "output_ids": rec["output_ids"]})
    want = h.conv.plan(renderer, [template_message(m) for m in msgs], TOOLS)
    got = fresh.plan(renderer, [template_message(m) for m in msgs], TOOLS)
    assert got.prompt_ids == want.prompt_ids and (got.parent_call, got.kind) == (2, "main")
    assert got.reused_tokens == want.reused_tokens > 0 and got.branch_reason is None


def test_anthropic_tool_use_only_turns_render_with_qwen3(renderer):
    """An echoed assistant turn that holds only tool_use blocks renders with Qwen3's template (it fails on a null
    content), so an Anthropic harness's tool loop extends instead of failing."""
    import orjson

    from gyre_slurm.proxy import anthropic_api

    body = orjson.dumps({"model": "policy", "max_tokens": 8, "system": MAIN_SYS, "messages": [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}]})
    _, messages, tools = anthropic_api.parse_messages(body)
    text = renderer.render(messages, tools, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>' in text
    assert text.endswith("<tool_response>\na.py\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
