"""The Megatron trainer's bf16 mixed precision (train.precision: bf16) against fp32 on CPU: one GSPO step from the
same checkpoint and batch at world 1, an exact resume, a bf16 satellite. The same step in model-parallel cells (TP2,
PP2, DP2, TP2×PP2, MoE DP2×EP2, TP2×DP2) is tests/test_dist_optimizer.py's, against these tolerances.

Tolerances come from bf16's 8-bit mantissa (one rounding ≈ 2^-9 ≈ 2e-3 relative, a few of them per layer): the loss
and the gradient norm within 1e-2 relative of fp32's; the updated weights within 5e-2 of the fp32 update's size
(‖w_bf16 − w_fp32‖ / ‖w_fp32 − w_0‖; AdamW's direction is bounded whatever the gradient, so this compares the
gradients). Measured on the tiny models (docs/cells.md): loss 2e-5, grad norm 1.5e-3, weights 1.3e-2 at world 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gyre_slurm.config import TrainSection
from gyre_slurm.train.backends import make_trainer
from gyre_slurm.train.megatron_trainer import MegatronTrainer
from gyre_slurm.train.torch_trainer import TorchTrainer
from tests.megatron_rank import hf_state, load_hf_state
from tests.test_trainer import build_tiny_qwen3, make_batch

REL = 1e-2  # loss and grad norm, relative
UPDATE_REL = 5e-2  # weights, relative to the fp32 step's update
ADAM_EPS = 1e-3  # as tests/test_megatron.py
RUNS = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2)}
OFFSETS = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2}
STEP = {"lr": 2e-2, "micro_batch_tokens": 64}  # runs straddle micro-batches: the bf16 grads accumulate


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tied"))


def trainer(model_dir: Path, **kw) -> MegatronTrainer:
    tr = MegatronTrainer(model_dir, device="cpu", seed=0, **STEP, **kw)
    for group in tr.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return tr


def state(tr) -> dict[str, torch.Tensor]:
    return hf_state(tr) if isinstance(tr, MegatronTrainer) else \
        {n: p.detach().clone() for n, p in tr.model.state_dict().items()}


def update_gap(got: dict, want: dict, start: dict) -> float:
    """‖got − want‖ / ‖want − start‖ over all weights."""
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    den = sum(float((want[n] - start[n]).pow(2).sum()) for n in want)
    assert den > 0, "the fp32 step moved no weight"
    return (num / den) ** 0.5


def assert_step_close(got: dict, want: dict) -> None:
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=REL), key
    assert got["clip_frac"] == want["clip_frac"] and got["optimizer_steps"] == want["optimizer_steps"] == 1


def test_bf16_step_is_within_tolerance_of_fp32(tied_dir):
    batch = make_batch(TorchTrainer(tied_dir, device="cpu", seed=0), 3, RUNS, length=48, offsets=OFFSETS)
    fp32 = trainer(tied_dir, precision="fp32")
    start = state(fp32)
    want = fp32.train_step(batch)
    bf16 = trainer(tied_dir, precision="bf16")
    got = bf16.train_step(batch)

    assert_step_close(got, want)
    gap = update_gap(state(bf16), state(fp32), start)
    assert gap <= UPDATE_REL, gap
    assert got["prepass_micro_batches"] > 0 and got["micro_batches"] > 1  # accumulated over micro-batches
    # bf16 weights and activations, fp32 masters (the optimizer's) that keep what bf16 rounds away
    assert {p.dtype for p in bf16.gpt.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in bf16.params} == {torch.float32}
    assert {s.dtype for st in bf16.optimizer.state.values() for s in st.values() if s.dim()} == {torch.float32}
    masters = dict(zip(bf16._gpt, bf16.params, strict=True))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    assert all(torch.equal(p, masters[n].bfloat16()) for n, p in bf16._gpt.items())


def test_bf16_resume_is_exact(tied_dir, tmp_path):
    """The version folder's optimizer state holds the fp32 masters: a trainer built from it takes the next step exactly
    as the one that saved it."""
    from gyre_slurm.train.optimizer_state import MASTER, key, read_index

    batch = make_batch(TorchTrainer(tied_dir, device="cpu", seed=0), 3, RUNS, length=48, offsets=OFFSETS)
    first = trainer(tied_dir, precision="bf16")
    first.train_step(batch)
    saved = first.save(tmp_path / "v1")
    index = read_index(saved)
    assert index.precision == "bf16" and MASTER in index.states
    on_disk = torch.load(saved / "optimizer.rank0-of-1.pt", weights_only=True)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(on_disk[key(MASTER, norm, (0,))], state(first)[norm])  # the master, not its bf16 rounding
    want = first.train_step(batch)
    again = trainer(saved, precision="bf16", resume_optimizer=True)
    got = again.train_step(batch)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(again.params, first.params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(again.gpt.parameters(), first.gpt.parameters(), strict=True))


def test_precision_setting(tied_dir):
    assert make_trainer(tied_dir, TrainSection(backend="megatron", precision="bf16"), device="cpu").precision == "bf16"
    assert make_trainer(tied_dir, TrainSection(backend="megatron"), device="cpu").precision == "fp32"  # auto, CPU
    with pytest.raises(ValidationError, match="train.precision: bf16 needs train.backend: megatron"):
        TrainSection(precision="bf16")
    with pytest.raises(ValueError, match="precision must be"):
        MegatronTrainer(tied_dir, device="cpu", precision="fp16")


def test_bf16_core_and_satellite_step_is_within_tolerance_of_one_fp32_cell(tied_dir, tmp_path):
    """A bf16 satellite's gradient message (fp32 main grads, Hugging Face names) adds into a bf16 core: the step is one
    fp32 cell's within the tolerances; weights the satellite pulls reach its bf16 weights and fp32 masters."""
    from gyre_slurm.train.shards import shard_id, split_batch
    from gyre_slurm.train.step_runner import CoreStep, SatelliteStep

    batch = make_batch(TorchTrainer(tied_dir, device="cpu", seed=0), 11, RUNS, offsets=OFFSETS)
    batch.step, batch.version_in = 5, 4
    one = trainer(tied_dir, precision="fp32")
    start = state(one)  # what a pull carries
    want = one.train_step(batch)
    shards = split_batch(batch, n_shards=2)
    core = CoreStep(trainer(tied_dir, precision="bf16"), 5, 4, [shard_id(s) for s in shards])
    sat_trainer = trainer(tied_dir, precision="bf16")
    with torch.no_grad():  # wrong weights first: the pull must replace them in the bf16 weights and the masters
        for p in sat_trainer.params:
            p.add_(0.1)
    sat = SatelliteStep(sat_trainer, name="sat")
    sat.load(tied_dir, 5, 4, pull=lambda tr: load_hf_state(tr, start))
    assert core.run_shard(shards[0])
    grads = sat.run_shard(shards[1])
    assert all(torch.equal(a, b) for a, b in zip(sat_trainer.params, core.trainer.params, strict=True))  # masters
    assert {g.dtype for g in grads.grads.values()} == {torch.float32}
    assert core.accept(grads) == "added"
    _, metrics = core.finish(tmp_path / "v5")
    assert metrics["satellites"] == 1
    assert metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=REL)
    gap = update_gap(state(core.trainer), state(one), start)
    assert gap <= UPDATE_REL, gap
