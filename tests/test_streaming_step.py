"""A streaming step (docs/algorithms.md §8) equals the step on its whole batch: groups arrive one by one, each is
split into shards by the daemon's queue (losses unnormalised: the step's valid runs are only known at its seal),
the core and satellites compute them, a satellite joins mid-step and another is killed with -9 mid-step, and
the core divides by the valid runs once before its one optimizer step. Both trainer backends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gyre_slurm.coordinator.shard_queue import ShardQueue
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.train.batch import UNNORMALISED, TrainBatch, read_batch
from gyre_slurm.train.grad_channel import GradReceiver, GradSender
from gyre_slurm.train.shards import subset
from gyre_slurm.train.step_runner import CoreStep, SatelliteStep
from tests.test_satellite import ADAM_EPS, LR, MBT, OFFSETS, REPO, RUNS, TOKEN, kill_when
from tests.test_trainer import build_tiny_qwen3, make_batch

GROUPS = [[1, 2], [3, 4, 5], [6, 7]]  # the runs of the step's three groups, in the order they become ready

SATELLITE = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from gyre_slurm.train.backends import trainer_class
from gyre_slurm.train.batch import read_batch
from gyre_slurm.train.grad_channel import GradSender
from gyre_slurm.train.step_runner import SatelliteStep
cfg = json.loads(sys.argv[1])
tr = trainer_class(cfg["backend"])(cfg["weights"], device="cpu", lr=cfg["lr"], micro_batch_tokens=cfg["mbt"])
sat = SatelliteStep(tr, GradSender(cfg["endpoint"], cfg["token"], name="sat-9"), name="sat-9")
sat.load(Path(cfg["weights"]), cfg["step"], cfg["version_in"])
for group in cfg["groups"]:  # each list of shards travels as one message
    for path in group:
        while not Path(path).exists():
            time.sleep(0.01)
        sat.accumulate(read_batch(Path(path)))
        Path(path + ".done").touch()
    sat.flush()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def trainer(backend: str, model_dir: Path):
    from gyre_slurm.train.backends import trainer_class

    tr = trainer_class(backend)(model_dir, device="cpu", lr=LR, micro_batch_tokens=MBT, seed=0)
    for group in tr.optimizer.param_groups:
        group["eps"] = ADAM_EPS  # as tests/test_satellite.py: the update is smooth in g
    return tr


def weights(tr) -> dict[str, torch.Tensor]:
    """The trainer's weights by Hugging Face name (a Megatron trainer's: its fp32 masters, converted)."""
    if hasattr(tr, "model"):
        return {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    from tests.megatron_rank import hf_state

    return hf_state(tr)


def group_part(batch: TrainBatch, runs: list[int]) -> TrainBatch:
    """What RolloutBook.build_batch gives for the groups that hold these runs."""
    return subset(batch, [i for i, s in enumerate(batch.samples) if s.run_id in runs], n_valid_runs=None)


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_streaming_step_equals_the_step_on_its_whole_batch(backend, model_dir, tmp_path):
    batch = make_batch(trainer("torch", model_dir), 11, RUNS, offsets=OFFSETS)
    batch.step, batch.version_in = 5, 4
    one = trainer(backend, model_dir)
    want_metrics = one.train_step(batch)
    want = weights(one)

    ledger = Ledger(tmp_path / "ledger.db")
    queue = ShardQueue(ledger, tmp_path)
    queue.start(5, attempt=1)
    core = CoreStep(trainer(backend, model_dir), 5, 4)  # not sealed: its groups come one by one
    rx = GradReceiver(TOKEN)
    rx.expect(5)
    joined = SatelliteStep(trainer(backend, model_dir), GradSender(rx.endpoint, TOKEN, name="sat-1"), name="sat-1")
    proc = None
    try:
        def arrive(runs: list[int]) -> list[Path]:
            refs = queue.add(group_part(batch, runs), shard_runs=1, now=time.time())
            return [Path(r.path) for r in refs]

        def shard(path: Path) -> TrainBatch:
            s = read_batch(path)
            assert s.n_valid_runs == UNNORMALISED
            return s

        a = arrive(GROUPS[0])  # shards 0, 1: the core alone at first
        assert core.run_shard(shard(a[0])) and not core.done
        joined.load(model_dir, 5, 4)  # a satellite joins mid-step, with the step's starting weights
        joined.run_shard(shard(a[1]))
        b = arrive(GROUPS[1])  # shards 2, 3, 4: a satellite process takes 2 and 3, and is killed before sending 3
        handed = tmp_path / "handed"  # what the process is handed, one by one: 2 and 3, never 4
        handed.mkdir()
        for p in b[:2]:
            (handed / p.name).write_bytes(p.read_bytes())
        cfg = {"backend": backend, "weights": str(model_dir), "lr": LR, "mbt": MBT, "endpoint": rx.endpoint,
               "token": TOKEN, "step": 5, "version_in": 4,
               "groups": [[str(handed / b[0].name)], [str(handed / b[1].name), str(handed / b[2].name)]]}
        err = (tmp_path / "sat.err").open("w")
        proc = subprocess.Popen([sys.executable, "-c", SATELLITE, json.dumps(cfg)], cwd=REPO, stderr=err)
        kill_when(lambda: 2 in core.covered and (handed / (b[1].name + ".done")).exists(), proc, core, rx,
                  tmp_path / "sat.err", timeout_s=300)
        assert set(core.covered) == {0, 1, 2}  # shard 3 died with the process; nobody did 4
        c = arrive(GROUPS[2])  # shards 5, 6
        seal = queue.seal_step(len(RUNS))
        assert seal.n_shards == 7
        core.seal(range(seal.n_shards), seal.n_valid_runs)
        assert core.missing == [3, 4, 5, 6]
        for p in (b[1], b[2], c[0]):
            core.run_shard(shard(p))
        joined.run_shard(shard(c[1]))
        assert core.collect(rx, timeout=60), core.missing
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        joined.sink.close()
        rx.close()
    assert core.covered == {0: "core", 1: "sat-1", 2: "sat-9", 3: "core", 4: "core", 5: "core", 6: "sat-1"}
    _, m = core.finish(tmp_path / "v5")
    assert m["n_valid_runs"] == len(RUNS) and m["satellites"] == 2
    assert m["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(want_metrics["grad_norm"], rel=1e-5)
    worst = 0.0
    for name, got in weights(core.trainer).items():
        w = want[name]
        assert torch.allclose(got, w, rtol=1e-6, atol=1e-8), (name, (got - w).abs().max().item())
        big = w.abs() >= 1e-3
        worst = max(worst, ((got - w).abs()[big] / w.abs()[big]).max().item())
    print(f"{backend}: max relative parameter difference, streaming vs whole batch: {worst:.3g}")


def test_a_step_is_sealed_once_and_takes_no_shard_beyond_its_seal(model_dir):
    core = CoreStep(trainer("torch", model_dir), 5, 4)
    assert not core.done and core.missing == []  # unsealed: nothing is known to be missing, nothing is done
    core.seal(range(3), 7)
    core.seal(range(3), 7)  # the same seal again (every answer to the core carries it)
    with pytest.raises(ValueError, match="sealed"):
        core.seal(range(4), 7)
    assert core.missing == [0, 1, 2] and core.accept(
        __import__("gyre_slurm.train.grad_channel", fromlist=["GradMessage"]).GradMessage(5, 4, (3,), "x", {})
    ).startswith("unknown shards")
