"""weights.engine_update: push. A new version reaches the cell's own rollout server without the disk, in two hops,
each recorded as a Transfer:

1. pull (transport "mooncake", receiver "agent:<cell>"): the node agent pulls the version the core published into
   its registered host staging buffer, as named tensors (transfer/weights.py WeightPuller; no nn.Module). The
   Transfer Engine does the cross-node hop from the core.
2. push (transport "nccl", the name sglang_weights.DistributedWeightSender gives every distributed update whatever
   its backend; receiver "engine:<cell>"): the agent is rank 0 of a weight-update group, the server's ranks follow
   (/init_weights_update_group with rank_offset 1 and world size 1 + the server's GPU ranks; SGLang joins each rank
   as rank_offset + tp_rank, so the ranks are sglang.tp_size, also with dp attention; the embedded engine is one
   rank), and broadcasts bucket by bucket while /update_weights_from_distributed receives. Backend: NCCL for an
   SGLang server when this process has CUDA (each bucket is then staged on its current CUDA device), gloo otherwise
   (the embedded engine: always). The hop stays on the node; a server spread over several nodes receives on its
   other nodes' ranks from here too.

The group belongs to one server start: formed at the first push to it, formed again for a new start (the caller's
`server`, the backend's process object, names the start) or after a push that failed (a refused bucket leaves our
broadcast of it waiting: that group is done for), destroyed on close.

Never half-loaded weights served. Both engines load each bucket as it arrives: SGLang answers a failed one with
"the full weights of the ModelRunner are partially updated", the embedded engine keeps the buckets before a refused
one, and between two bucket calls either would admit new calls on a mix of versions. So the push pauses generation
in abort mode first (calls in flight come back with what they sampled, and the proxy continues them, here after the
update or on another cell; new calls wait), waits until the server is idle (POST /flush_cache answers 200 only
then: SGLang asserts the flush a bucket with flush_cache asks for, and crashes on a busy server), sends the weight
version and flush_cache with the last bucket only (the version the engine reports changes once all of it is in),
then continues generation. A failed push loads the version the server served before back from its snapshot folder
(always written; the one path here that reads the disk, and only to recover) before generation continues: the
server serves its old version, the failure is recorded ok=false and raised. Loading into a staging copy instead
would need a second copy of the weights in GPU memory and a route SGLang does not have.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import httpx
import torch

from gyre_slurm.agent.weight_link import folder_bytes
from gyre_slurm.engines.client import EngineClient, parse_weight_version
from gyre_slurm.engines.sglang_weights import GROUP_TIMEOUT_S, DistributedWeightSender
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import WeightsHandle, WeightsRef
from gyre_slurm.spawn import free_port
from gyre_slurm.transfer.engine import TransferAgent
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weights import WeightPuller

log = logging.getLogger("gyre.agent")
IDLE_TIMEOUT_S = 60.0  # an abort-paused server finishes its aborted calls within a step or two


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


class EnginePusher:
    """One cell's push path into its own server. `agent` gives this process's Transfer Engine; `host` is where the
    server's ranks reach this process (the group's store), `bind_host` where its port is bound."""

    def __init__(self, agent: Callable[[], TransferAgent], cell: int, host: str, bind_host: str, *,
                 bucket_bytes: int, engine_ranks: int = 1, sglang: bool = False,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self._agent, self.cell, self.host, self.bind_host = agent, cell, host, bind_host
        self.bucket_bytes, self.engine_ranks, self.timeout_s = int(bucket_bytes), int(engine_ranks), timeout_s
        self.backend = "nccl" if sglang and torch.cuda.is_available() else "gloo"
        self.puller: WeightPuller | None = None
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None  # the last version pulled, in staging memory
        self.sender: DistributedWeightSender | None = None
        self.groups_formed = 0
        self._server: object = None  # the server start the group and `served` belong to
        self._served: WeightsRef | None = None  # what that server serves now: what a failed push restores
        self._names = itertools.count()
        self._lock = threading.Lock()

    @property
    def receiver(self) -> str:
        return f"engine:{self.cell}"

    def update(self, client: EngineClient, ref: WeightsRef, handle: WeightsHandle, server: object,
               record: Callable[[TransferReport], None]) -> None:
        """Make the server behind `client` serve `ref` (published as `handle`); raises after recording a failure."""
        with self._lock:
            server = client.base_url if server is None else server
            if server != self._server:
                self._drop(gone=True)  # a new start: the old group went with the old server
                self._server, self._served = server, None
            tensors = self._pull(handle, ref.version, record)
            if self._served is None:
                self._served = self._serving(client)
            t0, paused = time.perf_counter(), False
            try:
                sender = self._connected(client)
                paused = True  # from here on a failure restores (a pause that failed halfway may have held)
                client.pause_generation("abort")
                self._wait_idle(client)
                report = sender.send(tensors.items(), ref.version, bucket_bytes=self.bucket_bytes)
            except Exception as exc:
                record(TransferReport("nccl", ref.version, 0, time.perf_counter() - t0, self.receiver, ok=False,
                                      error=_error(exc)))
                self._drop()
                if paused:
                    self._restore(client, record)
                raise GyreError(f"cell {self.cell}: pushing weights version {ref.version} into {client.base_url} "
                                f"failed ({_error(exc)}); it serves version "
                                f"{self._served.version if self._served else '?'}") from None
            record(report)
            self._served = ref
            client.continue_generation()
            log.info("pushed version %d into %s over %s (%d bytes in %.3f s)", ref.version, client.base_url,
                     self.backend, report.nbytes, report.seconds)

    def _pull(self, handle: WeightsHandle, version: int, record: Callable[[TransferReport], None]) \
            -> dict[str, torch.Tensor]:
        """The version in host memory: pulled over the Transfer Engine, or still held from the last pull (a server
        that lost its weights to a memory release gets the same version pushed again)."""
        if self.held is not None and self.held[0] == handle.version:
            return self.held[1]
        self.held = None  # the staging buffer is about to be overwritten
        t0 = time.perf_counter()
        try:
            if self.puller is None:
                self.puller = WeightPuller(self._agent(), f"agent:{self.cell}")
            tensors, report = self.puller.pull(handle)
        except Exception as exc:
            record(TransferReport("mooncake", version, 0, time.perf_counter() - t0, f"agent:{self.cell}", ok=False,
                                  error=_error(exc)))
            raise
        record(report)
        self.held = handle.version, tensors
        return tensors

    def _serving(self, client: EngineClient) -> WeightsRef | None:
        """What a server we have not pushed into serves: the folder it started from, under its version label."""
        try:
            info = client.model_info()
        except Exception as exc:  # the push will fail too, and say why
            log.warning("cell %d: cannot ask %s what it serves: %s", self.cell, client.base_url, _error(exc))
            return None
        version = parse_weight_version(info.get("weight_version"))
        path = info.get("model_path")
        return WeightsRef(version=version, path=str(path)) if version is not None and path else None

    def _connected(self, client: EngineClient) -> DistributedWeightSender:
        if self.sender is None:
            sender = DistributedWeightSender(
                client, self.host, free_port(self.bind_host), group_name=f"gyre_push_{self.cell}_{next(self._names)}",
                backend=self.backend, engine_ranks=self.engine_ranks, timeout_s=self.timeout_s,
                receiver=self.receiver)
            sender.connect()  # refused: our half of the rendezvous waits out its timeout in a daemon thread
            self.sender = sender
            self.groups_formed += 1
            log.info("cell %d: weight-update group %s formed with %s (%s, world size %d)", self.cell,
                     sender.group_name, client.base_url, self.backend, 1 + self.engine_ranks)
        return self.sender

    def _wait_idle(self, client: EngineClient) -> None:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            r = httpx.post(client.base_url + "/flush_cache", timeout=30)
            if r.status_code == 200:
                return
            if time.monotonic() > deadline:
                raise GyreError(f"{client.base_url} still runs calls {IDLE_TIMEOUT_S:.0f} s after an abort pause "
                                f"(/flush_cache -> {r.status_code})")
            time.sleep(0.05)

    def _restore(self, client: EngineClient, record: Callable[[TransferReport], None]) -> None:
        """Load back the version the server served before a failed push, then let generation continue. If that
        fails too, the server stays paused: better no calls than calls on a mix of versions."""
        served, t0 = self._served, time.perf_counter()
        try:
            if served is None:
                raise GyreError("the version it served before is not known")
            client.update_weights_from_disk(served.path, served.version)
        except Exception as exc:
            record(TransferReport("file", -1 if served is None else served.version, 0, time.perf_counter() - t0,
                                  self.receiver, ok=False, error=_error(exc)))
            raise GyreError(f"cell {self.cell}: a failed push left {client.base_url} with weights of two versions "
                            f"and restoring failed ({_error(exc)}): generation stays paused") from None
        record(TransferReport("file", served.version, folder_bytes(served.path), time.perf_counter() - t0,
                              self.receiver))
        client.continue_generation()
        log.warning("cell %d: push failed; %s serves version %d again (from %s)", self.cell, client.base_url,
                    served.version, served.path)

    def _drop(self, gone: bool = False) -> None:
        """Forget the group: destroyed on the server (best effort) and here. `gone`: the server start it was
        formed with is no more (a new one may answer at the same address: it refuses the name, harmlessly)."""
        sender, self.sender = self.sender, None
        if sender is None:
            return
        if gone:
            sender.client = EngineClient(sender.client.base_url, timeout_s=5)
        sender.close()

    def close(self) -> None:
        with self._lock:
            self._drop()
            if self.puller is not None:
                self.puller.close()
            self.puller, self.held = None, None


__all__ = ["EnginePusher"]
