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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gyre_slurm.harness.runner import HarnessError, HarnessResult, describe_exit, run_in_group
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


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "no output on stderr"


@dataclass(frozen=True)
class Captured:
    """One run of an evaluator program: how it ended and the ends of what it printed."""

    result: HarnessResult | None  # None: it could not start (error says why)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None

    @property
    def output(self) -> str:
        return f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}\n"


def run_captured(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float,
                 cancel: threading.Event | None) -> Captured:
    """Run argv in its own process group under a wall-clock limit; keep the ends of stdout and stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            r = run_in_group(argv, cwd, env, timeout_s, out, err, cancel=cancel, grace_s=1.0)
        except HarnessError as e:
            return Captured(None, error=f"evaluator could not start: {e}")
        return Captured(r, _read_tail(out), _read_tail(err))


Attempt = tuple[float | None, str | None, str, bool]  # (score, error, output, cancelled)


def ended(c: Captured, timeout_s: float) -> Attempt | None:
    """The attempt's outcome when the program did not run to an exit of its own (None when it did)."""
    if c.result is None:
        return None, c.error, "", False
    if c.result.cancelled:
        return None, "evaluator cancelled: the worker is shutting down", c.output, True
    if c.result.timed_out:
        return None, f"evaluator timed out after {timeout_s:g} s", c.output, False
    return None


def _attempt(task: TaskSpec, workspace: Path, cancel: threading.Event | None) -> Attempt:
    """One run on the host: (score, error, output, cancelled)."""
    env = {**os.environ, "GYRE_WORKSPACE": str(workspace)}
    c = run_captured(task.evaluator_argv(workspace), workspace, env, task.eval_timeout_s, cancel)
    stop = ended(c, task.eval_timeout_s)
    if stop is not None:
        return stop
    assert c.result is not None and c.result.exit_code is not None
    if c.result.exit_code != 0:
        return None, f"evaluator failed ({describe_exit(c.result.exit_code)}): {last_line(c.stderr)}", c.output, False
    try:
        return parse_score(c.stdout), None, c.output, False
    except ValueError as e:
        return None, f"evaluator printed no valid score: {e}", c.output, False


def run_evaluator(task: TaskSpec, workspace: Path, retries: int = 1, *, cancel: threading.Event | None = None,
                  attempt: Callable[[], Attempt] | None = None) -> EvalResult:
    """Score the workspace; an error is re-evaluated up to `retries` more times before it stands. `attempt` runs
    one evaluation (default: the task's evaluator on the host, in the workspace; an image task's in a fresh copy
    of its image: scoring/image_eval.py)."""
    workspace = Path(workspace).resolve()
    one = attempt or (lambda: _attempt(task, workspace, cancel))
    start = time.monotonic()
    attempts = 0
    while True:
        attempts += 1
        score, error, output, cancelled = one()
        if error is None or cancelled or attempts > retries:
            break
    if error is not None and attempts > 1:
        error = f"{error} (after {attempts} attempts)"
    return EvalResult(score=score, error=error, duration_s=time.monotonic() - start, attempts=attempts,
                      output=output, cancelled=cancelled)
