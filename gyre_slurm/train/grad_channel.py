"""Direct gradient channel, satellite → core. The daemon is never on this path.

This module is the whole transport: `GradMessage` (what travels), `GradSender` (satellite side) and
`GradReceiver` (core side). The message goes over ZeroMQ (DEALER → ROUTER); the gradient bytes either ride in it
(weights.transport file) or stay in the satellite's memory registered with the Mooncake Transfer Engine, which the
core pulls from (mooncake), then acknowledges so the satellite can free that buffer.

Wire format, one ZeroMQ multipart message, no pickle anywhere:

    frame 0  MAGIC (bytes inline) or MAGIC_TE (bytes over the Transfer Engine)
    frame 1  header: msgpack map {step, version_in, shards: [ids], sender, metrics: {name: float},
                                  params: [[name, dtype, shape, nbytes], ...]}
    frame 2  HMAC-SHA256 over (MAGIC, header, every tensor's bytes), keyed with the run token, each part
             length-prefixed so frame boundaries cannot be shifted
    frame 3+ inline: the raw bytes of each parameter's gradient (C order), in header order
             MAGIC_TE: one frame, msgpack {peer, addr, seq}: where the bytes lie (packed in header order)

The MAC covers the tensor bytes too: a forged gradient would poison the weights for good; over the Transfer
Engine the bytes are pulled first and then checked against it (the locator itself is not trusted: it only says
where to fetch bytes that must still match the MAC). Anything that fails to verify is dropped with a logged
reason; the receiver never raises on what a peer sends.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import struct
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch
import zmq
from torch import Tensor

from gyre_slurm.transfer.engine import TransferAgent, TransferError

log = logging.getLogger(__name__)

MAGIC = b"GYRE-GRAD/1"
MAGIC_TE = b"GYRE-GRAD-TE/1"
ACK = b"ack"
_MAC_BYTES = 32
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_NAME = 512


class GradChannelError(RuntimeError):
    """A gradient message could not be sent (the receiving side never raises)."""


@dataclass
class GradMessage:
    """Accumulated gradients of the shards `shard_ids` of one step, computed at weights `version_in`."""

    step: int
    version_in: int
    shard_ids: tuple[int, ...]
    sender: str
    grads: dict[str, Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


def frames_mac(token: str, parts: Iterable[bytes | memoryview]) -> bytes:
    """HMAC-SHA256 keyed with the run token over length-prefixed parts."""
    h = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.digest()


def _tensor_bytes(t: Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def encode_message(msg: GradMessage, token: str) -> list[bytes | memoryview]:
    """The multipart frames of `msg`, signed with the run token."""
    params, payloads = [], []
    for name, g in msg.grads.items():
        if g.dtype not in _DTYPE_NAMES:
            raise GradChannelError(f"gradient {name!r} has dtype {g.dtype}, not one of {sorted(DTYPES)}")
        data = _tensor_bytes(g)
        params.append([name, _DTYPE_NAMES[g.dtype], list(g.shape), len(data)])
        payloads.append(data)
    header = msgpack.packb({
        "step": int(msg.step), "version_in": int(msg.version_in), "shards": [int(s) for s in msg.shard_ids],
        "sender": str(msg.sender), "metrics": {str(k): float(v) for k, v in msg.metrics.items()}, "params": params,
    }, use_bin_type=True)
    return [MAGIC, header, frames_mac(token, [MAGIC, header, *payloads]), *payloads]


def _is_int(x: object, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _check_header(h: object) -> str | None:
    """Why this header is malformed, or None."""
    if not isinstance(h, dict):
        return "header is not a map"
    if not (_is_int(h.get("step")) and _is_int(h.get("version_in"))):
        return "step and version_in must be ints >= 0"
    shards = h.get("shards")
    if not isinstance(shards, list) or not shards or not all(_is_int(s) for s in shards) \
            or len(set(shards)) != len(shards):
        return "shards must be a non-empty list of distinct ints >= 0"
    if not isinstance(h.get("sender"), str) or len(h["sender"]) > _MAX_NAME:
        return "sender must be a short string"
    metrics = h.get("metrics")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and isinstance(v, float | int)
                                                and not isinstance(v, bool) for k, v in metrics.items()):
        return "metrics must map names to numbers"
    params = h.get("params")
    if not isinstance(params, list):
        return "params must be a list"
    for p in params:
        if not (isinstance(p, list) and len(p) == 4 and isinstance(p[0], str) and len(p[0]) <= _MAX_NAME
                and p[1] in DTYPES and isinstance(p[2], list) and all(_is_int(d) for d in p[2]) and _is_int(p[3])):
            return f"bad parameter entry {str(p)[:80]}"
        if math.prod(p[2]) * DTYPES[p[1]].itemsize != p[3]:
            return f"parameter {p[0]!r}: {p[3]} bytes do not fit shape {p[2]} of {p[1]}"
    if len({p[0] for p in params}) != len(params):
        return "a parameter name appears twice"
    return None


def decode_message(frames: list[bytes | memoryview], token: str, *, step: int | None = None) \
        -> tuple[GradMessage | None, str]:
    """(message, "ok") or (None, reason). Verifies the MAC before trusting any byte of the header."""
    if len(frames) < 3 or bytes(frames[0]) != MAGIC:
        return None, "malformed: not a gradient message"
    header, mac, payloads = frames[1], bytes(frames[2]), frames[3:]
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, frames_mac(token, [MAGIC, header, *payloads])):
        return None, "auth: bad HMAC (wrong run token or altered frames)"
    try:
        h = msgpack.unpackb(header, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        return None, f"malformed: header is not msgpack ({type(e).__name__})"
    why = _check_header(h)
    if why is not None:
        return None, f"malformed: {why}"
    if len(h["params"]) != len(payloads):
        return None, f"malformed: {len(h['params'])} parameters announced, {len(payloads)} tensor frames"
    if step is not None and h["step"] != step:
        return None, f"wrong step: message for step {h['step']}, receiving step {step}"
    grads = {}
    for (name, dtype, shape, nbytes), data in zip(h["params"], payloads, strict=True):
        if len(data) != nbytes:
            return None, f"malformed: parameter {name!r} has {len(data)} bytes, header says {nbytes}"
        if not nbytes:  # torch cannot view an empty byte tensor as another dtype
            grads[name] = torch.zeros(shape, dtype=DTYPES[dtype])
            continue
        raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())  # own, writable memory
        grads[name] = raw.view(DTYPES[dtype]).reshape(shape)
    msg = GradMessage(step=h["step"], version_in=h["version_in"], shard_ids=tuple(h["shards"]), sender=h["sender"],
                      grads=grads, metrics={k: float(v) for k, v in h["metrics"].items()})
    return msg, "ok"


class GradReceiver:
    """Core side: binds a ROUTER socket and yields verified messages. Refused frames are logged and counted in
    `rejections` (the most recent reasons); nothing a peer sends makes it raise. With a Transfer Engine `agent`
    it also takes messages whose bytes lie at the sender (up to `max_bytes` each: the model's size), pulls them
    into a staging buffer of its own, and acknowledges each so the sender can reuse that memory."""

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0, *, advertise_host: str | None = None,
                 context: zmq.Context | None = None, agent: TransferAgent | None = None,
                 max_bytes: int = 0) -> None:
        self._token = token
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host or host}:{port}"
        self.step: int | None = None
        self.rejections: deque[str] = deque(maxlen=256)
        self.received = 0
        self.pulled_bytes = 0
        self._agent, self._max_bytes = agent, int(max_bytes)
        self._staging: Tensor | None = None

    def expect(self, step: int | None) -> None:
        """Accept only messages for this step from now on (None: any step)."""
        self.step = step

    def poll(self, timeout: float) -> list[GradMessage]:
        """Wait up to `timeout` seconds for at least one verified message; return it and any others already
        queued (an empty list on timeout)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        out: list[GradMessage] = []
        while True:
            wait_ms = 0 if out else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                if out or time.monotonic() >= deadline:
                    return out
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            frames = [f.buffer for f in frames]
            if frames and bytes(frames[0]) == MAGIC_TE:
                frames, why = self._pull(ident.bytes, frames)
            msg, why = decode_message(frames, self._token, step=self.step) if frames else (None, why)
            if msg is None:
                self.rejections.append(why)
                log.warning("gradient message refused: %s", why)
                continue
            self.received += 1
            out.append(msg)

    def _pull(self, ident: bytes, frames: list) -> tuple[list, str]:
        """The message's frames with its bytes fetched from the sender (then acknowledged), or ([], reason)."""
        if self._agent is None:
            return [], "malformed: bytes over the Transfer Engine, and this receiver has none"
        if len(frames) != 4:
            return [], "malformed: a Transfer Engine message has 4 frames"
        try:
            loc = msgpack.unpackb(frames[3], raw=False)
            h = msgpack.unpackb(frames[1], raw=False)
            peer, addr, seq = str(loc["peer"]), int(loc["addr"]), int(loc["seq"])
            sizes = [int(p[3]) for p in h["params"]]
        except Exception as e:  # any shape of garbage: refused below, never trusted
            return [], f"malformed: Transfer Engine locator or header ({type(e).__name__})"
        total = sum(sizes)
        if any(n < 0 for n in sizes) or total > self._max_bytes or addr < 0:
            return [], f"malformed: {total} bytes announced, at most {self._max_bytes} accepted"
        if self._staging is None or self._staging.numel() < total:
            if self._staging is not None:
                self._agent.release(self._staging)
            self._staging = self._agent.allocate(max(total, 1))
        try:
            if total:
                self._agent.read(peer, [self._staging.data_ptr()], [addr], [total])
        except TransferError as e:
            return [], f"transfer: {e}"
        finally:
            self._sock.send_multipart([ident, ACK, struct.pack("<Q", seq)])  # pulled or not: the sender may free it
        self.pulled_bytes += total
        data = memoryview(self._staging.numpy())
        payloads, off = [], 0
        for n in sizes:
            payloads.append(data[off:off + n])
            off += n
        return [MAGIC, frames[1], frames[2], *payloads], "ok"

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._agent is not None and self._staging is not None:
            self._agent.release(self._staging)
            self._staging = None


class GradSender:
    """Satellite side: connects a DEALER socket to the core's endpoint. With a Transfer Engine `agent` the bytes
    stay in a registered buffer of this side until the core acknowledges it has pulled them."""

    def __init__(self, endpoint: str, token: str, *, name: str = "satellite", send_timeout_s: float = 120.0,
                 context: zmq.Context | None = None, agent: TransferAgent | None = None) -> None:
        self.name, self._token = name, token
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.connect(endpoint)
        self._agent = agent
        self._seq = 0
        self._held: dict[int, Tensor] = {}  # seq -> registered buffer the core has not acknowledged yet

    def send(self, msg: GradMessage) -> None:
        """Queue the message for the core (ZeroMQ sends it in the background; `close` waits for it). Large
        tensors go zero-copy inline: do not modify them afterwards (export_grads returns copies)."""
        frames = encode_message(msg, self._token)
        if self._agent is not None:
            self._reap(0)
            payloads = frames[3:]
            buf = self._agent.allocate(sum(len(p) for p in payloads))
            data, off = memoryview(buf.numpy()), 0
            for p in payloads:
                data[off:off + len(p)] = p
                off += len(p)
            self._seq += 1
            self._held[self._seq] = buf
            loc = msgpack.packb({"peer": self._agent.peer, "addr": buf.data_ptr(), "seq": self._seq})
            frames = [MAGIC_TE, frames[1], frames[2], loc]
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise GradChannelError("the core did not take the gradients in time (no receiver or it is full)") \
                from None

    def _reap(self, wait_s: float) -> None:
        """Free the buffers the core has acknowledged (waiting up to wait_s for the rest)."""
        deadline = time.monotonic() + wait_s
        while self._held:
            left = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self._sock.poll(left, zmq.POLLIN):
                return
            parts = self._sock.recv_multipart()
            if len(parts) == 2 and parts[0] == ACK and len(parts[1]) == 8:
                buf = self._held.pop(struct.unpack("<Q", parts[1])[0], None)
                if buf is not None and self._agent is not None:
                    self._agent.release(buf)

    @property
    def unacknowledged(self) -> int:
        return len(self._held)

    def close(self, linger_s: float = 30.0) -> None:
        """Close after up to `linger_s` seconds of delivering what is still queued (and, over the Transfer Engine,
        of waiting for the core to pull it)."""
        self._reap(linger_s)
        self._sock.close(linger=int(linger_s * 1000))
        if self._agent is not None:
            for buf in self._held.values():
                self._agent.release(buf)
        self._held.clear()
