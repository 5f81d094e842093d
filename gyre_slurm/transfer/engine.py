"""The Mooncake Transfer Engine, as this project uses it: one engine per process, memory registered once, reads
and writes of registered byte ranges between peers.

Mooncake's Python binding returns 0 or -1 and logs the reason (glog, to stderr); this wrapper turns a -1 into a
`TransferError` that names the peer and the size, and keeps the tensors it registered alive for as long as they are
registered. Peers find each other by "host:rpc_port" (the P2PHANDSHAKE mode: no metadata server). Over TCP the
remote side's engine threads serve a read without its Python code doing anything, so a sender never waits on its
receivers and a receiver that dies harms nobody but itself.

The Transfer Engine has no authentication of its own (neither has RDMA): any process that can reach a peer's port
may read or write that peer's registered memory. Run it on the cluster's trusted fabric, or set weights.verify:
every bucket read is then checked against digests that came in a token-authenticated control message.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gyre_slurm.errors import GyreError


class TransferError(GyreError):
    """A transfer, registration or engine start failed."""


def wheel_for(cuda: str | None) -> str:
    """The Mooncake wheel that matches a torch built for CUDA `cuda` (torch.version.cuda; None: a CPU torch). The
    CUDA wheels link the CUDA runtime of the toolkit they were built with (Mooncake's .github/workflows/
    _build-wheel.yaml: cuda on cuda12.8, cuda13 on cuda13.0; mooncake-integration/CMakeLists.txt links CUDA::cudart)."""
    if cuda is None:
        return "mooncake-transfer-engine-non-cuda"
    return "mooncake-transfer-engine-cuda13" if cuda.split(".")[0] == "13" else "mooncake-transfer-engine"


def _import_engine():
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO/WARNING lines ("No RDMA devices found") are noise
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransferError(
            f"weights.transport is mooncake but the Mooncake Transfer Engine does not import ({e}); install "
            f"{wheel_for(torch.version.cuda)} (the wheel for this torch's CUDA {torch.version.cuda or 'none'}), or "
            "set weights.transport: file") from None
    return TransferEngine


def linked_libraries(path: Path) -> list[str]:
    """The DT_NEEDED entries of a little-endian ELF64 shared object (what the loader must find to load it)."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQI", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, kind, _flags, _addr, offset, size, link in sections:
        if kind != 6:  # SHT_DYNAMIC: (d_tag, d_val) pairs; its sh_link is the string table
            continue
        strtab = sections[link][4]
        for tag, val in struct.iter_unpack("<qQ", data[offset:offset + size]):
            if tag == 1:  # DT_NEEDED
                names.append(data[strtab + val:data.index(b"\0", strtab + val)].decode())
    return names


