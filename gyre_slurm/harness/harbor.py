"""Harbor task folders (the format of Terminal-Bench 2) as a task suite: `tasks.suite: harbor:PATH`.

A Harbor task is a folder holding task.toml, instruction.md, environment/, tests/test.sh (the verifier) and maybe
solution/solve.sh. PATH is one such folder, or a folder of them (its subfolders that hold a task.toml, by name).
Each becomes a TaskSpec:
  - id: the task folder's name (it must be a valid task id); prompt: instruction.md, as written;
  - starting files: everything in environment/ (the template folder, copied into the workspace); none without it;
  - evaluator: `python -m gyre_slurm.scoring.harbor_verify TASK_DIR {workspace}`, which runs tests/test.sh in
    bubblewrap with the workspace at /app (see there);
  - timeouts: [agent] timeout_sec (else the run's harness timeout) and [verifier] timeout_sec (else Harbor's 600 s).
A task that names a container image runs in it (harness/image_runtime.py): `[environment] docker_image` (an image
reference, or oci-archive:/docker-archive:/oci:/rootfs: paths relative to the task folder), or an
`environment/Dockerfile`, built with podman into the node's image cache when a run first needs it (its FROM must
resolve from podman's local images or a reachable registry). The agent works in the image's working folder (its
WORKDIR: Terminal-Bench's images set /app); test.sh runs in a fresh copy of the image with the run's changes, the
task's tests/ at /tests and a fresh /logs, and the reward is read from /logs as above.
Refused (skipped with one line each, the rest of the suite runs): a Compose file in environment/ (several
containers), a verifier in an image of its own ([verifier] environment_mode = "separate"), and a Dockerfile where
podman is not installed.
The rest of task.toml (metadata, resources, network, users, verifier env) is not read.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.tasks import TaskSpec, resolve_paths

TASK_TOML = "task.toml"
INSTRUCTION = "instruction.md"
ENVIRONMENT = "environment"
TEST_SCRIPT = "tests/test.sh"
VERIFIER_MODULE = "gyre_slurm.scoring.harbor_verify"
DEFAULT_VERIFIER_TIMEOUT_S = 600.0  # Harbor's default [verifier] timeout_sec
EVAL_MARGIN_S = 30.0  # the evaluator's limit over test.sh's own: starting bubblewrap, reading the reward
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
DOCKERFILE = "Dockerfile"
IMAGE_TEST_SCRIPT = "/tests/test.sh"


def read_task_toml(task_dir: Path) -> dict[str, Any]:
    """task.toml as a dict. Raises ConfigError naming the file when it is missing or not valid TOML."""
    path = task_dir / TASK_TOML
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError(f"{path}: reading Harbor's task.toml needs Python 3.11 or newer (tomllib)") from None
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (a Harbor task folder holds a task.toml)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def _section(cfg: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = cfg.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: [{name}] must be a table, got {type(value).__name__}")
    return value


def _seconds(cfg: dict[str, Any], section: str, path: Path) -> float | None:
    """[section] timeout_sec: a positive number of seconds, or None when not given."""
    value = _section(cfg, section, path).get("timeout_sec")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{path}: [{section}] timeout_sec must be a positive number of seconds, got {value!r}")
    return float(value)


def verifier_timeout_s(task_dir: Path) -> float:
    """test.sh's wall-clock limit: [verifier] timeout_sec, else Harbor's default."""
    path = task_dir / TASK_TOML
    return _seconds(read_task_toml(task_dir), "verifier", path) or DEFAULT_VERIFIER_TIMEOUT_S


def refusal(task_dir: Path, cfg: dict[str, Any]) -> str | None:
    """Why this node cannot run the task (for its refusal line), or None."""
    path = task_dir / TASK_TOML
    for name in COMPOSE_FILES:
        if (task_dir / ENVIRONMENT / name).exists():
            return f"it needs several containers ({ENVIRONMENT}/{name}), which no runtime here starts"
    verifier = _section(cfg, "verifier", path)
    if verifier.get("environment_mode") == "separate":
        return "its verifier runs in an image of its own ([verifier] environment_mode = \"separate\")"
    if (task_dir / ENVIRONMENT / DOCKERFILE).exists() and not _section(cfg, "environment", path).get("docker_image") \
            and shutil.which("podman") is None:
        return f"building its {ENVIRONMENT}/{DOCKERFILE} needs podman, which is not installed here"
    return None


def image_of(task_dir: Path, cfg: dict[str, Any]) -> str | None:
    """The task's image reference: [environment] docker_image, else its environment/Dockerfile to build, else None."""
    value = _section(cfg, "environment", task_dir / TASK_TOML).get("docker_image")
    if value:
        if not isinstance(value, str):
            raise ConfigError(f"{task_dir / TASK_TOML}: [environment] docker_image must be a string")
        return value
    if (task_dir / ENVIRONMENT / DOCKERFILE).is_file():
        return f"dockerfile:{task_dir / ENVIRONMENT}"
    return None


