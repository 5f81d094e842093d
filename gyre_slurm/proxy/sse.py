"""Server-sent events. The engine call is not streamed (TITO needs the whole output before it can parse and
record it), so a streamed reply is the finished reply cut into pieces."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

PIECE_CHARS = 24  # small enough that clients see several deltas, large enough to keep the stream short
DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def pieces(text: str | None, size: int = PIECE_CHARS) -> Iterator[str]:
    for i in range(0, len(text or ""), size):
        yield text[i:i + size]


async def _iterate(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    # an async body keeps the stream on the event loop (a sync iterator would take a worker thread per chunk)
    for chunk in chunks:
        yield chunk


def response(chunks: Iterable[bytes]) -> StreamingResponse:
    """A finished reply's events as the HTTP response."""
    return StreamingResponse(_iterate(chunks), media_type="text/event-stream", headers=HEADERS)
