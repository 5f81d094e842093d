"""A model call's token arrays on the wire and in segment files: ids and log-probs as packed little-endian bytes.

A call's ids and log-probs travel as packed bytes (int32 ids, float64 log-probs), not msgpack lists: decoding,
validating and re-packing 5,000 ids is then a copy instead of 5,000 Python ints (the daemon's CPU per call,
tools/bench_scale.py). A list is still accepted (older journals, hand-written messages).
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator

_SWAP = sys.byteorder != "little"


def pack(a: array) -> bytes:
    """The wire (and segment file) form of an Ids/Logprobs array."""
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def unpack(data: bytes | bytearray | memoryview, code: str) -> array:
    """pack's inverse: an array of typecode `code` ("i" ids, "d" log-probs)."""
    out = array(code)
    if len(data) % out.itemsize:
        raise ValueError(f"packed data must be a multiple of {out.itemsize} bytes")
    out.frombytes(data)
    if _SWAP:
        out.byteswap()
    return out


def _packed(code: str, what: str) -> Any:
    def to_array(v: Any) -> array:
        if isinstance(v, array) and v.typecode == code:
            return v
        if isinstance(v, bytes | bytearray | memoryview):
            return unpack(v, code)
        if not isinstance(v, list | tuple | array):
            raise ValueError(f"{what} must be packed bytes or a list")
        try:
            return array(code, v)
        except (TypeError, OverflowError):
            raise ValueError(f"{what} must all be {'32-bit integers' if code == 'i' else 'numbers'}") from None

    return Annotated[array, PlainValidator(to_array), PlainSerializer(lambda a: a.tolist())]


Ids = _packed("i", "ids")
Logprobs = _packed("d", "log-probs")
TOKEN_ARRAYS = {"prompt_ids": "i", "output_ids": "i", "output_logprobs": "d"}  # a call's token fields: typecodes


def packed(fields: dict[str, Any]) -> dict[str, Any]:
    """fields with their token arrays packed (a CallRecord's wire body, a segment record)."""
    return {k: pack(v) if k in TOKEN_ARRAYS and isinstance(v, array) else v for k, v in fields.items()}
