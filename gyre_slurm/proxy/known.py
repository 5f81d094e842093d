"""What a rollout sent before, so that a request costs what it adds, not its whole history.

A harness re-sends its whole history with every request. Two ways to skip the part it sent before:
- bytes (the fast path): a serialiser that writes the same messages the same way (the official clients do) makes
  the new body start with the previous body's bytes up to its last message. Where each message ends in the
  previous body is kept, so the shared messages are found with one byte compare and only the rest of the body is
  parsed: parsing a 200k-token history costs more than everything else the proxy does for a call;
- parsed messages (the fallback): the body is parsed whole and its leading messages compared as dicts.
Either way, the shared messages were checked, validated and converted when they were first sent.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

KNOWN_MAX = 4  # conversations remembered per rollout (main, sub-agents, ...)
SCAN_MAX_BYTES = 1 << 16  # a body parsed whole is scanned for message ends only when small or the rollout's first
_CHUNK = 1 << 16
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')  # JSON strings (escapes included) and structure
_WS = b" \t\r\n"
_MESSAGES_KEY = b'"messages"'


@dataclass
class Known:
    raw_msgs: list[Any]  # the request's messages as sent (parsed)
    converted: list[Any]  # per raw message, what it became
    body: bytes | None = None  # the request body, kept while `ends` may serve the next request
    head: int = -1  # index of the '[' that opens the messages array in body
    ends: list[int] | None = None  # ends[i]: index just past raw message i in body


KnownMessages = list[Known]


def remember(known: KnownMessages | None, entry: Known, superseded: Known | None = None) -> None:
    """This request is now what the rollout sent before (a few conversations kept, newest first). The entry a
    request grew from by bytes gives up its body: the new body holds the same bytes (one body per conversation)."""
    if known is None:
        return
    if superseded is not None:
        superseded.body, superseded.ends = None, None
    known[:] = [entry] + [e for e in known if e.raw_msgs is not entry.raw_msgs][:KNOWN_MAX - 1]


def known_prefix(msgs: Any, known: KnownMessages | None) -> tuple[int, Known | None]:
    """How many leading raw messages equal ones sent before (compared as parsed values), and whose."""
    best, best_e = 0, None
    if not isinstance(msgs, list) or not known:
        return 0, None
    for e in known:
        n = min(len(e.raw_msgs), len(msgs) - 1)  # the last message is always validated (never an empty tail)
        if n <= best:
            continue  # cannot beat the best so far (the previous request of a growing history usually is)
        # a history resent unchanged: one list compare in C; a changed one is walked message by message
        i = n if msgs[:n] == e.raw_msgs[:n] else 0
        while i < n and (msgs[i] is e.raw_msgs[i] or msgs[i] == e.raw_msgs[i]):
            i += 1
        if i > best:
            best, best_e = i, e
    return best, best_e


# --- bytes ----------------------------------------------------------------------------------------------------------
def common_prefix_len(a: bytes, b: bytes, limit: int) -> int:
    """Length of the common prefix of a and b, up to limit: chunk compares, then a binary search in the chunk."""
    limit = min(limit, len(a), len(b))
    i = 0
    while i < limit and a[i:min(i + _CHUNK, limit)] == b[i:min(i + _CHUNK, limit)]:
        i += _CHUNK
    if i >= limit:
        return limit
    lo, hi = i, min(i + _CHUNK, limit)  # a[:lo] == b[:lo]; they differ before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo] != b[lo] else hi


def _skip_ws(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in _WS:
        i += 1
    return i


def _scan(body: bytes, pos: int, inside: bool) -> tuple[int, list[int]] | None:
    """Scan body from pos: (head, message ends). Starting inside the messages array (just after a ',' in it; head
    is then -1) or at the start of the body. None where the body is not what the fast path can use: no top-level
    "messages" array, a second "messages" key (the parser keeps the last), an element that is not an object."""
    depth = 2 if inside else 0  # brackets open: 1 = the body's object, 2 = its messages array
    head, ends, seen, done = -1, [], inside, False
    expect_key, key = False, b""
    for m in _TOKEN.finditer(body, pos):
        t = body[m.start()]
        if t == 0x22:  # a string
            if depth == 1 and expect_key:
                key, expect_key = m.group(), False
                if key == _MESSAGES_KEY and seen:
                    return None
                seen = seen or key == _MESSAGES_KEY
            elif depth == 2 and inside:
                return None
        elif t == 0x2C:  # ','
            expect_key = depth == 1
        elif t in (0x7B, 0x5B):  # '{' '['
            if depth == 2 and inside and t == 0x5B:
                return None
            depth += 1
            if depth == 1:
                expect_key = t == 0x7B
            elif depth == 2 and t == 0x5B and key == _MESSAGES_KEY and head < 0 and not inside and not done:
                head, inside = m.start(), True
        elif t in (0x7D, 0x5D):  # '}' ']'
            depth -= 1
            if inside and depth == 2:
                ends.append(m.end())
            elif inside and depth == 1:
                inside, done, key = False, True, b""
    return (head, ends) if done and depth == 0 else None


def message_ends(body: bytes) -> tuple[int, list[int]] | None:
    """(head, ends) of a whole body; None where the fast path cannot use it."""
    return _scan(body, 0, False)


def tail_ends(body: bytes, pos: int) -> list[int] | None:
    """Ends of the messages from pos (just after a ',' inside the messages array) to the array's end, and the check
    that no other "messages" key follows; None where the fast path cannot use the body."""
    got = _scan(body, pos, True)
    return None if got is None else got[1]


def byte_match(body: bytes, known: KnownMessages | None) -> tuple[Known, int, int] | None:
    """(entry, k, p): the body's first k messages are byte for byte the entry's (so are the body's bytes before
    them), and body[p] is the ',' after message k - 1. k leaves at least one message to validate."""
    best: tuple[Known, int, int] | None = None
    for e in known or ():
        if e.ends is None or e.body is None or (best is not None and len(e.ends) <= best[1]):
            continue
        same = common_prefix_len(body, e.body, e.ends[-1])
        k = bisect_right(e.ends, same)  # messages wholly inside the shared bytes
        while k > 0:
            p = _skip_ws(body, e.ends[k - 1])
            if p < len(body) and body[p] == 0x2C:  # a ',' after it: another message follows
                break
            k -= 1
        if k > 0 and (best is None or k > best[1]):
            best = (e, k, p)
    return best
