"""tools/gpu_check.sh --cpu: the script a lent GPU machine runs, walked here on the CPU (a smaller model), so that no
step of it rots between GPU runs. Each step prints one `<name>: ok|FAIL <figures>` line; the GPU-only parts of a
step say "skipped on cpu: <why>" in its line, never silently."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

STEPS = ("versions", "moe", "dense", "stage", "attention", "memory", "engine")


def test_the_gpu_check_walks_every_step_on_the_cpu(tmp_path) -> None:
    r = subprocess.run(["bash", str(REPO / "tools/gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                       timeout=600, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path), "HOME": str(tmp_path)})
    lines = r.stdout.strip().splitlines()
    step_lines = {line.split(":", 1)[0]: line for line in lines if line.split(":", 1)[0] in STEPS}
    assert list(step_lines) == list(STEPS), r.stdout[-3000:] + r.stderr[-3000:]  # every step, in this order
    for name, line in step_lines.items():
        assert line.startswith(f"{name}: ok "), line
    assert "NCCL duplicate-GPU refusal skipped on cpu: " in step_lines["stage"]
    assert "peak memory skipped on cpu: " in step_lines["attention"]
    assert "fp32 vs HF max |diff|" in step_lines["dense"] and "save/reload" in step_lines["dense"]
    assert "release/resume: the same tokens after" in step_lines["engine"]
    assert lines[-1].startswith("gpu check on cpu (cpu): OK: 7/7 steps ok"), lines[-1]
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_gpu_check_script_is_stored_executable() -> None:
    """Run as `tools/gpu_check.sh` on the device machine, which gets the tree from git: the mode is git's."""
    out = subprocess.run(["git", "ls-files", "-s", "tools/gpu_check.sh"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("100755 "), out
