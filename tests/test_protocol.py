"""The wire protocol: round trips, and every kind of bad frame becomes a ProtocolError with a code."""

from __future__ import annotations

import msgpack
import pytest

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    JoinStep,
    MicrobatchAssignment,
    MicrobatchDone,
    NoMicrobatch,
    Register,
    Request,
    ShardRef,
    StepOpen,
    SwitchDone,
    SwitchReport,
    TakeMicrobatch,
    TrainStep,
    WeightsRef,
    decode,
    encode,
    error_code,
)
from gyre_slurm.roles import Role

TOKEN = "s3cret"


def test_round_trip_of_each_message() -> None:
    msgs = [
        Register(node_index=3, node_name="node4", host="h", pid=1, role=None),
        Heartbeat(node_index=1, cell=1, role=Role.TRAIN, seq=9, rss_mb=1.5),
        SwitchDone(node_index=0, cell=0, report=SwitchReport(switch_id=2, role=Role.TRAIN, ok=True,
                                                             started_at=1.0, ended_at=2.0)),
        Request(req_id="a", op="reassign", args={"cell": 1, "role": "TRAIN"}),
        TrainStep(step=2, version_in=2, batch_path="b", out_dir="o", attempt=3,
                  shards=[ShardRef(shard=0, path="s0"), ShardRef(shard=1, path="s1")]),
        StepOpen(step=2, attempt=3, grad_endpoint="tcp://core:5555"),
        JoinStep(step=2, attempt=3, version_in=2, weights=WeightsRef(version=2, path="w"),
                 grad_endpoint="tcp://core:5555"),
        TakeMicrobatch(step=2, attempt=3, node_index=1), MicrobatchAssignment(step=2, shard=1, path="s1"),
        NoMicrobatch(step=2, step_over=True), MicrobatchDone(step=2, attempt=3, shard=1, by_cell=1),
    ]
    for m in msgs:
        assert decode(encode(m, TOKEN), TOKEN) == m


def _code(frame: bytes) -> str:
    with pytest.raises(ProtocolError) as ei:
        decode(frame, TOKEN)
    return error_code(ei.value)


def env(msg, v=PROTOCOL_VERSION, token=TOKEN) -> bytes:
    return msgpack.packb({"v": v, "token": token, "msg": msg})


def test_bad_frames() -> None:
    assert _code(b"\xc1\xff garbage") == "malformed"
    assert _code(b"") == "malformed"
    assert _code(msgpack.packb([1, 2, 3])) == "malformed"
    assert _code(env("not a map")) == "malformed"
    assert _code(env({"type": "heartbeat"}, v=99)) == "version"
    assert _code(env({"type": "heartbeat"}, token="wrong")) == "auth"
    assert _code(msgpack.packb({"v": PROTOCOL_VERSION, "msg": {}})) == "auth"
    assert _code(env({"type": "teleport"})) == "unknown_type"
    assert _code(env({"no": "type"})) == "unknown_type"
    assert _code(env({"type": "heartbeat", "node_index": -1, "cell": 0, "role": "TRAIN", "seq": 0})) == "invalid"
    assert _code(env({"type": "heartbeat", "node_index": 0, "cell": 0, "role": "NAPPING", "seq": 0})) == "invalid"
    assert _code(env({"type": "request", "req_id": "x", "op": "format_disk"})) == "invalid"
    assert _code(env({"type": "register", "node_index": 0, "node_name": "n", "host": "h", "pid": 1,
                      "extra": 1})) == "invalid"
    assert _code(b"\x00" * (17 * 1024 * 1024)) == "too_large"
