"""The process side of a model-parallel Megatron cell: its groups, the gradient all-reduces that Megatron's
`finalize_model_grads` would make, the global gradient norm, gathers to the cell's leader, and the pipeline pass.

Every rank of a cell runs the same trainer calls with the same arguments (SPMD; train/rank_group.py drives them
from the node agent). Megatron's groups come from `initialize_model_parallel(tp, pp, ep)` over a torch.distributed
world of tp·pp·dp ranks (gloo on CPU, NCCL on GPUs), in Megatron's default order tp-cp-ep-dp-pp.
What is all-reduced, and over which group (the same as finalize_model_grads without DDP's buckets):
- data parallel: every gradient, SUM (each DP rank's loss already carries the whole step's 1/|R_valid|); expert
  gradients over the expert-data-parallel group;
- tensor parallel: the q/k-norm gradients, SUM (each TP rank normalises only its own heads);
- tied embeddings under PP: the first stage's embedding and the last stage's copy, SUM over the embedding group.
After a step of the distributed optimizer (train/dist_optimizer.py) each replica's updated rows go to the other
replicas of its data-parallel (dense) or expert-data-parallel (experts) group: `dp_groups`, `broadcast_owned`.
The rank with global rank 0 (TP, PP, DP rank 0) is the leader: the one its node agent drives (it holds only its slices).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from gyre_slurm.parallel_sizes import ALL_REDUCE_BUCKET_BYTES
from gyre_slurm.train.megatron_shard import LocalTensor, RankCoords


@dataclass
class Parallel:
    """This process's place in its cell and the groups it talks over."""

    coords: RankCoords
    dp: int
    dp_rank: int
    rank: int
    world: int
    expert_dp_rank: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        return self.coords.tp

    @property
    def pp(self) -> int:
        return self.coords.pp

    def model_overrides(self, dtype: torch.dtype) -> dict:
        """TransformerConfig fields for this cell's shape."""
        out = dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                   expert_model_parallel_size=self.coords.ep)
        if self.pp > 1:  # shapes travel between stages with each micro-batch; p2p on the CPU cannot synchronise CUDA
            # (the dispatcher is unused by a dense model; the default one refuses variable lengths all the same)
            # calculate_per_token_loss: the schedule leaves each micro-batch's loss as GSPO made it (no 1/micro-batches)
            out.update(pipeline_dtype=dtype, variable_seq_lengths=True, batch_p2p_sync=self.device.type == "cuda",
                       moe_token_dispatcher_type="alltoall", calculate_per_token_loss=True)
        return out

    # -- collectives over the whole cell or one group ---------------------------------------------------------------
    def broadcast(self, obj, src: int = 0, group=None):
        """`obj` of global rank `src`, on every rank of `group` (the cell when None)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def from_last_stage(self, obj):
        if self.pp == 1:
            return obj
        from megatron.core import parallel_state as ps

        return self.broadcast(obj, src=ps.get_pipeline_model_parallel_last_rank(),
                              group=ps.get_pipeline_model_parallel_group())

    def gather_to_leader(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on the leader (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world if self.leader else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather_dp(self, obj) -> list:
        """Every DP rank's `obj` (same TP and PP coordinates), in DP order."""
        if self.dp == 1:
            return [obj]
        from megatron.core import parallel_state as ps

        out = [None] * self.dp
        dist.all_gather_object(out, obj, group=ps.get_data_parallel_group())
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # -- gradients -----------------------------------------------------------------------------------------------
    def sync_grads(self, params: dict[str, Tensor], tied_pp: bool) -> None:
        """The all-reduces listed in the module docstring (a missing gradient takes part as zeros)."""
        from megatron.core import parallel_state as ps

        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp > 1:
            dense = [p.grad for n, p in params.items() if ".local_experts." not in n]
            experts = [p.grad for n, p in params.items() if ".local_experts." in n]
            _all_reduce(dense, ps.get_data_parallel_group())
            if ps.get_expert_data_parallel_world_size() > 1:
                _all_reduce(experts, ps.get_expert_data_parallel_group())
        if self.tp > 1:
            _all_reduce([p.grad for n, p in params.items() if "q_layernorm" in n or "k_layernorm" in n],
                        ps.get_tensor_model_parallel_group())
        if tied_pp and self.pp > 1:
            name = "embedding.word_embeddings.weight" if self.coords.first_stage else "output_layer.weight"
            if name in params:
                _all_reduce([params[name].grad], ps.get_embedding_group())

    def dp_groups(self) -> tuple[DPGroup, DPGroup]:
        """The data-parallel group of the dense parameters and the expert-data-parallel group of the experts'
        (the groups `sync_grads` all-reduces over: the replicas of this rank's tensors)."""
        from megatron.core import parallel_state as ps

        if self.world == 1:
            one = DPGroup(1, 0, (0,), None)
            return one, one
        return _dp_group(ps.get_data_parallel_group()), _dp_group(ps.get_expert_data_parallel_group())

    def grad_norm(self, params: dict[str, Tensor], local: list[LocalTensor]) -> float:
        """‖g‖₂ of the whole model: each tensor counted once across TP copies, PP stages, DP and EP replicas."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for lt in local:
            expert = ".local_experts." in lt.name
            if lt.primary and (self.expert_dp_rank if expert else self.dp_rank) == 0:
                g = params[lt.name].grad
                if g is not None:
                    sq += g.double().pow(2).sum()
        if self.world > 1:
            dist.all_reduce(sq)
        return float(sq.sqrt())


@dataclass(frozen=True)
class DPGroup:
    """A group of replicas: its size, this rank's index in it, its members' global ranks, the torch group."""

    size: int
    index: int
    ranks: tuple[int, ...]
    group: object


def _dp_group(group) -> DPGroup:
    ranks = tuple(dist.get_process_group_ranks(group))
    return DPGroup(len(ranks), dist.get_rank(group), ranks, group)


BUCKET_BYTES = 64 << 20  # one broadcast's flat buffer at most (a tensor larger than it goes alone)


def broadcast_owned(tensors: list[Tensor], owners: list[int], g: DPGroup) -> None:
    """Each tensor from the replica that owns it (its index in `g`) to the others, in place: every member passes the
    same list (names, shapes, dtypes). Per owner, flat buckets of at most BUCKET_BYTES."""
    if g.size == 1:
        return
    for k in range(g.size):
        mine = [t for t, o in zip(tensors, owners, strict=True) if o == k]
        for bucket in _buckets(mine):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if k == g.index else \
                torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            dist.broadcast(flat, src=g.ranks[k], group=g.group)
            if k != g.index:
                for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                    t.copy_(part.view_as(t))


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    """Consecutive runs of one dtype and at most BUCKET_BYTES."""
    out: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if not out or out[-1][0].dtype != t.dtype or size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _all_reduce(tensors: list[Tensor], group) -> None:
    """SUM in place, in flat buffers of at most ALL_REDUCE_BUCKET_BYTES (a tensor larger than that goes alone)."""
    bucket: list[Tensor] = []
    size = 0
    for t in tensors:
        if bucket and size + t.numel() * t.element_size() > ALL_REDUCE_BUCKET_BYTES:
            _all_reduce_flat(bucket, group)
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        _all_reduce_flat(bucket, group)


def _all_reduce_flat(tensors: list[Tensor], group) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0], group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


@dataclass(frozen=True)
class Rendezvous:
    """Where a cell's ranks meet (train/rank_group.py picks it): the leader's TCP store, this rank, the world, and
    how long a collective may wait for a peer (a rank killed with -9 fails its peers' next collective, not hangs)."""

    host: str
    port: int
    rank: int
    world: int
    timeout_s: float


def init_parallel(tp: int, pp: int, dp: int, ep: int, device: torch.device,
                  rendezvous: Rendezvous | None = None) -> Parallel:
    """torch.distributed (world tp·pp·dp: the rank group's rendezvous, the env:// variables of a launcher, or one
    in-process rank) and Megatron's model-parallel groups, once per process (teardown_parallel ends them)."""
    from megatron.core import parallel_state as ps

    from gyre_slurm.train.megatron_cpu import patch_for_cpu

    if device.type == "cuda":
        device = bind_cuda_device(device)
    else:
        patch_for_cpu()
    want = tp * pp * dp
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # a bound device: NCCL's communicators are made for this GPU (eagerly), not guessed from the rank
        bound = {"device_id": device} if device.type == "cuda" else {}
        if rendezvous is not None:
            dist.init_process_group(backend, init_method=f"tcp://{rendezvous.host}:{rendezvous.port}",
                                    rank=rendezvous.rank, world_size=rendezvous.world,
                                    timeout=timedelta(seconds=rendezvous.timeout_s), **bound)
        elif want == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bound)
        else:
            dist.init_process_group(backend, **bound)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    if dist.get_world_size() != want:
        raise ValueError(f"tensor_parallel {tp} · pipeline_parallel {pp} · data_parallel {dp} = {want} ranks, but "
                         f"this cell's torch.distributed world has {dist.get_world_size()}")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1 if ep > 1 else None)
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
        raise ValueError("this process already holds Megatron groups of other sizes")
    coords = RankCoords(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp,
                        pp_rank=ps.get_pipeline_model_parallel_rank(), ep=ep,
                        ep_rank=ps.get_expert_model_parallel_rank())
    return Parallel(coords, dp=dp, dp_rank=ps.get_data_parallel_rank(), rank=dist.get_rank(), world=want,
                    expert_dp_rank=ps.get_expert_data_parallel_rank(), device=device)


