"""Optimizer mini-batches (train.minibatches, docs/algorithms.md §1.5 / §6.3): one rollout batch, several optimizer
steps; in decoupled mode π_prox is fixed at the step's starting weights, so GSPO's ratio and clip act."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gyre_slurm.train.batch import TrainBatch, TrainSample
from gyre_slurm.train.gspo import EPS_HIGH, EPS_LOW
from gyre_slurm.train.shards import split_indices
from tests.test_trainer import build_tiny_qwen3, make_batch, own_logprobs

RUNS = {1: (1.0, 2), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 1), 5: (0.8, 2), 6: (-0.4, 1), 7: (1.5, 1), 8: (-1.0, 2)}
OFFSETS = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2, 5: 0.0, 6: 2e-4, 7: 3e-3, 8: -1e-4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def trainer(model_dir: Path, **kw):
    from gyre_slurm.train.torch_trainer import TorchTrainer

    return TorchTrainer(model_dir, device="cpu", seed=0, **{"micro_batch_tokens": 60, **kw})


def params(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_one_minibatch_is_exactly_the_single_step_path(model_dir, mode):
    a = trainer(model_dir, mode=mode, lr=1e-2)
    b = trainer(model_dir, mode=mode, lr=1e-2, minibatches=1)
    assert a.minibatches == 1  # the default
    for seed in (0, 1):
        batch = make_batch(a, seed, RUNS, offsets=OFFSETS)
        got = a.train_step(batch)
        b.zero_grad()  # what train_step was before mini-batches: one forward_backward, one optimizer step
        want = b.forward_backward(batch)
        want.update(b.optimizer_step())
        for k, v in want.items():
            assert got[k] == v, k
        assert got["minibatches"] == 1 and got["optimizer_steps"] == 1 and got["later_clip_frac"] == 0
    for name, p in params(a).items():
        assert torch.equal(p, params(b)[name]), name


def test_decoupled_minibatches_make_the_ratio_and_the_clip_act(model_dir):
    tr = trainer(model_dir, mode="decoupled", lr=1e-2, minibatches=4)
    batch = make_batch(tr, 3, RUNS, offsets=OFFSETS)
    before = params(tr)
    m = tr.train_step(batch)
    parts = tr.last_minibatch_metrics
    assert m["minibatches"] == 4 and m["optimizer_steps"] == 4 and len(parts) == 4 and tr.steps == 4
    assert parts[0]["mean_abs_log_s"] < 1e-5  # θ = θ_old on the first mini-batch: s_r = 1 up to rounding
    assert all(p["mean_abs_log_s"] > 1e-3 for p in parts[1:])  # then θ moved away from π_prox
    assert m["later_mean_abs_log_s"] > 1e-3 and m["later_clip_frac"] > 0 and m["later_clip_frac_runs"] > 0
    assert m["later_frac_runs_s_outside_window"] > 0
    # Every run trained once; the behaviour weight comes from π_prox (θ_old) against λ on every part.
    assert m["runs"] == len(RUNS) and m["tokens_trained"] == sum(batch.targets_per_run.values())
    assert m["mean_log_w"] == pytest.approx(sum(OFFSETS.values()) / len(OFFSETS), abs=1e-5)
    assert any(not torch.equal(p, before[n]) for n, p in params(tr).items())
    # A learning rate too small to leave the window: the ratio moves but never clips.
    calm = trainer(model_dir, mode="decoupled", lr=1e-7, minibatches=4)
    q = calm.train_step(batch)
    assert q["later_clip_frac"] == 0 and 0 < q["later_mean_abs_log_s"] < 1e-4


def test_prox_gradient_equals_the_decoupled_objective_on_full_logits(model_dir):
    """forward_backward with π_prox, runs straddling micro-batches, against a direct computation (§6.3 B)."""
    tr = trainer(model_dir, mode="decoupled", lr=1e-2)
    runs = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2)}
    batch = make_batch(tr, 4, runs, offsets={1: 1e-4, 2: 5e-3, 3: -2e-3, 4: 1.0})
    prox = tr.proximal_logprobs(batch)
    for s, lp in zip(batch.samples, prox, strict=True):
        want = [x for x, m in zip(own_logprobs(tr, s), s.loss_mask, strict=True) if m]
        assert lp.tolist() == pytest.approx(want, abs=1e-5)
    tr.train_step(make_batch(tr, 5, runs))  # θ moves away from π_prox
    tr.zero_grad()
    m = tr.forward_backward(batch, prox=prox)
    assert m["prepass_micro_batches"] > 0 and m["w_trunc_frac"] == 0.25  # run 4: exp(1) > w_max = 2
    got = tr.export_grads()

    tr.zero_grad()
    terms = []
    for r, (adv, _) in runs.items():
        lp, old, behav = [], [], []
        for k, s in ((k, s) for k, s in enumerate(batch.samples) if s.run_id == r):
            logits = tr.model(input_ids=torch.tensor([s.tokens])).logits[0].double().log_softmax(-1)
            lp += [logits[i - 1, s.tokens[i]] for i in range(1, len(s.tokens)) if s.loss_mask[i]]
            old += prox[k].tolist()
            behav += [x for x, m_ in zip(s.behav_logp, s.loss_mask, strict=True) if m_]
        old_t, behav_t = torch.tensor(old, dtype=torch.float64), torch.tensor(behav, dtype=torch.float64)
        ratio = torch.exp((torch.stack(lp) - old_t).mean())
        w = torch.clamp(torch.exp((old_t - behav_t).mean()), max=tr.w_max)
        terms.append(w * torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv))
    ref = -torch.stack(terms).mean()
    ref.backward()
    assert m["loss"] == pytest.approx(ref.item(), abs=1e-5)
    for name, g in tr.export_grads().items():
        assert torch.allclose(got[name], g.float(), atol=1e-5, rtol=1e-4), name
    assert m["mean_abs_log_s"] > 1e-3 and 0 < m["clip_frac_runs"] <= 1


def test_bypass_minibatches_normalise_each_part_by_its_own_runs(model_dir):
    tr = trainer(model_dir, mode="bypass", lr=1e-3, minibatches=2)
    batch = make_batch(tr, 6, RUNS)  # behaviour = the trainer's own log-probs: s_r = 1 on the first part
    m = tr.train_step(batch)
    first, second = tr.last_minibatch_metrics
    parts = split_indices(batch, n_shards=2)
    first_runs = {batch.samples[i].run_id for i in parts[0]}
    assert first["n_valid_runs"] == first["runs"] == len(first_runs)
    assert first["loss"] == pytest.approx(-sum(RUNS[r][0] for r in first_runs) / len(first_runs), abs=1e-5)
    assert second["mean_abs_log_s"] > 0  # bypass: log s_r = mean(logπ_θ − λ), and θ has moved
    assert m["optimizer_steps"] == 2 and m["n_valid_runs"] == len(RUNS) and m["runs"] == len(RUNS)
    assert m["loss"] == pytest.approx((first["loss"] * first["runs"] + second["loss"] * second["runs"]) / len(RUNS))
    assert "mean_log_w" not in m


def test_bad_minibatch_values(model_dir):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="minibatches"):
            trainer(model_dir, minibatches=bad)
    tr = trainer(model_dir, mode="decoupled", minibatches=10)  # more than the batch's runs: clamped
    m = tr.train_step(make_batch(tr, 7, {1: (1.0, 1), 2: (-1.0, 2), 3: (0.5, 1)}))
    assert m["minibatches"] == 3 and m["optimizer_steps"] == 3 and tr.steps == 3
    before = params(tr)
    empty = TrainBatch([TrainSample(1, [1, 2, 3], [0, 0, 0], [0.0] * 3)], {}, {}, step=0, version_in=0)
    m = tr.train_step(empty)
    assert m["skipped"] == 1 and m["optimizer_steps"] == 0 and m["runs"] == 0
    assert all(torch.equal(p, before[n]) for n, p in params(tr).items())
    with pytest.raises(ValueError, match="decoupled"):
        trainer(model_dir, mode="bypass").forward_backward(empty, prox=[torch.zeros(0)])
