"""GSPO loss (docs/algorithms.md §1.5) against a direct float64 implementation of the paper's sequence objective."""

from __future__ import annotations

import math
import random
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


# --- Independent references written from docs/algorithms.md §1.1, §1.5, §3.3, §6.3 -------------------------------
# Plain Python loops over runs and tokens in float64; nothing from gyre_slurm.train.gspo is used on this side.
SPEC_EPS_LOW, SPEC_EPS_HIGH = 3e-4, 4e-4  # §1.5 defaults (the paper's clip range)


def spec_loss(new: torch.Tensor, old: list[float], run_of: list[int], adv: dict[int, float],
              w: dict[int, float] | None = None) -> torch.Tensor:
    """L = (1/|R|) Σ_r w_r · −min(s_r Â_r, clip(s_r, 1−ε_lo, 1+ε_hi) Â_r),  s_r = exp((1/|T_r|) Σ_{t∈T_r}
    (logπ_θ(t) − logπ_old(t))). Bypass: old = behaviour log-probs λ, w_r = 1. Decoupled (§6.3 B): old = π_prox
    from a separate forward, w_r = min(exp((1/|T_r|) Σ (logπ_prox − λ)), w_max), no gradient.
    `new` is a float64 tensor (with grad); old, run_of: one entry per target, in any order."""
    runs = sorted(set(run_of))
    total = torch.zeros((), dtype=torch.float64)
    for r in runs:
        log_ratio_sum = torch.zeros((), dtype=torch.float64)
        count = 0
        for k in range(len(run_of)):
            if run_of[k] == r:
                log_ratio_sum = log_ratio_sum + (new[k] - old[k])
                count += 1
        s = torch.exp(log_ratio_sum / count)
        clipped_s = torch.clamp(s, 1.0 - SPEC_EPS_LOW, 1.0 + SPEC_EPS_HIGH)
        objective = torch.minimum(s * adv[r], clipped_s * adv[r])
        total = total - (1.0 if w is None else w[r]) * objective
    return total / len(runs)


def spec_grad(new: list[float], old: list[float], run_of: list[int], adv: dict[int, float],
              w: dict[int, float] | None = None) -> list[float]:
    """§1.1's gradient in closed form: each target of an unclipped run gets −w_r s_r Â_r / (|T_r| |R|); a run on
    the clipped side (Â>0 with s > 1+ε_hi, Â<0 with s < 1−ε_lo) gets none."""
    runs = sorted(set(run_of))
    out = [0.0] * len(new)
    for r in runs:
        idx = [k for k in range(len(run_of)) if run_of[k] == r]
        s = math.exp(sum(new[k] - old[k] for k in idx) / len(idx))
        a = adv[r]
        if (a > 0 and s > 1.0 + SPEC_EPS_HIGH) or (a < 0 and s < 1.0 - SPEC_EPS_LOW):
            continue
        for k in idx:
            out[k] = -(1.0 if w is None else w[r]) * s * a / (len(idx) * len(runs))
    return out


def spec_behaviour_weight(prox: list[float], behav: list[float], run_of: list[int], w_max: float) -> dict[int, float]:
    """§6.3 (B): log w_r = mean_{T_r}(logπ_prox − λ) (geometric mean), truncated at w_max."""
    out = {}
    for r in sorted(set(run_of)):
        idx = [k for k in range(len(run_of)) if run_of[k] == r]
        out[r] = min(math.exp(sum(prox[k] - behav[k] for k in idx) / len(idx)), w_max)
    return out


# Per-run mean log-ratios: inside the window (|x| < 3e-4), above it, below it; the signs of Â are set below so that
# both clipped sides and both unclipped sides occur.
RATIO_OFFSETS = [1e-4, -2e-4, 2e-3, -2e-3, 8e-4, -6e-3, 3e-2, 0.0, -9e-4]
ADV_SIGNS = [1, -1, 1, 1, -1, -1, -1, 1, -1]  # (2e-3,+), (-6e-3,-), (3e-2,-)... clipped and unclipped on both sides
# Per-run mean log(π_prox/λ): w_r below 1, near 1, and above w_max = 2 (log 2 ≈ 0.693), so truncation happens.
WEIGHT_OFFSETS = [-0.3, 0.0, 0.2, 0.9, -0.05, 1.2, 0.5, 0.05, 0.75]
W_MAX = 2.0


