"""Weights over the Transfer Engine: the core publishes each version once, every receiver pulls it.

The core (`WeightPublisher`) keeps two registered slots and writes version v into slot v % 2, so receivers still
pulling v are not disturbed while v + 1 is written. A slot is a 64-byte header (magic, version, state, payload size,
table size, layout id) followed by the parameters packed at 64-byte-aligned offsets (`plan_layout`) and then a small
table: one SHA-256 per bucket (with weights.verify) and the version's source (the core: its snapshot folder). Its
`WeightsHandle` travels in the token-authenticated control messages (TrainDone, StepOpen, LoadWeights, JoinStep): the
core's peer name, the slot's address and both slots' addresses, the layout and, with `verify`, the bucket digests.

A receiver (`WeightPuller`: a rollout engine, a satellite) reads the header, pulls the buckets into its own
registered staging buffer in batches, checks every bucket's digest (when there are digests) while the next batch is
read, and reads the header again: the version is checked at both ends, so a slot rewritten during the read is
refused, never loaded. A receiver slower than two steps finds its version replaced (slot v % 2 holds v + 2 or is
being written). `pull(h)` then fails; `pull(h, at_least=True)` reads both slots' headers and takes the newest
READY version ≥ the one asked, of the same layout, bucket digests from that slot's table (the handle's are for
its own version), and says which version it got and where that one lies (`TransferReport.version`, `.source`).
Only an older
version, another layout or a peer that is gone is an error then. The sender does nothing per receiver: a receiver
that dies mid-transfer harms nobody else.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.report import TransferReport

ALIGN = 64
HEADER = struct.Struct("<8sQQQQQ")  # magic, version, state, payload bytes, table bytes, layout id
HEADER_BYTES = ALIGN
MAGIC = b"GYREWT02"
WRITING, READY = 0, 1
PULL_GROUP_BYTES = 256 << 20  # buckets read in one Transfer Engine batch
TABLE_SPARE = 8192  # a slot's table: room for the source path and the JSON around the digests
PULL_TRIES = 4  # at_least: the newest slot may be rewritten while it is read (the core is that fast): pick again
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


def layout_rows(layout: Iterable[TensorSlot]) -> list[list]:
    """The layout as a handle carries it: [name, dtype, shape, offset, bytes] per tensor."""
    return [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in layout]


def layout_id(rows: Sequence[Sequence]) -> int:
    """A 64-bit fingerprint of a layout (handle rows), written in every slot's header: a receiver never reads a
    version of another layout into its own (slots freed and allocated again may reuse an address)."""
    text = json.dumps([[n, d, list(s), o, b] for n, d, s, o, b in rows], separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def bucket_ranges(nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive buckets covering nbytes."""
    bucket_bytes = max(int(bucket_bytes), ALIGN)
    return [(s, min(bucket_bytes, nbytes - s)) for s in range(0, nbytes, bucket_bytes)]


