"""A rollout's conversations as the proxy sees them, and where each new request attaches (docs/algorithms.md §2.4).

A black-box harness interleaves several conversations in one rollout: the main agent, sub-agents (their own
system prompt), a main conversation restarted from a summary after compaction, retries. Each conversation is a
*line*: a chain of calls, each extending the one before; the line holds the latest call's exact ids and one
Turn per call (where its prompt and output end, the reply the proxy returned). A request attaches at the
deepest turn of any line whose messages it extends (ties: the line used last), so the main agent resuming
after a sub-agent still extends its own ids. What attaches where:

  extends the last turn of a line           the line grows (branch_reason None)
  the exact request of an earlier turn      "retry": that turn's prompt is reused, the reply is a sibling
  extends an earlier turn of a line         "edit": a new line forked there (history after it was rewritten)
  the deepest match was cut by max_tokens   "truncated_parent": attach one turn earlier, or a new root
  the template does not append the suffix   "template_nonappend": a new root
  nothing matches                           a new root: "compaction" (same first message as a line, fewer
                                            messages), "new_agent" (a system prompt no line has), else "edit";
                                            None for the rollout's first call

Branch kinds (for Jmax selection, docs/algorithms.md §3.3), fixed when a line starts and kept by its calls:
  * a request header X-Gyre-Branch-Kind: main | main_summary | subagent | subagent_summary wins;
  * the rollout's first line not marked otherwise is main;
  * a new root that quotes the last reply of a line (a harness restarting from the summary the model wrote)
    is that line's summary kind (main_summary / subagent_summary);
  * a new root with the main line's system prompt is main_summary (history compacted or rewritten);
  * a new root with another system prompt is a sub-agent; with a sub-agent's system prompt and fewer messages
    than that sub-agent's line, that sub-agent's summary.

Every commit returns a small delta (what changed, never the whole history) that the proxy journals; replaying
the deltas of a rollout in call order rebuilds its lines after a restart. Pure logic, no I/O.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gyre_slurm.engines.client import JsonIds, ids_json
from gyre_slurm.proxy.tito import ChatRenderer, message_key, reply_matches, same_message, tools_key

KINDS = ("main", "main_summary", "subagent", "subagent_summary")
MAX_LINES = 32  # per rollout; the least recently used line is forgotten beyond this
_QUOTE_MIN_CHARS = 24  # a reply shorter than this is not taken as a summary when quoted


@dataclass
class Turn:
    n_messages: int  # messages in the request of this call
    prompt_len: int  # its prompt ends here in the line's ids
    end: int  # its output ends here
    reply: dict[str, Any]  # the assistant message the proxy returned (template_message shape)
    reply_key: list[Any]
    finish_reason: str
    call_index: int
    json_prompt_end: int = 0  # where prompt_len and end fall in the line's JSON text
    json_end: int = 0


@dataclass
class Line:
    id: int
    kind: str
    tools_key: str
    msgs: list[dict[str, Any]]  # the latest request's messages (template_message shape)
    ids: array  # the latest call's prompt ∥ output
    turns: list[Turn] = field(default_factory=list)
    json: bytearray = field(default_factory=bytearray)  # ids_json(ids), kept as the ids grow
    used: int = 0  # commit order, for ties and forgetting


class Attach(NamedTuple):
    line: int | None  # None: a new root
    turn: int  # index of the turn attached at
    retry: bool  # reuses the turn's prompt (a sibling) instead of extending its output


class PromptPlan(NamedTuple):
    prompt_ids: array  # the whole prompt
    reused_tokens: int  # ids taken as they were from an earlier call (the parent's prompt ∥ output, or prompt)
    branch_reason: str | None  # None: extends a line (or the first call)
    parent_call: int | None  # the call whose ids are the first reused_tokens of the prompt
    kind: str
    attach: Attach
    msgs: list[dict[str, Any]]  # the request's messages (template_message shape)
    tools_key: str


def _base(kind: str) -> str:
    return "subagent" if kind.startswith("subagent") else "main"


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # plain dict equality first: a harness re-sends its history as it was (C-speed on a 200k-token history)
    return a == b or same_message(message_key(a), message_key(b))


def _common_prefix(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    n = min(len(a), len(b))
    i = n if a[:n] == b[:n] else 0  # the usual case, a history resent as it was, in one compare in C
    while i < n and _same(a[i], b[i]):
        i += 1
    return i


class Conversations:
    """The lines of one rollout."""

    def __init__(self) -> None:
        self.lines: dict[int, Line] = {}
        self._next_line = 1
        self._seq = 0
        # line id -> (request msgs, line msgs, common prefix) of the last compare: plan() and commit() of one call
        # compare the same two histories, and a 200k-token history is thousands of messages
        self._compared: dict[int, tuple[list, list, int]] = {}

    def _common(self, msgs: list[dict[str, Any]], line: Line) -> int:
        memo = self._compared.get(line.id)
        if memo is not None and memo[0] is msgs and memo[1] is line.msgs:
            return memo[2]
        c = _common_prefix(msgs, line.msgs)
        self._compared[line.id] = (msgs, line.msgs, c)
        return c

    # --- planning ---------------------------------------------------------------------------------------------
    def _find(self, msgs: list[dict[str, Any]], tk: str) -> tuple[Line, int, bool] | None:
        """The deepest (line, turn, retry) the request attaches at, preferring the line used last on ties."""
        best: tuple[int, int, Line, int, bool] | None = None  # (depth, used, line, turn, retry)
        for line in self.lines.values():
            if line.tools_key != tk:
                continue
            c = self._common(msgs, line)
            for ti in range(len(line.turns) - 1, -1, -1):
                t = line.turns[ti]
                if c < t.n_messages:
                    continue
                if len(msgs) == t.n_messages:
                    cand = (t.prompt_len, line.used, line, ti, True)
                elif len(msgs) > t.n_messages + 1 and reply_matches(message_key(msgs[t.n_messages]),
                                                                    t.reply_key):
                    cand = (t.end, line.used, line, ti, False)
                else:
                    continue
                if best is None or cand[:2] > best[:2]:
                    best = cand
                break  # the deepest turn of this line that matches
        return None if best is None else (best[2], best[3], best[4])

    def _root_kind(self, msgs: list[dict[str, Any]]) -> tuple[str, str | None]:
        """Kind and branch reason of a new root."""
        if not any(_base(ln.kind) == "main" for ln in self.lines.values()):
            return "main", None  # the first line not marked otherwise (a title asked for first, with the header)
        by_age = sorted(self.lines.values(), key=lambda ln: -ln.used)
        quoted = [m.get("content") or "" for m in msgs if m.get("role") == "user"]
        for line in by_age:  # restarted from the model's own summary
            text = (line.turns[-1].reply.get("content") or "").strip()
            if len(text) >= _QUOTE_MIN_CHARS and any(text in q for q in quoted):
                return _base(line.kind) + "_summary", "compaction"
        # the first message says which agent this is: its system prompt (or, without one, its first request)
        same = [ln for ln in by_age if ln.msgs and _same(ln.msgs[0], msgs[0])]
        if not same:
            return "subagent", "new_agent"
        shorter = any(len(msgs) < len(ln.msgs) for ln in same)
        if any(_base(ln.kind) == "main" for ln in same):
            return "main_summary", "compaction" if shorter else "edit"
        return ("subagent_summary", "compaction") if shorter else ("subagent", "new_agent")

    def plan(self, renderer: ChatRenderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             kind_hint: str | None = None) -> PromptPlan:
        """The prompt for a request (messages already in template_message shape)."""
        msgs = list(messages)
        tk = tools_key(tools)

        def new_root(reason: str | None, kind: str | None = None) -> PromptPlan:
            k, r = self._root_kind(msgs)
            ids = array("i", renderer.canonical_ids(messages, tools))
            return PromptPlan(ids, 0, reason if reason is not None else r, None, kind_hint or kind or k,
                              Attach(None, -1, False), msgs, tk)

        found = self._find(msgs, tk)
        if found is None:
            return new_root(None)
        line, ti, retry = found
        kind = kind_hint or line.kind
        t = line.turns[ti]
        if retry:
            ids = JsonIds.extend_stored(line.ids, t.prompt_len, line.json, t.json_prompt_end, [])
            return PromptPlan(ids, t.prompt_len,
                              "retry", t.call_index, kind,
                              Attach(line.id, ti, True), msgs, tk)
        reason = None if ti == len(line.turns) - 1 else "edit"
        if t.finish_reason == "length":  # never extend a generation without its stop token
            if ti == 0:
                return new_root("truncated_parent", line.kind)
            ti, t, reason = ti - 1, line.turns[ti - 1], "truncated_parent"
        suffix = renderer.suffix_text(t.reply, messages[t.n_messages + 1:], tools)
        if suffix is None:
            return new_root("template_nonappend", line.kind)
        out_ids = line.ids[t.prompt_len:t.end]
        tail = renderer.encode(renderer.boundary_text(out_ids) + suffix)
        ids = JsonIds.extend_stored(line.ids, t.end, line.json, t.json_end, tail)
        return PromptPlan(ids, t.end, reason, t.call_index, kind,
                          Attach(line.id, ti, False), msgs, tk)

    # --- committing -------------------------------------------------------------------------------------------
    def commit(self, plan: PromptPlan, reply: dict[str, Any], output_ids: list[int], finish_reason: str,
               call_index: int) -> dict[str, Any]:
        """Take in a finished call; returns the delta to journal (apply() replays it)."""
        delta = self.delta(plan, reply, output_ids, finish_reason, call_index)
        self.apply(delta)
        return delta

    def delta(self, plan: PromptPlan, reply: dict[str, Any], output_ids: list[int], finish_reason: str,
              call_index: int) -> dict[str, Any]:
        """What taking in a finished call changes (apply() takes it in), nothing changed yet: the proxy journals
        the call first and takes it in only once the journal has it."""
        a = plan.attach
        line_id = a.line if (a.line is not None and not a.retry and plan.branch_reason is None) else None
        base = self.lines.get(a.line) if a.line is not None else None
        # against the base line as it is now (another call of the rollout may have grown it since plan())
        n_keep = self._common(plan.msgs, base) if base is not None else 0
        delta = {"line": line_id, "from_line": a.line, "turn": a.turn, "kind": plan.kind, "tools_key": plan.tools_key,
                 "n_keep": n_keep, "new_msgs": plan.msgs[n_keep:], "reply": reply, "finish_reason": finish_reason,
                 "call_index": call_index, "n_messages": len(plan.msgs), "reused": plan.reused_tokens,
                 "tail": plan.prompt_ids[plan.reused_tokens:].tolist(), "output_ids": list(output_ids)}
        return delta

    def apply(self, d: dict[str, Any]) -> None:
        """Replay one commit (from commit(), or from the journal after a restart)."""
        self._seq += 1
        base = self.lines.get(d["from_line"]) if d["from_line"] is not None else None
        msgs = (base.msgs[:d["n_keep"]] if base is not None else []) + list(d["new_msgs"])
        reply = d["reply"]
        grow = d["line"] is not None and d["line"] in self.lines and len(self.lines[d["line"]].ids) == d["reused"]
        if grow:  # the line grows in place
            line = self.lines[d["line"]]
        else:
            prefix, prefix_json, turns = array("i"), bytearray(), []
            if base is not None:
                prefix = base.ids[:d["reused"]]
                # the turns the new line shares: up to the attach point (a retry shares the turn's prompt only)
                turns = [t for t in base.turns[:d["turn"] + 1] if t.end <= d["reused"]]
                at = base.turns[d["turn"]]
                prefix_json = base.json[:at.json_end if at.end == d["reused"] else at.json_prompt_end]
            line = Line(self._next_line, d["kind"], d["tools_key"], [], prefix, turns, prefix_json)
            self._next_line += 1
            self.lines[line.id] = line
        line.ids.extend(array("i", d["tail"]))
        line.json += ids_json(d["tail"])
        prompt_len, json_prompt_end = len(line.ids), len(line.json)
        line.ids.extend(array("i", d["output_ids"]))
        line.json += ids_json(d["output_ids"])
        line.msgs = msgs
        line.tools_key = d["tools_key"]
        line.turns.append(Turn(d["n_messages"], prompt_len, len(line.ids), reply, message_key(reply),
                               d["finish_reason"], d["call_index"], json_prompt_end, len(line.json)))
        line.used = self._seq
        if len(self.lines) > MAX_LINES:
            gone = min(self.lines.values(), key=lambda ln: ln.used).id
            del self.lines[gone]
            self._compared.pop(gone, None)