def spec_case(seed: int, shuffle: bool = True):
    """Random targets of 9 runs with lengths 1..40, interleaved in random order like targets of several segments.

    Returns python lists: new (π_θ), prox (π_prox), behav (λ), run_of, adv (float32-exact values)."""
    rng = random.Random(seed)
    lengths = [1, *[rng.randint(2, 40) for _ in range(len(RATIO_OFFSETS) - 1)]]
    run_of = [r for r, n in enumerate(lengths) for _ in range(n)]
    if shuffle:
        rng.shuffle(run_of)

    def centred_noise(scale: float) -> list[float]:
        noise = [rng.gauss(0.0, scale) for _ in run_of]
        mean = {r: sum(x for x, q in zip(noise, run_of, strict=True) if q == r) / lengths[r] for r in set(run_of)}
        return [x - mean[q] for x, q in zip(noise, run_of, strict=True)]

    new = [-rng.uniform(0.5, 5.0) for _ in run_of]
    n1, n2 = centred_noise(0.01), centred_noise(0.05)
    prox = [x - RATIO_OFFSETS[r] - e for x, r, e in zip(new, run_of, n1, strict=True)]
    behav = [p - WEIGHT_OFFSETS[r] - e for p, r, e in zip(prox, run_of, n2, strict=True)]
    adv = {r: float(torch.tensor(sign * rng.uniform(0.1, 2.0), dtype=torch.float32)) for r, sign in
           enumerate(ADV_SIGNS)}
    return new, prox, behav, run_of, adv


def assert_close_lists(got: list[float], want: list[float], tol: float = 1e-6) -> None:
    assert len(got) == len(want)
    worst = max(abs(x - y) for x, y in zip(got, want, strict=True))
    assert worst < tol, worst


@pytest.mark.parametrize("seed", range(6))
def test_bypass_matches_spec_reference(seed):
    new, _, behav, run_of, adv = spec_case(seed)
    run_index = torch.tensor(run_of)
    counts = torch.tensor([run_of.count(r) for r in range(len(adv))])
    advantages = torch.tensor([adv[r] for r in range(len(adv))], dtype=torch.float64)
    got_new = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    loss, stats = gspo_loss(got_new, torch.tensor(behav, dtype=torch.float64), run_index, advantages, counts,
                            n_valid_runs=len(adv))
    loss.backward()
    ref_new = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    ref = spec_loss(ref_new, behav, run_of, adv)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    assert_close_lists(got_new.grad.tolist(), ref_new.grad.tolist())
    assert_close_lists(got_new.grad.tolist(), spec_grad(new, behav, run_of, adv))
    # the case really covers both clip sides, unclipped runs of both signs, and zero-gradient runs
    clipped = [r for r in range(len(adv)) if all(g == 0 for g, q in zip(ref_new.grad.tolist(), run_of, strict=True)
                                                 if q == r)]
    assert 0 < len(clipped) < len(adv) and 0 < stats.clip_frac_runs < 1
    assert {adv[r] > 0 for r in clipped} == {True, False}
    assert {adv[r] > 0 for r in range(len(adv)) if r not in clipped} == {True, False}


