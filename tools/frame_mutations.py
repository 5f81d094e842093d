"""Control frames for the fuzzer (tools/fuzz_frames.py): one real message of every type on the wire, and mutations
of their encoded frames that the protocol must refuse.

`SAMPLES` holds a valid instance of every member of protocol.Message (tests/test_fuzz_frames.py keeps it complete).
`Mutator.frame()` draws a sample, encodes it with the run's token and applies one mutation from `MUTATIONS`:

  envelope   the token wrong, missing or of another type; the version wrong or missing; the envelope or its 'msg'
             not a map; 'msg' missing
  bytes      truncated, a byte flipped, garbage, empty, trailing bytes after the map, nesting thousands deep
  body       a required field dropped, a field of another msgpack type, an unknown type tag, an unknown field,
             a huge array or string in a field, integers out of range (negative, past 64 bits), NaN and infinities,
             packed token arrays of a length no element size divides

A mutation can leave a frame that still decodes (a byte flip inside a string, a float for a float): such a draw is
made again, so every frame `frame()` returns is one `decode` refuses; `tried` counts the draws. `stale()` returns
valid frames that name nothing the run has (unknown rollouts, steps of another attempt, cells and switches that do
not exist): what a peer that slept through a restart sends.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable
from typing import Any, get_args

import msgpack

from gyre_slurm.errors import ProtocolError
from gyre_slurm.protocol import (
    PROTOCOL_VERSION,
    AddCellsRequest,
    CallAck,
    CallRecord,
    CellJobsRequest,
    ContextLimit,
    DoneAck,
    Error,
    EvalRequest,
    EventRequest,
    Heartbeat,
    JoinStep,
    LoadWeights,
    Message,
    NoShard,
    NoWork,
    PingRequest,
    ProxyHello,
    ReassignRequest,
    Register,
    RegisterAck,
    ReleaseRequest,
    Reply,
    Reregister,
    RolloutAssignment,
    RolloutDone,
    Route,
    RouteQuery,
    ShardAssignment,
    ShardDone,
    ShardFailed,
    ShardRef,
    Shutdown,
    ShutdownRequest,
    StatusRequest,
    StepOpen,
    StepSeal,
    SwitchDone,
    SwitchReport,
    SwitchRole,
    TakeRollout,
    TakeShard,
    TrainDone,
    TrainStep,
    Transfer,
    WeightsHandle,
    WeightsReceived,
    WeightsRef,
    WireMessage,
    WorkerHello,
    decode,
    encode,
)
from gyre_slurm.roles import Role
from gyre_slurm.statuses import RolloutStatus

_W = WeightsRef(version=3, path="/state/run/weights/v3", parts=[WeightsHandle(
    peer="node1:15000", addr=4096, version=3, nbytes=1024, bucket_bytes=512,
    tensors=[("lm_head.weight", "bfloat16", [16, 32], 0, 1024)], digests=["ab" * 32], rank=1, layout=[2, 1, 1, 1],
    cuts=[(0, 1, 2)])])
_REPORT = SwitchReport(switch_id=4, role=Role.TRAIN, ok=True, started_at=1.0, ended_at=2.5)
_SEAL = StepSeal(n_shards=2, n_valid_runs=16)

SAMPLES: list[WireMessage] = [
    Register(node_index=1, node_name="node1", host="10.0.0.2", pid=4242, role=Role.ROLLOUT, slurm_job_id="77",
             last_switch=_REPORT, engine_url="http://10.0.0.2:30000"),
    RegisterAck(cell=1, role=Role.ROLLOUT, heartbeat_interval_s=2.0, weights=_W),
    Heartbeat(node_index=1, cell=1, role=Role.ROLLOUT, seq=17, rss_mb=812.5, engine_url="http://10.0.0.2:30000"),
    Reregister(reason="the daemon restarted"),
    SwitchRole(switch_id=5, cell=1, target=Role.TRAIN, weights=_W),
    SwitchDone(node_index=1, cell=1, report=_REPORT),
    LoadWeights(weights=_W),
    Shutdown(reason="the run is over"),
    PingRequest(), StatusRequest(), ReassignRequest(cell=1, role=Role.TRAIN), ReleaseRequest(cell=1),
    ShutdownRequest(), AddCellsRequest(n=2), CellJobsRequest(jobs={0: "101", 1: "102"}),
    EventRequest(kind="process_restarted", message="proxy died (exit -9) and was started again"),
    EvalRequest(version=2),
    Reply(req_id="r1", ok=True, result={"cells": [{"id": 0, "role": "ROLLOUT"}]}),
    Error(code="refused", message="no cell 7"),
    TrainStep(step=3, version_in=3, batch_path="/b/step-3/batch.msgpack", out_dir="/w/v4", attempt=2,
              shards=[ShardRef(shard=0, path="/b/step-3/shard-0.msgpack")], sharded=True, seal=_SEAL),
    TrainDone(step=3, ok=True, weights=_W, metrics={"loss": 0.25, "grad_norm": 1.5}, attempt=2),
    StepOpen(step=3, attempt=2, grad_endpoint="tcp://node0:5555", weights=_W),
    JoinStep(step=3, attempt=2, version_in=3, weights=_W, grad_endpoint="tcp://node0:5555"),
    TakeShard(step=3, attempt=2, node_index=1),
    ShardAssignment(step=3, shard=1, path="/b/step-3/shard-1.msgpack", seal=_SEAL),
    NoShard(step=3, retry_after_s=0.2, step_over=False, seal=_SEAL),
    ShardFailed(step=3, attempt=2, shard=1, node_index=1, error="rank 0 lost"),
    ShardDone(step=3, attempt=2, shard=1, by_cell=1),
    TakeRollout(worker_id="worker-0", free_slots=4, worker_started_at=1.7e9, sandbox="bwrap"),
    WorkerHello(worker_id="worker-0", running=3),
    RolloutAssignment(rollout_id=12, task={"id": "t1", "files": {"a.py": "x = 1\n"}}, api_key="k" * 40,
                      base_url="http://proxy:8000/v1", workspace="/ws/12", timeout_s=600.0,
                      harness=["python", "-m", "agent"], preset="cli", max_tokens=4096, cli={"name": "codex"}),
    NoWork(retry_after_s=0.5),
    RolloutDone(rollout_id=12, worker_id="worker-0", status=RolloutStatus.COMPLETED, reward=1.0, harness_exit=0,
                started_at=1.7e9, harness_s=42.0, eval_s=1.5, score=1.0, harness_log="ok"),
    DoneAck(rollout_id=12),
    ProxyHello(proxy_id="proxy-0", url="http://proxy:8000", owed=[12, 13]),
    RouteQuery(rollout_id=12),
    Route(rollout_id=12, open=True, cell=1, engine_url="http://10.0.0.2:30000", weight_version=3, temperature=0.6),
    CallRecord(rollout_id=12, call_index=2, api="openai-chat", prompt_ids=array("i", [5, 6, 7]),
               output_ids=array("i", [8, 9]), output_logprobs=array("d", [-0.5, -1.25]), weight_version=3, cell=1,
               finish_reason="stop", started_at=1.7e9, latency_s=0.8, reused_tokens=40, parent_call=1),
    ContextLimit(rollout_id=12, prompt_tokens=70_000, limit=65_536),
    CallAck(rollout_id=12, call_index=2, rollout_open=True),
    WeightsReceived(node_index=1, cell=1, transfers=[Transfer(transport="mooncake", version=3, nbytes=1024,
                                                              seconds=0.01, receiver="engine:1")]),
]


def message_types() -> set[type]:
    return set(get_args(get_args(Message)[0]))


# --- mutations: each takes (rng, the sample's wire body, the token) and returns the frame's bytes ---------------
def _env(body: Any, token: Any = None, v: Any = PROTOCOL_VERSION, **over: Any) -> dict:
    env = {"v": v, "token": token, "msg": body}
    env.update(over)
    return env


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _other_type(rng: random.Random, old: Any) -> Any:
    """A value of a msgpack type other than old's (and not one that pydantic would take for it)."""
    choices: list[Any] = [None, True, rng.randint(-2**63, 2**64 - 1), rng.uniform(-1e300, 1e300),
                          "x" * rng.randint(0, 40), b"\xff" * rng.randint(0, 40),
                          [rng.random() for _ in range(rng.randint(0, 5))], {"k": rng.random()},
                          msgpack.ExtType(rng.randint(0, 127), b"\x00\x01")]
    return rng.choice([c for c in choices if type(c) is not type(old)])


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into nested maps and lists of a wire body."""
    out: list[tuple] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += _paths(v, (*prefix, k))
    return out


def _set(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _at_random_path(rng: random.Random, body: dict, value: Callable[[Any], Any]) -> dict:
    paths = _paths(body) or [("type",)]
    path = rng.choice(paths)
    _set(body, path, value(_get(body, path)))
    return body


def _drop(rng: random.Random, body: dict, _t: str) -> bytes:
    paths = [p for p in _paths(body) if isinstance(p[-1], str)] or [("type",)]
    path = rng.choice(paths)
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    return _pack(_env(body, _t))


MUTATIONS: dict[str, Callable[[random.Random, dict, str], bytes]] = {
    # envelope
    "token_wrong": lambda r, b, t: _pack(_env(b, t[:-1] + chr(ord(t[-1]) ^ 1))),
    "token_missing": lambda r, b, t: _pack({"v": PROTOCOL_VERSION, "msg": b}),
    "token_type": lambda r, b, t: _pack(_env(b, _other_type(r, t))),
    "token_other_run": lambda r, b, t: _pack(_env(b, f"{r.getrandbits(128):032x}")),
    "version_wrong": lambda r, b, t: _pack(_env(b, t, v=r.choice([0, 1, PROTOCOL_VERSION + 1, str(PROTOCOL_VERSION),
                                                               None, 2**40]))),
    "version_missing": lambda r, b, t: _pack({"token": t, "msg": b}),
    "envelope_not_map": lambda r, b, t: _pack(r.choice([[PROTOCOL_VERSION, t, b], t, 7, None, b"\x00"])),
    "msg_not_map": lambda r, b, t: _pack(_env(_other_type(r, b), t)),
    "msg_missing": lambda r, b, t: _pack({"v": PROTOCOL_VERSION, "token": t}),
    "int_map_key": lambda r, b, t: _pack({**_env(b, t), 7: "x"}),
    # bytes
    "truncated": lambda r, b, t: (f := _pack(_env(b, t)))[:r.randrange(len(f))],
    "byte_flip": lambda r, b, t: _flip(r, _pack(_env(b, t))),
    "garbage": lambda r, b, t: r.randbytes(r.randint(1, 4096)),
    "empty": lambda r, b, t: b"",
    "trailing": lambda r, b, t: _pack(_env(b, t)) + r.randbytes(r.randint(1, 64)),
    "deep_nesting": lambda r, b, t: b"\x91" * r.randint(1_000, 100_000) + b"\xc0",
    # body
    "field_dropped": _drop,
    "field_type": lambda r, b, t: _pack(_env(_at_random_path(r, b, lambda old: _other_type(r, old)), t)),
    "type_unknown": lambda r, b, t: _pack(_env({**b, "type": r.choice(["", "hack", "Register", "REGISTER", 1])}, t)),
    "field_unknown": lambda r, b, t: _pack(_env({**b, r.choice(["x", "__class__", "tokenn", ""]): 1}, t)),
    "huge_array": lambda r, b, t: _pack(_env(_at_random_path(r, b, lambda _o: list(range(r.randint(10**4, 3 * 10**5)))),
                                             t)),
    "huge_string": lambda r, b, t: _pack(_env(_at_random_path(r, b, lambda _o: "A" * r.randint(10**5, 4 * 10**6)),
                                              t)),
    "int_range": lambda r, b, t: _pack(_env(_at_random_path(r, b, lambda _o: r.choice([-1, -2**63, 2**64 - 1])), t)),
    "float_special": lambda r, b, t: _pack(_env(_at_random_path(r, b, lambda _o: r.choice(
        [math.nan, math.inf, -math.inf])), t)),
    "packed_odd": lambda r, b, t: _pack(_env({**b, r.choice(["prompt_ids", "output_ids", "output_logprobs"]):
                                              r.randbytes(r.choice([1, 3, 5, 7, 9]))}, t)),
}


def _flip(rng: random.Random, frame: bytes) -> bytes:
    i = rng.randrange(len(frame))
    return frame[:i] + bytes([frame[i] ^ (1 << rng.randrange(8))]) + frame[i + 1:]


class Mutator:
    """Mutated frames for one run's token; `counts` says how many of each mutation were returned."""

    def __init__(self, token: str, seed: int, samples: list[WireMessage] | None = None) -> None:
        self.token = token
        self.rng = random.Random(seed)
        self.samples = samples or SAMPLES
        self.counts: dict[str, int] = {m: 0 for m in MUTATIONS}
        self.tried = 0

    def frame(self) -> tuple[str, bytes]:
        """(mutation name, a frame decode refuses)."""
        while True:
            self.tried += 1
            name = self.rng.choice(list(MUTATIONS))
            sample = self.rng.choice(self.samples)
            body = msgpack.unpackb(encode(sample, self.token), raw=False)["msg"]  # a fresh, mutable copy
            try:
                frame = MUTATIONS[name](self.rng, body, self.token)
            except (KeyError, IndexError, TypeError, ValueError, OverflowError):
                continue  # this sample has nothing this mutation can change (a field-less message)
            try:
                decode(frame, self.token)
            except ProtocolError:
                self.counts[name] += 1
                return name, frame


