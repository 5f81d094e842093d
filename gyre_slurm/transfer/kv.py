"""KV-cache migration over the Transfer Engine: a call aborted on one engine continues on another without its
prefill being computed again.

When an engine aborts a request because its cell is switching (/pause_generation or /abort_request with
export_kv), it packs the request's KV cache (prompt + the ids generated so far, `cache.length` tokens) into a
buffer registered with the Transfer Engine (`KVExports.export`) and puts the `KVHandle` in the abort answer's
meta_info. The proxy hands the handle to the engine that continues the call (POST /import_kv); that engine pulls
the bytes (`fetch`), checks them, and puts them into its prefix cache (`unpack`: the tensors are views of the
received buffer, no copy), so the continuation's /generate prefills only the last token.

Packed layout (pure, `pack` / `unpack`): for each layer, its keys then its values, each [kv_heads, tokens,
head_dim] contiguous in the model's dtype; so `tokens * layout.token_bytes` bytes in all, in one range.

What is checked before anything lands in a cache (`refusal`, then `fetch`): the layout (layers, kv heads, head dim,
dtype), the weights (the version label and a digest of a sample of every parameter: a KV computed by other weights
is never imported), that the ids the continuation sends start with the ids the handle covers (count + SHA-256),
the handle's expiry, and after the read the bytes' CRC-32 (a stale address re-used by a later export is caught).

Export buffers are the exporting engine's, apart from its KV cache: they outlive its memory release, for `ttl_s`
or until the importer says it has them (/release_kv_export), and their total is capped (`max_bytes`); beyond the
cap an export is refused and the continuation re-prefills.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import KVCache
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.weights import DTYPE_NAMES, DTYPES


class KVMigrationError(GyreError):
    """An export or import refused (no room, other weights, expired, ...); the message says why."""


# --- layout and packing (pure) ----------------------------------------------------------------------------------
class KVLayout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: str

    @classmethod
    def of(cls, cache: KVCache) -> KVLayout:
        _, heads, _, dim = cache.keys[0].shape
        return cls(layers=len(cache.keys), kv_heads=heads, head_dim=dim, dtype=DTYPE_NAMES[cache.keys[0].dtype])

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPES[self.dtype].itemsize


def pack(cache: KVCache, n: int, out: torch.Tensor) -> None:
    """Write the first n tokens' KV into the uint8 tensor `out` (at least n * token_bytes long)."""
    layout = KVLayout.of(cache)
    if not 0 < n <= cache.length:
        raise ValueError(f"cannot pack {n} tokens of a cache holding {cache.length}")
    size = n * layout.token_bytes // (2 * layout.layers)
    off = 0
    for k, v in zip(cache.keys, cache.values, strict=True):
        for t in (k, v):
            out[off:off + size].view(t.dtype).view(layout.kv_heads, n, layout.head_dim).copy_(t[0, :, :n])
            off += size


def unpack(buf: torch.Tensor, layout: KVLayout, n: int) -> KVCache:
    """A KVCache of n tokens whose tensors are views of the packed uint8 `buf` (it holds exactly n tokens: the
    request that takes it over grows it by copying)."""
    dtype, size = DTYPES[layout.dtype], n * layout.token_bytes // (2 * layout.layers)
    if buf.numel() < n * layout.token_bytes:
        raise ValueError(f"{buf.numel()} bytes cannot hold {n} tokens of KV ({n * layout.token_bytes} bytes)")
    views = [buf[i * size:(i + 1) * size].view(dtype).view(1, layout.kv_heads, n, layout.head_dim)
             for i in range(2 * layout.layers)]
    cache = KVCache.__new__(KVCache)
    cache.keys, cache.values, cache.length = views[0::2], views[1::2], n
    return cache


def token_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()


def crc32(buf: torch.Tensor) -> int:
    return zlib.crc32(memoryview(buf.numpy()))


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of 64 evenly spaced values of every parameter: another checkpoint, or a training step (which moves
    every parameter), gives another digest; cheap enough to compute at each weight change."""
    h = hashlib.blake2b(digest_size=12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(name.encode())
            h.update(flat[:: max(1, flat.numel() // 64)][:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


# --- the handle -----------------------------------------------------------------------------------------------
class KVHandle(BaseModel):
    """What an abort answer carries in meta_info["kv_handle"] and /import_kv takes back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    peer: str = Field(min_length=1, max_length=256)  # "host:rpc_port" of the exporter's Transfer Engine
    url: str | None = Field(default=None, max_length=512)  # the exporter's HTTP address (/release_kv_export)
    addr: int = Field(ge=0)
    nbytes: int = Field(ge=1)
    tokens: int = Field(ge=1)  # the first `tokens` ids of prompt + output
    token_digest: str = Field(min_length=64, max_length=64)
    crc32: int = Field(ge=0)
    layout: KVLayout
    weight_version: str = Field(max_length=256)
    weights_digest: str = Field(max_length=64)
    expires_at: float  # time.time() on the exporter's clock


