"""The Megatron sizes of a cell (TP, PP, DP, EP) and whether they can be laid out: one check that the config and the
trainer share, without torch."""

from __future__ import annotations

PARALLEL_FIELDS = ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel")
MAX_CPU_RANKS = 64  # a CPU cell runs its trainer ranks as processes on its own node(s)
# the gradient all-reduce's flat buffers (train/megatron_parallel.py), as megatron-core DDP's buckets (40M elements):
# the memory plan counts one of them, never a copy of every gradient
ALL_REDUCE_BUCKET_BYTES = 256 << 20


def check_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, data_parallel: int = 1,
                   expert_parallel: int = 1, *, gpus_per_cell: int | None = None, nodes_per_cell: int = 1) -> None:
    """One line for the first Megatron size that cannot be laid out (the config and the trainer both check, without
    torch). gpus_per_cell None: the sizes alone; else also against the cell (0 = CPU cells). A single rank
    (TP = PP = DP = 1) is the one-process trainer and fits any cell."""
    sizes = (tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
    for name, size in zip(PARALLEL_FIELDS, sizes, strict=True):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"train.{name} must be an int >= 1, not {size!r}")
    tp, pp, dp, ep = sizes
    # megatron-core forms expert groups with expert tensor parallel = tp: ep·(dp/ep) expert-data ranks per tp group
    if dp % ep:
        raise ValueError(f"train.expert_parallel ({ep}) must divide train.data_parallel ({dp}): Megatron carves the "
                         f"expert groups out of the data-parallel ranks (expert tensor parallel = tp {tp})")
    ranks = tp * pp * dp
    if gpus_per_cell is None or ranks == 1:
        return
    product = f"train.tensor_parallel·pipeline_parallel·data_parallel ({tp}·{pp}·{dp} = {ranks})"
    if gpus_per_cell == 0:
        if ranks > MAX_CPU_RANKS:
            raise ValueError(f"{product} is more than {MAX_CPU_RANKS} CPU ranks for one CPU cell "
                             "(cluster.gpus_per_cell 0)")
        return
    if ranks != gpus_per_cell:
        raise ValueError(f"{product} must equal cluster.gpus_per_cell ({gpus_per_cell}): one trainer rank per GPU "
                         "of a cell")
    per_node = gpus_per_cell // nodes_per_cell
    if per_node % tp:
        raise ValueError(f"train.tensor_parallel ({tp}) must divide the GPUs of a node (cluster.gpus_per_cell "
                         f"{gpus_per_cell} / nodes_per_cell {nodes_per_cell} = {per_node}): TP stays inside a node")
