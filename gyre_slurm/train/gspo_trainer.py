"""The GSPO step over multi-segment runs that every trainer backend shares (docs/algorithms.md §1.5).

One `train_step` takes one TrainBatch (whole runs) and makes `minibatches` optimizer steps on run-aligned parts
of it (default 1). Each part: pack samples into micro-batches by a padded-token budget, run a no-grad pre-pass for
the runs that straddle micro-batches (so sg[s_r] comes from the same θ as the gradient), accumulate the
per-run-mean GSPO loss (train/gspo.py), clip gradients, step AdamW. In decoupled mode (§6.3 B) π_prox is one
no-grad pass over the whole batch at the step's starting weights. The optimizer state lives in the object across
steps (the core cell keeps it), and `save` writes it into each version's folder beside the weights (optimizer.pt; a
Megatron cell its ranks' pieces by Hugging Face name, train/optimizer_state.py), so a core trainer built again from
that folder with resume_optimizer (a core killed with -9) takes the next step exactly as the lost one would have.
Only the last two versions' folders keep it (every file matching OPTIMIZER_GLOB).

A backend (TorchTrainer, MegatronTrainer) builds its model in `_build` (returning the parameters to optimise) and
provides `_logprobs` (log π of the targets of a right-padded micro-batch) and the pieces of docs/design.md §4's
Trainer interface that depend on the model's layout: `export_grads`/`add_grads` (Hugging Face names),
`load_weights`, `_save_weights`. Its `model` is the Hugging Face-layout module that engines, the weight transport and
gradient messages name parameters by.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from gyre_slurm.train.batch import TrainBatch
from gyre_slurm.train.gspo import EPS_HIGH, EPS_LOW, gspo_loss, kl_penalty, run_log_ratio_sums
from gyre_slurm.train.metrics import merge_metrics, weighted
from gyre_slurm.train.shards import split_indices, subset

Mode = Literal["bypass", "decoupled"]
OPTIMIZER_FILE = "optimizer.pt"  # in a version's folder: the AdamW state (moments, step counts) that produced it
OPTIMIZER_GLOB = "optimizer.*"  # every file of it: a Megatron cell's ranks' files and index (train/optimizer_state.py)
KEEP_OPTIMIZER_STATES = 2  # versions whose folder keeps it (the daemon may not have recorded the newest yet)
log = logging.getLogger("gyre.train")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    prox: Tensor | None  # [n_targets] float64 π_prox log-probs when given (decoupled mode, mini-batches)


@dataclass
class _Prepared:
    """One forward_backward's micro-batches and per-run tensors (runs indexed 0..R-1)."""

    micros: list[_Micro]
    adv: Tensor  # [R] Â_r
    t_r: Tensor  # [R] |T_r|
    split: Tensor  # [R] bool: the run straddles micro-batches (its ratio needs the pre-pass)
    n_valid: int
    prox_delta: Tensor | None  # [R] float64 mean(logπ_prox − λ) when π_prox is given


_METRIC_KEYS = ("loss", "tokens_trained", "runs", "n_valid_runs", "clip_frac", "clip_frac_runs", "mean_abs_log_s",
                "mismatch", "frac_runs_outside_window", "frac_runs_s_outside_window", "micro_batches",
                "prepass_micro_batches", "padded_tokens")