def refusal(h: KVHandle, input_ids: Sequence[int], layout: KVLayout, weight_version: str,
            digest: str | None, room: int, now: float | None = None) -> str | None:
    """Why `h` cannot be imported by an engine of this layout and weights with `room` bytes of cache, for a
    request of `input_ids`; None when it can. `digest` None: the weights digest is not checked (yet)."""
    if h.layout != layout:
        return f"the KV layout differs: handle {h.layout.model_dump()}, this engine {layout.model_dump()}"
    if h.nbytes != h.tokens * layout.token_bytes:
        return f"the handle's size ({h.nbytes} bytes) does not fit {h.tokens} tokens of this layout"
    if h.weight_version != weight_version:
        return (f"other weights: the KV was computed by weight version {h.weight_version!r}, this engine serves "
                f"{weight_version!r}")
    if digest is not None and h.weights_digest != digest:
        return f"other weights: same version label {weight_version!r} but the weights differ"
    if (now or time.time()) > h.expires_at:
        return f"the handle expired {time.time() - h.expires_at:.1f} s ago"
    if len(input_ids) < h.tokens or token_digest(input_ids[:h.tokens]) != h.token_digest:
        return f"the ids sent do not start with the {h.tokens} ids the handle covers"
    if h.nbytes > room:
        return f"no room: {h.nbytes} bytes of KV, the prefix cache holds at most {room}"
    return None


# --- the exporter's side --------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Export:
    buf: torch.Tensor
    expires: float  # monotonic


class KVExports:
    """The export buffers of one engine, bounded by `max_bytes` and `ttl_s`; a daemon thread frees expired ones.

    `agent` is called on first use (starting the Transfer Engine costs ports and threads: an engine that never
    exports never starts one)."""

    def __init__(self, agent: Callable[[], TransferAgent], max_bytes: int, ttl_s: float) -> None:
        self._agent_factory, self.max_bytes, self.ttl_s = agent, int(max_bytes), float(ttl_s)
        self._agent: TransferAgent | None = None
        self._lock = threading.Lock()
        self._held: dict[str, _Export] = {}
        self.bytes = 0
        self.stats = {"kv_exports": 0, "kv_exports_refused": 0, "kv_exports_released": 0, "kv_exports_expired": 0}
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    @property
    def agent(self) -> TransferAgent:
        if self._agent is None:
            self._agent = self._agent_factory()
        return self._agent

    def export(self, cache: KVCache, ids: Sequence[int], weight_version: str, weights: str,
               url: str | None) -> KVHandle:
        """Pack the cache's valid tokens (the first cache.length of `ids`) into a new registered buffer. Raises
        KVMigrationError (over the cap, nothing to export) or TransferError (the Transfer Engine failed)."""
        n = cache.length
        if n <= 0:
            raise KVMigrationError("the request has no KV yet")
        layout = KVLayout.of(cache)
        nbytes = n * layout.token_bytes
        self.purge()
        with self._lock:
            if self.bytes + nbytes > self.max_bytes:
                self.stats["kv_exports_refused"] += 1
                raise KVMigrationError(f"export refused: {nbytes} bytes would exceed the cap of {self.max_bytes} "
                                       f"({self.bytes} held by {len(self._held)} exports)")
            self.bytes += nbytes  # reserved before the copy: concurrent exports cannot overshoot the cap
        try:
            buf = self.agent.allocate(nbytes)
            pack(cache, n, buf)
        except BaseException:
            with self._lock:
                self.bytes -= nbytes
            raise
        xid = uuid.uuid4().hex
        with self._lock:
            self._held[xid] = _Export(buf, time.monotonic() + self.ttl_s)
            self.stats["kv_exports"] += 1
        self._start_sweeper()
        return KVHandle(id=xid, peer=self.agent.peer, url=url, addr=buf.data_ptr(), nbytes=nbytes, tokens=n,
                        token_digest=token_digest(ids[:n]), crc32=crc32(buf), layout=layout,
                        weight_version=weight_version, weights_digest=weights, expires_at=time.time() + self.ttl_s)

    def release(self, xid: str, reason: str = "kv_exports_released") -> bool:
        with self._lock:
            ex = self._held.pop(xid, None)
            if ex is None:
                return False
            self.bytes -= ex.buf.numel()
            self.stats[reason] += 1
        self.agent.release(ex.buf)
        return True

    def purge(self) -> int:
        """Free the expired exports; how many."""
        now = time.monotonic()
        with self._lock:
            old = [x for x, ex in self._held.items() if ex.expires <= now]
        return sum(self.release(x, "kv_exports_expired") for x in old)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _start_sweeper(self) -> None:
        with self._lock:
            if self._sweeper is not None:
                return
            self._sweeper = threading.Thread(target=self._sweep, name="gyre-kv-exports", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(min(max(self.ttl_s / 4, 0.05), 5.0)):
            self.purge()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids = list(self._held)
        for x in ids:
            self.release(x)


# --- the importer's side --------------------------------------------------------------------------------------
def fetch(agent: TransferAgent, h: KVHandle) -> torch.Tensor:
    """Read the handle's bytes into a new local buffer (unregistered again once read) and check their CRC-32.
    Raises TransferError: the peer is gone, the export was freed (expired or released), or the bytes changed."""
    buf = agent.allocate(h.nbytes)
    try:
        agent.read(h.peer, [buf.data_ptr()], [h.addr], [h.nbytes])
    finally:
        agent.release(buf)
    if crc32(buf) != h.crc32:
        raise TransferError(f"KV export {h.id} at {h.peer}: the bytes read do not match their CRC-32 (the export "
                            "was freed and its memory re-used)")
    return buf


__all__ = ["KVExports", "KVHandle", "KVLayout", "KVMigrationError", "fetch", "pack", "refusal", "token_digest",
           "unpack", "weights_digest"]
