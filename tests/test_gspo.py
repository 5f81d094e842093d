"""GSPO loss (ALGORITHMS.md §1.5) against a direct float64 implementation of the paper's sequence objective."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from gyre_slurm.train.gspo import EPS_HIGH, EPS_LOW, gspo_loss, run_log_ratio_sums


def reference_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, run_index: torch.Tensor,
                   adv: torch.Tensor) -> torch.Tensor:
    """−J with J = (1/|R|) Σ_r min(s_r Â_r, clip(s_r, 1−ε_lo, 1+ε_hi) Â_r), s_r = exp(mean_t(logπ_θ − logπ_old)).

    Written run by run, no stop-gradient, no shared code with the implementation.
    """
    terms = []
    for r in range(adv.shape[0]):
        sel = run_index == r
        if not bool(sel.any()):
            continue
        s = torch.exp((logp_new[sel] - logp_old[sel]).mean())
        terms.append(torch.min(s * adv[r], torch.clamp(s, 1 - EPS_LOW, 1 + EPS_HIGH) * adv[r]))
    return -torch.stack(terms).mean()


def make_case(seed: int, n_runs: int = 8):
    """Runs of random length whose mean log-ratio sits inside the clip window for some, outside for others."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n_runs,), generator=g)
    run_index = torch.repeat_interleave(torch.arange(n_runs), lengths)
    n = int(lengths.sum())
    logp_old = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    noise = torch.randn(n, generator=g, dtype=torch.float64) * 0.01
    # Remove the per-run noise mean so the run's offset alone decides where s_r lands.
    noise_mean = torch.zeros(n_runs, dtype=torch.float64).index_add_(0, run_index, noise) / lengths
    offsets = torch.tensor([1e-4, -1e-4, 2e-3, -2e-3, 5e-5, -5e-3, 3e-2, -2e-4], dtype=torch.float64)[:n_runs]
    logp_new = logp_old + noise - noise_mean[run_index] + offsets[run_index]
    adv = torch.randn(n_runs, generator=g, dtype=torch.float64)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1  # both signs for sure
    adv[2], adv[5] = abs(adv[2]) + 0.1, -abs(adv[5]) - 0.1  # s above the window with Â>0, below with Â<0: clipped
    adv[3] = abs(adv[3]) + 0.1  # s below the window with Â>0: not clipped
    return logp_new, logp_old, run_index, adv, lengths


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_matches_paper_objective_value_and_gradient(seed):
    logp_new, logp_old, run_index, adv, lengths = make_case(seed)
    a = logp_new.clone().requires_grad_()
    loss, stats = gspo_loss(a, logp_old, run_index, adv, lengths, n_valid_runs=adv.shape[0])
    loss.backward()
    b = logp_new.clone().requires_grad_()
    ref = reference_loss(b, logp_old, run_index, adv)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=0)
    # Offsets ±2e-3, −5e-3 and 3e-2 are outside the window: some runs clip (which ones depends on Â's sign).
    assert 0 < stats.clip_frac_runs < 1
    assert stats.mean_abs_log_s == pytest.approx(
        float(sum(abs(x) for x in [1e-4, -1e-4, 2e-3, -2e-3, 5e-5, -5e-3, 3e-2, -2e-4])) / 8, rel=1e-6)


