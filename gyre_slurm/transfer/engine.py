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

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyre_slurm.errors import GyreError


class TransferError(GyreError):
    """A transfer, registration or engine start failed."""


def _import_engine():
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO/WARNING lines ("No RDMA devices found") are noise
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransferError(
            f"weights.transport is mooncake but the Mooncake Transfer Engine does not import ({e}); install "
            "mooncake-transfer-engine (GPU nodes) or mooncake-transfer-engine-non-cuda (CPU), or set "
            "weights.transport: file") from None
    return TransferEngine


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
    """This process's Transfer Engine. `protocol` is "tcp" here, "rdma" on an InfiniBand/RoCE fabric (then
    `device` names the NICs, "" lets Mooncake choose)."""

    _lock = threading.Lock()
    _by_key: dict[tuple[str, str, str], TransferAgent] = {}

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        engine_cls = _import_engine()
        self._te = engine_cls()
        if self._te.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransferError(f"the Transfer Engine did not start on {host} over {protocol}")
        self.host, self.protocol = host, protocol
        self.peer = f"{host}:{self._te.get_rpc_port()}"  # what other processes name this engine by
        self._held: dict[int, torch.Tensor] = {}

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
        if not tensor.is_contiguous():
            raise TransferError("only contiguous tensors can be registered")
        addr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if addr not in self._held:
            if self._te.register_memory(addr, n) != 0:
                raise TransferError(f"registering {n} bytes with the Transfer Engine failed")
            self._held[addr] = tensor
        return Region(addr, n)

    def release(self, tensor: torch.Tensor) -> None:
        addr = tensor.data_ptr()
        if self._held.pop(addr, None) is not None:
            self._te.unregister_memory(addr)

    # --- transfers ------------------------------------------------------------------------------------------------
    def read(self, peer: str, local: Sequence[int], remote: Sequence[int], sizes: Sequence[int]) -> None:
        """Read each remote range of `peer` into the local range at the same index (local ranges must lie in memory
        registered here, remote ones in memory the peer registered). Raises TransferError on any failure."""
        self._batch(self._te.batch_transfer_sync_read, "read from", peer, local, remote, sizes)

    def write(self, peer: str, local: Sequence[int], remote: Sequence[int], sizes: Sequence[int]) -> None:
        """Write each local range into the peer's remote range at the same index."""
        self._batch(self._te.batch_transfer_sync_write, "write to", peer, local, remote, sizes)

    @staticmethod
    def _batch(fn, verb: str, peer: str, local: Sequence[int], remote: Sequence[int], sizes: Sequence[int]) -> None:
        if not (len(local) == len(remote) == len(sizes)):
            raise ValueError("local, remote and sizes must have the same length")
        if not sizes:
            return
        if fn(peer, [int(x) for x in local], [int(x) for x in remote], [int(x) for x in sizes]) != 0:
            raise TransferError(f"Transfer Engine: {verb} {peer} failed ({sum(sizes)} bytes in {len(sizes)} "
                                "ranges): the peer is gone, or a range is not registered there")
