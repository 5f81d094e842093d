"""Weights over the Transfer Engine: the core publishes each version once, every receiver pulls it.

The core (`WeightPublisher`) keeps two registered slots and writes version v into slot v % 2, so receivers still
pulling v are not disturbed while v + 1 is written. A slot is a 64-byte header (magic, version, state, size)
followed by the parameters packed at 64-byte-aligned offsets (`plan_layout`). Its `WeightsHandle` travels in the
token-authenticated control messages (TrainDone, StepOpen, LoadWeights, JoinStep): the core's peer name, the
slot's address, the layout and, with `verify`, one SHA-256 digest per bucket.

A receiver (`WeightPuller`: a rollout engine, a satellite) reads the header, pulls the buckets into its own
registered staging buffer in batches, checks every bucket's digest (when the handle has them) while the next
batch is read, and reads the header again: the version is
checked at both ends, so a slot rewritten during the read (a receiver slower than two steps) is refused, never
loaded. The sender does nothing per receiver: a receiver that dies mid-transfer harms nobody else.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.report import TransferReport

ALIGN = 64
HEADER = struct.Struct("<8sQQQ")  # magic, version, state, payload bytes
HEADER_BYTES = ALIGN
MAGIC = b"GYREWT01"
WRITING, READY = 0, 1
PULL_GROUP_BYTES = 256 << 20  # buckets read in one Transfer Engine batch
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
                                  "uint8": torch.uint8, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


# --- layout (pure) ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the payload (after the header)
    nbytes: int


def plan_layout(tensors: Iterable[tuple[str, Tensor]]) -> tuple[list[TensorSlot], int]:
    """Each tensor's place in the payload, in order, 64-byte aligned; and the payload's size."""
    slots, off = [], 0
    for name, t in tensors:
        if t.dtype not in DTYPE_NAMES:
            raise TransferError(f"tensor {name!r} has dtype {t.dtype}, which the weight transport does not carry")
        n = t.numel() * t.element_size()
        slots.append(TensorSlot(name, DTYPE_NAMES[t.dtype], tuple(t.shape), off, n))
        off += -(-n // ALIGN) * ALIGN
    return slots, off


def bucket_ranges(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive buckets covering nbytes."""
    bucket_bytes = max(int(bucket_bytes), ALIGN)
    return [(s, min(bucket_bytes, nbytes - s)) for s in range(0, nbytes, bucket_bytes)]


def _digests(payload: Tensor, buckets: list[tuple[int, int]]) -> list[str]:
    mv = memoryview(payload.numpy())
    return [hashlib.sha256(mv[s:s + n]).hexdigest() for s, n in buckets]


def _views(payload: Tensor, layout: Iterable[TensorSlot]) -> dict[str, Tensor]:
    out = {}
    for s in layout:
        raw = payload[s.offset:s.offset + s.nbytes]
        out[s.name] = (raw.view(DTYPES[s.dtype]) if s.nbytes else torch.empty(0, dtype=DTYPES[s.dtype])) \
            .view(s.shape)
    return out


