"""Token-in/token-out prompt building (ALGORITHMS.md §2.3–2.4): reuse the exact ids of the previous call.

A call that extends the rollout's previous call (same messages, then the assistant reply the proxy gave, then
new messages S) is prefilled with  prev.prompt_ids ∥ prev.output_ids ∥ β ∥ τ(S):  sampled ids are never
decoded and re-encoded. β closes the assistant turn the way the template does (for ChatML, the "\\n" after
<|im_end|>); τ(S) is S rendered after a dummy history that ends in an assistant message (β and τ(S) are
tokenised together, as one text). Anything else starts a new branch, rendered canonically from the messages,
with a reason code:

  None                first call of the rollout
  compaction          fewer messages than the previous request (history summarised or dropped)
  edit                otherwise rewritten: an earlier message, the echoed reply, or the tools changed
  retry               the exact previous request again: its prompt is reused, the new reply is a sibling
  truncated_parent    the previous reply was cut by max_tokens: never extend a generation without its stop
  template_nonappend  the template does not render S as a pure append after an assistant turn

Pure logic: the tokenizer is the only dependency, no I/O.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from jinja2 import TemplateError

REASONS = ("compaction", "edit", "retry", "truncated_parent", "template_nonappend")
_MARKER = "\u2063gyre-turn-end\u2063"  # invisible separators make a collision with template text unlikely
# dummy histories before an assistant turn: a user query (Qwen3's template raises without one), or a system
# message first for templates that insist on it
_DUMMY_HEADS = ([{"role": "user", "content": "."}],
                [{"role": "system", "content": "."}, {"role": "user", "content": "."}])


# --- messages as the template sees them -------------------------------------------------------------------------
def _text(content: Any) -> str | None:
    """OpenAI content (a string, None, or a list of parts) as template text."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:  # non-text parts are kept verbatim so that a change still shows up in comparisons
                out.append(json.dumps(part, sort_keys=True, ensure_ascii=False))
        return "".join(out)
    return json.dumps(content, sort_keys=True, ensure_ascii=False)


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A request message reduced to what chat templates read; wire-only keys (index, name of parts, …) dropped."""
    out: dict[str, Any] = {"role": msg.get("role"), "content": _text(msg.get("content"))}
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning:
        out["reasoning_content"] = reasoning
    calls = msg.get("tool_calls")
    if calls:
        tcs = []
        for tc in calls:
            fn = (tc.get("function") or {}) if isinstance(tc, dict) else {}
            tcs.append({"id": tc.get("id") if isinstance(tc, dict) else None, "type": "function",
                        "function": {"name": fn.get("name"), "arguments": fn.get("arguments")}})
        out["tool_calls"] = tcs
    for k in ("tool_call_id", "name"):
        if msg.get(k) is not None:
            out[k] = msg[k]
    return out


def _canon_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return args  # not JSON: compared as the raw string
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def message_key(msg: dict[str, Any]) -> list[Any]:
    """What decides equality: role, content, reasoning_content, tool calls (name + parsed arguments).
    Plain lists so that a key survives a msgpack round trip (the journal) and still compares equal."""
    calls = [[(tc.get("function") or {}).get("name"), _canon_args((tc.get("function") or {}).get("arguments"))]
             for tc in msg.get("tool_calls") or []]
    return [msg.get("role"), msg.get("content") or "", msg.get("reasoning_content") or "", calls]


def reply_matches(echoed: list[Any], ours: list[Any]) -> bool:
    """The harness's copy of our reply. Clients that do not carry reasoning_content back (most OpenAI clients
    drop unknown fields) still extend: the ids of the thinking stay in the prompt as the model sampled them."""
    if echoed[2] == "":
        return echoed[0] == ours[0] and echoed[1] == ours[1] and echoed[3] == ours[3]
    return echoed == ours


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


# --- rendering ----------------------------------------------------------------------------------------------------
class ChatRenderer:
    """The model's chat template and tokenizer, and what TITO derives from them (turn end, suffix rendering)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self.eos_text: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.convert_tokens_to_ids(self.eos_text)
        # What the template writes after an assistant turn's text, e.g. "<|im_end|>\n" for ChatML.
        self.turn_end = self.eos_text
        for head in _DUMMY_HEADS:
            try:
                probe = self.render([*head, {"role": "assistant", "content": _MARKER}], None, False)
            except TemplateError:
                continue
            at = probe.rfind(_MARKER)
            if at >= 0:
                self.turn_end = probe[at + len(_MARKER):]
            break

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def canonical_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def boundary_text(self, output_ids: Sequence[int]) -> str:
        """β as text: the rest of the template's turn end after what the model emitted (ALGORITHMS §2.3)."""
        if output_ids and output_ids[-1] == self.eos_id and self.turn_end.startswith(self.eos_text):
            return self.turn_end[len(self.eos_text):]
        return self.turn_end  # stopped without the EOS (a stop string): close the turn as context

    def suffix_text(self, reply: dict[str, Any], suffix: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> str | None:
        """τ(S) as text, or None when the template does not append S cleanly after an assistant turn."""
        for head in _DUMMY_HEADS:  # templates differ in what they insist on before an assistant turn
            dummy = [*head, reply]
            try:
                without = self.render(dummy, tools, add_generation_prompt=False)
                with_s = self.render(dummy + suffix, tools, add_generation_prompt=True)
            except TemplateError:
                continue
            return with_s[len(without):] if with_s.startswith(without) else None
        return None


# --- the previous call and the plan for the next one ---------------------------------------------------------------
@dataclass
class CallState:
    """What the proxy keeps per rollout about its last call."""

    message_keys: list[list[Any]]  # the request's messages (message_key)
    tools_key: str
    reply: dict[str, Any]  # the assistant message the proxy returned (template_message shape)
    prompt_ids: Sequence[int]  # a list, or array("i") where many long rollouts are held
    output_ids: Sequence[int]
    finish_reason: str  # stop | tool_calls | length | abort

    def to_dict(self) -> dict[str, Any]:
        return {"message_keys": self.message_keys, "tools_key": self.tools_key, "reply": self.reply,
                "prompt_ids": list(self.prompt_ids), "output_ids": list(self.output_ids),
                "finish_reason": self.finish_reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallState:
        return cls(**d)


class PromptPlan(NamedTuple):
    prompt_ids: list[int]
    reused_tokens: int  # ids taken as they were from earlier calls
    branch_reason: str | None  # None: extends the previous call (or the first call)


def build_prompt(renderer: ChatRenderer, prev: CallState | None, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> PromptPlan:
    """The prompt ids for a request (messages already in template_message shape)."""
    def new_branch(reason: str | None) -> PromptPlan:
        return PromptPlan(renderer.canonical_ids(messages, tools), 0, reason)

    if prev is None:
        return new_branch(None)
    keys = [message_key(m) for m in messages]
    n = len(prev.message_keys)
    same_tools = tools_key(tools) == prev.tools_key
    if same_tools and keys == prev.message_keys:
        return PromptPlan([*prev.prompt_ids], len(prev.prompt_ids), "retry")
    extends = (same_tools and len(keys) > n and keys[:n] == prev.message_keys
               and reply_matches(keys[n], message_key(prev.reply)))
    if not extends:
        return new_branch("compaction" if len(keys) < n else "edit")
    if prev.finish_reason == "length":
        return new_branch("truncated_parent")
    suffix = renderer.suffix_text(messages[n], messages[n + 1:], tools)
    if suffix is None:
        return new_branch("template_nonappend")
    head = [*prev.prompt_ids, *prev.output_ids]  # lists or compact arrays
    return PromptPlan(head + renderer.encode(renderer.boundary_text(prev.output_ids) + suffix), len(head), None)


def canonical_mismatch(renderer: ChatRenderer, prompt_ids: list[int], messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> int | None:
    """Health check: None if the ids decode to the canonical render of the messages, else the first differing
    character. A mismatch is not an error (TITO keeps what the model sampled); its rate is a metric."""
    got = renderer.decode(prompt_ids)
    want = renderer.render(messages, tools, add_generation_prompt=True)
    if got == want:
        return None
    return len(os.path.commonprefix([got, want]))
