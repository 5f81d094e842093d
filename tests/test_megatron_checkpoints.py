"""Checkpoints of model-parallel Megatron cells: every layout's cut of a Hugging Face folder into the ranks' slices
and back is bit-exact, and a TP2 cell whose rank was killed with -9 right after saving a version resumes from that
folder (weights and every rank's optimizer state) exactly as the uninterrupted cell goes on."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gyre_slurm.model.qwen3 import Qwen3Config
from gyre_slurm.train.megatron_shard import (
    RankCoords,
    assemble,
    folder_reader,
    hf_cut,
    hf_pieces,
    local_state,
    local_tensors,
    state_reader,
)
from tests.test_megatron_parallel import build_models, cell_inputs, run_cell, start_cell, wait_cell

pytestmark = pytest.mark.slow
TOL = 1e-6
LAYOUTS = {
    "tp2": [RankCoords(tp=2, tp_rank=t) for t in range(2)],
    "pp2": [RankCoords(pp=2, pp_rank=p) for p in range(2)],
    "tp2xpp2": [RankCoords(tp=2, tp_rank=t, pp=2, pp_rank=p) for p in range(2) for t in range(2)],
    "ep2": [RankCoords(ep=2, ep_rank=e) for e in range(2)],  # dp 2 × ep 2: each DP rank its half of the experts
}
MODES = ("bypass", "decoupled")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_models(tmp_path_factory.mktemp("models"))


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def senders(cfg: Qwen3Config, c: RankCoords):
    """As MegatronTrainer._senders: a tensor the EP ranks replicate (they are DP ranks) is sent by EP rank 0."""
    return [lt for lt in local_tensors(cfg, c) if c.ep_rank == 0 or ".local_experts." in lt.name]


@pytest.mark.parametrize(("model", "layout"),
                         [(m, lay) for m in ("tied", "untied") for lay in ("tp2", "pp2", "tp2xpp2")] + [("moe", "ep2")])
def test_sharded_round_trip_is_bit_exact(models, model, layout):
    folder = models[model]
    cfg = Qwen3Config.from_pretrained(folder)
    state = hf_state(folder)
    pieces = []
    for c in LAYOUTS[layout]:
        mine = local_state(cfg, c, state_reader(state, c))
        read = local_state(cfg, c, folder_reader(folder, c))  # the slices a rank reads from the files alone
        assert list(read) == list(mine) == [lt.name for lt in local_tensors(cfg, c)]
        for n, t in mine.items():
            assert read[n].dtype == t.dtype and torch.equal(read[n], t), (c, n)
        if cfg.tie_word_embeddings and c.pp > 1 and c.last_stage:  # the last stage's own copy of the embedding
            assert torch.equal(mine["output_layer.weight"], hf_cut(state["model.embed_tokens.weight"], 0, c))
        pieces += hf_pieces(cfg, c, mine, senders(cfg, c))
    back = assemble(pieces)
    assert sorted(back) == sorted(state)
    for n, t in state.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n


def job(mode: str, **kw) -> dict:
    """A job of tests/megatron_rank.py; the warm-up makes the resumed step count matter, not only AdamW's moments."""
    trainer = {"mode": mode, "minibatches": 2, "lr": 2e-2, "micro_batch_tokens": 64, "lr_warmup_steps": 4}
    return {**kw, "trainer": {**trainer, **kw.get("trainer", {})}}


def state_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def test_rank_killed_after_save_resumes_exactly(models, tmp_path):
    d, batch, x = cell_inputs(tmp_path, "tied", models["tied"])
    tp2 = {"tensor_parallel": 2}
    want = run_cell(tmp_path / "uninterrupted", d, batch, x, tp2, [job(m, steps=2) for m in MODES])

    saved = {m: tmp_path / f"v1-{m}" for m in MODES}
    first = [job(m, steps=1, save_to=str(saved[m])) for m in MODES]
    first[-1]["kill_rank_after_save"] = 1
    procs = start_cell(tmp_path / "first-life", d, batch, x, tp2, first)
    outs = wait_cell(procs, timeout=600)
    assert procs[1].returncode == -signal.SIGKILL, f"rank 1 exited {procs[1].returncode}:\n{outs[1][-4000:]}"
    for m, folder in saved.items():  # the other rank's exit is not looked at: the folder must be whole anyway
        names = {f.name for f in folder.iterdir()}
        assert {"config.json", "optimizer.index.json", "optimizer.rank0-of-2.pt", "optimizer.rank1-of-2.pt"} <= names, m
        on_disk, step1 = hf_state(folder), want["jobs"][MODES.index(m)][0]["state"]
        assert state_diff(on_disk, {n: step1[n] for n in on_disk}) <= TOL, m  # the weights after step 1

    second = [job(m, model_dir=str(saved[m]), trainer={"resume_optimizer": True}) for m in MODES]
    second.append(job("bypass", model_dir=str(saved["bypass"])))  # the same weights, AdamW and warm-up from zero
    got = run_cell(tmp_path / "second-life", d, batch, x, tp2, second)
    for k, m in enumerate(MODES):
        resumed, uninterrupted = got["jobs"][k][0], want["jobs"][k][1]
        diff = state_diff(resumed["state"], uninterrupted["state"])
        assert diff <= TOL, f"{m}: resumed weights differ by {diff:.2e}"
        for key in ("loss", "grad_norm"):
            assert abs(resumed["metrics"][key] - uninterrupted["metrics"][key]) <= TOL, (m, key)
        assert resumed["metrics"]["optimizer_steps"] == 2
    fresh = state_diff(got["jobs"][-1][0]["state"], want["jobs"][0][1]["state"])
    assert fresh > 100 * TOL, f"resuming without the optimizer state differs by only {fresh:.2e}"