@pytest.mark.parametrize("seed", range(6))
def test_decoupled_matches_spec_reference(seed):
    """§6.3 (B) with θ ≠ θ_prox (e.g. a later mini-batch): old = π_prox, w_r from π_prox and λ, truncated."""
    new, prox, behav, run_of, adv = spec_case(seed)
    n_runs = len(adv)
    run_index = torch.tensor(run_of)
    counts = torch.tensor([run_of.count(r) for r in range(n_runs)])
    advantages = torch.tensor([adv[r] for r in range(n_runs)], dtype=torch.float64)
    prox_t, behav_t = torch.tensor(prox, dtype=torch.float64), torch.tensor(behav, dtype=torch.float64)
    # The implementation's side, as the trainer builds w_r: per-run sums, exp, truncation.
    sums, _ = run_log_ratio_sums(prox_t, behav_t, run_index, n_runs)
    w_impl = torch.clamp(torch.exp(sums / counts), max=W_MAX)
    got_new = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    loss, _ = gspo_loss(got_new, prox_t, run_index, advantages, counts, n_runs, behav_weight=w_impl)
    loss.backward()

    w = spec_behaviour_weight(prox, behav, run_of, W_MAX)
    assert sum(v == W_MAX for v in w.values()) >= 2 and min(w.values()) < 1  # truncation happens, and w < 1
    assert_close_lists(w_impl.tolist(), [w[r] for r in range(n_runs)], 1e-12)
    ref_new = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    ref = spec_loss(ref_new, prox, run_of, adv, w)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-6
    assert_close_lists(got_new.grad.tolist(), ref_new.grad.tolist())
    assert_close_lists(got_new.grad.tolist(), spec_grad(new, prox, run_of, adv, w))
    # Sanity: the behaviour weight matters (the bypass reference on the same data differs).
    assert abs(spec_loss(torch.tensor(new, dtype=torch.float64), behav, run_of, adv).item() - ref.item()) > 1e-3


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
@pytest.mark.parametrize("budget", [100_000, 60])
def test_trainer_loss_and_gradient_match_spec(tiny_policy_dir, monkeypatch, mode, budget):
    """The torch trainer's whole path (packing, pre-pass, per-run mean, bypass / decoupled maths) against the
    spec, with the model's log-probs replaced by free float64 parameters so the gradient wrt each current
    log-prob is visible. In decoupled mode the trainer's π_prox is the step-start θ (one optimizer step per
    batch), so the reference uses π_prox = the current values, held constant."""
    from gyre_slurm.train import torch_trainer
    from gyre_slurm.train.batch import TrainBatch, TrainSample

    rng = random.Random(7)
    adv = spec_case(11)[4]
    n_runs = len(adv)
    offsets = RATIO_OFFSETS if mode == "bypass" else WEIGHT_OFFSETS
    # Multi-segment runs: run r has 1..3 segments; target k of the batch is token id k + 1 (the fake's index).
    layout, theta, run_of = [], [], []
    for r in range(n_runs):
        for _ in range(1 + r % 3):
            tokens = [0]
            for _ in range(rng.randint(8, 40) - 1):
                if rng.random() < 0.5:
                    theta.append(-rng.uniform(0.5, 5.0))
                    run_of.append(r)
                    tokens.append(len(theta))
                else:
                    tokens.append(0)
            layout.append((r, tokens))
    assert all(run_of.count(r) > 0 for r in range(n_runs))
    noise = [rng.gauss(0.0, 0.01) for _ in run_of]
    mean_noise = {r: sum(e for e, q in zip(noise, run_of, strict=True) if q == r) / run_of.count(r)
                  for r in range(n_runs)}
    behav = [t - offsets[r] - (e - mean_noise[r]) for t, r, e in zip(theta, run_of, noise, strict=True)]
    samples = [TrainSample(1000 + r, tokens, [int(t > 0) for t in tokens], [behav[t - 1] if t else 0.0 for t in tokens])
               for r, tokens in layout]
    batch = TrainBatch(samples, {1000 + r: adv[r] for r in range(n_runs)},
                       {1000 + r: run_of.count(r) for r in range(n_runs)}, step=0, version_in=0)

    params = torch.tensor(theta, dtype=torch.float64, requires_grad=True)

    def fake_target_logprobs(model, input_ids, target_mask):
        return params[input_ids[:, 1:][target_mask[:, 1:]] - 1]

    monkeypatch.setattr(torch_trainer, "target_logprobs", fake_target_logprobs)
    tr = torch_trainer.TorchTrainer(tiny_policy_dir, device="cpu", micro_batch_tokens=budget, mode=mode,
                                    w_max=W_MAX)
    m = tr.forward_backward(batch)
    assert (m["prepass_micro_batches"] > 0) == (budget < 1000)

    ref_new = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    if mode == "bypass":
        ref = spec_loss(ref_new, behav, run_of, adv)
        want_grad = spec_grad(theta, behav, run_of, adv)
    else:
        w = spec_behaviour_weight(theta, behav, run_of, W_MAX)
        assert sum(v == W_MAX for v in w.values()) >= 2
        ref = spec_loss(ref_new, list(theta), run_of, adv, w)
        want_grad = spec_grad(theta, list(theta), run_of, adv, w)
    ref.backward()
    assert abs(m["loss"] - ref.item()) < 1e-6
    assert_close_lists(params.grad.tolist(), ref_new.grad.tolist())
    assert_close_lists(params.grad.tolist(), want_grad)


