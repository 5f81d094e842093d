"""Shared fixtures: configs on disk, the gyre CLI as a subprocess, a local run of real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run

REPO = Path(__file__).resolve().parents[1]


def write_config(path: Path, state_dir: Path, **sections) -> Path:
    data = {
        "run": {"name": "t", "state_dir": str(state_dir)},
        "cluster": {"cells": 2},
        "control": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "switch_timeout_s": 20},
        "ledger": {"flush_interval_s": 0.02},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def config_file(tmp_path: Path, state_dir: Path) -> Path:
    return write_config(tmp_path / "run.yaml", state_dir)


def gyre(*args: str, timeout: float = 60, cwd: Path | None = None, env: dict | None = None):
    """Run the real `gyre` CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "gyre_slurm", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env={**os.environ, "COLUMNS": "160", **(env or {})})


@pytest.fixture
def local_run(config_file: Path):
    """A daemon and one agent per node as real processes, all registered."""
    cfg = load_config(config_file)
    run = start_local_run(cfg, config_file, "r1", start_timeout_s=60)
    yield run
    for p in run.procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