def named_weights(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """What a version carries: the model's parameters, each once (tied ones under their first name)."""
    return [(n, p.detach()) for n, p in model.named_parameters()]


def load_into(model: torch.nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy received tensors into the model's parameters in place (names and shapes must match exactly)."""
    params = dict(model.named_parameters())
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise TransferError(f"received weights do not fit the model: missing {missing[:3]}, unknown {extra[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise TransferError(f"received {name!r} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
            p.copy_(t)


# --- the core's side --------------------------------------------------------------------------------------------
class WeightPublisher:
    def __init__(self, agent: TransferAgent, *, bucket_bytes: int = 64 << 20, verify: bool = True) -> None:
        self.agent, self.bucket_bytes, self.verify = agent, int(bucket_bytes), verify
        self._slots: list[Tensor] = []
        self._layout: list[TensorSlot] | None = None
        self.last: WeightsHandle | None = None

    def publish(self, version: int, tensors: Iterable[tuple[str, Tensor]]) -> WeightsHandle:
        """Copy the tensors into slot version % 2 and return the handle receivers pull it by."""
        tensors = list(tensors)
        layout, nbytes = plan_layout(tensors)
        if layout != self._layout:
            for s in self._slots:
                self.agent.release(s)
            self._slots = [self.agent.allocate(HEADER_BYTES + nbytes) for _ in range(2)]
            self._layout = layout
        slot = self._slots[version % 2]
        slot[:HEADER_BYTES].numpy()[:HEADER.size] = memoryview(HEADER.pack(MAGIC, version, WRITING, nbytes))
        payload = slot[HEADER_BYTES:HEADER_BYTES + nbytes]
        views = _views(payload, layout)
        with torch.no_grad():
            for (name, t), s in zip(tensors, layout, strict=True):
                if s.nbytes:
                    views[name].copy_(t)
        buckets = bucket_ranges(nbytes, self.bucket_bytes)
        digests = _digests(payload, buckets) if self.verify else None
        slot[:HEADER_BYTES].numpy()[:HEADER.size] = memoryview(HEADER.pack(MAGIC, version, READY, nbytes))
        self.last = WeightsHandle(
            peer=self.agent.peer, addr=slot.data_ptr(), version=version, nbytes=nbytes,
            bucket_bytes=self.bucket_bytes, digests=digests,
            tensors=[[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in layout])
        return self.last

    def close(self) -> None:
        for s in self._slots:
            self.agent.release(s)
        self._slots, self._layout = [], None


# --- a receiver's side ------------------------------------------------------------------------------------------
def handle_layout(h: WeightsHandle) -> list[TensorSlot]:
    layout = [TensorSlot(n, d, tuple(shape), off, nb) for n, d, shape, off, nb in h.tensors]
    for s in layout:
        if s.dtype not in DTYPES or s.offset < 0 or s.offset + s.nbytes > h.nbytes or s.offset % ALIGN \
                or (s.nbytes and s.nbytes != DTYPES[s.dtype].itemsize * int(torch.Size(s.shape).numel())):
            raise TransferError(f"weights handle of version {h.version}: bad entry for {s.name!r}")
    return layout


class WeightPuller:
    """Pulls published versions into a registered staging buffer of its own (grown when a version is larger)."""

    def __init__(self, agent: TransferAgent, receiver: str = "") -> None:
        self.agent, self.receiver = agent, receiver
        self._buf: Tensor | None = None

    def _staging(self, nbytes: int) -> Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            if self._buf is not None:
                self.agent.release(self._buf)
            self._buf = self.agent.allocate(nbytes)
        return self._buf

    def _header(self, h: WeightsHandle, buf: Tensor) -> tuple[int, int, int]:
        self.agent.read(h.peer, [buf.data_ptr()], [h.addr], [HEADER_BYTES])
        magic, version, state, nbytes = HEADER.unpack(bytes(buf[:HEADER.size].numpy()))
        if magic != MAGIC:
            raise TransferError(f"weights of version {h.version} at {h.peer}: not a weight slot")
        return version, state, nbytes

    def pull(self, h: WeightsHandle) -> tuple[dict[str, Tensor], TransferReport]:
        """The version's tensors (views into the staging buffer: valid until the next pull) and the report.
        Raises TransferError when the peer is gone, the slot holds another version, or a digest does not match."""
        layout = handle_layout(h)
        t0 = time.perf_counter()
        buf = self._staging(HEADER_BYTES + h.nbytes)
        if self._header(h, buf) != (h.version, READY, h.nbytes):
            raise TransferError(f"weights version {h.version} is no longer published at {h.peer} (replaced)")
        buckets = bucket_ranges(h.nbytes, h.bucket_bytes)
        if h.digests is not None and len(h.digests) != len(buckets):
            raise TransferError(f"weights handle of version {h.version}: {len(h.digests)} digests, "
                                f"{len(buckets)} buckets")
        base, remote = buf.data_ptr() + HEADER_BYTES, h.addr + HEADER_BYTES
        payload = buf[HEADER_BYTES:HEADER_BYTES + h.nbytes]
        per_read = max(1, PULL_GROUP_BYTES // max(h.bucket_bytes, 1))
        groups = [buckets[i:i + per_read] for i in range(0, len(buckets), per_read)]
        # each group is checked in a second thread while the next one is read (hashlib and the engine both
        # release the GIL), so verifying costs little more than the last group's digests
        with ThreadPoolExecutor(1) as pool:
            checks = []
            for g in groups:
                self.agent.read(h.peer, [base + s for s, _ in g], [remote + s for s, _ in g], [n for _, n in g])
                if h.digests is not None:
                    checks.append(pool.submit(_digests, payload, g))
            got = [d for c in checks for d in c.result()]
        if h.digests is not None:
            bad = [i for i, (d, want) in enumerate(zip(got, h.digests, strict=True)) if d != want]
            if bad:
                raise TransferError(f"weights version {h.version}: bucket(s) {bad[:5]} do not match their digest")
        if self._header(h, buf) != (h.version, READY, h.nbytes):
            raise TransferError(f"weights version {h.version} was replaced at {h.peer} while being read")
        report = TransferReport("mooncake", h.version, h.nbytes, time.perf_counter() - t0, self.receiver)
        return _views(payload, layout), report

    def pull_into(self, h: WeightsHandle, model: torch.nn.Module) -> TransferReport:
        """Pull and copy into the model's parameters; the report's time includes the copy."""
        t0 = time.perf_counter()
        tensors, report = self.pull(h)
        load_into(model, tensors)
        return TransferReport("mooncake", h.version, h.nbytes, time.perf_counter() - t0, self.receiver)

    def close(self) -> None:
        if self._buf is not None:
            self.agent.release(self._buf)
            self._buf = None
