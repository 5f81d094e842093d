"""The wire protocol: round trips, packed token arrays, and every kind of bad frame becomes a ProtocolError with a
code."""

from __future__ import annotations

from array import array
from pathlib import Path

import msgpack
import pytest

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import (
    PROTOCOL_VERSION,
    CallRecord,
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
from gyre_slurm.trajectory.segments import SegmentFile, payload_of

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


def _record(**over) -> CallRecord:
    fields = dict(rollout_id=4, call_index=1, api="openai-chat", prompt_ids=[151_643, 7, 0], output_ids=[9, 151_000],
                  output_logprobs=[-0.125, -1.0e-7], weight_version=2, finish_reason="stop", started_at=1.0,
                  latency_s=0.5, reused_tokens=12, parent_call=0)
    return CallRecord(**{**fields, **over})


def test_a_call_records_ids_travel_packed_and_come_back_exact() -> None:
    rec = _record()
    body = msgpack.unpackb(encode(rec, TOKEN))["msg"]
    assert body["prompt_ids"] == array("i", [151_643, 7, 0]).tobytes()  # 4 bytes an id, not a msgpack list
    assert body["output_logprobs"] == array("d", [-0.125, -1.0e-7]).tobytes()  # float64: no rounding
    got = decode(encode(rec, TOKEN), TOKEN)
    assert got == rec and got.prompt_ids.tolist() == [151_643, 7, 0] and got.output_logprobs.tolist() == [-0.125,
                                                                                                          -1.0e-7]
    assert rec.model_dump(mode="json")["output_ids"] == [9, 151_000]  # dumps (journals, logs) stay plain lists
    listed = {**body, "prompt_ids": [151_643, 7, 0], "output_ids": [9, 151_000], "output_logprobs": [-0.125, -1e-7]}
    assert decode(env(listed), TOKEN) == rec  # a peer (or an older journal) sending lists is still understood


def test_bad_packed_ids_are_refused() -> None:
    body = _record().wire_body()
    assert _code(env({**body, "prompt_ids": b"\x01\x02\x03"})) == "invalid"  # not a whole number of ids
    assert _code(env({**body, "output_logprobs": b"\x00" * 12})) == "invalid"
    assert _code(env({**body, "prompt_ids": "1,2,3"})) == "invalid"
    assert _code(env({**body, "output_ids": [1, 2 ** 40]})) == "invalid"  # not a 32-bit id
    assert _code(env({**body, "output_ids": [1.5, 2]})) == "invalid"


def test_segment_records_keep_packed_arrays_and_old_lists_read_alike(tmp_path: Path) -> None:
    seg = SegmentFile(tmp_path / "calls.seg")
    rec = _record()
    new_at = seg.append(payload_of(rec))
    old = {**payload_of(rec), "prompt_ids": [151_643, 7, 0], "output_ids": [9, 151_000],
           "output_logprobs": [-0.125, -1e-7]}
    old_at = seg.append(old)  # what a ledger written before packing holds
    for at in (new_at, old_at):
        got = seg.read(*at)
        assert got["prompt_ids"] == rec.prompt_ids and got["output_logprobs"] == rec.output_logprobs
        assert list(got["output_ids"]) == [9, 151_000]
    assert [r["call_index"] for _, r in seg.scan()] == [1, 1]
    seg.close()
