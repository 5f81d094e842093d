"""Gradients of a model-parallel satellite, rank to rank: each satellite rank sends its own gradient slices (local
Megatron names, after its cell's all-reduces) to the core rank of the same place, which adds them. The satellite
has the core's layout (every cell trains with the same train section), so rank r's slices are core rank r's.

Every rank sends (not only the primary senders): a DP replica's gradient equals DP rank 0's after the all-reduce,
and each core rank then adds exactly the piece it holds, with no collective on the core beyond the decision below.

Core side: every core rank runs its own `GradReceiver` (grad_channel.py: ZeroMQ, bytes inline or over the
Transfer Engine, each message's HMAC keyed with the run token checked there); the endpoints are gathered to the
leader and go out in StepOpen/JoinStep as a list by rank. The leader polls its own receiver and decides for the
whole cell whether a message counts (step_runner.CoreStep: the shard-once rule); then every rank looks for its piece
of the same message (sender, step, version, shards) within a wait, and an all-reduce of "have it, and it fits"
decides: all add, or none does. So a shard is counted once or not at all.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.train.grad_channel import GradChannelError, GradMessage, GradReceiver, GradSender
from gyre_slurm.transfer.engine import TransferError
from gyre_slurm.transfer.weight_parts import RankLink

log = logging.getLogger(__name__)

PIECE_WAIT_S = 10.0  # how long a core rank waits for its piece of a message its leader took
KEEP_PENDING = 32  # pieces a core rank keeps that its leader has not asked for (refused ones age out)

Key = tuple[str, int, int, tuple[int, ...]]


def grad_key(msg: GradMessage) -> Key:
    """What identifies one satellite message across the core's ranks."""
    return msg.sender, int(msg.step), int(msg.version_in), tuple(int(s) for s in msg.shard_ids)


@dataclass(frozen=True)
class GradLink:
    """Where each rank's receiver binds and how peers reach it; `te`: gradient bytes over the Transfer Engine
    (weights.transport mooncake: each rank's own engine), None: inline in the message."""

    bind_host: str
    hosts: tuple[str, ...]  # each rank's address as peers reach it
    te: RankLink | None = None

    def advertised(self, rank: int) -> str:
        if self.bind_host != "0.0.0.0":
            return self.bind_host
        return self.hosts[rank] if rank < len(self.hosts) else self.hosts[0]


def all_have(par, ok: bool) -> bool:
    """Whether every rank of the cell says ok (collective)."""
    if par.world == 1:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=par.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class RankGrads:
    """One rank's side: its receiver and the pieces it holds until its leader asks for them (core), or its sender
    (satellite)."""

    def __init__(self) -> None:
        self.receiver: GradReceiver | None = None
        self.sender: GradSender | None = None
        self._sent_to: tuple[str, str] | None = None
        self._pending: OrderedDict[Key, GradMessage] = OrderedDict()

    # -- the core ---------------------------------------------------------------------------------------------------
    def open(self, token: str, step: int, link: GradLink, rank: int, max_bytes: int) -> str:
        """A receiver for `step` (the one before closed); its endpoint."""
        self.close_receiver()
        agent = link.te.agent(rank) if link.te is not None else None
        self.receiver = GradReceiver(token, link.bind_host, advertise_host=link.advertised(rank), agent=agent,
                                     max_bytes=max_bytes)
        self.receiver.expect(step)
        return self.receiver.endpoint

    @property
    def endpoint(self) -> str:
        assert self.receiver is not None
        return self.receiver.endpoint

    def expect(self, step: int | None) -> None:
        if self.receiver is not None:
            self.receiver.expect(step)

    def poll(self, timeout: float) -> list[GradMessage]:
        """The leader's MessageSource: verified messages, each also kept here for `take`."""
        if self.receiver is None:
            return []
        got = self.receiver.poll(timeout)
        for m in got:
            self._keep(m)
        return got

    def _keep(self, m: GradMessage) -> None:
        self._pending[grad_key(m)] = m
        while len(self._pending) > KEEP_PENDING:
            self._pending.popitem(last=False)

    def take(self, key: Key, wait_s: float) -> GradMessage | None:
        """This rank's piece of message `key`, waiting up to wait_s for it (None: it did not come)."""
        deadline = time.monotonic() + wait_s
        while key not in self._pending and self.receiver is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for m in self.receiver.poll(left):
                self._keep(m)
        return self._pending.pop(key, None)

    def close_receiver(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None
        self._pending.clear()

    # -- a satellite ------------------------------------------------------------------------------------------------
    def send(self, msg: GradMessage, endpoint: str, token: str, link: GradLink | None, rank: int) -> None:
        if self.sender is None or self._sent_to != (endpoint, token):
            self.close_sender(0.0)
            agent = link.te.agent(rank) if link is not None and link.te is not None else None
            self.sender = GradSender(endpoint, token, name=msg.sender, agent=agent)
            self._sent_to = endpoint, token
        self.sender.send(msg)

    def try_send(self, msg: GradMessage, endpoint: str, token: str, link: GradLink | None, rank: int) -> str | None:
        """`send`, with why it failed as a line instead of raised."""
        try:
            self.send(msg, endpoint, token, link, rank)
        except (GradChannelError, TransferError) as e:
            return f"rank {rank}: {e}"
        return None

    def close_sender(self, linger_s: float) -> None:
        if self.sender is not None:
            self.sender.close(linger_s=linger_s)
        self.sender, self._sent_to = None, None

    def close(self, linger_s: float = 0.0) -> None:
        self.close_sender(linger_s)
        self.close_receiver()


def why_not_fits(grads: dict[str, Tensor], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why a piece does not fit this rank's parameters (None: it does)."""
    for name, g in grads.items():
        want = shapes.get(name)
        if want is None:
            return f"unknown parameter {name!r}"
        if tuple(g.shape) != want or not g.is_floating_point():
            return f"parameter {name!r}: gradient {tuple(g.shape)} {g.dtype} does not fit {want}"
    return None


class RankSink:
    """A satellite cell's MessageSink (step_runner.SatelliteStep) to the core rank by rank: each rank of its trainer
    exports and sends its own slices (`send_grads`, a call every rank makes); `exports`: the sink does the export."""

    exports = True

    def __init__(self, trainer, endpoints: list[str], token: str, link: GradLink | None) -> None:
        world = trainer.par.world
        if len(endpoints) != world:
            raise ValueError(f"the core's gradients arrive at {len(endpoints)} rank(s), this satellite has {world}: "
                             "every cell must train with the same train section")
        self.trainer, self.endpoints, self.token, self.link = trainer, list(endpoints), token, link

    def send(self, msg: GradMessage) -> None:
        header = GradMessage(msg.step, msg.version_in, tuple(msg.shard_ids), msg.sender, {}, dict(msg.metrics))
        why = self.trainer.send_grads(header, self.endpoints, self.token, self.link)
        if why is not None:
            raise GradChannelError(why)

    def close(self, linger_s: float = 30.0) -> None:
        self.trainer.close_grads(linger_s)
