"""Satellites: run-aligned shards, the direct gradient channel (real ZeroMQ on localhost), and a core step that
counts each shard exactly once, so that any split of the work gives the one-cell update."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from gyre_slurm.train.batch import BatchError, TrainBatch, write_batch
from gyre_slurm.train.grad_channel import (
    MAGIC,
    GradMessage,
    GradReceiver,
    GradSender,
    decode_message,
    encode_message,
    frames_mac,
)
from gyre_slurm.train.shards import check_shards, merge_shards, run_costs, shard_id, split_batch
from gyre_slurm.train.step_runner import ADDED, CoreStep, SatelliteStep
from gyre_slurm.train.torch_trainer import TorchTrainer
from tests.test_trainer import build_tiny_qwen3, make_batch

REPO = Path(__file__).resolve().parents[1]
TOKEN = "run-token-for-tests"
LR = 1e-3
ADAM_EPS = 1e-3
MBT = 60  # small micro-batch budget: multi-segment runs straddle micro-batches inside a shard
RUNS = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2), 5: (0.8, 2), 6: (-0.4, 1), 7: (1.5, 3)}
OFFSETS = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2, 5: 0.0, 6: 2e-4, 7: 3e-3}  # some runs clip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def batch(model_dir) -> TrainBatch:
    b = make_batch(trainer(model_dir), 11, RUNS, offsets=OFFSETS)
    b.step, b.version_in = 5, 4
    return b


@pytest.fixture(scope="module")
def one_cell(model_dir, batch) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]:
    """Weights and metrics after train_step(whole batch) on one cell, and that step's gradient (before
    clipping): what every split of the work must reproduce."""
    tr = trainer(model_dir)
    m = tr.train_step(batch)
    grad_tr = trainer(model_dir)
    grad_tr.zero_grad()
    grad_tr.forward_backward(batch)
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}, m, grad_tr.export_grads()


def trainer(model_dir: Path) -> TorchTrainer:
    tr = TorchTrainer(model_dir, device="cpu", lr=LR, micro_batch_tokens=MBT, seed=0)
    # AdamW's first step moves a weight by lr·g/(|g|+eps). With the default eps = 1e-8 that is a sign function
    # of gradient entries near 1e-9, where float32 summation order alone (shards add up in another order than
    # one cell's micro-batches) changes the sign: a 1e-6 comparison of the weights would then measure rounding.
    # eps = 1e-3 makes the update smooth in g, so the weights compare the gradients; the gradients themselves
    # are compared too (assert_same_grads).
    for group in tr.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return tr


def assert_same_grads(got: dict[str, torch.Tensor], one_cell) -> float:
    """The step's gradient equals one cell's within rtol 1e-6 plus 1e-6 of the tensor's largest entry
    (entries that cancel to ~1e-9 carry float32 rounding of the terms); returns the max relative difference."""
    _, _, want = one_cell
    assert got.keys() == want.keys()
    worst = 0.0
    for name, g in want.items():
        scale = g.abs().max().item()
        assert torch.allclose(got[name], g, rtol=1e-6, atol=1e-6 * scale), name
        worst = max(worst, (got[name] - g).abs().max().item() / scale)
    print(f"max gradient difference / largest gradient entry: {worst:.3g}")
    return worst


def assert_same_update(tr: TorchTrainer, one_cell) -> float:
    """Every parameter equal to the one-cell update (allclose rtol 1e-6, atol 1e-8: a few float32 ulps of
    weights ~0.03); returns the max relative difference over entries with |w| >= 1e-3."""
    want = one_cell[0]
    worst, worst_abs = 0.0, 0.0
    for name, p in tr.model.named_parameters():
        got, w = p.detach(), want[name]
        diff = (got - w).abs()
        big = w.abs() >= 1e-3
        worst = max(worst, (diff[big] / w.abs()[big]).max().item() if big.any() else 0.0)
        worst_abs = max(worst_abs, diff.max().item())
        assert torch.allclose(got, w, rtol=1e-6, atol=1e-8), (name, diff.max().item())
    print(f"max relative parameter difference vs one cell: {worst:.3g} (max absolute {worst_abs:.3g})")
    return worst


# --- shards (pure) ------------------------------------------------------------------------------------------------
def test_split_batch_is_run_aligned_and_keeps_the_global_normaliser(batch):
    shards = split_batch(batch, n_shards=3)
    check_shards(batch, shards)
    assert [shard_id(s) for s in shards] == [0, 1, 2] and all(s.meta["n_shards"] == 3 for s in shards)
    assert all(s.n_valid_runs == len(RUNS) for s in shards)
    for s in shards:
        s.validate()
        assert (s.step, s.version_in) == (batch.step, batch.version_in)
    assert split_batch(batch, n_shards=3) == shards  # deterministic
    merged = merge_shards(shards)
    assert sorted(merged.runs()) == sorted(batch.runs()) and merged.advantages == batch.advantages
    assert sorted(map(id, merged.samples)) == sorted(map(id, batch.samples))
    # Balanced: no shard carries more than the biggest run plus an even share.
    costs = run_costs(batch)
    loads = [sum(run_costs(s).values()) for s in shards]
    assert max(loads) <= sum(costs.values()) / 3 + max(costs.values())

    assert len(split_batch(batch, n_shards=100)) == len(RUNS)  # clamped: never an empty shard
    mini = split_batch(batch, n_shards=2, keep_normaliser=False)
    assert [s.n_valid_runs for s in mini] == [None, None]
    for budget in (1, 150, 10_000):
        cut = split_batch(batch, max_tokens=budget)
        check_shards(batch, cut)
        assert all(sum(run_costs(s).values()) <= budget or len(s.runs()) == 1 for s in cut)
    assert len(split_batch(batch, max_tokens=1)) == len(RUNS)
    assert len(split_batch(batch, max_tokens=10**9)) == 1


def test_split_batch_refuses_bad_arguments_and_check_shards_finds_damage(batch):
    for kw in ({}, {"n_shards": 2, "max_tokens": 100}, {"n_shards": 0}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            split_batch(batch, **kw)
    check_shards(batch, split_batch(batch, n_shards=3))
    lost = split_batch(batch, n_shards=3)
    lost[2].samples.pop()
    with pytest.raises(BatchError, match="samples"):
        check_shards(batch, lost)
    cut = split_batch(batch, n_shards=3)
    cut[0].samples.append(next(s for s in cut[1].samples if any(s.loss_mask)))
    with pytest.raises(BatchError, match="split across shards"):
        check_shards(batch, cut)
    bad = split_batch(batch, n_shards=3)
    bad[1].advantages[bad[1].runs()[0]] += 1.0
    with pytest.raises(BatchError, match="advantage"):
        check_shards(batch, bad)
    with pytest.raises(BatchError, match="shard index"):
        shard_id(batch)


# --- the channel ----------------------------------------------------------------------------------------------------
def test_grad_message_roundtrip_keeps_dtypes_and_shapes():
    grads = {"a": torch.randn(3, 4), "b.weight": torch.randn(5, dtype=torch.float64),
             "c": torch.randn(2, 2).to(torch.bfloat16), "empty": torch.zeros(0, 7)}
    msg = GradMessage(7, 6, (2, 0), "sat-x", grads, {"loss": 0.25, "runs": 3.0})
    got, why = decode_message(encode_message(msg, TOKEN), TOKEN, step=7)
    assert why == "ok" and (got.step, got.version_in, got.shard_ids, got.sender) == (7, 6, (2, 0), "sat-x")
    assert got.metrics == {"loss": 0.25, "runs": 3.0}
    for name, g in grads.items():
        assert got.grads[name].dtype == g.dtype and torch.equal(got.grads[name], g)


def _signed(header: dict | bytes, payloads=()) -> list[bytes]:
    """Frames with a valid MAC around any header: the receiver must still check what it says."""
    raw = header if isinstance(header, bytes) else msgpack.packb(header)
    return [MAGIC, raw, frames_mac(TOKEN, [MAGIC, raw, *payloads]), *payloads]


def test_bad_frames_are_refused_with_a_reason_and_the_receiver_keeps_working():
    rx = GradReceiver(TOKEN)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(rx.endpoint)
    good = GradMessage(3, 2, (0,), "sat", {"w": torch.ones(2)})
    ok_header = {"step": 3, "version_in": 2, "shards": [1], "sender": "s", "metrics": {},
                 "params": [["w", "float32", [2], 8]]}
    try:
        rx.expect(3)
        bad_frames = [
            encode_message(good, "not-the-token"),  # wrong token
            encode_message(GradMessage(2, 1, (0,), "sat", {"w": torch.ones(2)}), TOKEN),  # wrong step
            [b"\x00garbage"], [MAGIC, b"\xc1\xc1", b"short"],  # garbage, truncated MAC
            _signed(b"\xc1not msgpack"),
            _signed({**ok_header, "shards": []}, [bytes(8)]),
            _signed({**ok_header, "params": [["w", "float32", [3], 8]]}, [bytes(8)]),  # bytes do not fit shape
            _signed({**ok_header, "params": [["w", "int8", [8], 8]]}, [bytes(8)]),  # dtype not allowed
            _signed(ok_header, [bytes(4)]),  # frame shorter than announced
            _signed(ok_header, []),  # tensor frame missing
        ]
        frames = encode_message(good, TOKEN)
        frames[-1] = bytes(len(frames[-1]))  # altered tensor bytes after signing
        bad_frames.append(frames)
        for f in bad_frames:
            raw.send_multipart(f)
        raw.send_multipart(encode_message(good, TOKEN))
        got = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = rx.poll(1.0)
        assert [m.shard_ids for m in got] == [(0,)] and torch.equal(got[0].grads["w"], torch.ones(2))
        reasons = list(rx.rejections)
        assert len(reasons) == len(bad_frames), reasons
        assert sum(r.startswith("auth") for r in reasons) == 3 and sum(r.startswith("wrong step") for r in reasons) == 1
        assert all(r.startswith(("auth", "wrong step", "malformed")) for r in reasons), reasons
        assert rx.poll(0.05) == []  # times out quietly
    finally:
        raw.close(linger=0)
        rx.close()


# --- core + satellites ----------------------------------------------------------------------------------------------
def test_a_satellite_joining_mid_step_gives_the_one_cell_update(model_dir, batch, one_cell, tmp_path):
    shards = split_batch(batch, n_shards=4)
    core = CoreStep(trainer(model_dir), batch.step, batch.version_in, range(len(shards)))
    rx = GradReceiver(TOKEN)
    rx.expect(batch.step)
    sender = GradSender(rx.endpoint, TOKEN, name="sat-1")
    try:
        assert core.run_shard(shards[0])  # the core starts alone ...
        sat = SatelliteStep(trainer(model_dir), sender, name="sat-1")  # ... a satellite joins with v_in's weights
        sat.load(model_dir, batch.step, batch.version_in)
        fb = [sat.accumulate(shards[1])]
        sat.flush()
        fb.append(sat.accumulate(shards[2]))
        assert core.run_shard(shards[3])
        sat.flush()
        assert core.collect(rx, timeout=30), core.missing
    finally:
        sender.close()
        rx.close()
    assert any(m["prepass_micro_batches"] > 0 for m in fb)  # runs straddle micro-batches inside a shard
    assert core.covered == {0: "core", 1: "sat-1", 2: "sat-1", 3: "core"}
    assert_same_grads(core.trainer.export_grads(), one_cell)
    path, m = core.finish(tmp_path / "v5")
    assert (path / "model.safetensors").exists() and core.version_out == batch.version_in + 1
    assert_same_update(core.trainer, one_cell)
    want = one_cell[1]
    assert m["loss"] == pytest.approx(want["loss"], abs=1e-6) and m["runs"] == want["runs"] == len(RUNS)
    for k in ("tokens_trained", "n_valid_runs", "clip_frac", "clip_frac_runs", "mean_abs_log_s",
              "frac_runs_outside_window", "grad_norm"):
        assert m[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    assert 0 < m["clip_frac_runs"] < 1 and m["shards"] == 4 and m["shards_core"] == 2 and m["satellites"] == 1


def test_duplicates_count_once_and_lost_work_is_redone(model_dir, batch, one_cell, tmp_path):
    shards = split_batch(batch, n_shards=5)
    core = CoreStep(trainer(model_dir), batch.step, batch.version_in, range(5))
    sat = SatelliteStep(trainer(model_dir), name="sat-2")
    sat.load(model_dir, batch.step, batch.version_in)
    one = sat.run_shard(shards[1])
    assert core.accept(one) == ADDED
    assert core.accept(one) == "duplicate"  # delivered twice: added once
    sat.run_shard(shards[2])  # computed, but its message never arrives
    sat.accumulate(shards[4])  # partial work of a satellite that then dies: never sent, never counted
    assert core.missing == [0, 2, 3, 4]
    assert core.run_shard(shards[3])
    pair = sat.run_shards([shards[0]])  # (the pending shard 4 goes with it)
    late = GradMessage(batch.step, batch.version_in, (3, 4), "sat-2", one.grads)
    assert core.accept(late).startswith("overlap")  # cannot take shard 4 without counting 3 twice
    assert core.accept(GradMessage(batch.step + 1, batch.version_in, (2,), "x", {})).startswith("other step")
    assert core.accept(GradMessage(batch.step, batch.version_in, (9,), "x", {})).startswith("unknown shards")
    bad_shape = GradMessage(batch.step, batch.version_in, (2,), "x", {n: g[:1] for n, g in one.grads.items()})
    assert "does not fit" in core.accept(bad_shape)
    assert core.accept(pair) == ADDED and core.missing == [2]
    with pytest.raises(RuntimeError, match=r"\[2\]"):
        core.finish(tmp_path / "early")
    assert core.run_shard(shards[2]) and not core.run_shard(shards[2])  # redone by the core, once
    assert_same_grads(core.trainer.export_grads(), one_cell)
    core.finish(tmp_path / "v5")
    assert_same_update(core.trainer, one_cell)
    assert len(core.refused) == 5


SATELLITE = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from gyre_slurm.train.batch import read_batch
from gyre_slurm.train.grad_channel import GradSender
from gyre_slurm.train.step_runner import SatelliteStep
from gyre_slurm.train.torch_trainer import TorchTrainer
cfg = json.loads(sys.argv[1])
queue = Path(cfg["queue"])
tr = TorchTrainer(cfg["weights"], device="cpu", lr=cfg["lr"], micro_batch_tokens=cfg["mbt"])
sat = SatelliteStep(tr, GradSender(cfg["endpoint"], cfg["token"], name="sat-9"), name="sat-9")
sat.load(Path(cfg["weights"]), cfg["step"], cfg["version_in"])
for group in cfg["groups"]:  # each group of shards travels as one message
    for sid in group:
        path = queue / f"{sid}.msgpack"
        while not path.exists():  # the test hands shards out one by one
            time.sleep(0.01)
        sat.accumulate(read_batch(path))
        (queue / f"done-{sid}").touch()
    sat.flush()
"""


