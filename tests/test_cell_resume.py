"""A cell going back to serving (agent/backend.py CellBackend), with real parts: the embedded engine as a process
started by the cell's own launcher, a GSPO trainer built by the cell on CPU, versions as snapshot folders.

- The engine's generation continues only once the version to serve is in: a call routed to the cell right after
  its memory resumes is served by that version, never by what the resume brought back.
- On a CUDA cell the core's trainer gives its GPU memory back (release_memory), and torch's allocator cache goes
  back to the driver, before the engine resumes; the trainer itself stays, and takes its memory back when the cell
  trains again. CUDA cannot run here: torch.cuda says it is available and the calls are recorded; the trainer is
  real, and it is the same object, with its optimizer state, after the round trip.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from gyre_slurm.agent.backend import CellBackend
from gyre_slurm.config import parse_config
from gyre_slurm.engines.client import Call, EngineClient, SamplingParams
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.protocol import WeightsRef
from gyre_slurm.roles import Role
from tests.test_engine import PROMPT


@pytest.fixture
def cell(tmp_path: Path):
    """Cell 0 (the core) of a one-cell run with the embedded engine; versions 0 and 1 are different weights."""
    v0, v1 = (create_tiny_model(tmp_path / f"v{v}", seed=v) for v in (0, 1))
    cfg = parse_config({"run": {"name": "resume", "state_dir": str(tmp_path / "state")},
                        "cluster": {"cells": 1, "engine": "embedded"}, "weights": {"transport": "file"}})
    run_dir = tmp_path / "run"
    for sub in ("logs", "engines"):
        (run_dir / sub).mkdir(parents=True)
    backend = CellBackend(cfg, run_dir, 0)
    yield backend, WeightsRef(version=0, path=str(v0)), WeightsRef(version=1, path=str(v1))
    backend.close()


def held(url: str) -> int:
    """Calls the engine holds (running or waiting, paused or not)."""
    return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]["running_requests"]


def watch_resume(monkeypatch, on_resume) -> None:
    """The cell's engine client calls on_resume(url) right after POST /resume_memory_occupation answers."""
    class Client(EngineClient):
        def _send(self, call: Call):
            out = super()._send(call)
            if call.path == "/resume_memory_occupation":
                on_resume(self.base_url)
            return out

    monkeypatch.setattr(CellBackend, "_client", lambda self: Client(self.engine_url))


def test_a_call_right_after_the_resume_is_served_by_the_version_the_cell_serves(cell, monkeypatch):
    backend, v0, v1 = cell
    backend.enter(Role.ROLLOUT, v0)
    backend.leave(Role.ROLLOUT)  # paused (abort mode) and released: the engine's weights left memory
    answers: list[int | None] = []
    resumed: list[str] = []

    def route_a_call(url: str) -> None:  # the proxy routes a call to the cell as soon as its engine answers
        def call() -> None:
            res = asyncio.run(EngineClient(url).generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True)))
            answers.append(res.weight_version)

        threading.Thread(target=call, daemon=True).start()
        deadline = time.monotonic() + 60
        while held(url) < 1:  # the engine has it before the cell goes on
            assert time.monotonic() < deadline, "the engine never received the call"
            time.sleep(0.02)
        resumed.append(url)

    watch_resume(monkeypatch, route_a_call)
    backend.enter(Role.ROLLOUT, v1)
    assert resumed, "the engine's memory was not resumed"
    deadline = time.monotonic() + 60
    while not answers and time.monotonic() < deadline:
        time.sleep(0.02)
    assert answers == [1]  # not 0: what the resume reloaded from the last folder
    assert backend.serving == 1 and not backend.released
    res = asyncio.run(EngineClient(backend.engine_url).generate(PROMPT, SamplingParams(max_new_tokens=4)))
    assert res.weight_version == 1  # and generation continued after the reload


def test_a_cuda_core_gives_its_trainers_memory_back_before_the_engine_resumes_and_keeps_the_trainer(cell,
                                                                                                    monkeypatch):
    from gyre_slurm.train import rank_group

    backend, v0, _ = cell
    backend.enter(Role.ROLLOUT, v0)
    backend.leave(Role.ROLLOUT)
    backend.enter(Role.TRAIN, v0)  # the core builds its trainer (CPU here)
    trainer = backend.trainer
    assert trainer is not None
    events: list[str] = []

    def spy(name: str):
        real = getattr(rank_group, name)
        return lambda t: (events.append(name), real(t))[1]

    monkeypatch.setattr(rank_group, "MEMORY_CALLS", {n: spy(n) for n in rank_group.MEMORY_CALLS})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA cell: what this machine cannot be
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    watch_resume(monkeypatch, lambda url: events.append("resume"))
    backend.leave(Role.TRAIN)
    backend.enter(Role.ROLLOUT, v0)
    assert events == ["release_memory", "empty_cache", "resume"]
    assert backend.trainer is trainer  # kept: no process, model or optimizer state to build again at the next TRAIN
    backend.leave(Role.ROLLOUT)
    backend.enter(Role.TRAIN, v0)
    assert events[3:] == ["reclaim_memory"] and backend.trainer is trainer
    backend.leave(Role.TRAIN)
    backend.enter(Role.ROLLOUT, v0)  # and again: the round trip repeats
    assert events[4:6] == ["release_memory", "empty_cache"] and backend.trainer is trainer

    monkeypatch.undo()  # a CPU cell: nothing moves, the trainer stays as well
    backend.leave(Role.ROLLOUT)
    backend.enter(Role.TRAIN, v0)
    backend.leave(Role.TRAIN)
    backend.enter(Role.ROLLOUT, v0)
    assert backend.trainer is trainer