class GSPOTrainer:
    """The backend-neutral part of a trainer: settings, optimizer, packing, pre-pass, loss accumulation, steps."""

    model: torch.nn.Module
    params: list[Tensor]
    optimizer: torch.optim.Optimizer

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
        minibatches: int = 1,
        device: torch.device | str | None = None,
        resume_optimizer: bool = False,
        lr_warmup_steps: int = 0,
        kl_coef: float = 0.0,
        reference_dir: Path | None = None,
        embedding_lr: float | None = None,
    ) -> None:
        if mode not in ("bypass", "decoupled"):
            raise ValueError(f"mode must be 'bypass' or 'decoupled', not {mode!r}")
        if not isinstance(minibatches, int) or isinstance(minibatches, bool) or minibatches < 1:
            raise ValueError(f"minibatches must be an int >= 1 (optimizer steps per rollout batch), "
                             f"not {minibatches!r}")
        self.grad_clip, self.micro_batch_tokens = grad_clip, micro_batch_tokens
        self.eps_low, self.eps_high, self.mode, self.w_max = eps_low, eps_high, mode, w_max
        self.minibatches = minibatches
        if not isinstance(lr_warmup_steps, int) or lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be an int >= 0, not {lr_warmup_steps!r}")
        self.lr, self.lr_warmup_steps = lr, lr_warmup_steps
        self.steps = 0  # optimizer steps taken, saved with the optimizer state (so a resumed warm-up goes on)
        self.last_minibatch_metrics: list[dict[str, float]] = []  # per mini-batch, of the last train_step
        self.device = torch.device(device) if device is not None else default_device()
        self.model_dir = Path(model_dir)
        torch.manual_seed(seed)
        self.params, self.pad_id = self._build()
        if kl_coef < 0 or (kl_coef > 0 and reference_dir is None):
            raise ValueError(f"kl_coef must be >= 0 and, above 0, come with a reference_dir (is {kl_coef!r}, "
                             f"{reference_dir!r})")
        self.kl_coef = kl_coef
        self.reference = self._build_reference(Path(reference_dir)) if kl_coef > 0 else None
        self.optimizer = self._make_optimizer(lr, weight_decay, embedding_lr)
        self._optimizer_saved: list[Path] = []
        if resume_optimizer:
            self._resume_optimizer()

    def _make_optimizer(self, lr: float, weight_decay: float, embedding_lr: float | None) -> torch.optim.Optimizer:
        """AdamW over `params` (a backend may keep only its share of them: Megatron's distributed optimizer)."""
        return torch.optim.AdamW(self._param_groups(lr, embedding_lr), lr=lr, weight_decay=weight_decay)

    def _param_groups(self, lr: float, embedding_lr: float | None) -> list[dict]:
        """AdamW's groups, each with its lr as a multiple of lr (`lr_scale`, so the warm-up scales them alike): the
        token embeddings apart when embedding_lr is given (the small CLI policies take larger steps there than the
        trunk can bear: docs/benchmarks.md)."""
        if embedding_lr is None:
            return [{"params": self.params, "lr_scale": 1.0}]
        emb = {id(p) for p in self._embedding_params()}
        return [{"params": [p for p in self.params if id(p) not in emb], "lr_scale": 1.0},
                {"params": [p for p in self.params if id(p) in emb], "lr_scale": embedding_lr / lr}]

    # -- what a backend provides --------------------------------------------------------------------------------
    def _embedding_params(self) -> list[Tensor]:
        """The token-embedding (and output-head) parameters, for a learning rate of their own."""
        raise NotImplementedError(f"{type(self).__name__} has no embedding_lr")

    def _build(self) -> tuple[list[Tensor], int]:
        """Load the policy from self.model_dir onto self.device, set self.model (the Hugging Face-layout module);
        return the parameters to optimise (each once) and the padding token id."""
        raise NotImplementedError

    def _logprobs(self, input_ids: Tensor, target_mask: Tensor) -> Tensor:
        """log π(token_i | tokens_<i) at every target_mask[b, i], row-major (as torch_trainer.target_logprobs)."""
        raise NotImplementedError

    def _build_reference(self, reference_dir: Path) -> torch.nn.Module:
        """The frozen reference policy (version 0) that the KL anchor (kl_coef > 0) pulls towards."""
        raise NotImplementedError(f"{type(self).__name__} has no KL anchor (train.kl_coef)")

    def _reference_logprobs(self, micros: list[_Micro]) -> list[Tensor]:
        """log π_ref of each micro-batch's targets (no gradient), in `_logprobs`' order."""
        raise NotImplementedError

    def _grad_micros(self, micros: list[tuple[Tensor, Tensor]], loss_of: Callable[[int, Tensor], Tensor]) -> None:
        """Backpropagate loss_of(k, log-probs of micro-batch k) for every (input_ids, target_mask) micro-batch."""
        for k, (ids, mask) in enumerate(micros):
            loss_of(k, self._logprobs(ids, mask)).backward()

    def _no_grad_logprobs(self, micros: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """The target log-probs of each (input_ids, target_mask) micro-batch, without gradients."""
        with torch.no_grad():
            return [self._logprobs(ids, mask) for ids, mask in micros]

    def _share(self, acc: dict) -> dict:
        """What `_grad_micros`' loss calls accumulated, as every rank of the model sees it (one process: as is)."""
        return acc

    def _clip_grads(self, max_norm: float) -> float:
        """Clip the gradient to max_norm in place; return its norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def _before_pass(self) -> None:
        """Called before any forward over a batch (a backend that must prepare its weights does it here)."""

    def _after_update(self) -> None:
        """Called after each optimizer step."""

    # -- docs/design.md §4 pieces ------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, batch: TrainBatch, prox: Sequence[Tensor] | None = None) -> dict[str, float]:
        """Accumulate this batch's GSPO gradient into .grad (add, not overwrite) and return its metrics.

        prox (decoupled mode only): π_prox log-probs per sample, as `proximal_logprobs` returns them, taken at
        the weights the step started from. Then log s_r = mean(logπ_θ − logπ_prox) and log w_r =
        mean(logπ_prox − λ). Without it π_prox is the current θ: s_r = 1 and w_r uses logπ_θ.
        """
        batch.validate()
        if prox is not None and (self.mode != "decoupled" or len(prox) != len(batch.samples)):
            raise ValueError(f"prox needs mode 'decoupled' (is {self.mode!r}) and one entry per sample "
                             f"({len(prox)} for {len(batch.samples)})")
        runs = batch.runs()
        if not runs:
            return dict.fromkeys(_METRIC_KEYS, 0.0)  # same keys as a real step, so logs stay rectangular
        self._before_pass()
        ctx = self._prepare(batch, runs, prox)
        n_runs = len(runs)
        pre_sums, n_pre = self._prepass(ctx)

        acc: dict = {"delta_sum": torch.zeros(n_runs, dtype=torch.float64, device=self.device),  # Σ(logπ_θ − λ)
                     "stats": None, "loss": 0.0, "k3_sum": torch.zeros(n_runs, dtype=torch.float64, device=self.device)}
        ref = self._reference_logprobs(ctx.micros) if self.reference is not None else None

        def micro_loss(k: int, logp: Tensor) -> Tensor:
            mb = ctx.micros[k]
            local, _ = run_log_ratio_sums(logp.double(), mb.behav, mb.run_index, n_runs)
            acc["delta_sum"] += local.detach()
            old, sg_log_s, w = self._ratio_terms(ctx, mb, logp, local, pre_sums)
            loss, st = gspo_loss(logp, old, mb.run_index, ctx.adv, ctx.t_r, ctx.n_valid, eps_low=self.eps_low,
                                 eps_high=self.eps_high, sg_log_s=sg_log_s, behav_weight=w)
            if ref is not None:
                kl, k3_sums = kl_penalty(logp, ref[k], mb.run_index, ctx.t_r, ctx.n_valid)
                loss = loss + self.kl_coef * kl
                acc["k3_sum"] += k3_sums.double()
            acc["loss"] += float(loss.detach())
            acc["stats"] = st if acc["stats"] is None else acc["stats"].merge(st)
            return loss

        self._grad_micros([(mb.input_ids, mb.target_mask) for mb in ctx.micros], micro_loss)
        acc = self._share(acc)  # a pipeline's loss is computed on its last stage
        delta_sum, stats, loss_total = acc["delta_sum"], acc["stats"], acc["loss"]

        # δ_r per §6.3: against π_prox when given, else the current θ (every run complete now, pre-update θ).
        delta = ctx.prox_delta if ctx.prox_delta is not None else delta_sum / ctx.t_r
        delta_full = delta.tolist()
        outside = [d for d in delta_full if not (-self.eps_low <= d <= self.eps_high)]
        s_outside = [d for d in stats.log_s.tolist() if not (-self.eps_low <= d <= self.eps_high)]
        out = {
            "loss": loss_total, "tokens_trained": float(ctx.t_r.sum()), "runs": float(n_runs),
            "n_valid_runs": float(ctx.n_valid),
            **stats.as_dict(),
            "mismatch": statistics.median(abs(d) for d in delta_full),
            "frac_runs_outside_window": len(outside) / n_runs,
            "frac_runs_s_outside_window": len(s_outside) / n_runs,
            "micro_batches": float(len(ctx.micros)), "prepass_micro_batches": float(n_pre),
            "padded_tokens": float(sum(mb.input_ids.numel() for mb in ctx.micros)),
        }
        if ref is not None:  # the policy's KL to the reference, per-run mean of k3 averaged over runs
            out["kl"] = float((acc["k3_sum"] / ctx.t_r).mean())
        if self.mode == "decoupled":
            out["mean_log_w"] = statistics.fmean(delta_full)
            out["w_trunc_frac"] = sum(d > math.log(self.w_max) for d in delta_full) / n_runs
        return out

    def proximal_logprobs(self, batch: TrainBatch) -> list[Tensor]:
        """π_prox for decoupled mode: per sample, log π(target) at the current weights for each of its targets
        in order (float64, empty for a sample without targets). One no-grad pass."""
        keep = [(i, max(j for j, m in enumerate(s.loss_mask) if m) + 1)
                for i, s in enumerate(batch.samples) if any(s.loss_mask)]
        out = [torch.zeros(0, dtype=torch.float64, device=self.device) for _ in batch.samples]
        self._before_pass()
        groups = pack_micro_batches([n for _, n in keep], [batch.samples[i].run_id for i, _ in keep],
                                    self.micro_batch_tokens)
        items = [[keep[k] for k in g] for g in groups]
        padded = [self._pad(batch, it) for it in items]
        logps = self._no_grad_logprobs([(ids.to(self.device), mask.to(self.device)) for ids, mask in padded])
        for it, (_, mask), logp in zip(items, padded, logps, strict=True):
            for (i, _), part in zip(it, torch.split(logp.double(), mask.sum(1).tolist()), strict=True):
                out[i] = part
        return out

    # -- snapshots: weights and the optimizer state that made them ------------------------------------------------
    def save(self, out_dir: Path) -> Path:
        """A version's folder (Hugging Face layout, written aside and renamed into place), with optimizer.pt."""
        path = self._save_weights(Path(out_dir), self._write_optimizer)
        self._optimizer_saved.append(path)
        for old in self._optimizer_saved[:-KEEP_OPTIMIZER_STATES]:
            for f in old.glob(OPTIMIZER_GLOB):  # every rank's
                f.unlink(missing_ok=True)
        self._optimizer_saved = self._optimizer_saved[-KEEP_OPTIMIZER_STATES:]
        return path

    def _save_weights(self, out_dir: Path, extra: Callable[[Path], None]) -> Path:
        raise NotImplementedError

    def _write_optimizer(self, folder: Path) -> None:
        """This process's optimizer state into a version's folder (a backend may write it its own way)."""
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, folder / self._optimizer_name())

    def _optimizer_name(self) -> str:
        """This process's optimizer-state file in a version's folder."""
        return OPTIMIZER_FILE

    def _resume_optimizer(self) -> None:
        path = self.model_dir / self._optimizer_name()
        if not path.is_file():  # version 0, or a folder from elsewhere: the optimizer starts fresh
            others = sorted(f.name for f in self.model_dir.glob(OPTIMIZER_GLOB))
            if others:  # another backend's (a Megatron cell's pieces by Hugging Face name)
                log.warning("%s holds optimizer state this trainer does not read (%s), not %s: AdamW starts from "
                            "zero, the weights carry over", self.model_dir, ", ".join(others), path.name)
            else:
                log.info("no optimizer state in %s: AdamW starts from zero", self.model_dir)
            return
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        log.info("optimizer state resumed from %s (%d steps)", path, self.steps)

    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradient by `factor` (a streaming step's normaliser, known only at its end)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def step_lr(self) -> float:
        """The learning rate of the next optimizer step: linear warm-up over the first lr_warmup_steps (AdamW's
        first steps move every weight by about lr whatever the gradient's size), then lr."""
        if self.steps >= self.lr_warmup_steps:
            return self.lr
        return self.lr * (self.steps + 1) / self.lr_warmup_steps

    def optimizer_step(self) -> dict[str, float]:
        """Clip and step; a non-finite gradient skips the step (it would corrupt the weights for good)."""
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        norm = self._clip_grads(max_norm)
        skipped = not math.isfinite(norm)
        lr = self.step_lr()
        if not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            self.optimizer.step()
            self.steps += 1
            self._after_update()
        self.zero_grad()
        return {"grad_norm": norm, "skipped": float(skipped), "lr": lr}

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One rollout batch: `minibatches` optimizer steps (clamped to the number of runs with targets).

        With one mini-batch this is zero_grad, forward_backward, optimizer_step. With k > 1 the batch is split
        run-aligned into k parts (shards.split_indices), each normalised by its OWN valid-run count (not the
        whole batch's), each one optimizer step. In decoupled mode π_prox is taken for every run with the
        weights at the start of the step, so on later parts s_r = π_θ/π_prox moves away from 1 and GSPO's
        clip acts; in bypass mode π_old is the behaviour policy throughout.
        """
        t0 = time.perf_counter()
        n_parts = min(self.minibatches, max(1, len(batch.runs())))
        if n_parts == 1:
            self.zero_grad()
            metrics = self.forward_backward(batch)
            metrics.update(self._step_unless_empty(metrics))
            self.last_minibatch_metrics = [dict(metrics)]
            metrics.update(self._minibatch_summary(self.last_minibatch_metrics))
        else:
            metrics = self._train_minibatches(batch, n_parts)
        metrics["seconds"] = time.perf_counter() - t0
        return metrics

    # -- internals ------------------------------------------------------------------------------------------------
    def _step_unless_empty(self, metrics: dict[str, float]) -> dict[str, float]:
        if metrics["runs"] > 0:
            return self.optimizer_step()
        return {"grad_norm": 0.0, "skipped": 1.0}  # nothing to learn from: weight decay alone would move weights

    def _train_minibatches(self, batch: TrainBatch, n_parts: int) -> dict[str, float]:
        batch.validate()
        parts = split_indices(batch, n_shards=n_parts)
        prox = self.proximal_logprobs(batch) if self.mode == "decoupled" else None  # θ_old, before any update
        per_part = []
        for idx in parts:
            self.zero_grad()
            m = self.forward_backward(subset(batch, idx, n_valid_runs=None),
                                      None if prox is None else [prox[i] for i in idx])
            m.update(self._step_unless_empty(m))
            per_part.append(m)
        self.last_minibatch_metrics = per_part
        out = merge_metrics(per_part, shared_normaliser=False)
        out.update(self._minibatch_summary(per_part))
        return out

    @staticmethod
    def _minibatch_summary(parts: list[dict[str, float]]) -> dict[str, float]:
        """Step-level counts, and the ratio metrics of the mini-batches after the first (where θ ≠ θ_old)."""
        later = parts[1:]
        return {
            "minibatches": float(len(parts)),
            "optimizer_steps": float(sum(1 for m in parts if not m["skipped"])),
            "skipped": float(sum(m["skipped"] for m in parts)),
            "grad_norm": statistics.fmean(m["grad_norm"] for m in parts),
            "later_clip_frac": weighted(later, "clip_frac", "tokens_trained"),
            "later_clip_frac_runs": weighted(later, "clip_frac_runs", "runs"),
            "later_mean_abs_log_s": weighted(later, "mean_abs_log_s", "runs"),
            "later_frac_runs_s_outside_window": weighted(later, "frac_runs_s_outside_window", "runs"),
        }

    def _prepare(self, batch: TrainBatch, runs: list[int], prox: Sequence[Tensor] | None) -> _Prepared:
        run_pos = {r: k for k, r in enumerate(runs)}
        dev = self.device
        adv = torch.tensor([batch.advantages[r] for r in runs], dtype=torch.float32, device=dev)
        t_r = torch.tensor([batch.targets_per_run[r] for r in runs], dtype=torch.long, device=dev)
        # Only the tokens up to a sample's last target matter (causal model); samples without targets are skipped.
        keep = [(i, max(j for j, m in enumerate(s.loss_mask) if m) + 1)
                for i, s in enumerate(batch.samples) if any(s.loss_mask)]
        groups = pack_micro_batches([n for _, n in keep], [batch.samples[i].run_id for i, _ in keep],
                                    self.micro_batch_tokens)
        micros = [self._collate(batch, [keep[k] for k in g], run_pos, prox) for g in groups]
        seen: dict[int, int] = {}
        for mb in micros:
            for r in mb.runs:
                seen[r] = seen.get(r, 0) + 1
        split = torch.tensor([seen[k] > 1 for k in range(len(runs))], device=dev)
        prox_delta = None
        if prox is not None:
            sums = sum(run_log_ratio_sums(mb.prox, mb.behav, mb.run_index, len(runs))[0] for mb in micros)
            prox_delta = sums / t_r
        return _Prepared(micros, adv, t_r, split, batch.normaliser(), prox_delta)

    def _prepass(self, ctx: _Prepared) -> tuple[Tensor, int]:
        """Σ(logπ_θ − logπ_old) per run for runs that straddle micro-batches, at the same θ as the gradient
        pass (π_old: π_prox when given, else the behaviour policy)."""
        pre_sums = torch.zeros(len(ctx.adv), dtype=torch.float64, device=self.device)
        split = ctx.split.tolist()
        micros = [mb for mb in ctx.micros if any(split[r] for r in mb.runs)]
        # called even with nothing to do: expert-parallel ranks take part in each other's passes
        logps = self._no_grad_logprobs([(mb.input_ids, mb.target_mask) for mb in micros])
        for mb, logp in zip(micros, logps, strict=True):
            ref = mb.behav if mb.prox is None else mb.prox
            pre_sums += run_log_ratio_sums(logp.double(), ref, mb.run_index, len(ctx.adv))[0]
        return pre_sums, len(micros)

    def _ratio_terms(self, ctx: _Prepared, mb: _Micro, logp: Tensor, local: Tensor, pre_sums: Tensor) \
            -> tuple[Tensor, Tensor, Tensor | None]:
        """(π_old log-probs, sg[log s_r], behaviour weight w_r or None) for this micro-batch's loss."""
        n_runs = len(ctx.adv)
        if mb.prox is not None:  # decoupled with π_prox from the step start: s_r = π_θ/π_prox, w_r = π_prox/λ
            local_p = run_log_ratio_sums(logp.double(), mb.prox, mb.run_index, n_runs)[0]
            sg_log_s = torch.where(ctx.split, pre_sums, local_p) / ctx.t_r
            w = torch.clamp(torch.exp(ctx.prox_delta), max=self.w_max).float()
            return mb.prox, sg_log_s.float(), w
        # δ_r = mean_{T_r}(logπ_θ − λ): whole-run value, from this micro-batch unless the run is split.
        delta = torch.where(ctx.split, pre_sums, local) / ctx.t_r
        if self.mode == "bypass":  # π_old := π_behave, log s_r = δ_r
            return mb.behav, delta.float(), None
        # π_old := π_prox = θ now (s_r = 1), behaviour weight w_r = exp(δ_r) truncated at w_max
        return logp.detach(), torch.zeros(n_runs, device=self.device), \
            torch.clamp(torch.exp(delta), max=self.w_max).float()

    def _pad(self, batch: TrainBatch, items: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Right-padded token ids and target mask (on the CPU) of samples (index, tokens kept)."""
        width = max(n for _, n in items)
        ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.bool)
        for row, (i, n) in enumerate(items):
            s = batch.samples[i]
            ids[row, :n] = torch.tensor(s.tokens[:n], dtype=torch.long)
            mask[row, :n] = torch.tensor(s.loss_mask[:n], dtype=torch.bool)
        return ids, mask

    def _collate(self, batch: TrainBatch, items: list[tuple[int, int]], run_pos: dict[int, int],
                 prox: Sequence[Tensor] | None = None) -> _Micro:
        ids, mask = self._pad(batch, items)
        behav: list[Tensor] = []
        run_index: list[Tensor] = []
        for row, (i, n) in enumerate(items):
            s = batch.samples[i]
            # float64: δ_r is compared against a 3e-4 window after averaging many targets
            behav.append(torch.tensor(s.behav_logp[:n], dtype=torch.float64)[mask[row, :n]])
            run_index.append(torch.full((len(behav[-1]),), run_pos[s.run_id], dtype=torch.long))
            if prox is not None and len(prox[i]) != len(behav[-1]):
                raise ValueError(f"prox for sample {i} has {len(prox[i])} log-probs, the sample {len(behav[-1])} "
                                 "targets")
        dev = self.device
        runs = frozenset(run_pos[batch.samples[i].run_id] for i, _ in items)
        prox_t = None if prox is None else torch.cat([prox[i].to(dev, torch.float64) for i, _ in items])
        # Row-major order matches target_logprobs (token 0 is never a target, so the shift keeps the order).
        return _Micro(ids.to(dev), mask.to(dev), torch.cat(behav).to(dev), torch.cat(run_index).to(dev), runs,
                      prox_t)
