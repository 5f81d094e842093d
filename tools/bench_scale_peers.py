"""The simulated peers of tools/bench_scale.py (not a benchmark of its own: bench_scale.py runs it).

    .venv/bin/python tools/bench_scale_peers.py CLIENT_SPEC.json    (started by bench_scale.py, one per client)

A client process holds simulated TITO proxies (DEALER sockets) and drives its share of the agent runs: each run
sends CallRecords that extend its history and waits for each CallAck; the frames are built from pre-packed token
lists so the client is never the bottleneck, and its figures go to the spec's "out" file as JSON. bench_scale.py
itself uses the node agents (Register, heartbeats) and the harness worker (takes every admitted rollout) below.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import sys
import threading
import time
from array import array
from pathlib import Path

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm import protocol as wire  # noqa: E402  (the one module that owns the wire protocol)
from gyre_slurm.errors import GyreError  # noqa: E402
from gyre_slurm.peer import connect_to_daemon  # noqa: E402
from gyre_slurm.roles import Role  # noqa: E402
from gyre_slurm.rundir import ControlInfo  # noqa: E402
from gyre_slurm.token_arrays import pack  # noqa: E402

VOCAB = 151_000  # Qwen3's ids
ENGINE_URL = "http://127.0.0.1:9"  # never called: the simulated proxies answer for the engines


# --- the simulated proxies (a client process each) ------------------------------------------------------------
class Packed:
    """A CallRecord frame built from pre-packed token arrays: the client packs only the few scalars per call, so
    it is never the bottleneck. It decodes to the very record protocol.encode would send (checked at start)."""

    def __init__(self, token: str, new_tokens: int, output_tokens: int, rng: random.Random, blocks: int = 4) -> None:
        self.p = msgpack.Packer()
        self.token = token
        n_prompt = new_tokens - output_tokens
        self.blocks = []
        for _ in range(blocks):
            prompt = [rng.randrange(VOCAB) for _ in range(n_prompt)]
            out = [rng.randrange(VOCAB) for _ in range(output_tokens)]
            logp = [-rng.random() * 3 for _ in range(output_tokens)]
            arrays = (array("i", prompt), array("i", out), array("d", logp))
            self.blocks.append(((prompt, out, logp), [self.p.pack(pack(a)) for a in arrays]))
        self.n_prompt, self.n_out = n_prompt, output_tokens
        self.head = b"".join([self.p.pack_map_header(3), self.p.pack("v"), self.p.pack(wire.PROTOCOL_VERSION),
                              self.p.pack("token"), self.p.pack(token), self.p.pack("msg")])

    def scalars(self, rid: int, idx: int, reused: int, now: float) -> dict:
        return {"type": "call_record", "rollout_id": rid, "call_index": idx, "api": "openai-chat",
                "weight_version": 0, "cell": None, "finish_reason": "tool_calls", "started_at": now,
                "latency_s": 0.5, "reused_tokens": reused, "parent_call": idx - 1 if idx else None,
                "branch_reason": None, "kind": "main"}

    def frame(self, rid: int, idx: int, reused: int, now: float) -> bytes:
        fields = self.scalars(rid, idx, reused, now)
        parts = [self.head, self.p.pack_map_header(len(fields) + 3)]
        for k, v in fields.items():
            parts += [self.p.pack(k), self.p.pack(v)]
        for k, b in zip(("prompt_ids", "output_ids", "output_logprobs"), self.blocks[idx % len(self.blocks)][1],
                        strict=True):
            parts += [self.p.pack(k), b]
        return b"".join(parts)

    def check(self) -> None:
        """The hand-packed frame decodes (protocol.decode, as the daemon does) to the CallRecord it stands for."""
        prompt, out, logp = self.blocks[1][0]
        fields = self.scalars(7, 1, 123, 1.0)
        want = wire.CallRecord(**fields, prompt_ids=prompt, output_ids=out, output_logprobs=logp)
        if wire.decode(self.frame(7, 1, 123, 1.0), self.token) != want:
            raise GyreError("the hand-packed CallRecord frame does not decode to the record it stands for")


class AgentRun:
    __slots__ = ("rid", "sock", "idx", "history", "sent_at", "sent_wall")

    def __init__(self, rid: int, sock: zmq.Socket) -> None:
        self.rid, self.sock, self.idx, self.history, self.sent_at, self.sent_wall = rid, sock, 0, 0, 0.0, 0.0


class Client:
    """One client process: --proxies DEALER sockets (simulated TITO proxies) carrying its share of the agent runs."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        info = ControlInfo(**spec["control"])
        self.pk = Packed(info.token, spec["new_tokens"], spec["output_tokens"], random.Random(spec["seed"]))
        self.pk.check()
        c = spec["client"]
        self.socks = [connect_to_daemon(info, f"proxy-sim-{c}-{j}", linger_ms=0) for j in range(spec["proxies"])]
        self.poller = zmq.Poller()
        for j, s in enumerate(self.socks):
            s.send(wire.encode(wire.ProxyHello(proxy_id=f"sim-{c}-{j}", url=ENGINE_URL), info.token))
            self.poller.register(s, zmq.POLLIN)
        self.runs = {rid: AgentRun(rid, self.socks[i % len(self.socks)]) for i, rid in enumerate(spec["rollouts"])}
        self.interval = len(self.runs) / spec["rate"] if spec["rate"] > 0 else 0.0
        rng = random.Random(spec["seed"])
        self.due = [(rng.uniform(0, self.interval), rid) for rid in self.runs]  # phases; go.json says from when
        heapq.heapify(self.due)
        self.t0 = self.t_end = 0.0
        self.per_call = self.pk.n_prompt + self.pk.n_out
        self.outstanding = 0
        self.st = {"acked": 0, "tokens": 0, "win_acked": 0, "win_tokens": 0, "closed": 0, "errors": {},
                   "lat_ms": []}

    def send_due(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, rid = heapq.heappop(self.due)
            r = self.runs[rid]
            r.sent_at, r.sent_wall = time.perf_counter(), now
            r.sock.send(self.pk.frame(rid, r.idx, r.history, now))
            self.outstanding += 1

    def on_frame(self, frame: bytes) -> None:
        msg = msgpack.unpackb(frame)["msg"]  # the token was checked by the daemon; only the ack's fields matter
        st = self.st
        if msg["type"] == "error":
            st["errors"][msg["code"]] = st["errors"].get(msg["code"], 0) + 1
            return
        if msg["type"] != "call_ack" or msg["rollout_id"] not in self.runs:
            return
        r, t_ack = self.runs[msg["rollout_id"]], time.time()
        self.outstanding -= 1
        if not msg["rollout_open"]:  # refused: the daemon thinks the rollout is over (it never is here)
            st["closed"] += 1
            return
        st["acked"] += 1
        st["tokens"] += self.per_call
        if self.t0 <= t_ack <= self.t_end:  # throughput: acks in the window
            st["win_acked"] += 1
            st["win_tokens"] += self.per_call
        if self.t0 <= r.sent_wall < self.t_end:  # latency: every call sent in it, however late its ack
            st["lat_ms"].append((time.perf_counter() - r.sent_at) * 1e3)
        r.history += self.per_call  # the next call reuses this one's prompt ∥ output
        r.idx += 1
        heapq.heappush(self.due, (max(t_ack, r.sent_wall + self.interval), r.rid))

    def run(self) -> None:
        stop_file, next_check = Path(self.spec["stop_file"]), 0.0
        while True:
            now = time.time()
            if now >= next_check:  # the parent ends the window early when the daemon's memory runs high
                next_check = now + 0.1
                if stop_file.exists():
                    self.t_end = min(self.t_end, float(stop_file.read_text() or now))
            sending = now < self.t_end
            if not sending and (self.outstanding == 0 or now > self.t_end + 10):
                break
            if sending:
                self.send_due(now)
            wait = min(0.05, max(0.0, self.due[0][0] - now)) if self.due and sending else 0.05
            for sock, _ in self.poller.poll(wait * 1000):
                while True:
                    try:
                        self.on_frame(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
        self.st["unacked"] = self.outstanding
        Path(self.spec["out"]).write_text(json.dumps(self.st))
        for s in self.socks:
            s.close()


# --- the node agents and the harness worker (threads of bench_scale.py itself) --------------------------------
class NodeAgents(threading.Thread):
    """The cells' node agents: Register with an engine URL, then heartbeats (with it) until stopped."""

    def __init__(self, info: ControlInfo, nodes: int) -> None:
        super().__init__(daemon=True)
        self.info, self.nodes, self.halt = info, nodes, threading.Event()

    def run(self) -> None:
        tok = self.info.token
        socks = [connect_to_daemon(self.info, f"agent-sim-{n}", linger_ms=0) for n in range(self.nodes)]
        for n, s in enumerate(socks):
            s.send(wire.encode(wire.Register(node_index=n, node_name=f"sim{n}", host="localhost", pid=os.getpid(),
                                             role=Role.ROLLOUT, engine_url=ENGINE_URL), tok))
        seq = 0
        while not self.halt.wait(0.5):
            for s in socks:
                while s.poll(0):
                    s.recv()  # RegisterAck (and nothing else: no policy moves a cell here)
            seq += 1
            for n, s in enumerate(socks):
                s.send(wire.encode(wire.Heartbeat(node_index=n, cell=n, role=Role.ROLLOUT, seq=seq,
                                                  engine_url=ENGINE_URL), tok))
        for s in socks:
            s.close()


def take_rollouts(info: ControlInfo, n: int, timeout_s: float = 60) -> list[int]:
    """A harness worker that takes every admitted rollout (RUNNING from then on) and never reports one done."""
    sock = connect_to_daemon(info, "worker-sim", linger_ms=0)
    sock.send(wire.encode(wire.ProxyHello(proxy_id="sim-hello", url=ENGINE_URL), info.token))  # known before a take
    got: list[int] = []
    deadline = time.monotonic() + timeout_s
    asked = False
    while len(got) < n:
        if time.monotonic() > deadline:
            raise GyreError(f"the daemon handed out {len(got)} of {n} rollouts in {timeout_s:g} s")
        if not asked:
            sock.send(wire.encode(wire.TakeRollout(worker_id="sim", free_slots=n - len(got)), info.token))
            asked = True
        if not sock.poll(1000):
            asked = False
            continue
        msg = wire.decode(sock.recv(), info.token)
        if isinstance(msg, wire.RolloutAssignment):
            got.append(msg.rollout_id)
            asked = len(got) < n and sock.poll(100)  # the rest of the burst first
        elif isinstance(msg, wire.NoWork):
            time.sleep(msg.retry_after_s)
            asked = False
    sock.close()
    return got


def serve_client(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    client = Client(spec)
    Path(spec["ready"]).write_text("ready")
    go = Path(spec["go_file"])
    while not go.exists():
        time.sleep(0.01)
    times = json.loads(go.read_text())
    client.t0, client.t_end = times["t0"], times["t1"]
    client.due = [(times["t_start"] + t, rid) for t, rid in client.due]  # the phases were drawn from 0
    client.run()


if __name__ == "__main__":
    serve_client(Path(sys.argv[1]))
