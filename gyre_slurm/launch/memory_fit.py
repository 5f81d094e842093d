"""Whether a run config fits its GPUs: the memory plan of both sides of a cell (launch/memory_plan.py's trainer, and
the rollout engine), and a one-line refusal that names a change that makes it fit, found by planning the candidates.

Pure: the model's shape and the config in, a plan and maybe a line out. GPU cells only are refused (cluster.
gpus_per_cell > 0, against cluster.gpu_memory_gb); CPU cells get the plan per rank, for information.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from gyre_slurm.config import RunConfig
from gyre_slurm.launch.memory_plan import GiB, TrainerLayout, TrainerMemory, trainer_layout, trainer_memory
from gyre_slurm.launch.model_shape import ModelShape
from gyre_slurm.sglang_gpus import sglang_flags


@dataclass(frozen=True)
class EngineMemory:
    """A rollout engine's memory per GPU (SGLang) or in host memory (the embedded engine)."""

    kind: str  # sglang | embedded
    weights: int
    kv_per_token: int
    kv_pool: int  # bytes of KV cache: SGLang's share after its weights; the embedded engine: one context's
    context: int  # the longest context a run asks for (context_length, else max_position_embeddings)
    tp: int
    mem_fraction: float

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_pool) // self.kv_per_token

    @property
    def fits(self) -> bool:
        return self.kv_pool > 0 and self.kv_tokens >= self.context

    @property
    def total(self) -> int:
        return self.weights + max(0, self.kv_pool)


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int | None  # one GPU's memory; None: CPU cells
    layout: TrainerLayout
    trainer: TrainerMemory
    engine: EngineMemory | None

    @property
    def trainer_fits(self) -> bool:
        return self.gpu_bytes is None or self.trainer.total <= self.gpu_bytes


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def context_length(shape: ModelShape, cfg: RunConfig) -> int:
    flags = sglang_flags(cfg.sglang.extra_args)
    return int(flags.get("context_length") or shape.max_positions)