def bind_cuda_device(device: torch.device | str) -> torch.device:
    """Make this rank's GPU the process's current device, before anything is allocated or a group made: megatron-core
    allocates on `torch.cuda.current_device()` (tensor_parallel/mappings.py, the pipeline's p2p buffers, the MoE
    router), and so do torch's object collectives under NCCL; left alone, every rank of a node would use GPU 0.
    "cuda" without an index: LOCAL_RANK's GPU where a launcher set it, else the current one."""
    device = torch.device(device)
    index = device.index
    if index is None:
        index = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def teardown_parallel() -> None:
    """End this process's Megatron groups and torch.distributed world (a rank group closing; a new one may follow)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the pipeline pass --------------------------------------------------------------------------------------------
def pipeline_pass(gpt, micros: list[tuple[Tensor, Tensor]], loss_of: Callable[[int, Tensor], Tensor], *,
                  stage_logprobs: Callable, forward_only: bool) -> None:
    """Megatron's 1F1B schedule over the micro-batches (input_ids, target_mask): the last stage turns each one's
    target log-probs into loss_of(k, logp) (its backward runs through every stage unless forward_only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micros:
        return
    feed = iter(enumerate(micros))

    def step(data_iterator, model):
        k, (ids, mask) = next(data_iterator)
        return stage_logprobs(model, ids, mask), partial(_loss, k)

    def _loss(k: int, logp: Tensor):
        return loss_of(k, logp), torch.ones((), dtype=torch.int), {}

    get_forward_backward_func()(
        forward_step_func=step, data_iterator=feed, model=[gpt], num_microbatches=len(micros),
        seq_length=max(ids.shape[1] for ids, _ in micros), micro_batch_size=max(ids.shape[0] for ids, _ in micros),
        forward_only=forward_only)
