"""A cell going back to serving (agent/backend.py CellBackend), with real parts: the embedded engine as a process
started by the cell's own launcher, a GSPO trainer built by the cell on CPU, versions as snapshot folders.

- The engine's generation continues only once the version to serve is in: a call routed to the cell right after
  its memory resumes is served by that version, never by what the resume brought back.
- On a CUDA cell the core's trainer leaves memory, and torch's allocator cache goes back to the driver, before the
  engine resumes. CUDA cannot run here: torch.cuda says it is available and its empty_cache is recorded;
  the trainer is real, and its model being garbage collected is what shows its memory went.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
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


def test_a_cuda_core_frees_its_trainer_and_the_allocator_cache_before_the_engine_resumes(cell, monkeypatch):
    backend, v0, _ = cell
    backend.enter(Role.ROLLOUT, v0)
    backend.leave(Role.ROLLOUT)
    backend.enter(Role.TRAIN, v0)  # the core builds its trainer (CPU here)
    assert backend.trainer is not None
    events: list[str] = []
    weakref.finalize(backend.trainer.model, events.append, "trainer freed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA cell: what this machine cannot be
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    watch_resume(monkeypatch, lambda url: events.append("resume"))
    backend.leave(Role.TRAIN)
    backend.enter(Role.ROLLOUT, v0)
    assert events == ["trainer freed", "empty_cache", "resume"]
    assert backend.trainer is None and backend.trainer_source == Path(v0.path)

    monkeypatch.undo()  # back on CPU: the next TRAIN builds the trainer again from its version, and it stays
    backend.leave(Role.ROLLOUT)
    backend.enter(Role.TRAIN, v0)
    trainer = backend.trainer
    assert trainer is not None
    backend.leave(Role.TRAIN)
    backend.enter(Role.ROLLOUT, v0)
    assert backend.trainer is trainer  # a CPU cell keeps it (no GPU share to give back; rebuilding costs a load)
