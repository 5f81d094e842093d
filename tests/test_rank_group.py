"""The rank group a node agent leads (train/rank_group.py): rank 0 in this process, rank 1 a real `gyre
trainer-rank` process over gloo. Its steps equal one process's; the group a satellite cell builds stays up while the
cell serves rollouts (the same follower process; on a CUDA cell every rank gave its memory back and took it again)
and trains on as if it had never left; a follower killed with -9 turns the next call into one clear
TrainerRanksLost line, and the cell closes that group when it leaves TRAIN; a new group resumes from the saved
version with both ranks' optimizer state and takes the step the first group took, to 1e-6."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from gyre_slurm.agent.backend import CellBackend
from gyre_slurm.config import TrainSection, parse_config
from gyre_slurm.errors import TrainerRanksLost
from gyre_slurm.protocol import WeightsRef
from gyre_slurm.roles import Role
from gyre_slurm.train import rank_group
from gyre_slurm.train.megatron_parallel import teardown_parallel
from gyre_slurm.train.megatron_trainer import MegatronTrainer
from gyre_slurm.train.rank_group import MemoryMove, RankGroup
from gyre_slurm.train.torch_trainer import TorchTrainer
from tests.test_trainer import build_tiny_qwen3, make_batch

pytestmark = pytest.mark.slow
TRAIN = {"backend": "megatron", "lr": 2e-2, "lr_warmup_steps": 3, "micro_batch_tokens": 64}


@pytest.fixture
def own_world():
    """This process's torch.distributed world is the group's while the test runs (other tests use world 1)."""
    teardown_parallel()
    yield
    teardown_parallel()


def _state(trainer, folder: Path) -> dict[str, torch.Tensor]:
    """The trainer's weights by Hugging Face name, as it saves them (every rank writes its part)."""
    from safetensors.torch import load_file

    out = trainer.save(folder)
    return {n: t for f in sorted(Path(out).glob("*.safetensors")) for n, t in load_file(f).items()}


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def satellite_cell(tmp_path: Path, model: Path) -> tuple[CellBackend, WeightsRef]:
    """Cell 1 of a two-cell run with tensor-parallel cells: a satellite, its engine left out (never started)."""
    cfg = parse_config({"run": {"name": "ranks", "state_dir": str(tmp_path / "state"), "seed": 0},
                        "cluster": {"cells": 2, "engine": "embedded"}, "weights": {"transport": "file"},
                        "train": {**TRAIN, "tensor_parallel": 2, "satellites": True}})
    (tmp_path / "run" / "logs").mkdir(parents=True)
    backend = CellBackend(cfg, tmp_path / "run", 1)
    backend._serve = lambda weights: None  # the rollout engine is not what this test is about
    return backend, WeightsRef(version=0, path=str(model))


def test_a_rank_group_trains_as_one_process_stays_across_switches_and_resumes_after_a_kill(tmp_path: Path, own_world,
                                                                                           monkeypatch) -> None:
    model = build_tiny_qwen3(tmp_path / "m")
    batch = make_batch(TorchTrainer(model, device="cpu", seed=0), 3, {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1)},
                       length=48, offsets={1: 1e-4, 2: 5e-3, 3: -2e-3})
    one = MegatronTrainer(model, device="cpu", seed=0, **{k: v for k, v in TRAIN.items() if k != "backend"})
    want = [one.train_step(batch) for _ in range(2)], _state(one, tmp_path / "one")
    teardown_parallel()

    cell, v0 = satellite_cell(tmp_path, model)
    cell.enter(Role.TRAIN, v0)
    cell.prepare(Role.TRAIN)  # the satellite builds its rank group
    sat = cell.satellite
    group = sat.trainer
    assert isinstance(group, RankGroup)
    try:
        got = [group.train_step(batch)]
        saved = group.save(tmp_path / "v1")
        (follower,) = group.procs
        calls: list[tuple[str, list | None]] = []
        real = rank_group.memory_call
        monkeypatch.setattr(rank_group, "memory_call", lambda t, name: calls.append((name, real(t, name))) or
                            calls[-1][1])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA cell's switches (nothing to move)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        cell.leave(Role.TRAIN)
        cell.enter(Role.ROLLOUT, v0)  # serving: the group stays, its memory went to the engine
        cell.leave(Role.ROLLOUT)
        cell.enter(Role.TRAIN, v0)
        cell.prepare(Role.TRAIN)  # back: ready at once, its memory taken back
        monkeypatch.undo()
        assert cell.satellite is sat and sat.trainer is group and group.procs == [follower]
        assert follower.poll() is None and group.healthy
        moves = [MemoryMove(0, "cpu", 0), MemoryMove(1, "cpu", 0)]  # every rank did it (nothing moves on the CPU)
        assert calls == [("release_memory", moves), ("reclaim_memory", moves)]
        got.append(group.train_step(batch))  # the step after the round trip is the one it would have taken
        uninterrupted = _state(group, tmp_path / "v2")
        follower.send_signal(signal.SIGKILL)
        follower.wait()
        with pytest.raises(TrainerRanksLost, match=r"^trainer rank 1 of this cell exited \(code -9\); see .*rank1-"):
            group.train_step(batch)
        assert not group.healthy
        cell.leave(Role.TRAIN)  # a group that lost a rank does not stay
        assert cell.satellite is None
    finally:
        group.close()
    assert {p.name for p in saved.iterdir()} >= {"optimizer.rank0-of-2.pt", "optimizer.rank1-of-2.pt"}

    again = RankGroup(saved, TrainSection(**TRAIN, tensor_parallel=2), seed=0, resume_optimizer=True,
                      log_dir=tmp_path / "logs", world=2, device="cpu")
    try:
        got.append(again.train_step(batch))
        state = _state(again, tmp_path / "again")
    finally:
        again.close()
    assert again.procs[0].returncode == 0  # the follower left its loop when the group closed
    # the second step twice: in the first group, and in the new one from the saved version (warm-up lr included)
    for g, w in zip(got, [*want[0], want[0][1]], strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-6) and g["lr"] == pytest.approx(w["lr"])
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    # the resumed step is the uninterrupted one (AdamW's moments and step count came back with both ranks' files);
    # against world 1 the weights differ by AdamW's amplified rounding (tests/test_megatron_parallel.py pins eps)
    assert _diff(state, uninterrupted) <= 1e-6
    assert _diff(state, want[1]) <= 1e-3
