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
then continues generation. The buckets go inside a weight-update session (/begin_weight_update ...
/end_weight_update, DistributedWeightSender.send), which SGLang since its session API requires
(managers/scheduler_components/weight_updater.py), on a server that has one (probed once per server start: an
older build answers 404 and loads directly): pause, flush, begin, buckets, end, continue, the order slime and
miles use. A failed push loads the version the server served before back from its snapshot folder
(always written; the one path here that reads the disk, and only to recover) before generation continues: the
server serves its old version, the failure is recorded ok=false and raised. Loading into a staging copy instead
would need a second copy of the weights in GPU memory and a route SGLang does not have.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from gyre_slurm.agent.engine_update import EngineUpdater, Record
from gyre_slurm.engines.client import EngineClient
from gyre_slurm.engines.sglang_weights import GROUP_TIMEOUT_S, DistributedWeightSender
from gyre_slurm.protocol import WeightsHandle, WeightsRef
from gyre_slurm.spawn import free_port
from gyre_slurm.transfer.engine import TransferAgent

log = logging.getLogger("gyre.agent")


class EnginePusher(EngineUpdater):
    """One cell's push path into its own server. `agent` gives this process's Transfer Engine; `host` is where the
    server's ranks reach this process (the group's store), `bind_host` where its port is bound."""

    verb = "push"

    def __init__(self, agent: Callable[[], TransferAgent], cell: int, host: str, bind_host: str, *,
                 bucket_bytes: int, engine_ranks: int = 1, sglang: bool = False,
                 timeout_s: float = GROUP_TIMEOUT_S, gpu: int | None = None) -> None:
        super().__init__(agent, cell)
        self.host, self.bind_host = host, bind_host
        self.gpu = gpu  # NCCL: a GPU SGLang's ranks leave free (sglang_gpus.push_gpu), never theirs
        self.bucket_bytes, self.engine_ranks, self.timeout_s = int(bucket_bytes), int(engine_ranks), timeout_s
        self.backend = "nccl" if sglang and torch.cuda.is_available() else "gloo"
        self.sender: DistributedWeightSender | None = None
        self.groups_formed = 0
        self._names = itertools.count()

    def update(self, client: EngineClient, ref: WeightsRef, handle: list[WeightsHandle], server: object,
               record: Record) -> WeightsRef:
        """Make the server behind `client` serve `ref` (published as `handle`), or the newest version after it where
        it was replaced before it was read; returns the version served. Raises after recording a failure."""
        with self._lock:
            if self._new_server(client, server):
                self._drop(gone=True)  # a new start: the old group went with the old server
            got, tensors = self._pull(handle, ref, record)
            self._know_served(client)
            self._paused_update(client, got.version, "nccl", record,
                                lambda: self.sender.send(tensors.items(), got.version, bucket_bytes=self.bucket_bytes),
                                prepare=lambda: self._connected(client), on_failure=self._drop)
            self._served = got
            return got

    def _connected(self, client: EngineClient) -> DistributedWeightSender:
        if self.sender is None:
            sender = DistributedWeightSender(
                client, self.host, free_port(self.bind_host), group_name=f"gyre_push_{self.cell}_{next(self._names)}",
                backend=self.backend, engine_ranks=self.engine_ranks, timeout_s=self.timeout_s,
                receiver=self.receiver, gpu=self.gpu)
            sender.connect()  # refused: our half of the rendezvous waits out its timeout in a daemon thread
            self.sender = sender
            self.groups_formed += 1
            log.info("cell %d: weight-update group %s formed with %s (%s, world size %d)", self.cell,
                     sender.group_name, client.base_url, self.backend, 1 + self.engine_ranks)
        return self.sender

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
            self._close_puller()


__all__ = ["EnginePusher"]
