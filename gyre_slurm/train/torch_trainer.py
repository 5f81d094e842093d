"""The torch trainer: GSPO over multi-segment runs on a Hugging Face causal LM (the embedded default backend).

The step itself (packing, pre-pass, per-run-mean loss accumulation, mini-batches, decoupled mode) is the shared
`GSPOTrainer` (train/gspo_trainer.py); this backend runs it on a transformers model in place, so gradients and
weights carry Hugging Face names as they are. Also the model helpers the warm-up and the weight transport use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.train.gspo_trainer import GSPOTrainer
from gyre_slurm.train.gspo_trainer import default_device as default_device  # re-exported (warm-up, tools)
from gyre_slurm.train.gspo_trainer import pack_micro_batches as pack_micro_batches  # re-exported (tests, tools)

# Files that save_pretrained writes itself, or weights: never copied from the source folder.
_MODEL_FILES = {"config.json", "generation_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".msgpack", ".h5")


# --- model helpers (shared with the warm-up) ------------------------------------------------------------------
def load_policy(model_dir: Path, device: torch.device | str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from gyre_slurm.model import quiet_transformers

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(Path(model_dir), dtype=torch.float32)
    return model.to(device or default_device())


def target_logprobs(model: torch.nn.Module, input_ids: Tensor, target_mask: Tensor) -> Tensor:
    """log π(token_i | tokens_<i) at every position i where target_mask[b, i], in row-major order.

    Right padding needs no attention mask: with causal attention real positions never see the padding.
    The output head runs only on the positions that predict a target; agent trajectories are mostly
    context, so this skips most of the vocabulary-sized logits.
    """
    pred = target_mask[:, 1:]
    inputs = input_ids[:, :-1]
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        logits = model(input_ids=inputs, use_cache=False).logits[pred].float()  # head has extra maths: use it
    else:
        hidden = model.get_decoder()(input_ids=inputs, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden[pred]).float()
    targets = input_ids[:, 1:][pred]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def load_weights_into(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy a snapshot folder's weights into `model` in place (its parameter objects stay)."""
    model.load_state_dict(load_policy(Path(model_dir), "cpu").state_dict())


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy everything but weights and model config (tokenizer, chat template, metadata) so out_dir stands alone."""
    copied = []
    for p in sorted(Path(src_dir).iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in _MODEL_FILES or p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(p, Path(out_dir) / p.name)
        copied.append(p.name)
    return copied


def save_policy(model: torch.nn.Module, src_dir: Path, out_dir: Path,
                extra: Callable[[Path], None] | None = None) -> Path:
    """Hugging Face folder (config + safetensors + tokenizer; `extra` adds to it), written beside out_dir then
    renamed into place, so a crash never leaves a half-written snapshot under the final name."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer_files(src_dir, tmp)
        if extra is not None:
            extra(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class TorchTrainer(GSPOTrainer):
    def _build(self) -> tuple[list[Tensor], int]:
        self.model = load_policy(self.model_dir, self.device)
        # No dropout: the policy being optimised is the one the engine samples, and the pre-pass must agree
        # with the gradient pass.
        self.model.eval()
        return [p for p in self.model.parameters() if p.requires_grad], \
            int(getattr(self.model.config, "pad_token_id", None) or 0)

    def _logprobs(self, input_ids: Tensor, target_mask: Tensor) -> Tensor:
        return target_logprobs(self.model, input_ids, target_mask)

    def _embedding_params(self) -> list[Tensor]:
        heads = (self.model.get_input_embeddings(), self.model.get_output_embeddings())
        return list({id(m.weight): m.weight for m in heads if m is not None}.values())  # tied: one tensor

    def _build_reference(self, reference_dir: Path) -> torch.nn.Module:
        ref = load_policy(reference_dir, self.device).eval()
        ref.requires_grad_(False)
        return ref

    def _reference_logprobs(self, micros) -> list[Tensor]:
        with torch.no_grad():
            return [target_logprobs(self.reference, mb.input_ids, mb.target_mask) for mb in micros]

    def grad_shapes(self) -> dict[str, tuple[int, ...]]:
        """The gradients another cell may send: parameter names and shapes (step_runner.CoreStep checks them)."""
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def export_grads(self) -> dict[str, Tensor]:
        """Accumulated gradients by parameter name (a satellite sends these to the core)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def add_grads(self, grads: dict[str, Tensor]) -> None:
        """Add another cell's accumulated gradients (same loss normaliser, so contributions simply sum)."""
        named = dict(self.model.named_parameters())
        for n, g in grads.items():
            p = named[n]
            g = g.to(p.device, p.dtype)
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place (keeps the parameter objects, so the optimizer state stays attached)."""
        load_weights_into(self.model, Path(model_dir))

    def _save_weights(self, out_dir: Path, extra: Callable[[Path], None]) -> Path:
        return save_policy(self.model, self.model_dir, out_dir, extra)
