"""NL2Repo-style tasks as a suite: `tasks.suite: nl2repo:PATH` — write a whole repository from a specification.

PATH is one task folder or a folder of them (those holding a task.toml, by name). A task folder holds:
  task.toml   `image` (required: the environment, e.g. a Python image with pytest), `workdir` (where the repository is
              written; default /workspace, empty unless the image has it), `[agent] timeout_sec`, `[verifier]
              timeout_sec` (default 1800), `total` (the number of hidden test cases: required, so that tests that
              never run — an import error at collection — count as failed) and `command` (the test argv; default
              `python -m pytest -rA -p no:cacheprovider /tests`);
  spec.md     the specification: the run's task (TASK.md), as NL2RepoBench gives its natural-language document;
  tests/      the hidden tests, at /tests in the evaluator's copy only;
  start/      optional starting files, copied into the working folder.
The score is the share of the `total` hidden tests that pass (NL2RepoBench's pass rate; scoring/grading.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.harbor import read_task_toml, task_dirs
from gyre_slurm.harness.tasks import TaskSpec, parse_task, resolve_paths

DEFAULT_WORKDIR = "/workspace"
DEFAULT_COMMAND = ("python", "-m", "pytest", "-rA", "-p", "no:cacheprovider", "/tests")
DEFAULT_VERIFIER_TIMEOUT_S = 1800.0


def _table(cfg: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = cfg.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: [{name}] must be a table")
    return value


def task(folder: Path) -> TaskSpec:
    path = folder / "task.toml"
    cfg = read_task_toml(folder)
    verifier = _table(cfg, "verifier", path)
    try:
        prompt = (folder / "spec.md").read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{folder}: spec.md cannot be read (an NL2Repo task's specification): {e}") from None
    if not (folder / "tests").is_dir():
        raise ConfigError(f"{folder}: no tests/ folder (the hidden tests)")
    if "image" not in cfg:
        raise ConfigError(f"{path}: image is required (the environment the repository is written and tested in)")
    data = {"id": folder.name, "prompt": prompt, "image": cfg["image"],
            "workdir": cfg.get("workdir", DEFAULT_WORKDIR),
            "template_dir": "start" if (folder / "start").is_dir() else None, "tests_dir": "tests",
            "evaluator": verifier.get("command", list(DEFAULT_COMMAND)),
            "grade": {"kind": "pytest", "total": verifier.get("total")},
            "timeout_s": _table(cfg, "agent", path).get("timeout_sec"),
            "eval_timeout_s": verifier.get("timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)}
    if data["grade"]["total"] is None:
        raise ConfigError(f"{path}: [verifier] total is required (the number of hidden test cases)")
    return resolve_paths(parse_task(data, str(path)), folder, str(path))


def load(root: Path) -> list[tuple[str, TaskSpec]]:
    root = Path(root).resolve()
    dirs = task_dirs(root)
    if not dirs:
        raise ConfigError(f"{root}: no NL2Repo tasks (no task.toml in it or in its subfolders)")
    return [(f"nl2repo:{d}", task(d)) for d in dirs]
