"""What the image tests share: the fixture images (built once, tools/fixture_images.py), an image runtime of each
kind over one image cache, and one rollout run by the worker's own code (worker/rollout.py) with a harness that does
what a script says inside the image."""

from __future__ import annotations

import sys
from pathlib import Path

from gyre_slurm.harness.cgroups import RunLimits
from gyre_slurm.harness.image_runtime import ImageRuntime, make_image_runtime
from gyre_slurm.harness.tasks import TaskSpec
from gyre_slurm.protocol import RolloutAssignment, RolloutDone
from gyre_slurm.worker.rollout import execute_rollout

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
IMAGE_CACHE = REPO / "state" / "images"  # the repository's own cache, as `gyre run` has it: unpacked once
sys.path.insert(0, str(REPO / "tools"))

import fixture_images  # noqa: E402


def fixture_images_built() -> dict[str, str]:
    return fixture_images.ensure(REPO / "state")


def runtime(kind: str, limits: RunLimits | None = None) -> ImageRuntime:
    rt, why = make_image_runtime(kind, IMAGE_CACHE, limits or RunLimits(cpus=1.0, memory_mb=1024, processes=512,
                                                                          disk_mb=256))
    assert rt is not None, why
    return rt


def script_harness(script: str) -> list[str]:
    """A harness that runs `script` with the image's bash in the working folder: what an agent's tool calls do."""
    return ["bash", "-c", script]


def run_task(task: TaskSpec, ws: Path, rt: ImageRuntime | None, harness: list[str], rollout_id: int = 1,
             timeout_s: float = 120.0, state_dir: Path = REPO / "state") -> RolloutDone:
    a = RolloutAssignment(rollout_id=rollout_id, task=task.model_dump(mode="json"), api_key="k", timeout_s=timeout_s,
                          base_url="http://127.0.0.1:9/v1", workspace=str(ws), harness=harness, preset="reference")
    return execute_rollout(a, "w", state_dir=state_dir, images=rt, images_why="no runtime in this test")
