"""SWE-bench rows as a task suite: `tasks.suite: swe:PATH.jsonl` (DeepSWE / R2E-Gym / SWE-bench shaped).

Each line is a SWE-bench instance as the dataset has it (`instance_id, repo, base_commit, problem_statement,
FAIL_TO_PASS, PASS_TO_PASS, test_patch`; the two test lists as JSON lists or as the JSON text of one, as on Hugging
Face) plus `image`: the image holding the repository at `base_commit` with its dependencies, as SWE-bench builds one
per instance. Optional: `workdir` (the repository inside the image; default /testbed, SWE-bench's), `test_cmd`
(the test command's argv; default `python -m pytest -rA -p no:cacheprovider`), `timeout_s`, `eval_timeout_s`.
Every other field (`patch`, `hints_text`, `version`, …) is not read.

The run works in the repository inside the image, with `problem_statement` as its task (TASK.md). The evaluator runs
in a fresh copy of the image holding the run's changes: the files the test patch touches go back to `base_commit`,
the test patch is applied, and the FAIL_TO_PASS and PASS_TO_PASS tests run (harness/scripts/run-swe.sh); the score is
the share of FAIL_TO_PASS that pass, 0 if any PASS_TO_PASS does not (scoring/grading.py). The image needs `sh`, `git`
and the test command.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.tasks import TaskSpec, jsonl_rows, parse_task, resolve_paths

SCRIPT = Path(__file__).with_name("scripts") / "run-swe.sh"
DEFAULT_WORKDIR = "/testbed"
DEFAULT_TEST_CMD = ("python", "-m", "pytest", "-rA", "-p", "no:cacheprovider")
DEFAULT_EVAL_TIMEOUT_S = 1800.0  # SWE-bench's own default per instance
_PATCH_FILE = re.compile(r"^diff --git a/.* b/(.*)$", re.M)
REQUIRED = ("instance_id", "problem_statement", "base_commit", "FAIL_TO_PASS", "PASS_TO_PASS", "test_patch", "image")


def _tests(row: dict[str, Any], key: str, where: str) -> list[str]:
    value = row[key]
    if isinstance(value, str):  # the Hugging Face dataset keeps them as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"{where}: {key} is neither a list nor the JSON text of one") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ConfigError(f"{where}: {key} must be a list of test ids")
    return value


def patched_files(test_patch: str) -> list[str]:
    """The files a test patch touches (SWE-bench reads them the same way)."""
    return list(dict.fromkeys(_PATCH_FILE.findall(test_patch)))


def row_task(row: Any, where: str, base: Path) -> TaskSpec:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object (a SWE-bench row), got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ConfigError(f"{where}: a SWE-bench row needs {', '.join(missing)}")
    f2p, p2p = _tests(row, "FAIL_TO_PASS", where), _tests(row, "PASS_TO_PASS", where)
    if not f2p:
        raise ConfigError(f"{where}: FAIL_TO_PASS is empty: nothing would tell a fix from no change")
    cmd = row.get("test_cmd", list(DEFAULT_TEST_CMD))
    if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) and a for a in cmd):
        raise ConfigError(f"{where}: test_cmd must be a non-empty list of arguments (an argv, not a shell line)")
    if not str(row["test_patch"]).strip():
        raise ConfigError(f"{where}: test_patch is empty")
    files = patched_files(str(row["test_patch"]))
    data = {"id": row["instance_id"], "prompt": row["problem_statement"], "image": row["image"],
            "workdir": row.get("workdir", DEFAULT_WORKDIR),
            "evaluator": ["sh", "/tests/run-swe.sh", str(row["base_commit"]), *cmd, *dict.fromkeys(f2p + p2p)],
            "eval_files": {"run-swe.sh": SCRIPT.read_text(), "test.patch": str(row["test_patch"]),
                           "test-files.txt": "".join(f"{f}\n" for f in files)},
            "grade": {"kind": "pytest", "fail_to_pass": f2p, "pass_to_pass": p2p},
            "timeout_s": row.get("timeout_s"), "eval_timeout_s": row.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)}
    return resolve_paths(parse_task(data, where), base, where)


def load(path: Path) -> list[tuple[str, TaskSpec]]:
    base = Path(path).resolve().parent
    return [(where, row_task(row, where, base)) for where, row in jsonl_rows(Path(path), f"swe:{path}")]
