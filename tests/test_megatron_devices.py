"""The Megatron trainer as a GPU process starts it, shown on the CPU: a fresh Python process where torch reports CUDA
(torch.cuda's device calls recorded, torch.distributed's init stopped at its first call), so nothing leaks into
this one. Stand-ins for CUDA and NCCL only; the megatron-core 0.16.1 and gyre code that runs is the real one.

- Qwen3-MoE without Transformer Engine on a GPU: megatron-core's `moe_utils.py` defines `te_general_gemm` only when
  TE imports, and its router always reads it; the CPU answers (train/megatron_cpu.py) must stay off on a GPU.
- Each rank's GPU is made current (`torch.cuda.set_device`) before its process group exists, and the group is bound
  to it (`device_id`): megatron-core allocates on `torch.cuda.current_device()`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_trainer import build_tiny_qwen3

from .conftest import REPO

# torch as a GPU process sees it: CUDA "available"; device calls recorded in CALLS; init_process_group recorded and
# stopped (no NCCL here), so the test sees what a rank did before its group was made
FAKE_CUDA = """
import json, sys
import torch
import torch.distributed as dist

CALLS = []
real_init_process_group = dist.init_process_group
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8
torch.cuda.set_device = lambda d: CALLS.append(["set_device", str(d)])
torch.cuda.current_device = lambda: 0


class GroupStarted(Exception):
    pass


def _init_process_group(backend, **kw):
    CALLS.append(["init_process_group", backend, str(kw.get("device_id"))])
    raise GroupStarted


dist.init_process_group = _init_process_group
"""


def run_as_gpu_process(body: str) -> dict:
    """Run FAKE_CUDA then `body` (which prints one JSON line last) in a fresh interpreter; return that JSON."""
    script = FAKE_CUDA + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                               "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_moe_on_a_gpu_without_transformer_engine_defines_the_router_gemm() -> None:
    got = run_as_gpu_process("""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe import moe_utils

        from gyre_slurm.model.qwen3 import Qwen3Config
        from gyre_slurm.model.tiny import tiny_moe_config
        from gyre_slurm.train import megatron_cpu
        from gyre_slurm.train.megatron_model import build_gpt

        real_init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # Megatron's groups, world 1
        ps.initialize_model_parallel(1, 1)
        build_gpt(Qwen3Config.from_dict(tiny_moe_config(320).to_dict()))  # the router is built, weights on the CPU
        print(json.dumps({"defined": hasattr(moe_utils, "te_general_gemm"),
                          "value": repr(getattr(moe_utils, "te_general_gemm", "missing")),
                          "have_te": moe_utils.HAVE_TE, "cpu_patches": megatron_cpu._applied,
                          "current_device_kept": torch.cuda.current_device() == 0}))
    """)
    assert got["have_te"] is False  # the case at issue: no Transformer Engine
    assert got["defined"] and got["value"] == "None", got  # the router's torch.mm path, not a NameError
    assert got["cpu_patches"] is False and got["current_device_kept"], got  # a GPU process runs no CPU answer


@pytest.mark.parametrize(("rank", "per_node", "gpu"), [(1, 0, 1), (5, 4, 1)])
def test_a_rank_sets_its_gpu_before_its_process_group(tmp_path: Path, rank: int, per_node: int, gpu: int) -> None:
    model = build_tiny_qwen3(tmp_path / "m")
    got = run_as_gpu_process(f"""
        from gyre_slurm.train.rank_group import RankSpec

        spec = RankSpec(model_dir={str(model)!r}, train={{"backend": "megatron", "tensor_parallel": 2}}, seed=0,
                        resume_optimizer=False, host="127.0.0.1", port=1, world=8, timeout_s=5.0,
                        per_node={per_node})
        try:
            spec.build({rank})
        except GroupStarted:
            pass
        print(json.dumps(CALLS))
    """)
    start = next(i for i, c in enumerate(got) if c[0] == "init_process_group")
    assert ["set_device", str(gpu)] in got[:start], got  # current before the group (and anything megatron makes)
    assert all(c == ["set_device", str(gpu)] for c in got if c[0] == "set_device"), got  # never another GPU
    assert got[start] == ["init_process_group", "nccl", f"cuda:{gpu}"], got  # the group bound to that GPU