def test_clipped_side_has_no_gradient_and_both_signs():
    # A>0 with s above the window: clipped (no gradient). A<0 with s above: not clipped (pushes down).
    lo = torch.zeros(4, dtype=torch.float64)
    run_index = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    new = (lo + 1e-2).requires_grad_()
    loss, stats = gspo_loss(new, lo, run_index, adv, torch.tensor([2, 2]), 2)
    loss.backward()
    assert torch.all(new.grad[:2] == 0)
    assert torch.all(new.grad[2:] > 0)  # loss grows with logπ of a negative-advantage run
    assert stats.clip_frac_tokens == 0.5 and stats.clip_frac_runs == 0.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_micro_batch_split_equals_one_shot(seed):
    logp_new, logp_old, run_index, adv, lengths = make_case(seed)
    n, n_runs = logp_new.shape[0], adv.shape[0]
    one = logp_new.clone().requires_grad_()
    loss_one, stats_one = gspo_loss(one, logp_old, run_index, adv, lengths, n_runs)
    loss_one.backward()

    # Cut at arbitrary points (runs straddle cuts), pre-pass for sg[log s_r], then accumulate.
    cuts = [0, n // 5, n // 2, n // 2 + 3, n]
    sums = torch.zeros(n_runs, dtype=torch.float64)
    for lo, hi in pairwise(cuts):
        s, _ = run_log_ratio_sums(logp_new[lo:hi], logp_old[lo:hi], run_index[lo:hi], n_runs)
        sums += s
    sg_log_s = sums / lengths
    split = logp_new.clone().requires_grad_()
    total, stats = 0.0, None
    for lo, hi in pairwise(cuts):
        part, st = gspo_loss(split[lo:hi], logp_old[lo:hi], run_index[lo:hi], adv, lengths, n_runs, sg_log_s=sg_log_s)
        total = total + part
        stats = st if stats is None else stats.merge(st)
    total.backward()
    assert abs(total.item() - loss_one.item()) < 1e-12
    assert torch.allclose(split.grad, one.grad, atol=1e-12, rtol=0)
    assert stats.as_dict() == pytest.approx(stats_one.as_dict())


def test_split_run_without_pre_pass_is_refused():
    logp_new, logp_old, run_index, adv, lengths = make_case(0)
    with pytest.raises(ValueError, match="span micro-batches"):
        gspo_loss(logp_new[:5], logp_old[:5], run_index[:5], adv, lengths, adv.shape[0])


def test_per_run_mean_segments_do_not_add_weight():
    # Run 0: 5 segments of 30 targets; run 1: one segment of 3. Each run's targets get total gradient −Â_r/|R|.
    seg = 30
    run_index = torch.tensor([0] * (5 * seg) + [1] * 3)
    counts = torch.tensor([5 * seg, 3])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    old = -torch.rand(run_index.shape[0], dtype=torch.float64)
    new = old.clone().requires_grad_()  # s_r = 1: inside the window
    sums, _ = run_log_ratio_sums(new, old, run_index, 2)
    sg = sums / counts
    total = 0.0
    bounds = [0, seg, 2 * seg, 3 * seg, 4 * seg, 5 * seg, 5 * seg + 3]  # micro-batch per segment
    for lo, hi in pairwise(bounds):
        part, _ = gspo_loss(new[lo:hi], old[lo:hi], run_index[lo:hi], adv, counts, 2, sg_log_s=sg)
        total = total + part
    total.backward()
    assert total.item() == pytest.approx(-1.0)
    assert new.grad[run_index == 0].sum().item() == pytest.approx(-0.5)
    assert new.grad[run_index == 1].sum().item() == pytest.approx(-0.5)


def test_behaviour_weight_scales_run_and_float32_close():
    logp_new, logp_old, run_index, adv, lengths = make_case(7)
    w = torch.linspace(0.5, 1.5, adv.shape[0], dtype=torch.float64)
    a = logp_new.clone().requires_grad_()
    loss_w, _ = gspo_loss(a, logp_old, run_index, adv, lengths, adv.shape[0], behav_weight=w)
    loss_w.backward()
    # Per-run terms scale by w_r: compare with per-run reference terms.
    ref_terms = torch.stack([reference_loss(logp_new, logp_old, run_index, torch.where(
        torch.arange(adv.shape[0]) == r, adv, torch.zeros_like(adv))) for r in range(adv.shape[0])])
    assert loss_w.item() == pytest.approx(float((ref_terms * w).sum()), abs=1e-9)
    f32, _ = gspo_loss(logp_new.float(), logp_old.float(), run_index, adv.float(), lengths, adv.shape[0])
    assert f32.dtype == torch.float32
    assert abs(f32.item() - reference_loss(logp_new, logp_old, run_index, adv).item()) < 1e-5


def test_log_ratio_clamp():
    old = torch.zeros(2, dtype=torch.float64)
    new = torch.full((2,), 50.0, dtype=torch.float64, requires_grad=True)
    loss, stats = gspo_loss(new, old, torch.tensor([0, 0]), torch.tensor([-1.0], dtype=torch.float64),
                            torch.tensor([2]), 1)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(torch.exp(torch.tensor(10.0)).item())
    assert stats.mean_abs_log_s == 10.0
