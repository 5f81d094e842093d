"""The Megatron cell's distributed optimizer (`train.distributed_optimizer`): which data-parallel replica keeps which
rows of each tensor's fp32 master and AdamW moments.

A rank's tensors have replicas on the other ranks of its data-parallel group (dense tensors) or expert-data-parallel
group (experts): the groups `megatron_parallel.sync_grads` all-reduces over. As Megatron's distributed optimizer
(megatron/core/optimizer/distrib_optimizer.py) shards its contiguous gradient buffer evenly, the replicas here split
the rank's tensors laid end to end (a fixed order every replica shares) into d equal ranges, each boundary moved to
the nearest row start (`partition_rows`): replica k keeps rows of at most two tensors it shares with a neighbour and
whole tensors in between, 1/d of the elements give or take a row. Each replica keeps the fp32 master (bf16 training;
a copy of the rows in fp32 training where it keeps part of a tensor) and the AdamW moments of its rows only, and
steps them (`Unit`: one row range, one AdamW parameter); the updated weights then go from each owner to the other
replicas (`ShardPlan.share`: per owner, flat buckets). Gradients stay all-reduced in full (gloo has no reduce-scatter;
clipping and `export_grads` read every gradient), so per parameter a rank holds 2 B of bf16 weight, 4 B of fp32 main
gradient and (4 B master + 8 B moments)/d in bf16 (Megatron's 6 + 12/d); 4 + 4 + 8/d in fp32 (+4 B for the rows of
the two tensors a replica shares). Without it (or at d = 1) every replica keeps every row, and replica 0 writes them.

Why not megatron-core's own `DistributedOptimizer`: it shards the contiguous gradient buffers of Megatron's DDP
(distributed/param_and_grad_buffer.py: `reduce_scatter_tensor` and `all_gather_into_tensor` over buckets, on CUDA
streams and `torch.cuda.current_device()` buffers), so it needs that DDP wrapped around the model, replacing this
trainer's gradient path (fp32 main gradients by hook, the all-reduces of sync_grads, gradients exported and added by
name), and it does not run on gloo, which has no reduce-scatter. Why not torch's `ZeroRedundancyOptimizer`: it runs
on gloo, but it partitions whole parameters (a 152k-row embedding is one of them: at DP 64 its owner keeps 13 times
its share), one instance serves one group (two here), and what it partitions and broadcasts are its parameters: given
the fp32 masters, every rank would still keep every master; its state is consolidated on one rank to be saved, where
this cell saves each owner's rows by Hugging Face name (train/optimizer_state.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.train.megatron_parallel import DPGroup, broadcast_owned

Range = tuple[int, int, int]  # (owner's index in its group, first row, row after the last)


def is_expert(name: str) -> bool:
    """A parameter of one expert (replicated over the expert-data-parallel group, not the data-parallel one)."""
    return ".local_experts." in name


def partition_rows(sizes: Sequence[tuple[str, int, int]], parts: int) -> dict[str, tuple[Range, ...]]:
    """Each tensor's row ranges by owner: the tensors (name, rows, elements per row) laid end to end in this order,
    replica k keeping elements [k·N/parts, (k+1)·N/parts), each boundary moved to the nearest row start of the tensor
    it falls in. Ranges are in row order and never empty; a replica's share of the whole is contiguous."""
    if not sizes:
        return {}
    starts, total = [], 0
    for _, rows, width in sizes:
        starts.append(total)
        total += rows * width
    cuts = []  # the boundaries, at row starts
    for k in range(1, parts):
        b = round(k * total / parts)
        i = max(bisect.bisect_right(starts, b) - 1, 0)
        _, rows, width = sizes[i]
        cuts.append(starts[i] + min(rows, round((b - starts[i]) / width)) * width)
    out: dict[str, tuple[Range, ...]] = {}
    for (name, rows, width), start in zip(sizes, starts, strict=True):
        at = sorted({0, rows, *((c - start) // width for c in cuts if start < c < start + rows * width)})
        out[name] = tuple((bisect.bisect_right(cuts, start + lo * width), lo, hi)
                          for lo, hi in zip(at[:-1], at[1:], strict=True))
    return out


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of each of this rank's tensors each replica keeps (not distributed: every replica all of them, and
    replica 0 writes them)."""

    distributed: bool
    ranges: Mapping[str, tuple[Range, ...]]
    dense: DPGroup
    expert: DPGroup

    def group(self, name: str) -> DPGroup:
        return self.expert if is_expert(name) else self.dense

    def mine(self, name: str) -> tuple[int, int] | None:
        """The rows this rank keeps of `name` (one range at most), or None."""
        if not self.distributed:
            return 0, self.ranges[name][-1][2]
        me = self.group(name).index
        return next(((lo, hi) for k, lo, hi in self.ranges[name] if k == me), None)

    def holds(self, name: str) -> bool:
        """This rank keeps the whole tensor's fp32 master and AdamW moments."""
        return len(self.ranges[name]) == 1 and self.mine(name) is not None

    def writes(self, name: str) -> bool:
        """This rank is the one replica that sends the tensor whole (the owner of its first rows)."""
        return self.ranges[name][0][0] == self.group(name).index

    def share(self, tensors: Mapping[str, Tensor]) -> None:
        """Every replica gets its owners' updated rows (collective over both groups; nothing when not distributed)."""
        if not self.distributed:
            return
        for g, expert in ((self.dense, False), (self.expert, True)):
            rows = [(tensors[n][lo:hi], k) for n in tensors if is_expert(n) == expert for k, lo, hi in self.ranges[n]]
            broadcast_owned([t for t, _ in rows], [k for _, k in rows], g)


def plan_shards(shapes: Mapping[str, torch.Size], dense: DPGroup, expert: DPGroup, distributed: bool) -> ShardPlan:
    """The plan for a rank's tensors (local name: shape), in their order (every replica's is the same)."""
    distributed = distributed and max(dense.size, expert.size) > 1
    ranges: dict[str, tuple[Range, ...]] = {}
    for g, kind in ((dense, False), (expert, True)):
        sizes = [(n, s[0], s[1:].numel()) for n, s in shapes.items() if is_expert(n) == kind]
        ranges.update(partition_rows(sizes, g.size) if distributed else {n: ((0, 0, r),) for n, r, _ in sizes})
    return ShardPlan(distributed, ranges, dense, expert)


@dataclass(frozen=True)
class Unit:
    """Rows [lo, hi) of one tensor that this rank's AdamW steps, as `param`: the model's parameter or its fp32 master
    where the rank keeps the whole tensor (`whole`), else an fp32 copy of the rows whose gradient is a view of the
    main gradient's rows (`link_grads`)."""

    name: str
    lo: int
    hi: int
    param: Tensor
    whole: bool


def make_units(plan: ShardPlan, weights: Mapping[str, Tensor], main: Mapping[str, Tensor]) -> list[Unit]:
    units = []
    for n, w in weights.items():
        mine = plan.mine(n)
        if mine is None:
            continue
        lo, hi = mine
        whole = plan.holds(n)
        param = main[n] if whole else torch.nn.Parameter(w.detach()[lo:hi].float().clone())
        units.append(Unit(n, lo, hi, param, whole))
    return units


def written(plan: ShardPlan, units: Sequence[Unit]) -> list[Unit]:
    """The units whose rows this rank writes: each row of a group's tensors once (not distributed: replica 0's)."""
    return [u for u in units if plan.distributed or plan.writes(u.name)]


def link_grads(units: Sequence[Unit], main: Mapping[str, Tensor]) -> None:
    """Each row unit's gradient: its rows of the tensor's main gradient (after the all-reduces and clipping)."""
    for u in units:
        if not u.whole:
            g = main[u.name].grad
            u.param.grad = None if g is None else g[u.lo:u.hi]


def units_to_weights(units: Sequence[Unit], weights: Mapping[str, Tensor]) -> None:
    """The model's weights from what AdamW stepped (a bf16 weight rounds its fp32 master)."""
    for u in units:
        if u.param is not weights[u.name]:
            weights[u.name][u.lo:u.hi].copy_(u.param)


def weights_to_units(units: Sequence[Unit], weights: Mapping[str, Tensor], name: str, t: Tensor) -> None:
    """Newly loaded values `t` of tensor `name` into the masters (or row copies) this rank keeps of it."""
    for u in units:
        if u.name == name and u.param is not weights[name]:
            u.param.copy_(t[u.lo:u.hi])


def stand_in_master(p: Tensor) -> Tensor:
    """The master of a parameter this rank does not keep whole: fp32 and of its shape, but a view of one element (no
    storage of its own), so that its .grad can still hold the full fp32 main gradient. A view, not a Parameter:
    whatever copies a trainer's tensors elsewhere leaves views alone (train/rank_group.py's release_memory), where a
    copy of it would be the full tensor."""
    return torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)


def state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of AdamW's moments, bytes of the tensors it steps) on this rank."""
    moments = sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
                  if isinstance(t, Tensor) and t.dim() > 0)
    params = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    return moments, params
