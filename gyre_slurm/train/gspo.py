"""GSPO loss over multi-segment runs (docs/algorithms.md §1.5), GSPO-token form.

Pure tensor code. One call handles the targets of one micro-batch; summing the returned contributions over the
micro-batches of a step gives

    L = (1/|R_valid|) Σ_r (1/|T_r|) Σ_{t∈T_r} ℓ_{r,t}

because every target is divided by its run's *whole-step* target count |T_r| and by the global number of valid
runs. The sequence ratio s_r must come from the same θ as the gradient: when a run spans micro-batches, the
caller passes `sg_log_s` from a no-grad pre-pass (see `run_log_ratio_sums`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EPS_LOW = 3e-4
EPS_HIGH = 4e-4
LOG_RATIO_CLAMP = 10.0


@dataclass
class GSPOStats:
    """Counts (not fractions) so that micro-batches can be merged; runs are indexed 0..R-1 as in the loss call.

    A run's s_r is one number for all its targets, so its clip state is the same in every micro-batch.
    """

    n_targets: int
    n_clipped_targets: int
    run_present: Tensor  # [R] bool: the run had targets in this micro-batch
    run_clipped: Tensor  # [R] bool: the clipped branch was taken (its gradient is zero)
    log_s: Tensor  # [R] the (clamped) log s_r used; meaningful where run_present

    def merge(self, other: GSPOStats) -> GSPOStats:
        present = self.run_present | other.run_present
        return GSPOStats(
            n_targets=self.n_targets + other.n_targets,
            n_clipped_targets=self.n_clipped_targets + other.n_clipped_targets,
            run_present=present,
            run_clipped=self.run_clipped | other.run_clipped,
            log_s=torch.where(other.run_present, other.log_s, self.log_s),
        )

    @property
    def clip_frac_tokens(self) -> float:
        return self.n_clipped_targets / self.n_targets if self.n_targets else 0.0

    @property
    def clip_frac_runs(self) -> float:
        n = int(self.run_present.sum())
        return int((self.run_clipped & self.run_present).sum()) / n if n else 0.0

    @property
    def mean_abs_log_s(self) -> float:
        n = int(self.run_present.sum())
        return float(self.log_s[self.run_present].abs().sum()) / n if n else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"clip_frac": self.clip_frac_tokens, "clip_frac_runs": self.clip_frac_runs,
                "mean_abs_log_s": self.mean_abs_log_s}


def run_log_ratio_sums(logp_new: Tensor, logp_old: Tensor, run_index: Tensor, n_runs: int) -> tuple[Tensor, Tensor]:
    """Per-run Σ(logπ_θ − logπ_old) and target count, detached: the pre-pass quantities of §1.5 step 2.

    Sum these over all micro-batches (and ranks), then sg_log_s = sums / |T_r|.
    """
    diff = (logp_new - logp_old).detach()
    sums = torch.zeros(n_runs, dtype=diff.dtype, device=diff.device).index_add_(0, run_index, diff)
    counts = torch.zeros(n_runs, dtype=torch.long, device=diff.device).index_add_(
        0, run_index, torch.ones_like(run_index))
    return sums, counts


def gspo_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    run_index: Tensor,
    advantages: Tensor,
    targets_per_run: Tensor,
    n_valid_runs: int | float,
    *,
    eps_low: float = EPS_LOW,
    eps_high: float = EPS_HIGH,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    sg_log_s: Tensor | None = None,
    behav_weight: Tensor | None = None,
) -> tuple[Tensor, GSPOStats]:
    """This micro-batch's share of the per-run-mean GSPO loss.

    logp_new [n] (with grad), logp_old [n] (π_old: behaviour log-probs in bypass mode, π_prox in decoupled mode),
    run_index [n] in 0..R-1; advantages, targets_per_run (|T_r| over the whole step) and optional sg_log_s
    (precomputed mean log-ratio) and behav_weight (w_r, no grad) are [R]. Without sg_log_s every run present here
    must have all its targets here.
    """
    n, n_runs = logp_new.shape[0], advantages.shape[0]
    if logp_old.shape != logp_new.shape or run_index.shape != logp_new.shape or logp_new.dim() != 1:
        raise ValueError(f"logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and run_index "
                         f"{tuple(run_index.shape)} must be the same 1-D shape")
    for name, t in (("targets_per_run", targets_per_run), ("sg_log_s", sg_log_s), ("behav_weight", behav_weight)):
        if t is not None and t.shape != (n_runs,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n_runs},) like advantages")
    if n_valid_runs <= 0:
        raise ValueError("n_valid_runs must be positive")
    run_index = run_index.long()
    dtype = logp_new.dtype

    sums, counts = run_log_ratio_sums(logp_new, logp_old, run_index, n_runs)
    present = counts > 0
    if sg_log_s is None:
        # A run cut across micro-batches would get a ratio from part of its targets: refuse rather than bias.
        if bool((counts[present] != targets_per_run[present]).any()):
            raise ValueError("a run's targets span micro-batches: pass sg_log_s from a pre-pass (run_log_ratio_sums)")
        sg_log_s = sums / counts.clamp(min=1)
    sg_log_s = sg_log_s.detach().to(dtype)

    # GSPO-token: value s_r on every target, gradient s_r·∇logπ_θ(target).
    log_s_tok = sg_log_s[run_index] + logp_new - logp_new.detach()
    s_tok = torch.exp(torch.clamp(log_s_tok, max=log_ratio_clamp))
    adv = advantages.to(dtype)[run_index]
    unclipped = -adv * s_tok
    clipped = -adv * torch.clamp(s_tok, 1.0 - eps_low, 1.0 + eps_high)
    per_tok = torch.maximum(unclipped, clipped)
    if behav_weight is not None:
        per_tok = per_tok * behav_weight.detach().to(dtype)[run_index]

    weight = 1.0 / (targets_per_run.to(dtype)[run_index] * float(n_valid_runs))
    loss = (per_tok * weight).sum() if n else logp_new.sum() * 0.0

    with torch.no_grad():
        tok_clipped = clipped > unclipped
        run_clipped = torch.zeros(n_runs, dtype=torch.bool, device=logp_new.device)
        run_clipped[run_index[tok_clipped]] = True
        stats = GSPOStats(n_targets=n, n_clipped_targets=int(tok_clipped.sum()), run_present=present,
                          run_clipped=run_clipped, log_s=torch.clamp(sg_log_s, max=log_ratio_clamp))
    return loss, stats


def kl_penalty(logp_new: Tensor, logp_ref: Tensor, run_index: Tensor, targets_per_run: Tensor,
               n_valid_runs: int | float) -> tuple[Tensor, Tensor]:
    """This micro-batch's share of the KL anchor to the reference policy, weighted like the GSPO loss:
    (1/|R_valid|) Σ_r (1/|T_r|) Σ_t k3, with k3 = exp(ref − new) − (ref − new) − 1 per target: Schulman's
    non-negative, low-variance estimate of KL(π_θ ‖ π_ref) on the sampled tokens, whose gradient pulls a token's
    log-prob back towards the reference's (hard where the policy has dropped a token the reference was sure of).
    Also returns Σ_t k3 per run [R] (detached), for the `kl` metric."""
    if logp_ref.shape != logp_new.shape or run_index.shape != logp_new.shape:
        raise ValueError(f"logp_new {tuple(logp_new.shape)}, logp_ref {tuple(logp_ref.shape)} and run_index "
                         f"{tuple(run_index.shape)} must be the same 1-D shape")
    run_index = run_index.long()
    diff = logp_ref.to(logp_new.dtype) - logp_new
    k3 = torch.exp(torch.clamp(diff, max=LOG_RATIO_CLAMP)) - diff - 1.0
    weight = 1.0 / (targets_per_run.to(logp_new.dtype)[run_index] * float(n_valid_runs))
    per_run = torch.zeros(targets_per_run.shape[0], dtype=k3.dtype, device=k3.device).index_add_(
        0, run_index, k3.detach())
    return (k3 * weight).sum(), per_run
