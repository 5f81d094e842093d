"""Append-only segment files for token payloads (prompt/output ids, log-probs) next to the ledger.

A 700k-token run does not belong in SQLite rows: each call's payload is one length-prefixed msgpack record in
state/<run>/segments/calls.seg, and the ledger's model_calls row keeps (offset, length). Its ids and log-probs
are packed arrays (token_arrays.pack: 4 bytes an id, 8 a log-prob; files written before hold msgpack lists, read
alike); a record read back gives them as arrays. The payload is
written (and flushed) before the ledger row that points to it, so the ledger never references missing data;
a record torn by a kill -9 at the tail is cut off when the file is opened again, and one a full disk tore at once
(DiskFull).
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from gyre_slurm.append_file import AppendFile
from gyre_slurm.errors import GyreError
from gyre_slurm.token_arrays import TOKEN_ARRAYS, packed, unpack

_HEADER = struct.Struct("<I")


def read_record(f: Any, offset: int, length: int) -> dict[str, Any]:
    """One record from an open segment file (readers open it read-only: a SegmentFile would cut a torn tail)."""
    f.seek(offset)
    data = f.read(length)
    if len(data) < _HEADER.size:
        raise GyreError(f"segment record at offset {offset} is missing (file cut short?)")
    (n,) = _HEADER.unpack_from(data)
    return _loaded(data[_HEADER.size:_HEADER.size + n])


def _loaded(body: bytes) -> dict[str, Any]:
    rec = msgpack.unpackb(body)
    for k, code in TOKEN_ARRAYS.items():
        v = rec.get(k)
        if v is not None:
            rec[k] = unpack(v, code) if isinstance(v, bytes) else array(code, v)
    return rec


class SegmentFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        self._truncate_torn_tail()
        self._f = AppendFile(self.path)  # kept open for the daemon's lifetime

    def _truncate_torn_tail(self) -> None:
        good = 0
        for offset, length, _ in self._scan():
            good = offset + length
        if good != self.path.stat().st_size:
            os.truncate(self.path, good)

    def append(self, record: dict[str, Any]) -> tuple[int, int]:
        """Append one record (arrays packed); returns (offset, length) of the whole framed record. A full disk
        raises DiskFull with the file as it was (append_file.py)."""
        body = msgpack.packb(packed(record))
        offset = self._f.append(_HEADER.pack(len(body)) + body)
        return offset, _HEADER.size + len(body)

    def cut(self, offset: int) -> None:
        """Cut off the record just appended at `offset` (one no ledger row will name)."""
        self._f.cut(offset)

    def read(self, offset: int, length: int) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            return read_record(f, offset, length)

    def _scan(self) -> Iterator[tuple[int, int, bytes]]:
        with open(self.path, "rb") as f:
            offset = 0
            while True:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return
                (n,) = _HEADER.unpack(head)
                body = f.read(n)
                if len(body) < n:
                    return
                yield offset, _HEADER.size + n, body
                offset += _HEADER.size + n

    def scan(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for offset, _length, body in self._scan():
            yield offset, _loaded(body)

    def close(self) -> None:
        self._f.close()


# What a model call's payload holds (a CallRecord's token data); older payloads lack the last three keys.
PAYLOAD_FIELDS = ("rollout_id", "call_index", "prompt_ids", "output_ids", "output_logprobs", "weight_version",
                  "finish_reason", "parent_call", "reused_tokens", "kind")


def payload_of(rec: Any) -> dict[str, Any]:
    """A CallRecord's payload, its arrays as they are (not copied into lists)."""
    return {k: getattr(rec, k) for k in PAYLOAD_FIELDS}


def insert_payload(tree: Any, rec: dict[str, Any]) -> None:
    """Insert one call payload into a RunTree (calls in call order; a payload names its parent call)."""
    tree.insert_call(rec["prompt_ids"], rec["output_ids"], rec["output_logprobs"], rec["weight_version"],
                     kind=rec.get("kind") or "main", finish_reason=rec["finish_reason"],
                     call_index=rec["call_index"], parent_call=rec.get("parent_call"),
                     reused=rec.get("reused_tokens") or 0)


def whole_prompts(calls: Iterable[Any]) -> dict[int, list[int]]:
    """Every call's whole prompt from records or payloads that carry only what is new (call order)."""
    seen: dict[int, tuple[list[int], list[int]]] = {}
    for c in calls:
        get = c.get if isinstance(c, dict) else lambda k, c=c: getattr(c, k)
        parent, reused = get("parent_call"), get("reused_tokens") or 0
        head: list[int] = []
        if parent is not None:
            p_prompt, p_out = seen[parent]
            head = (p_prompt + p_out)[:reused]
        seen[get("call_index")] = (head + list(get("prompt_ids")), list(get("output_ids")))
    return {k: v[0] for k, v in seen.items()}
