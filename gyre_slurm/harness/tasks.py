"""Task specs and task suites.

A task is what one rollout works on: a prompt (written to TASK.md), starting files and/or a template folder
laid out in the workspace, and an evaluator command run in the workspace afterwards. A task may name a container
image (`image`): the run then works inside it, in its working folder, and the evaluator runs in a fresh copy of it
with the run's changes laid over it and the task's hidden tests added (harness/image_runtime.py). A suite is a list
of tasks: a built-in one (`builtin:digits`), a folder of Harbor tasks (`harbor:PATH`, harness/harbor.py), SWE-bench
rows (`swe:PATH.jsonl`, harness/swe_suite.py), NL2Repo-style task folders (`nl2repo:PATH`,
harness/nl2repo_suite.py) or a JSONL file with one TaskSpec per line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.paths import check_relpath

BUILTIN_PREFIX = "builtin:"
HARBOR_PREFIX = "harbor:"
SWE_PREFIX = "swe:"
NL2REPO_PREFIX = "nl2repo:"
log = logging.getLogger("gyre.tasks")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class Grade(BaseModel):
    """How an image task's evaluator output becomes a score (scoring/grading.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["stdout", "pytest", "harbor"] = Field(
        "stdout", description="stdout: the score is the evaluator's last line (a number or {\"score\": x}); pytest: "
        "its output holds pytest's -rA summary, graded against the lists below; harbor: Harbor's reward file "
        "(/logs/verifier/reward.txt or reward.json).")
    fail_to_pass: list[str] = Field(default_factory=list, description="pytest: the tests the change must make pass; "
                                    "the score is the share that pass (SWE-bench's FAIL_TO_PASS).")
    pass_to_pass: list[str] = Field(default_factory=list, description="pytest: tests that must keep passing; one "
                                    "that does not makes the score 0 (SWE-bench's PASS_TO_PASS).")
    total: int | None = Field(None, ge=1, description="pytest without fail_to_pass: the number of hidden tests; the "
                              "score is the share of them that pass (NL2RepoBench's metric).")


class TaskSpec(BaseModel):
    """One task. `evaluator` is an argv list (never a shell string); in each element "{python}" becomes the
    worker's Python interpreter and "{workspace}" the rollout's workspace folder. For a task with an `image` the
    evaluator runs inside a fresh copy of the image, in `workdir` ({workspace}), with the hidden tests at
    `tests_at`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Task id: 1-128 letters, digits, '_', '.', '-'.")
    prompt: str = Field(description="What the agent is asked to do; written to TASK.md in the workspace.")
    files: dict[str, str] = Field(default_factory=dict, description="Starting files: relative path → text.")
    template_dir: Path | None = Field(None, description="A folder copied into the workspace before `files`.")
    evaluator: list[str] = Field(min_length=1, description="Evaluator argv, run in the workspace.")
    timeout_s: float | None = Field(None, gt=0, description="Harness wall-clock limit; null = the run's.")
    eval_timeout_s: float = Field(60.0, gt=0, description="Evaluator wall-clock limit (s).")
    image: str | None = Field(None, description="Container image the run works in: oci-archive:PATH, "
                              "docker-archive:PATH, oci:PATH, rootfs:PATH (a root file system folder, e.g. an "
                              "Apptainer sandbox) or an image reference pulled with podman or skopeo.")
    workdir: str | None = Field(None, description="Image tasks: the workspace inside the image (absolute); null = "
                                "the image's working folder, else /workspace.")
    tests_dir: Path | None = Field(None, description="Image tasks: a folder of hidden tests, there only for the "
                                   "evaluator (at tests_at).")
    eval_files: dict[str, str] = Field(default_factory=dict, description="Image tasks: hidden files (relative path "
                                       "→ text) added beside tests_dir's, for the evaluator only.")
    tests_at: str = Field("/tests", description="Image tasks: where the hidden tests are in the evaluator's copy.")
    grade: Grade = Field(default_factory=Grade, description="Image tasks: how the evaluator's output is scored.")

    @field_validator("id")
    @classmethod
    def _id_is_safe(cls, v: str) -> str:
        if not _ID.fullmatch(v):
            raise ValueError("must be 1-128 characters of letters, digits, '_', '.', '-' (not starting with one "
                             "of '_.-')")
        return v

    @field_validator("files", "eval_files")
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

    @field_validator("workdir", "tests_at")
    @classmethod
    def _inside_path(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = v.split("/")
        if not v.startswith("/") or v == "/" or ".." in parts or any(c in v for c in ",:\n\0"):
            raise ValueError(f"{v!r} must be an absolute folder inside the image, not /, without '..', ',' or ':'")
        return "/" + "/".join(p for p in parts if p)

    @model_validator(mode="after")
    def _image_only(self) -> TaskSpec:
        if self.image is None:
            given = [n for n, x in (("workdir", self.workdir), ("tests_dir", self.tests_dir),
                                    ("eval_files", self.eval_files)) if x]
            if given or self.grade.kind != "stdout":
                raise ValueError(f"{', '.join(given) or 'grade.kind ' + self.grade.kind} needs an image (the "
                                 "evaluator runs in a fresh copy of it)")
        elif any("{python}" in a for a in self.evaluator):
            raise ValueError("an image task's evaluator runs inside the image: {python} (the worker's Python) is "
                             "not there; name the image's own program (python3, bash, …)")
        return self

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


def jsonl_rows(path: Path, label: str) -> list[tuple[str, Any]]:
    """(file:line, the parsed JSON) of each non-empty line; ConfigError in one line naming the file or line."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{label}: task suite file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{label}: task suite file cannot be read: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((f"{label}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{label}:{n}: not valid JSON: {e.msg} (column {e.colno})") from None
    return out