@functools.cache
def cuda_build() -> bool:
    """Whether the installed Mooncake can take GPU memory: only a build with USE_CUDA asks the CUDA runtime where a
    pointer lives (mooncake-transfer-engine/src/memory_location.cpp, under USE_CUDA), and only such a build links
    libcudart (mooncake-integration/CMakeLists.txt). Any other build treats every address as host memory."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return False
    engine = Path(next(iter(spec.submodule_search_locations))) / "engine.so"
    return engine.is_file() and any(n.startswith("libcudart") for n in linked_libraries(engine))


def refuse_memory(device_type: str, cuda_ok: bool) -> str | None:
    """Why memory on `device_type` must not be registered with this Mooncake build (None: it may)."""
    if device_type == "cpu" or (device_type == "cuda" and cuda_ok):
        return None
    build = "a CUDA build takes CPU and CUDA memory only" if cuda_ok else "no CUDA support"
    return (f"a {device_type} tensor cannot be registered with this Mooncake build ({build}: it would read the device "
            f"address as host memory); install {wheel_for(torch.version.cuda)}, or copy it to the CPU first")


_ENV_LOCK = threading.Lock()  # one engine start at a time may change the environment


@contextlib.contextmanager
def transport_env(protocol: str):
    """The environment Mooncake's engine reads while it starts: MC_FORCE_TCP present for tcp, absent for rdma.
    `initialize`'s protocol only picks the Python binding's allocator (mooncake-integration/transfer_engine/
    transfer_engine_py.cpp, initMemoryAllocator); TransferEngineImpl::init (mooncake-transfer-engine/src/
    transfer_engine_impl.cpp) installs RDMA whenever it finds an HCA unless getenv("MC_FORCE_TCP") is non-null, and
    reads it nowhere else: set for the engine's creation only, then the process's value is put back."""
    if protocol not in ("tcp", "rdma"):
        raise TransferError(f"Transfer Engine protocol {protocol!r}: tcp or rdma")
    with _ENV_LOCK:
        before = os.environ.pop("MC_FORCE_TCP", None)
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "true"  # upstream tests presence; its docs and CI write "true"
        try:
            yield
        finally:
            os.environ.pop("MC_FORCE_TCP", None)
            if before is not None:
                os.environ["MC_FORCE_TCP"] = before


def available() -> str | None:
    """None when the Transfer Engine imports here, else why not (one line)."""
    try:
        _import_engine()
    except TransferError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Region:
    """A registered byte range: its address here and its size."""

    addr: int
    nbytes: int


class TransferAgent:
    """This process's Transfer Engine over `protocol` (weights.protocol): "tcp" is TCP even where InfiniBand
    adapters are found, "rdma" lets Mooncake install RDMA on the adapters `device` names (weights.device: comma-
    separated, Mooncake's device filter; "" = every one found; with none found Mooncake falls back to TCP).

    Two engine objects may stand behind it: the one that serves (its RPC port is this process's peer name, which
    other processes were told) and the one that starts this process's reads and writes. They are one until a
    transfer to a peer reached before fails twice: Mooncake keeps each peer's descriptor (its data port among
    others) by "host:rpc_port" for the engine's whole life, and no call drops it, so a process that came up later on
    a dead peer's RPC port stays unreachable through that engine. A fresh initiating engine knows no peer yet."""

    _lock = threading.Lock()
    _by_key: dict[tuple[str, str, str], TransferAgent] = {}

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        self._engine_cls = _import_engine()
        self.host, self.protocol, self.device = host, protocol, device
        self._te = self._start()
        self.peer = f"{host}:{self._te.get_rpc_port()}"  # what other processes name this engine by
        self._client = self._te
        self._reached: set[str] = set()  # peers the initiating engine has reached (and so remembers)
        self._held: dict[int, torch.Tensor] = {}
        self._mutex = threading.RLock()  # registrations and the renewal of the initiating engine
        self.renewals = 0

    def _start(self):
        te = self._engine_cls()
        with transport_env(self.protocol):  # the filter means nothing to TCP: pass it only for rdma
            started = te.initialize(self.host, "P2PHANDSHAKE", self.protocol,
                                    self.device if self.protocol == "rdma" else "")
        if started != 0:
            raise TransferError(f"the Transfer Engine did not start on {self.host} over {self.protocol}")
        return te

    @classmethod
    def shared(cls, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> TransferAgent:
        """One engine per process and address: every user in the process shares it (each engine opens ports and
        threads of its own)."""
        key = (host, protocol, device)
        with cls._lock:
            agent = cls._by_key.get(key)
            if agent is None:
                agent = cls._by_key[key] = cls(host, protocol, device)
            return agent

    # --- memory ---------------------------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A registered CPU byte buffer of `nbytes` (kept registered until `release`)."""
        buf = torch.empty(max(int(nbytes), 1), dtype=torch.uint8)
        self.register(buf)
        return buf

    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous CPU tensor's bytes, or a CUDA tensor's where Mooncake is a CUDA build (refused in
        one line otherwise: a non-CUDA build would read the GPU address as host memory)."""
        why = refuse_memory(tensor.device.type, tensor.device.type == "cuda" and cuda_build())
        if why:
            raise TransferError(why)
        if not tensor.is_contiguous():
            raise TransferError("only contiguous tensors can be registered")
        addr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._mutex:
            if addr not in self._held:
                for te in self._engines():
                    if te.register_memory(addr, n) != 0:
                        raise TransferError(f"registering {n} bytes with the Transfer Engine failed")
                self._held[addr] = tensor
        return Region(addr, n)

    def release(self, tensor: torch.Tensor) -> None:
        addr = tensor.data_ptr()
        with self._mutex:
            if self._held.pop(addr, None) is not None:
                for te in self._engines():
                    te.unregister_memory(addr)

    def _engines(self) -> tuple:
        return (self._te,) if self._client is self._te else (self._te, self._client)

    # --- transfers ------------------------------------------------------------------------------------------------
    def read(self, peer: str, local: Sequence[int], remote: Sequence[int], sizes: Sequence[int]) -> None:
        """Read each remote range of `peer` into the local range at the same index (local ranges must lie in memory
        registered here, remote ones in memory the peer registered). Raises TransferError on any failure."""
        self._batch("batch_transfer_sync_read", "read from", peer, local, remote, sizes)

    def write(self, peer: str, local: Sequence[int], remote: Sequence[int], sizes: Sequence[int]) -> None:
        """Write each local range into the peer's remote range at the same index."""
        self._batch("batch_transfer_sync_write", "write to", peer, local, remote, sizes)

    def _batch(self, op: str, verb: str, peer: str, local: Sequence[int], remote: Sequence[int],
               sizes: Sequence[int]) -> None:
        if not (len(local) == len(remote) == len(sizes)):
            raise ValueError("local, remote and sizes must have the same length")
        if not sizes:
            return
        args = (peer, [int(x) for x in local], [int(x) for x in remote], [int(x) for x in sizes])
        client = self._client
        # A second try on the same engine: a pooled connection that the peer's side closed fails once, then
        # reconnects. A peer reached before that still fails may be a new process on a dead one's port (see above).
        if getattr(client, op)(*args) == 0 or getattr(client, op)(*args) == 0:
            self._reached.add(peer)
            return
        if peer in self._reached and getattr(self._renew(client), op)(*args) == 0:
            self._reached.add(peer)
            return
        raise TransferError(f"Transfer Engine: {verb} {peer} failed ({sum(sizes)} bytes in {len(sizes)} ranges): "
                            "the peer is gone, or a range is not registered there")

    def _renew(self, stale):
        """A fresh initiating engine, this process's memory registered with it (once per stale engine: transfers
        that failed together renew it once)."""
        with self._mutex:
            if self._client is stale:
                fresh = self._start()
                for addr, tensor in self._held.items():
                    if fresh.register_memory(addr, tensor.numel() * tensor.element_size()) != 0:
                        raise TransferError("registering memory with a fresh Transfer Engine failed")
                if stale is not self._te:
                    for addr in self._held:
                        stale.unregister_memory(addr)
                self._client, self._reached, self.renewals = fresh, set(), self.renewals + 1
            return self._client
