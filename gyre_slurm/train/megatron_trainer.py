"""The Megatron trainer backend (`train.backend: megatron`): the shared GSPO step on Megatron-Core's GPTModel, in
one process or over a cell's tensor-, pipeline-, data- and expert-parallel ranks.

The policy trains in Megatron's layout (train/megatron_model.py: local TE-free spec, fused QKV, gate‖up); the rest
of the system speaks Hugging Face. So the cell's leader (global rank 0) keeps a Hugging Face mirror of the weights
on the CPU as `model`: snapshots are saved from it, the weight transport publishes it, a satellite's pull and
`load_weights` write into it, and gradient messages use its names and shapes (`export_grads` / `add_grads`). After
every optimizer step the ranks' slices are gathered into the mirror (train/megatron_shard.py says who holds what);
before a pass, a mirror that was written to (its parameters' in-place version counters changed) is cut into every
rank's slices again. Other ranks hold only their own slices: each reads them straight from the checkpoint's
safetensors files (`folder_reader`), never a full copy.

Model parallelism (train/megatron_parallel.py): TP on the linear layers inside Megatron; PP through Megatron's 1F1B
schedule over the step's micro-batches (the GSPO loss on the last stage; its sums go to the other stages after);
DP by cutting each forward_backward's batch run-aligned into dp parts that share the step's normaliser, gradients
all-reduced (SUM) before they are used. Every rank is called with the same arguments (SPMD). The optimizer is
torch's AdamW over each rank's own parameters (the same update Megatron's DDP + optimizer make, without buckets);
its state is saved per rank in each version's folder (`optimizer.rank{r}-of-{world}.pt`), so a cell of the same
shape resumes exactly.

Precision (`precision`, the config's train.precision): fp32, or Megatron's bf16 mixed precision as its
`Float16OptimizerWithFloat16Params` and DDP make it (megatron/core/optimizer/optimizer.py,
distributed/distributed_data_parallel.py): bf16 parameters and activations; an fp32 master copy of each parameter
(`_main`) whose `.grad` is the fp32 main gradient — each backward's bf16 gradient is added into it and dropped, so
micro-batches accumulate in fp32 —; clipping, the gradient all-reduces, export/add_grads and AdamW (fp32 moments)
work on the masters, and the bf16 parameters are copied from them after each step. Log-probs and the GSPO loss are
fp32 (the head's logits are upcast before the log-softmax). The mirror, hence every snapshot and published version,
holds the masters; the optimizer file holds them too, so a resume is exact. "auto": bf16 on CUDA, fp32 elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
from gyre_slurm.parallel_sizes import check_parallel
from gyre_slurm.train.batch import TrainBatch
from gyre_slurm.train.gspo_trainer import OPTIMIZER_FILE, GSPOTrainer
from gyre_slurm.train.megatron_convert import check_supported, tensor_maps
from gyre_slurm.train.megatron_model import build_gpt, gpt_state, gpt_target_logprobs, stage_target_logprobs
from gyre_slurm.train.megatron_parallel import Parallel, Rendezvous, init_parallel, pipeline_pass
from gyre_slurm.train.megatron_shard import (
    assemble,
    folder_reader,
    hf_pieces,
    local_state,
    local_tensors,
    state_reader,
)
from gyre_slurm.train.metrics import merge_metrics
from gyre_slurm.train.shards import split_indices, subset
from gyre_slurm.train.torch_trainer import load_policy, load_weights_into, save_policy

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MegatronTrainer(GSPOTrainer):
    """GSPOTrainer's arguments, the cell's model-parallel sizes (world = tp·pp·dp ranks) and the training precision
    ("fp32", "bf16" or "auto": bf16 on CUDA; `self.precision` is the one in force)."""

    def __init__(self, model_dir: Path, *args, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 data_parallel: int = 1, expert_parallel: int = 1, rendezvous: Rendezvous | None = None,
                 precision: str = "auto", **kwargs) -> None:
        check_parallel(tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        if precision not in ("auto", *PRECISIONS):
            raise ValueError(f"precision must be auto, fp32 or bf16, not {precision!r}")
        self.precision = precision
        self._sizes = (tensor_parallel, pipeline_parallel, data_parallel, expert_parallel)
        self._rendezvous = rendezvous  # where this cell's ranks meet (train/rank_group.py); None: env:// or world 1
        self._pending = False  # gradients accumulated here and not yet all-reduced
        super().__init__(model_dir, *args, **kwargs)

    def _build(self) -> tuple[list[Tensor], int]:
        self.config = Qwen3Config.from_pretrained(self.model_dir)
        check_supported(self.config)
        self.par: Parallel = init_parallel(*self._sizes, self.device, self._rendezvous)
        self.device = self.par.device  # a GPU with its index, bound to this process
        if self.precision == "auto":
            self.precision = "bf16" if self.device.type == "cuda" else "fp32"
        dtype = PRECISIONS[self.precision]
        c = self.par.coords
        self._local = local_tensors(self.config, c)
        self.gpt = build_gpt(self.config, dtype, pre_process=c.first_stage, post_process=c.last_stage,
                             **self.par.model_overrides(dtype)).to(self.device)
        self.gpt.eval()  # no dropout anywhere (the configs set it to 0 as well)
        self._gpt = gpt_state(self.gpt)
        self._main = self._gpt if dtype == torch.float32 else _main_params(self._gpt)
        if set(self._gpt) != {lt.name for lt in self._local}:
            raise RuntimeError(f"GPTModel parameters {sorted(set(self._gpt) ^ {lt.name for lt in self._local})[:4]} "
                               "differ from the shard plan")
        self.model = _load_mirror(self.model_dir, self.config) if self.par.leader else None
        self._mirror = dict(self.model.named_parameters()) if self.model is not None else {}
        self._load_slices(folder_reader(self.model_dir, c))
        pad = json.loads((self.model_dir / "config.json").read_text()).get("pad_token_id")
        return list(self._main.values()), int(pad or 0)

    # -- the backend's pieces ---------------------------------------------------------------------------------
    def _logprobs(self, input_ids: Tensor, target_mask: Tensor) -> Tensor:
        return gpt_target_logprobs(self.gpt, input_ids, target_mask)

    def _grad_micros(self, micros, loss_of) -> None:
        if self._experts_across_dp():
            return self._paired_passes(micros, loss_of, grad=True)
        if self.par.pp == 1:
            return super()._grad_micros(micros, loss_of)
        pipeline_pass(self.gpt, micros, loss_of, stage_logprobs=stage_target_logprobs, forward_only=False)

    def _no_grad_logprobs(self, micros: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        if self.par.pp == 1 and not self._experts_across_dp():
            return super()._no_grad_logprobs(micros)
        out: list[Tensor] = [torch.zeros(0)] * len(micros)

        def keep(k: int, logp: Tensor) -> Tensor:
            out[k] = logp.detach()
            return logp.sum() * 0

        with torch.no_grad():
            if self.par.pp == 1:
                self._paired_passes(micros, keep, grad=False)
            else:
                pipeline_pass(self.gpt, micros, keep, stage_logprobs=stage_target_logprobs, forward_only=True)
        return self.par.from_last_stage(out)

    def _experts_across_dp(self) -> bool:
        return bool(self.config.num_experts) and self.par.coords.ep > 1

    def _paired_passes(self, micros: list[tuple[Tensor, Tensor]], loss_of, *, grad: bool) -> None:
        """Expert parallelism over DP ranks that hold different micro-batches: Megatron's allgather dispatcher
        gathers equal token counts from every EP rank in every layer, forward and backward. So the DP ranks make the
        same number of passes, pass k of each padded to the largest [rows, width] among them (right padding, no
        targets: a real target's log-prob is unchanged), and a rank out of micro-batches runs padding only."""
        shapes = self.par.all_gather_dp([tuple(ids.shape) for ids, _ in micros])
        for k in range(max(len(s) for s in shapes)):
            rows = max(s[k][0] for s in shapes if k < len(s))
            width = max(s[k][1] for s in shapes if k < len(s))
            ids = torch.full((rows, width), self.pad_id, dtype=torch.long, device=self.device)
            mask = torch.zeros((rows, width), dtype=torch.bool, device=self.device)
            if k < len(micros):
                b, n = micros[k][0].shape
                ids[:b, :n], mask[:b, :n] = micros[k]
            logp = self._logprobs(ids, mask)
            loss = loss_of(k, logp) if k < len(micros) else logp.sum() * 0
            if grad:
                loss.backward()

    def _share(self, acc: dict) -> dict:
        return self.par.from_last_stage(acc)

    def forward_backward(self, batch: TrainBatch, prox: Sequence[Tensor] | None = None) -> dict[str, float]:
        """As GSPOTrainer's; with DP, this DP rank takes its run-aligned part (the whole step's normaliser kept) and
        the parts' metrics are merged as shards of one loss."""
        if batch.runs():
            self._pending = True
        if self.par.dp == 1:
            return super().forward_backward(batch, prox)
        parts = split_indices(batch, n_shards=self.par.dp)
        mine = parts[self.par.dp_rank] if self.par.dp_rank < len(parts) else []
        part = subset(batch, mine, n_valid_runs=batch.normaliser(), meta=batch.meta)
        m = super().forward_backward(part, None if prox is None else [prox[i] for i in mine])
        if not part.runs() and self._experts_across_dp():  # no pass of its own: it pads its peers' two passes
            self._no_grad_logprobs([])
            self._grad_micros([], None)
        parts_m = [p for p in self.par.all_gather_dp(m) if p["runs"] > 0] or [m]
        out = merge_metrics(parts_m, shared_normaliser=True)
        return {**m, **out}

    def zero_grad(self) -> None:
        super().zero_grad()
        self._pending = False

    def _sync(self) -> None:
        """All-reduce what this rank accumulated since the last sync (collective: every rank calls it together)."""
        if self._pending and self.par.world > 1:
            self.par.sync_grads(self._main, tied_pp=self.config.tie_word_embeddings)
        self._pending = False

    def _clip_grads(self, max_norm: float) -> float:
        self._sync()
        if self.par.world == 1:
            return super()._clip_grads(max_norm)
        norm = self.par.grad_norm(self._main, self._local)
        coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _before_pass(self) -> None:
        changed = self.par.broadcast(self.model is not None and self._versions() != self._seen)
        if changed:
            full = self.par.broadcast({n: p.detach() for n, p in self._mirror.items()} if self.par.leader else None)
            self._load_slices(state_reader(full, self.par.coords))

    def _after_update(self) -> None:
        if self._main is not self._gpt:
            with torch.no_grad():
                for n, p in self._gpt.items():
                    p.copy_(self._main[n])
        self._gpt_to_mirror()

    def export_grads(self) -> dict[str, Tensor]:
        """The cell's accumulated gradient by Hugging Face parameter name, on the leader ({} elsewhere and when
        nothing was accumulated): a satellite sends these."""
        self._sync()
        if self.par.broadcast(all(p.grad is None for p in self._main.values())):
            return {}
        grads = {n: p.grad.detach() if p.grad is not None else torch.zeros_like(p) for n, p in self._main.items()}
        full = self._gather(grads)
        return {n: g.contiguous() for n, g in full.items()} if full is not None else {}

    def add_grads(self, grads: dict[str, Tensor]) -> None:
        """Add another cell's gradients (Hugging Face names, every rank given the same; a tensor missing from them
        adds zero)."""
        self._sync()
        if not grads:
            return
        unknown = sorted(set(grads) - {n for t in tensor_maps(self.config) for n in t.hf})
        if unknown:
            raise KeyError(f"gradients for unknown parameters {unknown[:3]}")
        read = state_reader(grads, self.par.coords)
        for lt in self._local:
            given = [n in grads for n in lt.map.hf]
            if not any(given):
                continue
            if not all(given):
                raise KeyError(f"gradients for {lt.map.hf} come together or not at all")
            cut = [read(n, lt.dim) for n in lt.map.hf]
            p = self._main[lt.name]
            g = (lt.map.join(cut) if lt.map.join else cut[0]).to(p.device, p.dtype)
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place (parameter objects and optimizer state stay); every rank reads its slices."""
        if isinstance(self.model, Qwen3ForCausalLM):
            self.model.load_weights(Path(model_dir))
        elif self.model is not None:
            load_weights_into(self.model, Path(model_dir))
        self._load_slices(folder_reader(Path(model_dir), self.par.coords))

    def _save_weights(self, out_dir: Path, extra: Callable[[Path], None]) -> Path:
        """A Hugging Face snapshot folder written by the leader from its mirror (current after every step); every
        rank writes its optimizer state into it before it is renamed into place."""
        self._before_pass()
        if self.par.world == 1:
            return save_policy(self.model, self.model_dir, out_dir, extra)

        def with_ranks(folder: Path) -> None:
            self.par.broadcast(str(folder))
            extra(folder)
            self.par.barrier()

        if self.par.leader:
            return save_policy(self.model, self.model_dir, out_dir, with_ranks)
        folder = Path(self.par.broadcast(None))
        extra(folder)
        self.par.barrier()
        return Path(out_dir)

    def _optimizer_name(self) -> str:
        if self.par.world == 1:
            return OPTIMIZER_FILE
        return f"optimizer.rank{self.par.rank}-of-{self.par.world}.pt"

    # -- the mirror and the slices ------------------------------------------------------------------------------
    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._mirror.values())

    def _load_slices(self, read) -> None:
        with torch.no_grad():
            for n, t in local_state(self.config, self.par.coords, read).items():
                self._gpt[n].copy_(t)
                if self._main is not self._gpt:
                    self._main[n].copy_(t)
        self._seen = self._versions()

    def _extra_state(self) -> dict:
        """The fp32 masters beside AdamW's moments (bf16: the parameters are only their rounding)."""
        if self._main is self._gpt:
            return {}
        return {"main_params": {n: m.detach() for n, m in self._main.items()}}

    def _load_extra_state(self, state: dict) -> None:
        if "main_params" not in state:
            return
        with torch.no_grad():
            for n, m in self._main.items():
                m.copy_(state["main_params"][n])
                if m is not self._gpt[n]:
                    self._gpt[n].copy_(m)

    def _gather(self, tensors: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """Full Hugging Face tensors of every rank's slices, on the leader (None elsewhere). DP replicas other than
        DP rank 0 send nothing (they hold the same), nor do expert replicas."""
        mine = hf_pieces(self.config, self.par.coords, tensors, self._senders())
        got = self.par.gather_to_leader(mine)
        return None if got is None else assemble(p for rank in got for p in rank)

    def _senders(self):
        """The local tensors this rank sends in a gather (each tensor of the model from exactly one rank)."""
        dense_ok = self.par.dp_rank == 0
        expert_ok = self.par.expert_dp_rank == 0
        return [lt for lt in self._local if (expert_ok if ".local_experts." in lt.name else dense_ok)]

    def _gpt_to_mirror(self) -> None:
        full = self._gather({n: p.detach() for n, p in self._main.items()})
        if full is not None:
            with torch.no_grad():
                for n, p in self._mirror.items():
                    p.copy_(full[n])
        self._seen = self._versions()



def _main_params(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """An fp32 master of each (bf16) parameter, values set by the caller. Each backward's gradient of a parameter is
    added to its master's .grad in fp32 and dropped, as megatron-core's DDP backward hook does into main_grad."""
    main = {n: torch.nn.Parameter(p.detach().float()) for n, p in params.items()}
    for n, p in params.items():
        p.register_post_accumulate_grad_hook(partial(_into_main, main[n]))
    return main


def _into_main(main: Tensor, p: Tensor) -> None:
    g = p.grad.float()
    main.grad = g if main.grad is None else main.grad.add_(g)
    p.grad = None


def _load_mirror(model_dir: Path, cfg: Qwen3Config) -> torch.nn.Module:
    """The leader's Hugging Face mirror: transformers' model for a dense Qwen3; for Qwen3-MoE our own module, whose
    parameters are the published per-expert tensors (transformers 5 fuses the experts into [experts, …] tensors)."""
    if cfg.num_experts:
        return Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    return load_policy(model_dir, "cpu").eval()
