"""The harness of the model-parallel Megatron cell tests on CPU: several processes over gloo (world 2 and 4), each a
trainer rank started as a cell's launcher starts one (RANK, WORLD_SIZE, MASTER_ADDR; tests/megatron_rank.py), the
models they train, and the comparison with the same program at world 1 (logits of a fixed input, the weights after
every step within 1e-5). The layouts themselves (TP2, PP2, DP2, TP2×PP2, MoE DP2×EP2, TP2×DP2), each one spawned
world doing several checks, are tests/test_dist_optimizer.py's."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_slurm.spawn import free_port
from gyre_slurm.train.torch_trainer import TorchTrainer
from tests.test_megatron import build_untied_qwen3
from tests.test_trainer import VOCAB, build_tiny_qwen3, make_batch

from .conftest import REPO

TOL = 1e-5
ADAM_EPS = 1e-3  # AdamW's update is smooth in g (as tests/test_megatron.py), so weights compare the gradients
RUNS = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2), 5: (0.8, 2)}
OFFSETS = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2, 5: 0.0}  # inside and outside the clip window
JOBS = [{"trainer": {"mode": m, "minibatches": 2, "lr": 2e-2, "micro_batch_tokens": 64}}
        for m in ("bypass", "decoupled")]


def build_models(root: Path) -> dict[str, Path]:
    """The three models the cells train (tests/test_megatron_checkpoints.py cuts the same ones)."""
    from gyre_slurm.model.tiny import build_tiny_moe

    # the untied model: 4 layers (2 per stage at PP=2), 2 query heads per KV group
    return {"tied": build_tiny_qwen3(root / "tied"),
            "untied": build_untied_qwen3(root / "untied", layers=4, heads=4, ffn=96, seed=2),
            "moe": build_tiny_moe(root / "moe")}


def cell_inputs(root: Path, name: str, d: Path) -> tuple[Path, Path, Path]:
    """(model folder, pickled batch, logits input) of one model, as run_cell takes them."""
    batch = make_batch(TorchTrainer(d, device="cpu", seed=0), 3, RUNS, length=48, offsets=OFFSETS)
    (root / f"{name}.batch").write_bytes(pickle.dumps(batch))
    vocab = min(VOCAB, json.loads((d / "config.json").read_text())["vocab_size"])
    torch.save(torch.randint(0, vocab, (3, 29), generator=torch.Generator().manual_seed(5)), root / f"{name}.x")
    return d, root / f"{name}.batch", root / f"{name}.x"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Model folders, a batch and an input per model, and world 1's results (computed once per model)."""
    root = tmp_path_factory.mktemp("cells")
    inputs = {name: cell_inputs(root, name, d) for name, d in build_models(root).items()}
    ref: dict[str, dict] = {}

    def reference(name: str) -> dict:
        if name not in ref:
            ref[name] = run_cell(root / f"ref-{name}", *inputs[name], {})
        return ref[name]

    return inputs, reference


def start_cell(where: Path, model_dir: Path, batch: Path, x: Path, sizes: dict[str, int],
               jobs: list[dict] = JOBS) -> list[subprocess.Popen]:
    """Start the cell's ranks (one process each) on a spec written to `where`."""
    where.mkdir(parents=True, exist_ok=True)
    full = {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "expert_parallel": 1, **sizes}
    n = full["tensor_parallel"] * full["pipeline_parallel"] * full["data_parallel"]
    spec = where / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "batch": str(batch), "x": str(x), "sizes": full,
                                "jobs": jobs, "adam_eps": ADAM_EPS, "out": str(where / "out.pt")}))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "WORLD_SIZE": str(n),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return [subprocess.Popen([sys.executable, "-m", "tests.megatron_rank", str(spec)], cwd=REPO,
                             env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for r in range(n)]


def wait_cell(procs: list[subprocess.Popen], timeout: float = 900) -> list[str]:
    """Each rank's output once all have exited; past the timeout every rank is killed and TimeoutExpired raised."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            raise
    return outs


def run_cell(where: Path, model_dir: Path, batch: Path, x: Path, sizes: dict[str, int],
             jobs: list[dict] = JOBS, timeout: float = 900) -> dict:
    """Start the cell's ranks, wait for all (each must exit 0), return the leader's results."""
    procs = start_cell(where, model_dir, batch, x, sizes, jobs)
    outs = wait_cell(procs, timeout)
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-4000:]}"
    return torch.load(where / "out.pt", weights_only=False)


def assert_same(got: dict, want: dict) -> None:
    diff = float((got["logits"] - want["logits"]).abs().max())
    assert diff <= TOL, f"logits differ by {diff:.2e}"
    for job, (g_steps, w_steps) in enumerate(zip(got["jobs"], want["jobs"], strict=True)):
        for g, w in zip(g_steps, w_steps, strict=True):
            assert set(g["state"]) == set(w["state"])
            worst = max((float((g["state"][n] - w["state"][n]).abs().max()), n) for n in w["state"])
            assert worst[0] <= TOL, f"job {job}: {worst[1]} differs by {worst[0]:.2e}"
            for key in ("loss", "grad_norm", "clip_frac", "tokens_trained", "runs", "optimizer_steps"):
                assert g["metrics"][key] == pytest.approx(w["metrics"][key], rel=1e-5, abs=1e-6), key
