"""Whole runs with model-parallel Megatron cells: every training cell is a 2-rank tensor-parallel cell whose leader
lives in its node agent and whose second rank is a `gyre trainer-rank` process (train/rank_group.py). A satellite
cell joins each step; every rank of the core publishes its own slices of every version over the Transfer Engine (a
satellite rank pulls its twin's part, the rollout cell's agent every part, put together, and pushes the whole model
into its engine over the SGLang weight-update route, gloo); a rank of the core killed with -9 (during a step or
between two) is started again from the last version, optimizer state included."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import LocalRun, start_local_run

from .conftest import embedded_config, q

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, warm_model: Path, name: str, steps: int) -> Path:
    """3 cells: the async split keeps the core and one satellite in TRAIN while cell 2 rolls out."""
    return embedded_config(
        tmp_path, warm_model, name, cluster={"cells": 3, "engine": "embedded", "rollouts_per_cell": 8},
        control={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10},
        scheduler={"policy": "async", "train_cells": 2, "max_staleness": 1},
        tasks={"suite": "builtin:sevens", "group_size": 4, "groups_per_step": 2},
        harness={"timeout_s": 30, "concurrency": 8}, weights={"engine_update": "push"},
        train={"steps": steps, "lr": 3e-4, "shard_runs": 1, "backend": "megatron", "tensor_parallel": 2})


def followers(run: LocalRun, cell: int) -> list[int]:
    """Pids of the `gyre trainer-rank` processes the agent of `cell` leads (one node per cell)."""
    agent = run.agents[cell].pid
    out = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"trainer-rank" in argv and str(agent).encode() in argv:
            out.append(int(proc.name))
    return out


def _model_bytes(folder: Path) -> int:
    return sum(t.numel() * t.element_size() for f in folder.glob("*.safetensors") for t in load_file(f).values())


def test_tensor_parallel_cells_train_with_a_satellite_and_survive_a_rank_killed(tmp_path: Path,
                                                                               warm_model: Path) -> None:
    path = _config(tmp_path, warm_model, "tp2", steps=3)
    run = start_local_run(load_config(path), "tp2")
    db = run.run_dir / "ledger.db"
    killed: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'")[0][0] < 1:
            assert time.monotonic() < deadline, "no step finished"
            time.sleep(0.2)
        killed = followers(run, 0)
        assert len(killed) == 1, killed  # TP=2: the leader in the agent, one follower
        os.kill(killed[0], signal.SIGKILL)
        assert run.daemon.wait(timeout=400) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    assert not run.failed(), run.failed()
    assert q(db, "SELECT step, status, version_out FROM train_steps ORDER BY step") == \
        [(0, "DONE", 1), (1, "DONE", 2), (2, "DONE", 3)]
    # the satellite (a TP=2 cell as well) computed shards, the core added them
    done_by = {c for (c,) in q(db, "SELECT DISTINCT done_by FROM shards WHERE status = 'DONE'")}
    assert 0 in done_by and len(done_by) == 2, done_by
    # every version over the Transfer Engine in two parts (one per TP rank): a satellite rank pulls its twin's part
    # only, the agent both (the whole model's bytes, each whole tensor once more), the engine gets the whole model
    assert q(db, "SELECT version, transport FROM weight_versions ORDER BY version") == \
        [(v, "mooncake") for v in range(4)]
    got = q(db, "SELECT receiver, transport, ok, bytes FROM weight_transfers")
    assert got and {ok for *_, ok, _ in got} == {1}, [r for r in got if not r[2]]
    model = _model_bytes(run.run_dir / "weights" / "v00003")
    sats = q(db, "SELECT DISTINCT receiver, sender_rank FROM weight_transfers WHERE receiver LIKE 'satellite:%'")
    assert len(sats) >= 2 and all(r.endswith(f"/rank{s}") for r, s in sats), sats
    parts = q(db, "SELECT version, sum(bytes), count(*) FROM weight_transfers WHERE receiver LIKE 'agent:%' "
                  "GROUP BY version")
    assert parts and all(n == 2 and model <= b < 1.05 * model for _, b, n in parts), (parts, model)
    assert {b for r, *_, b in got if r.startswith("engine")} == {model}
    # the satellite pulls each step's version; the rollout cell's agent pulls every new one and pushes it into its
    # engine over a weight-update group (SGLang's /update_weights_from_distributed route, gloo here)
    hops = {(r.split(":")[0], t) for r, t, *_ in got}
    assert hops == {("satellite", "mooncake"), ("agent", "mooncake"), ("engine", "nccl")}, hops
    served = q(db, "SELECT DISTINCT cell_id, weight_version FROM model_calls WHERE weight_version > 0")
    pushed = q(db, "SELECT DISTINCT cell, version FROM weight_transfers WHERE receiver LIKE 'engine:%'")
    assert served and set(served) <= set(pushed)
    # the step in flight when the rank died failed with a retryable error and ran again under a new attempt
    retried = q(db, "SELECT message FROM events WHERE kind = 'step_retried'")
    assert len(retried) <= 1 and all("trainer rank 1 of this cell exited (code -9)" in m for (m,) in retried)
    # the core's ranks started again after the kill: twice in its log, and each version holds both ranks' state
    log = (run.run_dir / "logs" / "agent-0.log").read_text()
    assert log.count("megatron trainer (2 ranks) loaded") >= 2 and "lost a rank" in log, log[-3000:]
    for v in (1, 2, 3):
        names = {p.name for p in (run.run_dir / "weights" / f"v{v:05d}").iterdir()}
        assert {"optimizer.rank0-of-2.pt", "optimizer.rank1-of-2.pt"} <= names, names
    # the new ranks took up the optimizer state saved with the version they started from (tests/test_rank_group.py
    # shows that this resumes the step exactly)
    resumed = [line for line in log.splitlines() if "optimizer state resumed from" in line]
    assert resumed and all("optimizer.rank0-of-2.pt" in line for line in resumed), resumed
    # no rank outlived its run
    assert all(not Path(f"/proc/{pid}").exists() for pid in killed)
