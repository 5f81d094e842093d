"""Task specs and task suites.

A task is what one rollout works on: a prompt (written to TASK.md), starting files and/or a template folder
laid out in the workspace, and an evaluator command run in the workspace afterwards. A suite is a list of
tasks: a built-in one (`builtin:digits`), a folder of Harbor tasks (`harbor:PATH`, harness/harbor.py) or a JSONL
file with one TaskSpec per line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.paths import check_relpath

BUILTIN_PREFIX = "builtin:"
HARBOR_PREFIX = "harbor:"
log = logging.getLogger("gyre.tasks")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class TaskSpec(BaseModel):
    """One task. `evaluator` is an argv list (never a shell string); in each element "{python}" becomes the
    worker's Python interpreter and "{workspace}" the rollout's workspace folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Task id: 1-128 letters, digits, '_', '.', '-'.")
    prompt: str = Field(description="What the agent is asked to do; written to TASK.md in the workspace.")
    files: dict[str, str] = Field(default_factory=dict, description="Starting files: relative path → text.")
    template_dir: Path | None = Field(None, description="A folder copied into the workspace before `files`.")
    evaluator: list[str] = Field(min_length=1, description="Evaluator argv, run in the workspace.")
    timeout_s: float | None = Field(None, gt=0, description="Harness wall-clock limit; null = the run's.")
    eval_timeout_s: float = Field(60.0, gt=0, description="Evaluator wall-clock limit (s).")

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, v: str) -> str:
        if not _ID.fullmatch(v):
            raise ValueError("must be 1-128 characters of letters, digits, '_', '.', '-' (not starting with one "
                             "of '_.-')")
        return v

    @field_validator("files")
    @classmethod
    def _files_stay_inside(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            check_relpath(name)
        return v

    @field_validator("evaluator")
    @classmethod
    def _evaluator_has_a_program(cls, v: list[str]) -> list[str]:
        if not v[0].strip():
            raise ValueError("the first element (the program) must not be empty")
        return v

    def evaluator_argv(self, workspace: Path) -> list[str]:
        return substitute(self.evaluator, workspace)


def substitute(argv: list[str], workspace: Path) -> list[str]:
    """Replace "{python}" (this interpreter) and "{workspace}" in each element; no other expansion, no shell."""
    return [a.replace("{python}", sys.executable).replace("{workspace}", str(workspace)) for a in argv]


def _one_line(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "task"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def parse_task(data: Any, where: str) -> TaskSpec:
    """Validate one task; `where` ("file:line") starts the error message."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object (a TaskSpec), got {type(data).__name__}")
    try:
        return TaskSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: {_one_line(e)}") from None


def _builtin(name: str) -> list[dict[str, Any]]:
    from gyre_slurm.harness import builtin_suite

    if name not in builtin_suite.SUITES:
        raise ConfigError(f"unknown built-in suite '{name}' (known: {', '.join(sorted(builtin_suite.SUITES))})")
    return builtin_suite.tasks(builtin_suite.SUITES[name], slow_tools=name in builtin_suite.SLOW_SUITES,
                               counts=builtin_suite.COUNTS.get(name, builtin_suite.ALL_COUNTS),
                               phrasings=builtin_suite.REWORDED.get(name, ("",)))


def _jsonl(path: Path, label: str) -> list[tuple[str, TaskSpec]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{label}: task suite file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: task suite file cannot be read: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{label}:{n}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        task = parse_task(data, where)
        if task.template_dir is not None:
            task = _resolve_template(task, path.parent, where)
        out.append((where, task))
    return out


def _resolve_template(task: TaskSpec, base: Path, where: str) -> TaskSpec:
    # relative to the suite file, so a suite and its templates move together; absolute from here on, so the
    # TaskSpec means the same on every node
    tdir = task.template_dir if task.template_dir.is_absolute() else (base / task.template_dir)
    tdir = tdir.resolve()
    if not tdir.is_dir():
        raise ConfigError(f"{where}: template_dir: {tdir} is not a folder")
    return task.model_copy(update={"template_dir": tdir})


def _harbor(spec: str, refused: list[str] | None) -> list[tuple[str, TaskSpec]]:
    from gyre_slurm.harness import harbor

    tasks, skipped = harbor.load(Path(spec[len(HARBOR_PREFIX):]))
    for line in skipped:  # a task this node cannot run (a container image): the rest of the suite still runs
        log.warning("%s", line)
        if refused is not None:
            refused.append(line)
    return [(f"{spec}/{t.id}", t) for t in tasks]


def load_suite(spec: str, refused: list[str] | None = None) -> list[TaskSpec]:
    """`builtin:NAME`, `harbor:PATH` or the path of a JSONL file. Raises ConfigError naming the file and line of a
    bad task. Harbor tasks that cannot run here are skipped, each with one line: logged, and appended to
    `refused` when given."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        tasks = [(f"{spec}[{i}]", parse_task(t, f"{spec}[{i}]")) for i, t in enumerate(_builtin(name))]
    elif spec.startswith(HARBOR_PREFIX):
        tasks = _harbor(spec, refused)
    else:
        tasks = _jsonl(Path(spec), spec)
    if not tasks:
        raise ConfigError(f"{spec}: the task suite has no tasks")
    seen: dict[str, str] = {}
    for where, t in tasks:
        if t.id in seen:
            raise ConfigError(f"{where}: id: duplicate task id '{t.id}' (first at {seen[t.id]})")
        seen[t.id] = where
    return [t for _, t in tasks]
