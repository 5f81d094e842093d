"""A model-parallel cell's versions over the Transfer Engine, slice by slice (the parts of transfer/weight_parts.py).

Publishing: every rank that sends some tensors (`MegatronTrainer._senders`: among a tensor's DP replicas the one
that keeps its master, DP rank 0 without the distributed optimizer) copies the Hugging Face slices of its sender
tensors into its own publisher's slot, one local tensor split at a time, and says how each is cut; the handles are
gathered to the leader, which returns them as the version's parts. Nobody holds more than its own slices (the slot)
and one split tensor. A part also carries its rank's copies (a whole tensor such as a norm on TP rank > 0, the last
stage's copy of a tied embedding), so that a satellite rank finds everything it holds in its twin's part; whoever
puts full tensors together takes each piece once.

Loading (a satellite, whose cell has the core's layout: every cell trains with the same train section): each rank
pulls the part of the core rank with its own coordinates (its global rank) and, for what that one lacks (tensors
whose master a DP peer keeps, experts from other EP ranks' parts), only the parts that hold them; it loads those
pieces into its slices, no gather. Parts of another layout are refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.train.megatron_shard import LocalTensor, RankCoords
from gyre_slurm.train.slice_snapshot import iter_pieces, plan_pieces
from gyre_slurm.transfer.engine import TransferError
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weight_parts import PieceInfo, RankLink, publish_part, pull_pieces
from gyre_slurm.transfer.weights import WeightPublisher, WeightPuller


def layout_of(par) -> list[int]:
    """[tp, pp, dp, ep] of a cell (`par`: train/megatron_parallel.Parallel)."""
    return [par.tp, par.pp, par.dp, par.coords.ep]


class SliceLink:
    """One rank's publisher and puller (its own Transfer Engine, made at first use from the call's RankLink)."""

    def __init__(self) -> None:
        self.publisher: WeightPublisher | None = None
        self.puller: WeightPuller | None = None

    def publish(self, par, senders: Sequence[LocalTensor], slices: dict[str, Tensor], version: int,
                link: RankLink, source: str = "") -> WeightsHandle | None:
        """This rank's part of `version` (None: it sends nothing); published once per version."""
        pieces = plan_pieces(par.coords, senders, slices, copies=True)
        if not pieces:
            return None
        if self.publisher is None:
            self.publisher = WeightPublisher(link.agent(par.rank), bucket_bytes=link.bucket_bytes,
                                             verify=link.verify)
        last = self.publisher.last
        if last is not None and last.version == version and last.cuts is not None:
            return last
        meta = [(PieceInfo(p.name, p.dim, p.tp_rank, p.tp), torch.empty(p.shape, dtype=p.dtype, device="meta"))
                for p in pieces]
        return publish_part(self.publisher, version, meta,
                            lambda: ((p.name, t) for p, t in iter_pieces(pieces, senders, slices)),
                            rank=par.rank, layout=layout_of(par), source=source)

    def pull(self, par, local: Sequence[LocalTensor], parts: Sequence[WeightsHandle], link: RankLink,
             receiver: str) -> tuple[dict[str, Tensor], list[TransferReport]]:
        """This rank's own cut of every Hugging Face tensor it holds, from the parts that hold it."""
        mine = layout_of(par)
        for h in parts:
            if h.layout != mine:
                raise ValueError(f"weights version {h.version} comes cut for [tensor, pipeline, data, expert] "
                                 f"parallel {h.layout or [1, 1, 1, 1]}, this cell is {mine} (every cell must train "
                                 "with the same train section)")
        names = {n for lt in local for n in lt.map.hf}
        c: RankCoords = par.coords

        def wanted(p: PieceInfo) -> bool:
            return p.name in names and (p.dim is None or p.tp_rank == c.tp_rank)

        if self.puller is None:
            self.puller = WeightPuller(link.agent(par.rank), receiver)
        got = pull_pieces(self.puller, parts, wanted, prefer=par.rank)
        missing = sorted(names - set(got.tensors))
        if missing:
            raise ValueError(f"weights version {parts[0].version}: no part holds this rank's piece of {missing[:3]}")
        return got.tensors, got.reports

    def try_pull(self, par, local: Sequence[LocalTensor], parts: Sequence[WeightsHandle], link: RankLink,
                 receiver: str) -> tuple[dict[str, Tensor] | None, list[TransferReport], str | None]:
        """`pull`, with what went wrong as a line (rank, error) instead of raised."""
        try:
            pieces, reports = self.pull(par, local, parts, link, receiver)
        except (TransferError, ValueError) as e:
            return None, [], f"rank {par.rank}: {e}"
        return pieces, reports, None

    def close(self) -> None:
        for x in (self.publisher, self.puller):
            if x is not None:
                x.close()
        self.publisher = self.puller = None