def _spec(task_dir: Path, cfg: dict[str, Any]) -> TaskSpec:
    path = task_dir / TASK_TOML
    try:
        prompt = (task_dir / INSTRUCTION).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{task_dir}: {INSTRUCTION} cannot be read (a Harbor task's prompt): {e}") from None
    if not (task_dir / TEST_SCRIPT).is_file():
        raise ConfigError(f"{task_dir}: no {TEST_SCRIPT} (a Harbor task's verifier)")
    env = task_dir / ENVIRONMENT
    verifier_s = _seconds(cfg, "verifier", path) or DEFAULT_VERIFIER_TIMEOUT_S
    data = {"id": task_dir.name, "prompt": prompt, "template_dir": env if env.is_dir() else None,
            "evaluator": ["{python}", "-m", VERIFIER_MODULE, str(task_dir), "{workspace}"],
            "timeout_s": _seconds(cfg, "agent", path), "eval_timeout_s": verifier_s + EVAL_MARGIN_S}
    image = image_of(task_dir, cfg)
    if image is not None:  # test.sh in a fresh copy of the image (scoring/image_eval.py), /tests and /logs as above
        data.update(image=image, template_dir=None, evaluator=["bash", IMAGE_TEST_SCRIPT],
                    tests_dir=str(task_dir / Path(TEST_SCRIPT).parent), grade={"kind": "harbor"},
                    eval_timeout_s=verifier_s + EVAL_MARGIN_S)
    try:
        spec = TaskSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        if first["loc"] and first["loc"][0] == "id":
            raise ConfigError(f"{task_dir}: the folder name {task_dir.name!r} is the task's id and is not a valid "
                              f"one ({first['msg']}): rename the folder") from None
        raise ConfigError(f"{task_dir}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    return resolve_paths(spec, task_dir, str(path))


def task_dirs(root: Path) -> list[Path]:
    """The Harbor task folders of PATH: itself when it holds a task.toml, else its subfolders that do."""
    if not root.is_dir():
        raise ConfigError(f"{root}: no such folder of Harbor tasks")
    if (root / TASK_TOML).is_file():
        return [root]
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                  and (d / TASK_TOML).is_file())


def load(root: Path) -> tuple[list[TaskSpec], list[str]]:
    """(the tasks that run here, one line per refused task). Raises ConfigError on a broken task, or when no task
    is found or none is left."""
    root = Path(root).resolve()  # absolute: the TaskSpec means the same on every node (a shared filesystem)
    dirs = task_dirs(root)
    if not dirs:
        raise ConfigError(f"{root}: no Harbor tasks (no {TASK_TOML} in it or in its subfolders)")
    tasks: list[TaskSpec] = []
    refused: list[str] = []
    for d in dirs:
        cfg = read_task_toml(d)
        why = refusal(d, cfg)
        if why is not None:
            refused.append(f"harbor task '{d.name}' cannot run here: {why}: skipped")
            continue
        tasks.append(_spec(d, cfg))
    if not tasks:
        raise ConfigError(f"{root}: no Harbor task in it can run here ({len(refused)} refused: see above): no task "
                          "left to run")
    return tasks, refused
