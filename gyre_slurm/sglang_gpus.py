"""Which GPUs of a node an SGLang server's ranks take, and which one is left for the node agent's push rank.

SGLang (0.5.23: managers/data_parallel_controller.py `launch_tensor_parallel_group`, weight_cache/protocol.py
`compute_local_gpu_id`) puts the rank (pp_rank, tp_rank) of a node on GPU base_gpu_id + (pp_rank % pp_per_node) *
tp_per_node + (tp_rank % tp_per_node) * gpu_id_step, with --base-gpu-id 0 and --gpu-id-step 1 by default; a data-
parallel replica without dp attention starts tp_size * pp_size * gpu_id_step further on. The push path (one
weight-update rank of its own, NCCL) runs only with dp attention and without pipeline stages (config.py refuses the
rest), so the server takes tp_size / nodes_per_cell GPUs of each node. NCCL refuses a communicator with two ranks on
one GPU ("Duplicate GPU detected", ncclInvalidUsage; NVIDIA/nccl#1241): the agent's rank must sit on another one.
"""

from __future__ import annotations

from typing import Any


def sglang_flags(extra_args: dict[str, Any]) -> dict[str, Any]:
    """sglang.extra_args with the keys as SGLang's attribute names (no dashes)."""
    return {k.strip().lstrip("-").replace("-", "_"): v for k, v in extra_args.items()}


def sglang_node_gpus(tp_size: int, nodes_per_cell: int, extra_args: dict[str, Any]) -> list[int]:
    """The GPU ids a push-capable SGLang server's ranks take on each of its nodes."""
    flags = sglang_flags(extra_args)
    base, step = int(flags.get("base_gpu_id") or 0), int(flags.get("gpu_id_step") or 1)
    per_node = max(1, tp_size // nodes_per_cell)
    return [base + i * step for i in range(per_node)]


def push_gpu(gpus_per_node: int, tp_size: int, nodes_per_cell: int, extra_args: dict[str, Any]) -> int | None:
    """The first GPU of the node that SGLang does not use (the push rank's device), or None when it uses them all."""
    used = set(sglang_node_gpus(tp_size, nodes_per_cell, extra_args))
    return next((g for g in range(gpus_per_node) if g not in used), None)


__all__ = ["push_gpu", "sglang_flags", "sglang_node_gpus"]