def _jsonl(path: Path, label: str) -> list[tuple[str, TaskSpec]]:
    return [(where, resolve_paths(parse_task(data, where), path.parent, where))
            for where, data in jsonl_rows(path, label)]


def resolve_paths(task: TaskSpec, base: Path, where: str) -> TaskSpec:
    """The task's folders and its image's path made absolute, relative to `base` (the suite file's folder), so that
    a suite moves with its templates, tests and images, and the TaskSpec means the same on every node."""
    update: dict[str, Any] = {}
    for name in ("template_dir", "tests_dir"):
        d = getattr(task, name)
        if d is not None:
            d = (d if d.is_absolute() else base / d).resolve()
            if not d.is_dir():
                raise ConfigError(f"{where}: {name}: {d} is not a folder")
            update[name] = d
    if task.image is not None:
        from gyre_slurm.images.reference import parse_ref

        try:
            ref = parse_ref(task.image, base)
            update["image"] = ref.text if ref.path is None else \
                f"{ref.kind}:{ref.path}" + (f":{ref.name}" if ref.name else "")
        except ConfigError as e:
            raise ConfigError(f"{where}: image: {e}") from None
    return task.model_copy(update=update) if update else task


def _harbor(spec: str, refused: list[str] | None) -> list[tuple[str, TaskSpec]]:
    from gyre_slurm.harness import harbor

    tasks, skipped = harbor.load(Path(spec[len(HARBOR_PREFIX):]))
    for line in skipped:  # a task this node cannot run (a container image): the rest of the suite still runs
        log.warning("%s", line)
        if refused is not None:
            refused.append(line)
    return [(f"{spec}/{t.id}", t) for t in tasks]


def load_suite(spec: str, refused: list[str] | None = None) -> list[TaskSpec]:
    """`builtin:NAME`, `harbor:PATH`, `swe:PATH`, `nl2repo:PATH` or the path of a JSONL file. Raises ConfigError
    naming the file and line of a
    bad task. Harbor tasks that cannot run here are skipped, each with one line: logged, and appended to
    `refused` when given."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        tasks = [(f"{spec}[{i}]", parse_task(t, f"{spec}[{i}]")) for i, t in enumerate(_builtin(name))]
    elif spec.startswith(HARBOR_PREFIX):
        tasks = _harbor(spec, refused)
    elif spec.startswith(SWE_PREFIX):
        from gyre_slurm.harness import swe_suite

        tasks = swe_suite.load(Path(spec[len(SWE_PREFIX):]))
    elif spec.startswith(NL2REPO_PREFIX):
        from gyre_slurm.harness import nl2repo_suite

        tasks = nl2repo_suite.load(Path(spec[len(NL2REPO_PREFIX):]))
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
