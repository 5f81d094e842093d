"""The Mooncake Transfer Engine's transport is what the config says, and no GPU address reaches a build that would
read it as host memory.

Mooncake's `initialize(host, metadata, protocol, device)` passes `protocol` only to the Python binding's allocator
(mooncake-integration/transfer_engine/transfer_engine_py.cpp: initMemoryAllocator); TransferEngineImpl::init
(mooncake-transfer-engine/src/transfer_engine_impl.cpp) installs RDMA on any InfiniBand adapter it finds unless
MC_FORCE_TCP is in the environment when `initialize` runs. The real engine (the non-CUDA wheel) is started here in
a fresh process, its `initialize` wrapped to record the environment and the device filter it is called with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gyre_slurm.transfer import engine as te
from gyre_slurm.transfer.engine import TransferAgent, TransferError

from .conftest import REPO

# A fresh process per case: the engine reads its environment once, at initialize.
RECORD = """
import json, os, sys
import mooncake.engine
from gyre_slurm.transfer.engine import TransferAgent
seen = []
class Recording(mooncake.engine.TransferEngine):
    def initialize(self, host, metadata, protocol, device):
        seen.append({"force_tcp": os.environ.get("MC_FORCE_TCP"), "protocol": protocol, "device": device})
        return super().initialize(host, metadata, protocol, device)
mooncake.engine.TransferEngine = Recording
agent = TransferAgent("127.0.0.1", sys.argv[1], sys.argv[2])
print(json.dumps({"seen": seen, "after": os.environ.get("MC_FORCE_TCP"), "peer": agent.peer}))
"""


def start_recorded(protocol: str, device: str, env_force: str | None = None) -> dict:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
    if env_force is not None:
        env["MC_FORCE_TCP"] = env_force
    r = subprocess.run([sys.executable, "-c", RECORD, protocol, device], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tcp_forces_mooncake_onto_tcp_for_the_engine_start_only() -> None:
    out = start_recorded("tcp", "mlx5_0")
    assert out["seen"] == [{"force_tcp": "true", "protocol": "tcp", "device": ""}], out
    assert out["after"] is None  # the process's own environment is as it was
    assert out["peer"].startswith("127.0.0.1:")


def test_rdma_leaves_mooncake_free_to_install_rdma_on_the_named_devices() -> None:
    out = start_recorded("rdma", "mlx5_0,mlx5_1", env_force="1")  # set by the user's shell: not for this engine
    assert out["seen"] == [{"force_tcp": None, "protocol": "rdma", "device": "mlx5_0,mlx5_1"}], out
    assert out["after"] == "1"  # put back afterwards


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(TransferError, match="tcp or rdma"):
        TransferAgent("127.0.0.1", "efa")


def test_the_installed_wheel_is_read_as_not_a_cuda_build() -> None:
    """The CPU wheel installed here: its engine links libibverbs, not libcudart (read from its ELF header)."""
    import mooncake

    needed = te.linked_libraries(Path(mooncake.__file__).parent / "engine.so")
    assert "libibverbs.so.1" in needed and not any(n.startswith("libcudart") for n in needed)
    assert te.cuda_build() is False


def test_gpu_memory_is_refused_unless_mooncake_is_a_cuda_build() -> None:
    assert te.refuse_memory("cpu", cuda_ok=False) is None
    assert te.refuse_memory("cuda", cuda_ok=True) is None
    why = te.refuse_memory("cuda", cuda_ok=False)
    assert why is not None and "no CUDA support" in why and "\n" not in why
    assert te.refuse_memory("xpu", cuda_ok=True) is not None  # only CUDA's pointers are classified by a CUDA build


def test_register_refuses_a_cuda_tensor_on_this_build() -> None:
    """A stand-in for a CUDA tensor (none can be made here): register looks at its device before its address."""
    agent = TransferAgent.shared()
    fake = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(TransferError, match="cannot be registered with this Mooncake build"):
        agent.register(fake)  # type: ignore[arg-type]
    assert agent.register(torch.zeros(8)).nbytes == 32  # host memory still registers


def test_each_cuda_has_its_wheel() -> None:
    assert te.wheel_for("12.8") == "mooncake-transfer-engine"
    assert te.wheel_for("13.0") == "mooncake-transfer-engine-cuda13"
    assert te.wheel_for(None) == "mooncake-transfer-engine-non-cuda"
