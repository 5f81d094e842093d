"""tools/gpu_check.sh's steps (engine on a device, one Megatron GSPO step, weight update, release/resume, the
TP=2 cell's step against TP=1's, a Qwen3-MoE step) on the CPU: the script a lent GPU machine runs is the one
tried here, only the device differs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_its_steps_on_the_cpu(tmp_path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools/gpu_check.py"), "--device", "cpu", "--hidden", "256",
                        "--layers", "2", "--new-tokens", "16", "--ranks", "2"], capture_output=True, text=True,
                       timeout=600, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    assert "megatron TP=2 vs TP=1, first step" in r.stdout
    assert last.startswith("gpu check on cpu (cpu): OK") and "same tokens after release/resume: True" in last, last
    for timing in ("engine up", "megatron GSPO step", "weight update from disk", "release memory", "resume memory",
                   "megatron MoE GSPO step", "megatron TP=2 GSPO step"):
        assert f"\n{timing}: " in r.stdout, timing
