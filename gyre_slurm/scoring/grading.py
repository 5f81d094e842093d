"""From an image task's evaluator output to a score (TaskSpec.grade): pure functions.

- `stdout`: the last line is the score (scoring/evaluator.py's contract).
- `pytest`: the output holds pytest's `-rA` short summary ("PASSED tests/x.py::t", "FAILED … - reason", "ERROR …"),
  read the way SWE-bench's harness reads it (swebench/harness/log_parsers.py, parse_log_pytest: the status word,
  then the test id; PASSED and XFAIL count as passing; a test not reported did not pass). With `fail_to_pass`
  (SWE-bench rows) the score is the share of those tests that pass, and 0 when any of `pass_to_pass` does not —
  SWE-bench itself only says resolved (all of both) or not; the share gives partial credit in the same order. Without
  (NL2Repo tasks) it is the share of the hidden tests that pass, out of `total` when given (tests that never ran,
  e.g. an import error at collection, count as failed), as NL2RepoBench scores.
  An output where pytest never started (no "test session starts") is an evaluator error, not a 0: the image lacks
  pytest, or the grading script broke. A test patch that does not apply (the script says PATCH_FAILED) is a 0,
  as in SWE-bench ("Patch Apply Failed").
- `harbor`: Harbor's reward file (scoring/harbor_verify.py's `read_reward`).
"""

from __future__ import annotations

import re
from pathlib import Path

from gyre_slurm.harness.tasks import Grade
from gyre_slurm.scoring.evaluator import parse_score

PASSING = ("PASSED", "XFAIL")
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS)\s+(\S+)")
SESSION_START = "test session starts"
PATCH_FAILED = "GYRE_SWE_PATCH_FAILED"


def pytest_outcomes(output: str) -> dict[str, str]:
    """Test id → its last status in pytest's -rA summary."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        m = _STATUS.match(line.strip())
        if m:
            out[m.group(2)] = m.group(1)
    return out


def grade_pytest(output: str, grade: Grade) -> float:
    """The score of a pytest run's output. Raises ValueError when it is no pytest run at all."""
    if PATCH_FAILED in output:
        return 0.0
    if SESSION_START not in output:
        raise ValueError("pytest did not start (no 'test session starts' in its output)")
    seen = pytest_outcomes(output)

    def passed(test: str) -> bool:
        return seen.get(test) in PASSING

    if grade.fail_to_pass:
        if not all(passed(t) for t in grade.pass_to_pass):
            return 0.0
        return sum(passed(t) for t in grade.fail_to_pass) / len(grade.fail_to_pass)
    total = max(grade.total or 0, len(seen))
    return sum(s in PASSING for s in seen.values()) / total if total else 0.0


def grade(kind_grade: Grade, stdout: str, output: str, logs: Path | None, exit_code: int) -> float:
    """The score by the task's grade. Raises ValueError (or harbor_verify.VerifyError) saying what is wrong."""
    if kind_grade.kind == "pytest":
        return grade_pytest(output, kind_grade)
    if kind_grade.kind == "harbor":
        from gyre_slurm.scoring.harbor_verify import read_reward

        if logs is None:
            raise ValueError("no /logs folder to read Harbor's reward from")
        return read_reward(logs, exit_code)
    return parse_score(stdout)
