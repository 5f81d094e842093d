"""The torch trainer: GSPO over multi-segment runs on a Hugging Face causal LM (the embedded default backend).

One `train_step` is one optimizer step over one TrainBatch (whole runs, ALGORITHMS.md §1.5):
pack samples into micro-batches by a padded-token budget, run a no-grad pre-pass for the runs that straddle
micro-batches (so sg[s_r] comes from the same θ as the gradient), accumulate the per-run-mean GSPO loss,
clip gradients, step AdamW. The optimizer state lives in this object across steps (the core cell keeps it).

The pieces of DESIGN.md §4's Trainer interface are exposed too: `forward_backward`, `export_grads`/`add_grads`
(satellites → core), `optimizer_step`, `load_weights`, `save`.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from gyre_slurm.train.batch import TrainBatch
from gyre_slurm.train.gspo import EPS_HIGH, EPS_LOW, GSPOStats, gspo_loss, run_log_ratio_sums

Mode = Literal["bypass", "decoupled"]

# Files that save_pretrained writes itself, or weights: never copied from the source folder.
_MODEL_FILES = {"config.json", "generation_config.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json", ".msgpack", ".h5")


# --- model helpers (shared with the warm-up) ------------------------------------------------------------------
def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> list[str]:
    """Copy everything but weights and model config (tokenizer, chat template, metadata) so out_dir stands alone."""
    copied = []
    for p in sorted(Path(src_dir).iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in _MODEL_FILES or p.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(p, Path(out_dir) / p.name)
        copied.append(p.name)
    return copied


def save_policy(model: torch.nn.Module, src_dir: Path, out_dir: Path) -> Path:
    """Hugging Face folder (config + safetensors + tokenizer), written beside out_dir then renamed into place,
    so a crash never leaves a half-written snapshot under the final name."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer_files(src_dir, tmp)
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


