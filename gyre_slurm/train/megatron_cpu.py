"""Megatron-Core 0.16.1 on a machine without CUDA: the few places that assume a GPU, answered for the CPU.

megatron-core's model-parallel code runs on gloo as it is, except where it names the CUDA device itself
(measured: TP=2, PP=2 and EP=2 at world 2 within 3e-7 of world 1 with exactly these):
- `torch.cuda.current_device()`: RoPE tables, the TP gathers of `mappings.py`, the MoE router, the pipeline's p2p
  receive buffers and `GlobalMemoryBuffer` allocate on it. Answered with "cpu".
- `torch.cuda.synchronize()`: the pipeline's shape exchange (variable sequence lengths) calls it after its p2p ops;
  gloo's ops are complete when waited on, so it is a no-op.
- `CudaRNGStatesTracker.fork`: swaps the CUDA RNG state around model-parallel regions (dropout, init); here a null
  context (every dropout is 0 and weights come from a checkpoint, so no random numbers are drawn under it).
- `_get_cuda_rng_state` / `_set_cuda_rng_state` (tensor_parallel/random.py): activation recomputation
  (`CheckpointFunction`, train.recompute: full) saves the CUDA RNG state with the CPU one before a layer's forward and
  restores it for the recomputation; with no CUDA there is no such state: None, and setting it is a no-op (the CPU
  state and the tracker's are still saved and restored).
- `pipeline_parallel.schedules` counts tokens into `torch.zeros(..., device="cuda")`: that one call goes to the CPU.
- `LanguageModule.setup_embeddings_and_output_layer` moves the last stage's copy of tied embeddings with `.cuda()`
  before all-reducing it from the first stage (pipeline parallel only): inside that one call `.cuda()` is a no-op.
The caller's own choices that the CPU needs are not here: `batch_p2p_sync=False` (p2p calls
`torch.cuda.synchronize`) and a causal core attention that makes no mask (train/megatron_model.py's SDPA).

`patch_for_cpu()` applies them once per process, and only where CUDA is absent: a GPU process never runs any of it.

Apart from those, and wherever Transformer Engine does not import (CPU or GPU), `answer_missing_te()`: megatron-core
0.16.1's `moe_utils.py` imports `te_general_gemm` only inside its `try: from ...extensions.transformer_engine import`
block, yet the router's `RouterGatingLinearFunction.forward` tests `te_general_gemm is not None` unconditionally: a
NameError without TE. Defined as None there (as `extensions/transformer_engine.py` itself does when TE's GEMM is
missing), the router takes its torch.mm path.
"""

from __future__ import annotations

import contextlib
import types

import torch

_applied = False


class _SchedulesTorch(types.ModuleType):
    """`torch` as pipeline_parallel.schedules sees it: everything torch has, with device="cuda" zeros on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _cuda_is_a_no_op(fn):
    def wrapped(*args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    return wrapped


def patch_for_cpu() -> bool:
    """Apply the CPU answers (idempotent). Returns whether they are in force (False where CUDA is available)."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    answer_missing_te()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    schedules.torch = _SchedulesTorch("torch")
    LanguageModule.setup_embeddings_and_output_layer = _cuda_is_a_no_op(
        LanguageModule.setup_embeddings_and_output_layer)
    _applied = True
    return True


def answer_missing_te() -> None:
    """`moe_utils.te_general_gemm = None` where Transformer Engine did not define it (idempotent; any device)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


__all__ = ["answer_missing_te", "patch_for_cpu"]
