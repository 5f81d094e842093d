"""Model-parallel sizes of the Megatron backend, checked without importing torch (the config uses this too)."""

from __future__ import annotations

PARALLEL_FIELDS = ("tensor_parallel", "pipeline_parallel", "data_parallel")


def check_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, data_parallel: int = 1) -> None:
    """One line for the first size that is not implemented: TP = PP = DP = 1 is what the backend runs."""
    for name, size in zip(PARALLEL_FIELDS, (tensor_parallel, pipeline_parallel, data_parallel), strict=True):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"train.{name} must be an int >= 1, not {size!r}")
        if size > 1:
            raise ValueError(f"train.{name} > 1 is not supported yet (the Megatron backend runs TP = PP = DP = 1)")