def stale(token: str, seed: int, n: int, target: str = "daemon") -> list[tuple[str, bytes]]:
    """n valid frames naming nothing a run has, for `target` (daemon: what peers send it; agent, proxy: what the
    daemon sends them): ids far past any real one, attempts of no start, unknown cells, answers to nothing asked."""
    rng = random.Random(seed)
    far = lambda: rng.randint(10**6, 2**31 - 1)  # noqa: E731
    answers: list[Callable[[], WireMessage]] = [  # a daemon's answers to questions never asked
        lambda: Error(code="refused", message="stale"), lambda: Reply(req_id=f"{far():x}", ok=True),
        lambda: CallAck(rollout_id=far(), call_index=far(), rollout_open=rng.random() < 0.5),
        lambda: Route(rollout_id=far(), open=False), lambda: NoWork(), lambda: DoneAck(rollout_id=far()),
        lambda: NoShard(step=far()),
    ]
    makers: dict[str, list[Callable[[], WireMessage]]] = {
        "daemon": [
            lambda: Heartbeat(node_index=far(), cell=far(), role=Role.ROLLOUT, seq=far()),
            lambda: SwitchDone(node_index=far(), cell=far(), report=_REPORT.model_copy(update={"switch_id": far()})),
            lambda: TakeShard(step=far(), attempt=far(), node_index=far()),
            lambda: ShardDone(step=far(), attempt=far(), shard=far(), by_cell=far()),
            lambda: ShardFailed(step=far(), attempt=far(), shard=0, node_index=far(), error="stale"),
            lambda: TrainDone(step=far(), ok=True, attempt=far(), weights=_W),
            lambda: RolloutDone(rollout_id=far(), worker_id="worker-stale", status=RolloutStatus.COMPLETED,
                                reward=1.0, started_at=1.7e9, harness_s=1.0),
            lambda: CallRecord(rollout_id=far(), call_index=0, api="openai-chat", prompt_ids=array("i", [1, 2]),
                               output_ids=array("i", [3]), output_logprobs=array("d", [-0.1]),
                               weight_version=far(), finish_reason="stop", started_at=1.7e9, latency_s=0.1),
            lambda: ContextLimit(rollout_id=far(), prompt_tokens=10, limit=5),
            lambda: RouteQuery(rollout_id=far()),
            lambda: WeightsReceived(node_index=far(), cell=far(), transfers=[]),
        ],
        "agent": answers, "proxy": answers,
    }
    out = []
    for _ in range(n):
        msg = rng.choice(makers[target])()
        out.append((type(msg).__name__, encode(msg, token)))
    return out
