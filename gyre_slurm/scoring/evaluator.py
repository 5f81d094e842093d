"""Running a task's evaluator on a rollout's workspace (finished or timed out: partial scoring).

Contract (see scoring/builtin_eval.py): exit 0 and print the score in [0, 1] as the last non-empty line of
stdout, as a number or as JSON {"score": x}. A crash, a timeout, no number, NaN or a number out of range is an
evaluator error: the rollout is EVAL_ERROR and excluded from its group, never scored 0 (docs/algorithms.md §4.2).
An error may be re-evaluated on the same workspace a few times (evaluation is cheap; a re-roll would bias the
group toward fast runs, so there is none).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gyre_slurm.harness.runner import HarnessError, describe_exit, run_in_group
from gyre_slurm.harness.tasks import TaskSpec

_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True)
class EvalResult:
    score: float | None  # set if and only if error is None
    error: str | None
    duration_s: float  # all attempts together
    attempts: int
    output: str = ""  # the last attempt's stdout and stderr (their ends), for the workspace's eval.log
    cancelled: bool = False  # stopped because the worker is shutting down


def _short(s: str, n: int = 120) -> str:
    return repr(s if len(s) <= n else s[:n] + "…")


def parse_score(stdout: str) -> float:
    """The score from an evaluator's stdout. Raises ValueError saying what is wrong."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("nothing on stdout")
    last = lines[-1]
    if last.startswith("{"):
        try:
            data = json.loads(last)
        except json.JSONDecodeError:
            raise ValueError(f"last line is not valid JSON: {_short(last)}") from None
        if not isinstance(data, dict) or "score" not in data:
            raise ValueError(f"last line is JSON without a 'score': {_short(last)}")
        value = data["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"'score' is not a number: {_short(repr(value))}")
        x = float(value)
    else:
        try:
            x = float(last)
        except ValueError:
            raise ValueError(f"last line is not a number: {_short(last)}") from None
    if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise ValueError(f"score {x} is not a number in [0, 1]")
    return x


def _read_tail(f: IO[bytes]) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - _TAIL_BYTES))
    return f.read().decode(errors="replace")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "no output on stderr"


def _attempt(task: TaskSpec, workspace: Path, cancel: threading.Event | None) -> tuple[float | None, str | None,
                                                                                      str, bool]:
    """One run: (score, error, output, cancelled)."""
    env = {**os.environ, "GYRE_WORKSPACE": str(workspace)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            r = run_in_group(task.evaluator_argv(workspace), workspace, env, task.eval_timeout_s, out, err,
                             cancel=cancel, grace_s=1.0)
        except HarnessError as e:
            return None, f"evaluator could not start: {e}", "", False
        stdout, stderr = _read_tail(out), _read_tail(err)
    output = f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-4000:]}\n"
    if r.cancelled:
        return None, "evaluator cancelled: the worker is shutting down", output, True
    if r.timed_out:
        return None, f"evaluator timed out after {task.eval_timeout_s:g} s", output, False
    if r.exit_code != 0:
        return None, f"evaluator failed ({describe_exit(r.exit_code)}): {_last_line(stderr)}", output, False
    try:
        return parse_score(stdout), None, output, False
    except ValueError as e:
        return None, f"evaluator printed no valid score: {e}", output, False


def run_evaluator(task: TaskSpec, workspace: Path, retries: int = 1, *,
                  cancel: threading.Event | None = None) -> EvalResult:
    """Score the workspace; an error is re-evaluated up to `retries` more times before it stands."""
    workspace = Path(workspace).resolve()
    start = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        score, error, output, cancelled = _attempt(task, workspace, cancel)
        if error is None or cancelled or attempts > retries:
            break
    if error is not None and attempts > 1:
        error = f"{error} (after {attempts} attempts)"
    return EvalResult(score=score, error=error, duration_s=time.monotonic() - start, attempts=attempts,
                      output=output, cancelled=cancelled)
