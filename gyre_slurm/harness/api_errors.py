"""Spotting, in a harness's log, the API errors it got from the proxy, when it exits 0 all the same.

A harness CLI may report a refused or broken model call and carry on (or stop) with exit status 0; the run is then
scored as usual, but the reason it went wrong belongs in the rollout's `error`, where `gyre status` shows it.

The matcher is narrow on purpose: it knows the lines the real CLIs print for an API error (captured from Claude
Code 2.1.197 and Codex CLI 0.171.0 against a server answering 400, 404, 500 and a stream cut short), and nothing
else: the output of the task's own programs, which Codex echoes into its log, may say "error" or "ERROR:" freely.

- Claude Code (``claude -p``) prints the error as its result, at the start of a line: ``API Error: <status>
  <message>`` (``API Error: 400 tools: unsupported tool type ...``, ``API Error: 500 ... This is a server-side
  issue ...``) or ``API Error: <what happened>`` (``API Error: Connection to the API was lost (ECONNRESET). ...``).
  With ``--output-format json|stream-json``: the ``{"type":"result", "is_error":true, "result":"API Error: ..."}``
  line (the ``result`` is the excerpt).
- Codex CLI (``codex exec``) prints its error events as ``ERROR: <message>`` lines; matched when the message is
  the server's JSON error body (``ERROR: {"error": {...}}``) or one of Codex's own words for a failed call:
  ``unexpected status <3 digits>``, ``stream disconnected``, ``stream error``, ``exceeded retry limit``,
  ``We're currently experiencing high demand`` (its text for a 5xx), ``Codex ran out of room in the model's
  context window``, ``You've hit your usage limit``. ``ERROR: Reconnecting... n/m`` is a retry notice, not an error
  (the last retry's failure is printed as its own line); tracing lines (``2026-...Z ERROR codex_api::...``) have
  no colon after ERROR and are not matched. With ``--json``: ``{"type":"error","message":...}`` (not a
  ``Reconnecting...`` one) and ``{"type":"turn.failed","error":{"message":...}}``.

Two of Claude Code's "API Error" lines are the policy's doing, not the proxy's: ``API Error: Claude's response
exceeded the <n> output token maximum. ...`` (a reply cut at the CLI's own output-token limit, harness.max_tokens)
and ``API Error: The model has reached its context window limit.``; the CLI then ends the run with exit 1.
`length_limit_line` finds them: such a run is scored from its workspace as TRUNCATED_CONTEXT (worker/rollout.py's
classify), so a policy that loops until it is cut learns from it instead of being excluded.

A CLI also ends a run with a non-zero exit when the policy trips one of its guards: Claude Code's turn budget
(``Error: Reached max turns (6)``), Qwen Code's loop detection (``Loop detection halted the run ...``) and turn
budget. `policy_stop_line` finds those lines (POLICY_STOPS, and a CLI spec's own `policy_stops`): the run is scored
from its workspace as COMPLETED, its error saying why the CLI stopped; excluding it would hide the loop from training.
"""

from __future__ import annotations

import json
import re

MAX_LINE_CHARS = 300
_CLAUDE = re.compile(r"^API Error: \S")
_CODEX = re.compile(r"^ERROR: (\{|unexpected status \d{3}\b|stream disconnected\b|stream error\b|exceeded retry limit\b"
                    r"|We.re currently experiencing high demand|Codex ran out of room in the model.s context window"
                    r"|You.ve hit your usage limit)")
_RETRY = re.compile(r"^Reconnecting\.\.\.")
POLICY_STOPS = ("Error: Reached max turns (",)  # the presets' CLIs (Claude Code); a CLI spec brings its own
_LENGTH = re.compile(r"^API Error: (Claude.s response exceeded the \d+ output token maximum\b"
                     r"|The model has reached its context window limit)")


def _json_error(line: str) -> str | None:
    """The message of a JSON event line that reports an API error (Claude Code's result, Codex's error events)."""
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    if not isinstance(ev, dict):
        return None
    kind = ev.get("type")
    if kind == "result" and ev.get("is_error") is True:  # Claude Code
        res = ev.get("result")
        return res if isinstance(res, str) and _CLAUDE.match(res) else None
    if kind == "error" and isinstance(ev.get("message"), str) and not _RETRY.match(ev["message"]):  # Codex
        return ev["message"]
    if kind == "turn.failed" and isinstance(ev.get("error"), dict):  # Codex
        msg = ev["error"].get("message")
        return msg if isinstance(msg, str) else None
    return None


def match_api_error(line: str) -> str | None:
    """The part of one log line that reports an API error (see the module docstring), None if it reports none."""
    line = line.strip()
    if line.startswith("{"):
        msg = _json_error(line)
    elif _CLAUDE.match(line) or _CODEX.match(line):
        msg = line
    else:
        msg = None
    return None if msg is None else msg[:MAX_LINE_CHARS]


def api_error_lines(log: str, max_lines: int = 3) -> list[str]:
    """The API errors a harness log reports, each once, in order; at most `max_lines` (the last ones)."""
    seen: dict[str, None] = {}
    for line in log.splitlines():
        hit = match_api_error(line)
        if hit is not None:
            seen.pop(hit, None)  # a repeat moves to the end: the last errors are the ones kept
            seen[hit] = None
    return list(seen)[-max_lines:]


def api_error_reason(log: str) -> str | None:
    """One line saying the harness reported API errors, then the matching lines; None when there are none."""
    hits = api_error_lines(log)
    if not hits:
        return None
    return "harness exited 0 but its log shows API errors from the proxy:\n" + "\n".join(hits)


def length_limit_line(log: str) -> str | None:
    """The last line of a harness log (or of its JSON result's text) saying that the policy's reply ran into a
    length limit; None when none does."""
    hits = [hit for hit in map(match_api_error, log.splitlines()) if hit is not None and _LENGTH.match(hit)]
    return hits[-1] if hits else None


def policy_stop_line(log: str, prefixes: tuple[str, ...] | list[str] = ()) -> str | None:
    """The last line of a harness log that starts with one of POLICY_STOPS or `prefixes` (a CLI's words for "the
    policy tripped my guard"), None when none does."""
    starts = POLICY_STOPS + tuple(prefixes)
    hits = [line.strip() for line in log.splitlines() if line.strip().startswith(starts)]
    return hits[-1][:MAX_LINE_CHARS] if hits else None
