"""Token-in/token-out rendering (docs/algorithms.md §2.3): how a request's appended messages become ids after the
exact ids of an earlier call, and what decides that two messages are the same.

A call that extends an earlier call (same messages, then the assistant reply the proxy gave, then new messages
S) is prefilled with  prev.prompt_ids ∥ prev.output_ids ∥ β ∥ τ(S):  sampled ids are never decoded and
re-encoded. β closes the assistant turn the way the template does (for ChatML, the "\\n" after <|im_end|>);
τ(S) is S rendered after a dummy history that ends in an assistant message (β and τ(S) are tokenised together,
as one text). Which earlier call a request extends, and the branch it starts when it extends none, is
proxy/conversations.py.

Pure logic: the tokenizer is the only dependency, no I/O.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

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
    # null content (OpenAI tool-call turns) as "": templates such as Qwen3's fail on a missing content
    out: dict[str, Any] = {"role": msg.get("role"), "content": _text(msg.get("content")) or ""}
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


def _raw_args(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, sort_keys=True, ensure_ascii=False)


def message_key(msg: dict[str, Any]) -> list[Any]:
    """What decides equality: role, content, reasoning_content, tool calls (name + arguments as sent). Cheap to
    build (arguments are parsed only when two raw strings differ, see same_message); plain lists so that a key
    survives a msgpack round trip (the journal) and still compares equal."""
    calls = [[(tc.get("function") or {}).get("name"), _raw_args((tc.get("function") or {}).get("arguments"))]
             for tc in msg.get("tool_calls") or []]
    return [msg.get("role"), msg.get("content") or "", msg.get("reasoning_content") or "", calls]


def same_message(a: list[Any], b: list[Any]) -> bool:
    """Keys equal, tool-call arguments compared as parsed JSON (a client may re-serialise them)."""
    if a == b:
        return True
    if a[:3] != b[:3] or len(a[3]) != len(b[3]):
        return False
    return all(x[0] == y[0] and _canon_args(x[1]) == _canon_args(y[1]) for x, y in zip(a[3], b[3], strict=True))


def reply_matches(echoed: list[Any], ours: list[Any]) -> bool:
    """The harness's copy of our reply. Clients that do not carry reasoning_content back (most OpenAI clients
    drop unknown fields) still extend: the ids of the thinking stay in the prompt as the model sampled them."""
    if echoed[2] == "" and ours[2] != "":
        return same_message(echoed, [ours[0], ours[1], "", ours[3]])
    return same_message(echoed, ours)


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
        """β as text: the rest of the template's turn end after what the model emitted (docs/algorithms.md §2.3)."""
        if output_ids and output_ids[-1] == self.eos_id and self.turn_end.startswith(self.eos_text):
            return self.turn_end[len(self.eos_text):]
        return self.turn_end  # stopped without the EOS (a stop string): close the turn as context

    def suffix_text(self, reply: dict[str, Any], suffix: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> str | None:
        """τ(S) as text, or None when the template does not append S cleanly after an assistant turn.

        Pure appends are taken as they are. Templates that re-render the turn before S (Qwen3 writes an empty
        <think></think> into the last assistant turn only, and drops the thinking of turns before the latest
        user query) are spliced after the dummy turn's end, found by counting EOS tokens (NeMo-RL's rule,
        docs/algorithms.md §2.3): the model keeps seeing the ids it sampled, S comes out as the template writes it."""
        for head in _DUMMY_HEADS:  # templates differ in what they insist on before an assistant turn
            dummy = [*head, reply]
            try:
                without = self.render(dummy, tools, add_generation_prompt=False)
                with_s = self.render(dummy + suffix, tools, add_generation_prompt=True)
            except TemplateError:
                continue
            if with_s.startswith(without):
                return with_s[len(without):]
            return self._splice_after_turn(without, with_s)
        return None

    def _splice_after_turn(self, without: str, with_s: str) -> str | None:
        if not without.endswith(self.turn_end):
            return None
        n = without.count(self.eos_text)
        at = -1
        for _ in range(n):
            at = with_s.find(self.eos_text, at + 1)
            if at < 0:
                return None
        rest = with_s[at + len(self.eos_text):]
        tail = self.turn_end[len(self.eos_text):]  # what follows the EOS in a turn end ("\n" for ChatML)
        # the head before the dummy turn must be untouched, and S must follow a complete turn end
        head_end = without.rfind(self.eos_text, 0, len(without) - len(self.turn_end)) + len(self.eos_text)
        if not rest.startswith(tail) or not with_s.startswith(without[:head_end]):
            return None
        return rest[len(tail):]


def canonical_mismatch(renderer: ChatRenderer, prompt_ids: list[int], messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None) -> int | None:
    """Health check: None if the ids decode to the canonical render of the messages, else the first differing
    character. A mismatch is not an error (TITO keeps what the model sampled); its rate is a metric."""
    got = renderer.decode(prompt_ids)
    want = renderer.render(messages, tools, add_generation_prompt=True)
    if got == want:
        return None
    return len(os.path.commonprefix([got, want]))
