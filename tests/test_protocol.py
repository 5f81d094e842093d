"""The wire protocol: round trips, packed token arrays, and every kind of bad frame becomes a ProtocolError with a
code."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import get_args

import msgpack
import pytest

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import (
    PROTOCOL_VERSION,
    AddCellsRequest,
    CallRecord,
    CellJobsRequest,
    ControlRequest,
    EvalRequest,
    EventRequest,
    Heartbeat,
    JoinStep,
    NoShard,
    Op,
    PingRequest,
    ReassignRequest,
    Register,
    ReleaseRequest,
    ShardAssignment,
    ShardDone,
    ShardRef,
    ShutdownRequest,
    StatusRequest,
    StepOpen,
    SwitchDone,
    SwitchReport,
    TakeShard,
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
        ReassignRequest(req_id="a", cell=1, role=Role.TRAIN),
        TrainStep(step=2, version_in=2, batch_path="b", out_dir="o", attempt=3,
                  shards=[ShardRef(shard=0, path="s0"), ShardRef(shard=1, path="s1")]),
        StepOpen(step=2, attempt=3, grad_endpoint="tcp://core:5555"),
        JoinStep(step=2, attempt=3, version_in=2, weights=WeightsRef(version=2, path="w"),
                 grad_endpoint="tcp://core:5555"),
        TakeShard(step=2, attempt=3, node_index=1), ShardAssignment(step=2, shard=1, path="s1"),
        NoShard(step=2, step_over=True), ShardDone(step=2, attempt=3, shard=1, by_cell=1),
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
    assert _code(env({"type": "request", "req_id": "x", "op": "ping"})) == "unknown_type"  # protocol 1's
    assert _code(env({"type": "format_disk_request", "req_id": "x"})) == "unknown_type"
    assert _code(env({"type": "register", "node_index": 0, "node_name": "n", "host": "h", "pid": 1,
                      "extra": 1})) == "invalid"
    assert _code(b"\x00" * (17 * 1024 * 1024)) == "too_large"


# one of each control request, as its senders make them (a test below sends each to a real daemon)
REQUESTS = {
    PingRequest: PingRequest(), StatusRequest: StatusRequest(),
    ReassignRequest: ReassignRequest(cell=0, role=Role.TRAIN), ReleaseRequest: ReleaseRequest(cell=0),
    AddCellsRequest: AddCellsRequest(n=2), CellJobsRequest: CellJobsRequest(jobs={7: "4242"}),
    EventRequest: EventRequest(kind="process_restarted", message="worker-0 died (exit 1) and was started again"),
    EvalRequest: EvalRequest(version=3), ShutdownRequest: ShutdownRequest(),
}


def test_every_op_has_exactly_one_request_class() -> None:
    classes = ControlRequest.__subclasses__()
    assert sorted(c.op for c in classes) == sorted(get_args(Op))  # one each: no op twice, none missing
    assert set(REQUESTS) == set(classes)
    assert len({c.model_fields["type"].default for c in classes}) == len(classes)
    assert PingRequest().req_id != PingRequest().req_id  # each request its own id: its Reply is matched by it


@pytest.mark.parametrize("req", list(REQUESTS.values()), ids=lambda r: r.op)
def test_round_trip_of_each_control_request(req: ControlRequest) -> None:
    got = decode(encode(req, TOKEN), TOKEN)
    assert got == req and type(got) is type(req) and got.req_id == req.req_id


@pytest.mark.parametrize("body, where", [
    ({"type": "reassign_request", "req_id": "x", "cell": "1", "role": "TRAIN"}, "reassign_request.cell"),
    ({"type": "reassign_request", "req_id": "x", "cell": True, "role": "TRAIN"}, "reassign_request.cell"),
    ({"type": "reassign_request", "req_id": "x", "cell": 1, "role": "DOWN"}, "ROLLOUT or TRAIN, not DOWN"),
    ({"type": "reassign_request", "req_id": "x", "role": "TRAIN"}, "reassign_request.cell: Field required"),
    ({"type": "release_request", "req_id": "x", "cell": -1}, "release_request.cell"),
    ({"type": "add_cells_request", "req_id": "x", "n": "2"}, "add_cells_request.n"),
    ({"type": "add_cells_request", "req_id": "x", "n": 0}, "add_cells_request.n"),
    ({"type": "cell_jobs_request", "req_id": "x", "jobs": None}, "cell_jobs_request.jobs"),
    ({"type": "cell_jobs_request", "req_id": "x", "jobs": {"0": 12}}, "cell_jobs_request.jobs.0"),
    ({"type": "cell_jobs_request", "req_id": "x", "jobs": {"x": "12"}}, "cell_jobs_request.jobs.x"),
    ({"type": "cell_jobs_request", "req_id": "x", "jobs": {"0": "12; rm -rf /"}}, "cell_jobs_request.jobs.0"),
    ({"type": "event_request", "req_id": "x", "kind": "run_started", "message": "m"}, "event_request.kind"),
    ({"type": "event_request", "req_id": "x", "kind": "process_restarted", "message": ""}, "event_request.message"),
    ({"type": "eval_request", "req_id": "x", "version": 1.0}, "eval_request.version"),
    ({"type": "ping_request", "req_id": "x", "args": {}}, "ping_request.args"),
])
def test_a_wrong_control_request_is_invalid_and_says_which_field(body: dict, where: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(env(body), TOKEN)
    assert error_code(ei.value) == "invalid" and where in str(ei.value), str(ei.value)


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


@pytest.mark.slow
def test_a_real_daemon_answers_every_request_and_refuses_a_wrong_one_on_the_same_connection(tmp_path: Path) -> None:
    """A daemon process (control plane only, no agents) over its real socket: a request with a wrong-typed field
    gets an Error naming the field, the same connection then gets every request class answered by a Reply (a
    refusal is a Reply too), and nothing the refused frame carried reached the ledger."""
    from gyre_slurm.peer import connect_to_daemon
    from gyre_slurm.protocol import Error, Reply
    from gyre_slurm.rundir import read_control
    from gyre_slurm.spawn import gyre_argv, spawn

    from .conftest import q, write_config

    config = write_config(tmp_path / "run.yaml", tmp_path / "state")
    run_dir = tmp_path / "state" / "p"
    daemon = spawn(gyre_argv("daemon", str(config), "--run-id", "p"), tmp_path / "daemon.log")
    try:
        info = read_control(run_dir, wait_s=60)
        sock = connect_to_daemon(info, "cli", linger_ms=0, immediate=False)

        def ask(frame: bytes):
            sock.send(frame)
            assert sock.poll(10_000), "no answer from the daemon"
            return decode(sock.recv(), info.token)

        wrong = {"v": PROTOCOL_VERSION, "token": info.token,
                 "msg": {"type": "event_request", "req_id": "w", "kind": "process_restarted", "message": 42}}
        err = ask(msgpack.packb(wrong))
        assert isinstance(err, Error) and err.code == "invalid" and "event_request.message" in err.message, err
        answers = {cls: ask(encode(req, info.token)) for cls, req in REQUESTS.items()}  # ShutdownRequest last
        for cls, answer in answers.items():
            assert isinstance(answer, Reply) and answer.req_id == REQUESTS[cls].req_id, (cls, answer)
        results = {cls.op: (a.ok, a.result if a.ok else a.error) for cls, a in answers.items()}
        assert results["ping"][0] and results["ping"][1]["run_id"] == "p"
        assert results["status"][0] and results["event"] == (True, {"logged": True})
        assert results["reassign"] == (False, "cell 0 is DOWN (not all of its node agents are up)")
        assert results["release"] == (False, "cell 0 is not pinned")
        assert results["cell_jobs"] == (False, "no cell 7: this run has cells 0..1")
        assert not results["add_cells"][0] and "gyre submit" in results["add_cells"][1]
        assert results["eval"] == (False, "eval needs a run with an engine")
        assert results["shutdown"] == (True, {"stopping": True})
        sock.close()
        assert daemon.wait(timeout=15) == 0
        assert q(run_dir, "SELECT status FROM runs") == [("STOPPED",)]
        assert q(run_dir, "SELECT message FROM events WHERE kind = 'process_restarted'") == [
            (REQUESTS[EventRequest].message,)]  # the valid one only
        assert len(q(run_dir, "SELECT id FROM events WHERE kind = 'bad_message'")) == 1
    finally:
        daemon.kill()
        daemon.wait()
