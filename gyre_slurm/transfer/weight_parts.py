"""A weight version in parts: one `WeightsHandle` per sending rank of the core's cell, pulled part by part.

A model-parallel core publishes each version slice by slice: every rank that holds a primary copy of some tensors
(train/megatron_trainer.py `publish`) registers its own slices with the Transfer Engine in its own process, in its
own `WeightPublisher`, and says per tensor (a Hugging Face name) how it is cut: `[dim, TP rank, TP size]`, dim -1 for
a tensor sent whole. A whole-model version (the torch backend) is one part without cuts. The handles travel together
as the version's `WeightsRef.parts`.

A receiver pulls the parts one at a time into its `WeightPuller`'s staging buffer (one part's bytes) and takes out
what it serves before the next: full tensors (`pull_full`: the rollout engine, the agent's stage and push paths),
each put together from its TP pieces along its cut; or only the pieces of its own cut (`pull_pieces`: a satellite
rank of the core's layout, which pulls only the parts that hold them). Every part must come at the same version:
where `at_least` lets the puller take a newer version than a replaced one, parts that came at different versions
(the core published again between two of them) are pulled again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weights import WeightPublisher, WeightPuller

WHOLE = -1  # a cut's dim for a tensor sent whole
PART_TRIES = 4  # parts pulled at different versions (at_least, a core publishing meanwhile): pulled again


@dataclass(frozen=True)
class PieceInfo:
    """What a part says about one of its tensors: the Hugging Face name and its cut (dim None: whole)."""

    name: str
    dim: int | None
    tp_rank: int
    tp: int


@dataclass(frozen=True)
class RankLink:
    """What a rank's process needs to publish or pull over the Transfer Engine with an engine of its own (the
    config's weights.protocol, weights.device, bucket size and verify; each rank's address by rank)."""

    hosts: tuple[str, ...]
    protocol: str = "tcp"
    device: str = ""
    bucket_bytes: int = 64 << 20
    verify: bool = False

    def agent(self, rank: int) -> TransferAgent:
        return TransferAgent.shared(self.hosts[rank] if rank < len(self.hosts) else self.hosts[0], self.protocol,
                                    self.device)


def part_pieces(h: WeightsHandle) -> list[PieceInfo]:
    """Each tensor of a part with its cut (a part without cuts: every tensor whole)."""
    names = [row[0] for row in h.tensors]
    if h.cuts is None:
        return [PieceInfo(n, None, 0, 1) for n in names]
    if len(h.cuts) != len(names):
        raise TransferError(f"weights part of rank {h.rank}: {len(h.cuts)} cuts for {len(names)} tensors")
    out = []
    for n, (dim, rank, tp) in zip(names, h.cuts, strict=True):
        if tp < 1 or not 0 <= rank < tp or dim < WHOLE:
            raise TransferError(f"weights part of rank {h.rank}: bad cut {[dim, rank, tp]} of {n!r}")
        out.append(PieceInfo(n, None if dim == WHOLE else dim, rank, tp))
    return out


def publish_part(publisher: WeightPublisher, version: int, pieces: Sequence[tuple[PieceInfo, Tensor]],
                 produce: Callable[[], Iterable[tuple[str, Tensor]]], *, rank: int, layout: Sequence[int],
                 source: str = "") -> WeightsHandle:
    """This rank's part of `version`: `pieces` give each tensor's cut and its shape and dtype (a meta tensor will
    do), `produce()` yields (name, value) in the same order, one at a time (nothing is copied beyond the slot)."""
    values = iter(produce())

    def fill(name: str, view: Tensor) -> None:
        n, t = next(values)
        while n != name:  # an empty tensor has no bytes to fill
            n, t = next(values)
        if tuple(t.shape) != tuple(view.shape):
            raise TransferError(f"{name}: {tuple(t.shape)} produced for a slot of {tuple(view.shape)}")
        view.copy_(t)

    h = publisher.publish(version, [(p.name, t) for p, t in pieces], source=source, fill=fill)
    cuts = [(WHOLE if p.dim is None else p.dim, p.tp_rank, p.tp) for p, _ in pieces]
    publisher.last = h.model_copy(update={"rank": rank, "layout": list(layout), "cuts": cuts})
    return publisher.last


class Assembly:
    """Full tensors put together from the pieces of every part, each copied into its place as it comes."""

    def __init__(self) -> None:
        self.full: dict[str, Tensor] = {}
        self._seen: dict[str, set[int]] = {}
        self._tp: dict[str, int] = {}

    def add(self, p: PieceInfo, t: Tensor) -> None:
        """Copy a piece into its place; a piece that came before (a replica's copy) must be equal, and is skipped."""
        tp = 1 if p.dim is None else p.tp
        seen = self._seen.setdefault(p.name, set())
        if self._tp.setdefault(p.name, tp) != tp:
            raise TransferError(f"{p.name}: pieces of different cuts")
        if p.name not in self.full:
            shape = list(t.shape)
            if p.dim is not None:
                shape[p.dim] *= p.tp
            self.full[p.name] = torch.empty(shape, dtype=t.dtype)
        place = self.full[p.name] if p.dim is None else \
            self.full[p.name].narrow(p.dim, p.tp_rank * t.shape[p.dim], t.shape[p.dim])
        rank = 0 if p.dim is None else p.tp_rank
        if rank in seen:
            if not torch.equal(place, t):
                raise TransferError(f"{p.name}: two parts hold different values of TP piece {rank}")
            return
        place.copy_(t)
        seen.add(rank)

    def done(self) -> dict[str, Tensor]:
        short = sorted(n for n, s in self._seen.items() if len(s) != self._tp[n])
        if short:
            raise TransferError(f"pieces missing from the version's parts: {short[:3]}")
        return self.full


@dataclass
class Pulled:
    """A version pulled in parts: its tensors, the version that came (≥ the one asked where at_least), the
    publisher's source of it, and one report per part (its sending rank in sender_rank)."""

    tensors: dict[str, Tensor]
    version: int
    source: str
    reports: list[TransferReport]

    @property
    def report(self) -> TransferReport:
        """The whole pull as one report (the parts' bytes and seconds added up)."""
        r = self.reports[0]
        return TransferReport(r.transport, self.version, sum(x.nbytes for x in self.reports),
                              sum(x.seconds for x in self.reports), r.receiver, source=self.source)


def _pull_parts(puller: WeightPuller, parts: Sequence[WeightsHandle], at_least: bool,
                take: Callable[[WeightsHandle, dict[str, Tensor]], None], restart: Callable[[], None]) -> Pulled:
    """Each part pulled and handed to `take` (its tensors are views into the staging buffer, valid until the next
    pull); all at one version, else everything again (`restart` first)."""
    if not parts:
        raise TransferError("a weights version without parts")
    for _ in range(PART_TRIES):
        reports: list[TransferReport] = []
        for h in parts:
            tensors, r = puller.pull(h, at_least=at_least)
            if reports and r.version != reports[0].version:
                break
            take(h, tensors)
            reports.append(TransferReport(r.transport, r.version, r.nbytes, r.seconds, r.receiver,
                                          source=r.source, sender_rank=h.rank))
        else:
            return Pulled({}, reports[0].version, reports[0].source, reports)
        restart()
    raise TransferError(f"weights version ≥ {parts[0].version}: its parts came at different versions "
                        f"{PART_TRIES} times (the core publishes faster than they are read)")


def pull_full(puller: WeightPuller, parts: Sequence[WeightsHandle], at_least: bool = False) -> Pulled:
    """Full Hugging Face tensors of a version. One part without cuts: the staging buffer's views (valid until the
    next pull, as WeightPuller.pull's); several: tensors of their own, assembled piece by piece."""
    box: list = [Assembly(), None]

    def take(h: WeightsHandle, tensors: dict[str, Tensor]) -> None:
        if len(parts) == 1 and h.cuts is None:
            box[1] = tensors
            return
        for p in part_pieces(h):
            box[0].add(p, tensors[p.name])

    def restart() -> None:
        box[0] = Assembly()

    got = _pull_parts(puller, parts, at_least, take, restart)
    got.tensors = box[1] if box[1] is not None else box[0].done()
    return got


def pull_pieces(puller: WeightPuller, parts: Sequence[WeightsHandle], wanted: Callable[[PieceInfo], bool],
                prefer: int | None = None) -> Pulled:
    """Only the pieces `wanted` says this receiver serves (copies of their own), from as few parts as the handles
    say hold them: the part of rank `prefer` first, then each other part only for what is still missing (a
    satellite rank of the core's layout takes its own cut of each tensor it holds)."""
    order = sorted(parts, key=lambda h: h.rank != prefer)
    take_from: list[tuple[WeightsHandle, set[str]]] = []
    covered: set[str] = set()
    for h in order:
        here = {p.name for p in part_pieces(h) if wanted(p)} - covered
        if here:
            take_from.append((h, here))
            covered |= here
    names = dict((h.rank, here) for h, here in take_from)
    out: dict[str, Tensor] = {}

    def take(h: WeightsHandle, tensors: dict[str, Tensor]) -> None:
        for n in names[h.rank]:
            out[n] = tensors[n].clone()

    got = _pull_parts(puller, [h for h, _ in take_from], False, take, out.clear)
    got.tensors = out
    return got
