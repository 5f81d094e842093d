"""The trainer factory: `train.backend` picks the class, the rest of `train.*` its settings.

Both backends offer the same interface (train/gspo_trainer.py `GSPOTrainer`: train_step, forward_backward,
export_grads / add_grads, optimizer_step, load_weights, save, and `model` in the Hugging Face layout), so the core
and satellite step runners and the node agent use either.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gyre_slurm.config import TrainSection
from gyre_slurm.errors import GyreError
from gyre_slurm.train.gspo_trainer import GSPOTrainer


def trainer_class(backend: str) -> type[GSPOTrainer]:
    """The trainer class of a `train.backend` (imported only when asked for: megatron-core is an extra)."""
    if backend == "torch":
        from gyre_slurm.train.torch_trainer import TorchTrainer

        return TorchTrainer
    if backend == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise GyreError("train.backend: megatron needs megatron-core (pip install -e '.[megatron]')")
        from gyre_slurm.train.megatron_trainer import MegatronTrainer

        return MegatronTrainer
    raise ValueError(f"unknown train.backend {backend!r}")


def make_trainer(model_dir: Path, train: TrainSection, *, seed: int = 0, device: torch.device | str | None = None,
                 resume_optimizer: bool = False, rendezvous=None, reference_dir: Path | None = None) -> GSPOTrainer:
    """resume_optimizer: the core's trainer takes up the optimizer state saved with model_dir's version, if any.
    rendezvous: where a multi-rank cell's ranks meet (train/rank_group.py builds every rank through here).
    reference_dir: version 0, which the KL anchor pulls towards (needed when train.kl_coef > 0)."""
    common = dict(lr=train.lr, weight_decay=train.weight_decay, grad_clip=train.grad_clip,
                  micro_batch_tokens=train.micro_batch_tokens, eps_low=train.eps_low, eps_high=train.eps_high,
                  seed=seed, mode=train.mode, minibatches=train.minibatches, device=device,
                  resume_optimizer=resume_optimizer, lr_warmup_steps=train.lr_warmup_steps)
    if train.kl_coef > 0:
        common.update(kl_coef=train.kl_coef, reference_dir=reference_dir)
    if train.embedding_lr is not None:
        common.update(embedding_lr=train.embedding_lr)
    if train.backend == "megatron":
        common.update(tensor_parallel=train.tensor_parallel, pipeline_parallel=train.pipeline_parallel,
                      data_parallel=train.data_parallel, expert_parallel=train.expert_parallel,
                      rendezvous=rendezvous, precision=train.precision,
                      distributed_optimizer=train.distributed_optimizer, recompute=train.recompute)
    return trainer_class(train.backend)(Path(model_dir), **common)