def kill_when(done, proc: subprocess.Popen, core, rx, err: Path, timeout_s: float) -> None:
    """Feed the satellite's gradients to the core until `done()`, then SIGKILL the satellite and collect what was
    still in flight."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, f"satellite too slow; covered {core.covered}"
        for msg in rx.poll(0.1):
            core.accept(msg)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    core.collect(rx, timeout=0.3)


def test_a_satellite_killed_mid_step_costs_only_a_redo(model_dir, batch, one_cell, tmp_path):
    """A real satellite process sends shards 1 and 2, accumulates 3 (to send with 4) and is SIGKILLed while
    waiting for 4: the core redoes 3 and 4 and the step still equals the one-cell update."""
    shards = split_batch(batch, n_shards=5)
    queue = tmp_path / "queue"
    queue.mkdir()
    rx = GradReceiver(TOKEN)
    rx.expect(batch.step)
    core = CoreStep(trainer(model_dir), batch.step, batch.version_in, range(5))
    cfg = {"queue": str(queue), "weights": str(model_dir), "lr": LR, "mbt": MBT, "endpoint": rx.endpoint,
           "token": TOKEN, "step": batch.step, "version_in": batch.version_in, "groups": [[1], [2], [3, 4]]}
    err = (tmp_path / "sat.err").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SATELLITE, json.dumps(cfg)], cwd=REPO, stderr=err)
    try:
        for sid in (1, 2, 3):
            write_batch(queue / f"{sid}.msgpack", shards[sid])
        core.run_shard(shards[0])
        kill_when(lambda: {1, 2} <= core.covered.keys() and (queue / "done-3").exists(), proc, core, rx,
                  tmp_path / "sat.err", timeout_s=120)  # what was in flight after it: nothing for shards 3 or 4
        assert core.covered == {0: "core", 1: "sat-9", 2: "sat-9"} and core.missing == [3, 4]
        for sid in core.missing:
            core.run_shard(shards[sid])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
        rx.close()
    assert_same_grads(core.trainer.export_grads(), one_cell)
    _, m = core.finish(tmp_path / "v5")
    assert m["satellites"] == 1 and m["shards_core"] == 3
    assert_same_update(core.trainer, one_cell)