def engine_memory(shape: ModelShape, cfg: RunConfig, tp: int | None = None,
                  fraction: float | None = None) -> EngineMemory | None:
    """SGLang's weights and KV pool per GPU at sglang.tp_size and mem_fraction_static (or the ones given; pp_size from
    extra_args); the embedded engine's fp32 weights and one context's KV in host memory. None without an engine."""
    engine = cfg.cluster.engine
    if engine == "embedded":  # started without --context-length: the model's own
        kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 4
        return EngineMemory("embedded", 4 * shape.count(), kv, kv * shape.max_positions, shape.max_positions, 1, 0.0)
    if engine != "sglang":
        return None
    tp = tp or cfg.sglang.tp_size
    fraction = fraction or cfg.sglang.mem_fraction_static
    pp = int(sglang_flags(cfg.sglang.extra_args).get("pp_size") or 1)
    weights = 2 * shape.count() // (tp * pp)
    kv = 2 * (shape.layers // pp) * max(1, shape.kv_heads // tp) * shape.head_dim * 2
    pool = int(fraction * cfg.cluster.gpu_memory_gb * GiB) - weights
    return EngineMemory("sglang", weights, kv, pool, context_length(shape, cfg), tp, fraction)


def plan_memory(shape: ModelShape, cfg: RunConfig) -> MemoryPlan:
    lay = trainer_layout(cfg)
    gpu = int(cfg.cluster.gpu_memory_gb * GiB) if cfg.cluster.gpus_per_cell else None
    return MemoryPlan(gpu, lay, trainer_memory(shape, lay), engine_memory(shape, cfg))


# -- refusals and what would make them fit ---------------------------------------------------------------------
def fit_problem(shape: ModelShape, cfg: RunConfig) -> str | None:
    """One line when a GPU cell's trainer or SGLang engine does not fit: the need, the GPU's size, the largest term
    and a change that makes it fit (None when both fit, or for CPU cells)."""
    plan = plan_memory(shape, cfg)
    if plan.gpu_bytes is None:
        return None
    gpu = plan.gpu_bytes
    if not plan.trainer_fits:
        name, size = plan.trainer.largest()
        return (f"the trainer needs {gib(plan.trainer.total)} per GPU of {gpu / GiB:g} (largest: {name} "
                f"{gib(size)}): {_trainer_fix(shape, cfg, plan)}")
    e = plan.engine
    if e is not None and e.kind == "sglang" and not e.fits:
        if e.kv_pool <= 0:
            why = (f"its weights take {gib(e.weights)} per GPU at tp {e.tp}, more than mem_fraction_static "
                   f"{e.mem_fraction:g} of {gpu / GiB:g} GiB")
        else:
            why = (f"its KV cache holds {e.kv_tokens:,} tokens per GPU ({gib(e.kv_pool)} after {gib(e.weights)} of "
                   f"weights), less than one context of {e.context:,}")
        return f"the SGLang engine does not fit: {why}: {_engine_fix(shape, cfg, e)}"
    return None


@dataclass(frozen=True)
class _Candidate:
    lay: TrainerLayout
    nodes: int  # the factor on cluster.nodes_per_cell (and gpus_per_cell)
    changes: int
    rank: tuple[int, ...]  # which option of each kind, the preferred first

    def says(self, cfg: RunConfig, base: TrainerLayout) -> str:
        lay, c, out = self.lay, cfg.cluster, []
        if lay.recompute != base.recompute:
            out.append(f"train.recompute: {lay.recompute}")
        if lay.distributed_optimizer != base.distributed_optimizer:
            out.append("train.distributed_optimizer: true")
        if self.nodes > 1:
            out.append(f"cluster.nodes_per_cell: {c.nodes_per_cell * self.nodes}, cluster.gpus_per_cell: "
                       f"{c.gpus_per_cell * self.nodes}")
        out += [f"train.{name}: {getattr(lay, attr)}" for attr, name in (
            ("pp", "pipeline_parallel"), ("dp", "data_parallel"), ("ep", "expert_parallel"),
            ("micro_batch_tokens", "micro_batch_tokens")) if getattr(lay, attr) != getattr(base, attr)]
        return ", ".join(out)


def _options(shape: ModelShape, cfg: RunConfig, lay: TrainerLayout) -> list[list[dict]]:
    """The changes of each kind, in the order they are preferred: recomputation, the optimizer's sharding, more expert
    or pipeline parallel over the same ranks, more nodes per cell, smaller micro-batches (the largest first)."""
    recompute = [{"recompute": "full"}] if lay.recompute != "full" else []
    sharded = [{"distributed_optimizer": True}] if not lay.distributed_optimizer and lay.dp > 1 \
        and cfg.train.backend == "megatron" else []
    if shape.experts:  # MoE trains with TP = PP = 1: experts over more of the DP ranks
        parallel = [{"ep": ep} for ep in range(lay.ep + 1, lay.dp + 1) if lay.dp % ep == 0 and shape.experts % ep == 0]
    else:
        ranks = lay.pp * lay.dp
        parallel = [{"pp": pp, "dp": ranks // pp} for pp in range(lay.pp + 1, ranks + 1)
                    if ranks % pp == 0 and shape.layers % pp == 0 and (ranks // pp) % lay.ep == 0]
    nodes = [{"nodes": k} for k in (2, 4, 8)] if cfg.cluster.gpus_per_cell and cfg.train.backend == "megatron" else []
    micro = [{"micro_batch_tokens": lay.micro_batch_tokens >> i} for i in range(1, 8)
             if lay.micro_batch_tokens >> i >= 1024]
    return [recompute, sharded, parallel, nodes, micro]


def _candidates(shape: ModelShape, cfg: RunConfig, lay: TrainerLayout) -> list[_Candidate]:
    """Every combination of at most one change of each kind, fewest changes first, then the preferred kinds."""
    kinds = _options(shape, cfg, lay)
    out = []
    for picks in itertools.product(*[[None, *range(len(k))] for k in kinds]):
        new, k = lay, 1
        for kind, pick in zip(kinds, picks, strict=True):
            if pick is None:
                continue
            change = dict(kind[pick])
            k = change.pop("nodes", k)
            new = replace(new, **change)
        if k > 1:
            ep = new.ep * k if shape.experts and shape.experts % (new.ep * k) == 0 else new.ep
            new = replace(new, dp=new.dp * k, ep=ep)
        rank = tuple(1 << 20 if p is None else p for p in picks)  # a change of a kind ranks before none of it
        out.append(_Candidate(new, k, sum(p is not None for p in picks), rank))
    return sorted(out, key=lambda c: (c.changes, c.rank))


def _trainer_fix(shape: ModelShape, cfg: RunConfig, plan: MemoryPlan) -> str:
    """The first candidate that fits; else the one that needs the least on the same nodes, with the GPU it needs."""
    best: tuple[int, _Candidate] | None = None
    for cand in _candidates(shape, cfg, plan.layout):
        need = trainer_memory(shape, cand.lay).total
        if cand.changes and need <= plan.gpu_bytes:
            return f"set {cand.says(cfg, plan.layout)} (then {gib(need)})"
        if cand.nodes == 1 and (best is None or need < best[0]):  # a larger GPU, on the nodes the cell has
            best = (need, cand)
    need, cand = best
    gpu = f"GPUs of at least {need / GiB:.0f} GiB (cluster.gpu_memory_gb: {-(-need // GiB)})"
    return f"set {cand.says(cfg, plan.layout)} and use {gpu}" if cand.changes else f"it needs {gpu}"


def _engine_fix(shape: ModelShape, cfg: RunConfig, e: EngineMemory) -> str:
    """A larger sglang.tp_size (fewer replicas where the cell's GPUs run out), a larger mem_fraction_static, a shorter
    context_length, else the GPU it needs."""
    gpus, dp = cfg.cluster.gpus_per_cell, cfg.sglang.dp_size
    tp = e.tp * 2
    while tp <= gpus and shape.heads % tp == 0:
        got = engine_memory(shape, cfg, tp=tp)
        if got is not None and got.fits:
            fewer = f", sglang.dp_size: {gpus // tp}" if tp * dp > gpus else ""
            return f"set sglang.tp_size: {tp}{fewer} (then KV for {got.kv_tokens:,} tokens)"
        tp *= 2
    for fraction in (0.88, 0.9):
        got = engine_memory(shape, cfg, fraction=fraction)
        if fraction > e.mem_fraction and got is not None and got.fits:
            return f"set sglang.mem_fraction_static: {fraction} (then KV for {got.kv_tokens:,} tokens)"
    if e.kv_pool > 0 and e.kv_tokens >= 1024:
        return f"set sglang.extra_args.context_length: {e.kv_tokens // 1024 * 1024} (what its KV holds)"
    need = (e.weights + e.kv_per_token * e.context) / e.mem_fraction
    return f"it needs GPUs of at least {need / GiB:.0f} GiB (cluster.gpu_memory_gb: {-(-int(need) // GiB)})"