@pytest.fixture(scope="module")
def tiny_policy_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("policy")
    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    return d


def test_a_run_with_five_branches_weighs_the_same_as_a_run_with_one():
    """Through RunTree.segments and the loss: run 0 has 5 root-to-leaf paths (a main conversation, two retries,
    a sub-agent, a summary), run 1 a single path. With the same Â and s_r, each run's targets get the same total
    gradient and contribute the same loss, whatever their number of segments and targets."""
    from gyre_slurm.trajectory.tree import RunTree

    def lp(n: int) -> list[float]:
        return [-0.5 - 0.01 * i for i in range(n)]

    branchy = RunTree()
    p = [1, 2, 3]
    branchy.insert_call(p, [10, 11, 12], lp(3), 0)
    branchy.insert_call(p, [13, 14], lp(2), 0)  # a retry of the first call: sibling
    p2 = p + [10, 11, 12, 4, 5]
    branchy.insert_call(p2, [15, 16, 17, 18], lp(4), 0)
    branchy.insert_call(p2, [19], lp(1), 0)  # another retry
    branchy.insert_call([7, 8], [20, 21, 22], lp(3), 0, kind="subagent")
    branchy.insert_call([9], [30, 31], lp(2), 0, kind="main_summary")
    linear = RunTree()
    linear.insert_call([1, 2], [40, 41], lp(2), 0)
    linear.insert_call([1, 2, 40, 41, 6], [42], lp(1), 0)

    per_run = [branchy.segments(), linear.segments()]
    assert len(per_run[0][0]) == 5 and len(per_run[1][0]) == 1
    old, run_of = [], []
    for r, (segs, n) in enumerate(per_run):
        mine = [lp_ for s in segs for lp_, m in zip(s.behav_logp, s.loss_mask, strict=True) if m]
        assert len(mine) == n
        old += mine
        run_of += [r] * n
    run_index = torch.tensor(run_of)
    counts = torch.tensor([per_run[0][1], per_run[1][1]])
    assert counts.tolist() == [15, 3]
    for offset in (0.0, 1e-4, -2e-4):  # s_r inside the clip window
        new = (torch.tensor(old, dtype=torch.float64) + offset).requires_grad_()
        adv = torch.tensor([0.8, 0.8], dtype=torch.float64)
        loss, _ = gspo_loss(new, torch.tensor(old, dtype=torch.float64), run_index, adv, counts, 2)
        loss.backward()
        g0, g1 = new.grad[run_index == 0].sum().item(), new.grad[run_index == 1].sum().item()
        assert g0 == pytest.approx(g1, rel=1e-12) and g0 == pytest.approx(-0.8 * math.exp(offset) / 2, rel=1e-12)
        halves = [gspo_loss(new.detach(), torch.tensor(old, dtype=torch.float64), run_index,
                            adv * torch.tensor([1.0 - r, float(r)], dtype=torch.float64), counts, 2)[0].item()
                  for r in (0, 1)]
        assert halves[0] == pytest.approx(halves[1], rel=1e-12)
        ref = spec_loss(new.detach().clone().requires_grad_(), old, run_of, {0: 0.8, 1: 0.8})
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
