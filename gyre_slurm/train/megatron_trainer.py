"""The Megatron trainer backend (`train.backend: megatron`): the shared GSPO step on Megatron-Core's GPTModel.

The policy trains in Megatron's layout (train/megatron_model.py: local TE-free spec, fused QKV, gate‖up); the
rest of the system speaks Hugging Face. So the trainer keeps a Hugging Face mirror of the weights on the CPU as
`model`: snapshots are saved from it (the folder format TorchTrainer writes), the weight transport publishes it,
a satellite's pull and `load_weights` write into it, and gradient messages use its names and shapes
(`export_grads` / `add_grads` convert, which is exact: the conversion only moves rows). The mirror is refreshed
after every optimizer step; the GPTModel takes the mirror's weights before the next forward whenever the mirror
was written to (its parameters' in-place version counters changed). Cost: one more copy of the weights in host
memory.

What is implemented: TP = PP = DP = 1 (one process; torch.distributed is initialised for it with an in-process
store, gloo on CPU, NCCL on a GPU). Larger sizes are refused in one line. The optimizer is torch's AdamW over
the GPTModel's parameters (Megatron's distributed optimizer and DDP wrapper add nothing at DP = 1).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.config import check_parallel
from gyre_slurm.model.qwen3 import Qwen3Config
from gyre_slurm.train.gspo_trainer import GSPOTrainer
from gyre_slurm.train.megatron_convert import check_supported, hf_to_megatron, megatron_to_hf
from gyre_slurm.train.megatron_model import build_gpt, ensure_process_groups, gpt_state, gpt_target_logprobs
from gyre_slurm.train.torch_trainer import load_policy, load_weights_into, save_policy


class MegatronTrainer(GSPOTrainer):
    """GSPOTrainer's arguments, and the model-parallel sizes (1 each: larger ones are refused)."""

    def __init__(self, model_dir: Path, *args, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 data_parallel: int = 1, **kwargs) -> None:
        check_parallel(tensor_parallel, pipeline_parallel, data_parallel)
        super().__init__(model_dir, *args, **kwargs)

    def _build(self) -> tuple[list[Tensor], int]:
        self.config = Qwen3Config.from_pretrained(self.model_dir)
        check_supported(self.config)
        self.model = load_policy(self.model_dir, "cpu").eval()  # the Hugging Face mirror
        self._mirror = dict(self.model.named_parameters())  # a tied head once, as the embedding
        self._seen: tuple[int, ...] = ()
        ensure_process_groups(self.device)
        self.gpt = build_gpt(self.config).to(self.device)
        self.gpt.eval()  # no dropout anywhere (the configs set it to 0 as well)
        self._gpt = gpt_state(self.gpt)
        self._mirror_to_gpt()
        return list(self._gpt.values()), int(getattr(self.model.config, "pad_token_id", None) or 0)

    # -- the backend's pieces ---------------------------------------------------------------------------------
    def _logprobs(self, input_ids: Tensor, target_mask: Tensor) -> Tensor:
        return gpt_target_logprobs(self.gpt, input_ids, target_mask)

    def _before_pass(self) -> None:
        if self._versions() != self._seen:
            self._mirror_to_gpt()

    def _after_update(self) -> None:
        self._gpt_to_mirror()

    def export_grads(self) -> dict[str, Tensor]:
        """Accumulated gradients by Hugging Face parameter name (as TorchTrainer's: a satellite sends these)."""
        if all(p.grad is None for p in self._gpt.values()):
            return {}
        grads = {n: p.grad.detach() if p.grad is not None else torch.zeros_like(p) for n, p in self._gpt.items()}
        return {n: g.contiguous().clone() for n, g in megatron_to_hf(grads, self.config).items()}

    def add_grads(self, grads: dict[str, Tensor]) -> None:
        """Add another cell's gradients (Hugging Face names; a parameter missing from them adds zero)."""
        if not grads:
            return
        unknown = sorted(set(grads) - set(self._mirror))
        if unknown:
            raise KeyError(f"gradients for unknown parameters {unknown[:3]}")
        full = {n: grads[n] if n in grads else torch.zeros_like(p) for n, p in self._mirror.items()}
        for n, g in hf_to_megatron(full, self.config).items():
            p = self._gpt[n]
            g = g.to(p.device, p.dtype)
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place (parameter objects and optimizer state stay)."""
        load_weights_into(self.model, Path(model_dir))
        self._mirror_to_gpt()

    def _save_weights(self, out_dir: Path, extra: Callable[[Path], None]) -> Path:
        """A Hugging Face snapshot folder (config, safetensors, tokenizer), as TorchTrainer writes it."""
        self._before_pass()  # nothing to do unless the mirror was written to: it is the current weights
        return save_policy(self.model, self.model_dir, out_dir, extra)

    # -- the mirror ---------------------------------------------------------------------------------------------
    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._mirror.values())

    def _mirror_to_gpt(self) -> None:
        self._copy(self._mirror, self._gpt, hf_to_megatron)

    def _gpt_to_mirror(self) -> None:
        self._copy(self._gpt, self._mirror, megatron_to_hf)

    def _copy(self, src: dict[str, Tensor], dst: dict[str, Tensor], convert) -> None:
        with torch.no_grad():
            conv = convert({n: p.detach() for n, p in src.items()}, self.config)
            for n, p in dst.items():
                p.copy_(conv[n])
        self._seen = self._versions()
