"""Megatron ranks of the cells (pure, no torch): where each trainer rank runs and its parallel coordinates.

A cell runs tensor_parallel·pipeline_parallel·data_parallel trainer ranks, one per GPU (cluster.gpus_per_cell), in
megatron-core's default order "tp-cp-ep-dp-pp": TP fastest, then DP, then PP, so a TP group is the neighbouring
GPUs of one node. Expert groups (expert tensor parallel = tp, megatron-core's default) split each DP group into
expert_parallel parts: the EP coordinate is dp mod expert_parallel. The ranks of a cell fill its nodes in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gyre_slurm.config import RunConfig, TrainSection
from gyre_slurm.launch.layout import expand_nodelist, plan
from gyre_slurm.parallel_sizes import PARALLEL_FIELDS


@dataclass(frozen=True)
class RankPlacement:
    cell: int
    rank: int  # within the cell (Megatron's global rank of the cell's trainer)
    node: str
    gpu: int | None  # local GPU index on the node; None in a CPU cell
    tp: int
    pp: int
    dp: int
    ep: int


def parallel_sizes(train: TrainSection | Mapping[str, int]) -> dict[str, int]:
    """{field: size} of the four PARALLEL_FIELDS from a TrainSection or a mapping (missing sizes are 1)."""
    get = train.get if isinstance(train, Mapping) else lambda f, d: getattr(train, f, d)
    return {f: int(get(f, 1)) for f in PARALLEL_FIELDS}


def cell_ranks(train: TrainSection | Mapping[str, int]) -> int:
    s = parallel_sizes(train)
    return s["tensor_parallel"] * s["pipeline_parallel"] * s["data_parallel"]


def coordinates(rank: int, train: TrainSection | Mapping[str, int]) -> tuple[int, int, int, int]:
    """(tp, pp, dp, ep) of a cell's rank: rank = tp + TP·(dp + DP·pp)."""
    s = parallel_sizes(train)
    tp, dp = s["tensor_parallel"], s["data_parallel"]
    dp_rank = rank // tp % dp
    return rank % tp, rank // (tp * dp), dp_rank, dp_rank % s["expert_parallel"]


def place_ranks(cfg: RunConfig, hosts: list[str]) -> list[RankPlacement]:
    """Every rank of every cell on the allocation's hosts (laid out by launch.layout.plan): a GPU cell's ranks take
    gpus_per_node ranks per node in order; a CPU cell's spread evenly, ceil(ranks / nodes_per_cell) per node."""
    c = cfg.cluster
    agents, ranks = plan(hosts, c.cells, c.nodes_per_cell).agents, cell_ranks(cfg.train)
    per_node = ranks_per_node(cfg)
    out = []
    for cell in range(c.cells):
        nodes = agents[cell * c.nodes_per_cell:(cell + 1) * c.nodes_per_cell]
        for r in range(ranks):
            gpu = r % per_node if c.gpus_per_cell else None
            out.append(RankPlacement(cell, r, nodes[r // per_node], gpu, *coordinates(r, cfg.train)))
    return out


def check_model_fits(train: TrainSection | Mapping[str, int], model_cfg: Mapping[str, Any]) -> None:
    """One line for the first size the model (its Hugging Face config.json, as a dict) cannot be split into:
    heads, KV heads and vocabulary by TP, layers by PP, experts (MoE) by EP."""
    s = parallel_sizes(train)
    m = model_cfg.get("text_config") or model_cfg  # multimodal folders keep the language model's config inside
    heads = m.get("num_attention_heads")
    rules = [("num_attention_heads", heads, "tensor_parallel"),
             ("num_key_value_heads", m.get("num_key_value_heads", heads), "tensor_parallel"),
             ("vocab_size", m.get("vocab_size"), "tensor_parallel"),
             ("num_hidden_layers", m.get("num_hidden_layers"), "pipeline_parallel"),
             ("num_experts", m.get("num_experts", m.get("num_local_experts")), "expert_parallel")]
    for key, value, field in rules:
        if value is not None and int(value) % s[field]:
            raise ValueError(f"the model's {key} ({value}) is not divisible by train.{field} ({s[field]})")


def ranks_per_node(cfg: RunConfig) -> int:
    """A cell's trainer ranks on each of its nodes (the last node may hold fewer on CPU)."""
    return cfg.cluster.gpus_per_node or math.ceil(cell_ranks(cfg.train) / cfg.cluster.nodes_per_cell)


def cell_nodes(cfg: RunConfig, cell: int, env: Mapping[str, str]) -> list[str] | None:
    """The Slurm node names of `cell`'s nodes, in order; None outside Slurm (a local run: every node is here). A
    cell job (`gyre submit`) holds exactly its cell's nodes; one allocation lays them out as launch.layout.plan."""
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    hosts, npc = expand_nodelist(nodelist), cfg.cluster.nodes_per_cell
    if len(hosts) == npc:
        return hosts
    return list(plan(hosts, cfg.cluster.cells, npc).agents[cell * npc:(cell + 1) * npc])


def follower_nodes(cfg: RunConfig, cell: int, env: Mapping[str, str]) -> list[str | None]:
    """Where ranks 1…n-1 of `cell` run: None on the leader's own node (a process it starts), else the Slurm node
    the leader starts it on with srun."""
    nodes, per_node = cell_nodes(cfg, cell, env), ranks_per_node(cfg)
    out: list[str | None] = []
    for r in range(1, cell_ranks(cfg.train)):
        k = r // per_node
        out.append(None if k == 0 or nodes is None else nodes[k])
    return out