def table_capacity(n_buckets: int) -> int:
    """Bytes reserved after a slot's payload for its table (a hex digest and its JSON quoting per bucket)."""
    return -(-(67 * n_buckets + TABLE_SPARE) // ALIGN) * ALIGN


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
        self._layout_id = 0
        self.last: WeightsHandle | None = None

    def publish(self, version: int, tensors: Iterable[tuple[str, Tensor]], source: str = "",
                fill: Callable[[str, Tensor], None] | None = None) -> WeightsHandle:
        """Copy the tensors into slot version % 2 and return the handle receivers pull it by. `source`: where the
        version also lies (its snapshot folder), told to a receiver that gets this version instead of an older one."""
        tensors = list(tensors)
        layout, nbytes = plan_layout(tensors)
        buckets = bucket_ranges(nbytes, self.bucket_bytes)
        cap = table_capacity(len(buckets))
        if layout != self._layout:
            for s in self._slots:
                self.agent.release(s)
            self._slots = [self.agent.allocate(HEADER_BYTES + nbytes + cap) for _ in range(2)]
            self._layout, self._layout_id = layout, layout_id(layout_rows(layout))
        slot = self._slots[version % 2]
        self._header(slot, version, WRITING, nbytes, 0)
        payload = slot[HEADER_BYTES:HEADER_BYTES + nbytes]
        views = _views(payload, layout)
        with torch.no_grad():
            for (name, t), s in zip(tensors, layout, strict=True):
                if s.nbytes:  # fill: the caller writes each tensor (then `tensors` may be meta: dtype, shape only)
                    views[name].copy_(t) if fill is None else fill(name, views[name])
        digests = _digests(payload, buckets) if self.verify else None
        table = json.dumps({"digests": digests, "source": source}).encode()
        if len(table) > cap:
            raise TransferError(f"weights version {version}: its source {source[:80]!r}… does not fit the slot")
        slot[HEADER_BYTES + nbytes:HEADER_BYTES + nbytes + len(table)].numpy()[:] = memoryview(table)
        self._header(slot, version, READY, nbytes, len(table))
        self.last = WeightsHandle(
            peer=self.agent.peer, addr=slot.data_ptr(), version=version, nbytes=nbytes,
            bucket_bytes=self.bucket_bytes, digests=digests, tensors=layout_rows(layout),
            addrs=[s.data_ptr() for s in self._slots])
        return self.last

    def _header(self, slot: Tensor, version: int, state: int, nbytes: int, table: int) -> None:
        slot[:HEADER_BYTES].numpy()[:HEADER.size] = memoryview(
            HEADER.pack(MAGIC, version, state, nbytes, table, self._layout_id))

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


@dataclass(frozen=True)
class SlotHeader:
    addr: int
    version: int
    state: int
    nbytes: int
    table: int  # bytes of the table after the payload
    layout: int


class WeightPuller:
    """Pulls published versions into a registered staging buffer of its own (grown when a version is larger)."""

    def __init__(self, agent: TransferAgent, receiver: str = "") -> None:
        self.agent, self.receiver = agent, receiver
        self._buf: Tensor | None = None
        self._tab: Tensor | None = None

    def _staging(self, nbytes: int) -> Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            if self._buf is not None:
                self.agent.release(self._buf)
            self._buf = self.agent.allocate(nbytes)
        return self._buf

    def _header(self, h: WeightsHandle, addr: int, buf: Tensor) -> SlotHeader:
        self.agent.read(h.peer, [buf.data_ptr()], [addr], [HEADER_BYTES])
        magic, version, state, nbytes, table, layout = HEADER.unpack(bytes(buf[:HEADER.size].numpy()))
        if magic != MAGIC:
            raise TransferError(f"weights of version {h.version} at {h.peer}: not a weight slot")
        return SlotHeader(addr, version, state, nbytes, table, layout)

    def _table(self, h: WeightsHandle, s: SlotHeader) -> dict:
        if self._tab is None or self._tab.numel() < s.table:
            if self._tab is not None:
                self.agent.release(self._tab)
            self._tab = self.agent.allocate(max(s.table, 64 << 10))
        self.agent.read(h.peer, [self._tab.data_ptr()], [s.addr + HEADER_BYTES + s.nbytes], [s.table])
        try:
            return json.loads(bytes(self._tab[:s.table].numpy()))
        except ValueError:
            raise TransferError(f"weights version {s.version} at {h.peer}: its slot's table is unreadable") from None

    def pull(self, h: WeightsHandle, at_least: bool = False) -> tuple[dict[str, Tensor], TransferReport]:
        """The version's tensors (views into the staging buffer: valid until the next pull) and the report, whose
        version is the one pulled and source where that version also lies. `at_least`: where h.version was
        replaced, the newest version ≥ it of the same layout (else: refused, as a satellite needs). Raises
        TransferError when the peer is gone, no slot holds what is asked, or a digest does not match."""
        layout = handle_layout(h)
        want = layout_id(h.tensors)
        t0 = time.perf_counter()
        buf = self._staging(HEADER_BYTES + h.nbytes)
        for _ in range(PULL_TRIES):
            s = self._header(h, h.addr, buf)
            if (s.version, s.state) != (h.version, READY) or (s.layout, s.nbytes) != (want, h.nbytes):
                if not at_least:
                    raise TransferError(f"weights version {h.version} is no longer published at {h.peer} (replaced)")
                s = self._newest(h, buf, want)
            digests = h.digests if s.version == h.version else None
            table = self._table(h, s)
            if h.digests is not None and digests is None:
                digests = table.get("digests")
                if not isinstance(digests, list):
                    raise TransferError(f"weights version {s.version} at {h.peer} was published without digests")
            if self._read(h, s, buf, digests):
                report = TransferReport("mooncake", s.version, h.nbytes, time.perf_counter() - t0, self.receiver,
                                        source=str(table.get("source") or ""))
                return _views(buf[HEADER_BYTES:HEADER_BYTES + h.nbytes], layout), report
            if not at_least:
                raise TransferError(f"weights version {h.version} was replaced at {h.peer} while being read")
        raise TransferError(f"weights at {h.peer}: every version ≥ {h.version} was replaced while being read "
                            f"({PULL_TRIES} tries)")

    def _newest(self, h: WeightsHandle, buf: Tensor, want: int) -> SlotHeader:
        """The slot holding the newest READY version ≥ h.version of h's layout (both slots' headers read)."""
        seen = [self._header(h, a, buf) for a in (h.addrs or [h.addr])]
        fits = [s for s in seen if s.state == READY and (s.layout, s.nbytes) == (want, h.nbytes)]
        newer = [s for s in fits if s.version >= h.version]
        if newer:
            return max(newer, key=lambda s: s.version)
        if not fits:
            raise TransferError(f"weights version {h.version} at {h.peer}: no slot holds a version of its layout "
                                "(the core published another model, or restarted)")
        raise TransferError(f"weights version {h.version} at {h.peer}: only older versions "
                            f"({', '.join(str(s.version) for s in fits)}) are published there")

    def _read(self, h: WeightsHandle, s: SlotHeader, buf: Tensor, digests: list[str] | None) -> bool:
        """Read slot `s`'s payload into the staging buffer and check it; False when the slot was rewritten
        meanwhile (its header at the end is not the one at the start)."""
        buckets = bucket_ranges(h.nbytes, h.bucket_bytes)
        if digests is not None and len(digests) != len(buckets):
            raise TransferError(f"weights of version {s.version}: {len(digests)} digests, {len(buckets)} buckets")
        base, remote = buf.data_ptr() + HEADER_BYTES, s.addr + HEADER_BYTES
        payload = buf[HEADER_BYTES:HEADER_BYTES + h.nbytes]
        per_read = max(1, PULL_GROUP_BYTES // max(h.bucket_bytes, 1))
        groups = [buckets[i:i + per_read] for i in range(0, len(buckets), per_read)]
        # each group is checked in a second thread while the next one is read (hashlib and the engine both
        # release the GIL), so verifying costs little more than the last group's digests
        with ThreadPoolExecutor(1) as pool:
            checks = []
            for g in groups:
                self.agent.read(h.peer, [base + a for a, _ in g], [remote + a for a, _ in g], [n for _, n in g])
                if digests is not None:
                    checks.append(pool.submit(_digests, payload, g))
            got = [d for c in checks for d in c.result()]
        if self._header(h, s.addr, buf) != s:
            return False
        if digests is not None:
            bad = [i for i, (d, want) in enumerate(zip(got, digests, strict=True)) if d != want]
            if bad:
                raise TransferError(f"weights version {s.version}: bucket(s) {bad[:5]} do not match their digest")
        return True

    def pull_into(self, h: WeightsHandle, model: torch.nn.Module, at_least: bool = False) -> TransferReport:
        """Pull and copy into the model's parameters; the report's time includes the copy."""
        t0 = time.perf_counter()
        tensors, report = self.pull(h, at_least)
        load_into(model, tensors)
        return TransferReport("mooncake", report.version, h.nbytes, time.perf_counter() - t0, self.receiver,
                              source=report.source)

    def close(self) -> None:
        for b in (self._buf, self._tab):
            if b is not None:
                self.agent.release(b)
        self._buf = self._tab = None