# --- packing (pure) -------------------------------------------------------------------------------------------
def pack_micro_batches(lengths: Sequence[int], run_ids: Sequence[int], budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size (rows × longest) stays within `budget`.

    A run's samples stay together when they fit in one micro-batch (then its ratio needs no pre-pass);
    larger runs are split sample by sample. First-fit over items sorted longest first, so each micro-batch's
    width is set by its first item and similar lengths share padding. A sample longer than the budget gets
    a micro-batch of its own. Deterministic.
    """
    by_run: dict[int, list[int]] = {}
    for i, r in enumerate(run_ids):
        by_run.setdefault(r, []).append(i)
    items: list[list[int]] = []
    for idxs in by_run.values():
        if len(idxs) * max(lengths[i] for i in idxs) <= budget:
            items.append(idxs)
        else:
            items.extend([i] for i in idxs)
    items.sort(key=lambda it: (-max(lengths[i] for i in it), -len(it), it[0]))
    bins: list[tuple[list[int], int]] = []
    for it in items:
        width = max(lengths[i] for i in it)
        for k, (idxs, w) in enumerate(bins):
            if (len(idxs) + len(it)) * max(w, width) <= budget:
                bins[k] = (idxs + it, max(w, width))
                break
        else:
            bins.append((list(it), width))
    return [sorted(idxs) for idxs, _ in bins]


@dataclass
class _Micro:
    input_ids: Tensor  # [B, L] right-padded
    target_mask: Tensor  # [B, L] bool, aligned to the predicted token
    behav: Tensor  # [n_targets] float64 behaviour log-probs, row-major like target_logprobs
    run_index: Tensor  # [n_targets] in 0..R-1
    runs: frozenset[int]  # run indices present


class TorchTrainer:
    def __init__(
        self,
        model_dir: Path,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_tokens: int = 4096,
        eps_low: float = EPS_LOW,
        eps_high: float = EPS_HIGH,
        seed: int = 0,
        *,
        mode: Mode = "bypass",
        w_max: float = 2.0,
        device: torch.device | str | None = None,
    ) -> None:
        if mode not in ("bypass", "decoupled"):
            raise ValueError(f"mode must be 'bypass' or 'decoupled', not {mode!r}")
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.device = torch.device(device) if device is not None else default_device()
        self.model = load_policy(self.model_dir, self.device)
        # No dropout: the policy being optimised is the one the engine samples, and the pre-pass must agree
        # with the gradient pass.
        self.model.eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.grad_clip, self.micro_batch_tokens = grad_clip, micro_batch_tokens
        self.eps_low, self.eps_high, self.mode, self.w_max = eps_low, eps_high, mode, w_max
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.steps = 0

    # -- DESIGN.md §4 pieces ------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Accumulate this batch's GSPO gradient into .grad (add, not overwrite) and return its metrics."""
        batch.validate()
        runs = batch.runs()
        if not runs:
            keys = ("loss", "tokens_trained", "runs", "n_valid_runs", "clip_frac", "clip_frac_runs", "mean_abs_log_s",
                    "mismatch", "frac_runs_outside_window", "micro_batches", "prepass_micro_batches", "padded_tokens")
            return dict.fromkeys(keys, 0.0)  # same keys as a real step, so logs stay rectangular
        run_pos = {r: k for k, r in enumerate(runs)}
        n_runs, n_valid = len(runs), batch.n_valid_runs or len(runs)
        dev = self.device
        adv = torch.tensor([batch.advantages[r] for r in runs], dtype=torch.float32, device=dev)
        t_r = torch.tensor([batch.targets_per_run[r] for r in runs], dtype=torch.long, device=dev)

        # Only the tokens up to a sample's last target matter (causal model); samples without targets are skipped.
        keep = [(i, max(j for j, m in enumerate(s.loss_mask) if m) + 1)
                for i, s in enumerate(batch.samples) if any(s.loss_mask)]
        groups = pack_micro_batches([n for _, n in keep], [batch.samples[i].run_id for i, _ in keep],
                                    self.micro_batch_tokens)
        micros = [self._collate(batch, [keep[k] for k in g], run_pos) for g in groups]
        seen: dict[int, int] = {}
        for mb in micros:
            for r in mb.runs:
                seen[r] = seen.get(r, 0) + 1
        split = torch.tensor([seen[k] > 1 for k in range(n_runs)], device=dev)

        # Pre-pass: Σ(logπ_θ − λ) for runs that straddle micro-batches, at the same θ as the gradient pass.
        pre_sums = torch.zeros(n_runs, dtype=torch.float64, device=dev)
        n_pre = 0
        if bool(split.any()):
            with torch.no_grad():
                for mb in micros:
                    if any(seen[r] > 1 for r in mb.runs):
                        logp = target_logprobs(self.model, mb.input_ids, mb.target_mask)
                        pre_sums += run_log_ratio_sums(logp.double(), mb.behav, mb.run_index, n_runs)[0]
                        n_pre += 1

        delta_sum = torch.zeros(n_runs, dtype=torch.float64, device=dev)  # Σ(logπ_θ − λ) per run, before update
        stats: GSPOStats | None = None
        loss_total = 0.0
        for mb in micros:
            logp = target_logprobs(self.model, mb.input_ids, mb.target_mask)
            local, _ = run_log_ratio_sums(logp.double(), mb.behav, mb.run_index, n_runs)
            delta_sum += local
            # δ_r = mean_{T_r}(logπ_θ − λ): whole-run value, from this micro-batch unless the run is split.
            delta = torch.where(split, pre_sums, local) / t_r
            if self.mode == "bypass":  # π_old := π_behave, log s_r = δ_r
                old, sg_log_s, w = mb.behav, delta.float(), None
            else:  # π_old := π_prox = θ now (s_r = 1), behaviour weight w_r = exp(δ_r) truncated at w_max
                old, sg_log_s = logp.detach(), torch.zeros(n_runs, device=dev)
                w = torch.clamp(torch.exp(delta), max=self.w_max).float()
            loss, st = gspo_loss(logp, old, mb.run_index, adv, t_r, n_valid, eps_low=self.eps_low,
                                 eps_high=self.eps_high, sg_log_s=sg_log_s, behav_weight=w)
            loss.backward()
            loss_total += float(loss.detach())
            stats = st if stats is None else stats.merge(st)

        delta_full = (delta_sum / t_r).tolist()  # every run complete now, all at the pre-update θ
        outside = [d for d in delta_full if not (-self.eps_low <= d <= self.eps_high)]
        out = {
            "loss": loss_total, "tokens_trained": float(t_r.sum()), "runs": float(n_runs),
            "n_valid_runs": float(n_valid),
            **stats.as_dict(),
            "mismatch": statistics.median(abs(d) for d in delta_full),
            "frac_runs_outside_window": len(outside) / n_runs,
            "micro_batches": float(len(micros)), "prepass_micro_batches": float(n_pre),
            "padded_tokens": float(sum(mb.input_ids.numel() for mb in micros)),
        }
        if self.mode == "decoupled":
            out["mean_log_w"] = statistics.fmean(delta_full)
            out["w_trunc_frac"] = sum(d > math.log(self.w_max) for d in delta_full) / n_runs
        return out

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

    def optimizer_step(self) -> dict[str, float]:
        """Clip and step; a non-finite gradient skips the step (it would corrupt the weights for good)."""
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        skipped = not math.isfinite(norm)
        if not skipped:
            self.optimizer.step()
            self.steps += 1
        self.zero_grad()
        return {"grad_norm": norm, "skipped": float(skipped)}

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        self.zero_grad()
        metrics = self.forward_backward(batch)
        if metrics["runs"] > 0:
            metrics.update(self.optimizer_step())
        else:  # nothing to learn from: no step (weight decay alone would still move the weights)
            metrics.update({"grad_norm": 0.0, "skipped": 1.0})
        metrics["seconds"] = time.perf_counter() - t0
        return metrics

    def load_weights(self, model_dir: Path) -> None:
        """Replace the weights in place (keeps the parameter objects, so the optimizer state stays attached)."""
        fresh = load_policy(Path(model_dir), "cpu")
        self.model.load_state_dict(fresh.state_dict())

    def save(self, out_dir: Path) -> Path:
        return save_policy(self.model, self.model_dir, Path(out_dir))

    # -- internals ------------------------------------------------------------------------------------------------
    def _collate(self, batch: TrainBatch, items: list[tuple[int, int]], run_pos: dict[int, int]) -> _Micro:
        width = max(n for _, n in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.bool)
        behav: list[Tensor] = []
        run_index: list[Tensor] = []
        for row, (i, n) in enumerate(items):
            s = batch.samples[i]
            ids[row, :n] = torch.tensor(s.tokens[:n], dtype=torch.long)
            mask[row, :n] = torch.tensor(s.loss_mask[:n], dtype=torch.bool)
            # float64: δ_r is compared against a 3e-4 window after averaging many targets
            behav.append(torch.tensor(s.behav_logp[:n], dtype=torch.float64)[mask[row, :n]])
            run_index.append(torch.full((len(behav[-1]),), run_pos[s.run_id], dtype=torch.long))
        dev = self.device
        runs = frozenset(run_pos[batch.samples[i].run_id] for i, _ in items)
        # Row-major order matches target_logprobs (token 0 is never a target, so the shift keeps the order).
        return _Micro(ids.to(dev), mask.to(dev), torch.cat(behav).to(dev), torch.cat(run_index).to(dev), runs)
