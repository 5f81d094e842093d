"""One rollout from assignment to report: lay the task out in its workspace, run the harness command (any program
that speaks the OpenAI or Anthropic API; it gets the proxy's base URL and the rollout's key) under a wall-clock
limit, then ALWAYS run the evaluator on what the workspace holds (finished or timed out: partial scoring,
docs/algorithms.md §4.2), and classify the run. Sits above harness/ and scoring/, which know nothing of each other.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.api_errors import api_error_reason, length_limit_line, policy_stop_line
from gyre_slurm.harness.cli_spec import CliSpec
from gyre_slurm.harness.image_runtime import CHANGES, ImageRuntime, harness_env
from gyre_slurm.harness.install import node_dir
from gyre_slurm.harness.netrelay import url_in_sandbox
from gyre_slurm.harness.paths import GYRE_DIR
from gyre_slurm.harness.presets import HOME_DIR, launch
from gyre_slurm.harness.runner import HarnessResult, describe_exit, log_tail, run_harness
from gyre_slurm.harness.sandbox import Limits, Sandbox
from gyre_slurm.harness.tasks import TaskSpec
from gyre_slurm.harness.workspace import lay_out
from gyre_slurm.images.cache import Image
from gyre_slurm.protocol import RolloutAssignment, RolloutDone
from gyre_slurm.scoring.evaluator import EvalResult, run_evaluator
from gyre_slurm.scoring.image_eval import image_attempt
from gyre_slurm.statuses import RolloutStatus

HARNESS_LOG = "harness.log"
EVAL_LOG = "eval.log"
MAX_ERROR_CHARS = 2000
LOG_SCAN_BYTES = 256 * 1024  # the end of the harness log searched for API errors (an hours-long run logs MBs)


def classify(h: HarnessResult, ev: EvalResult, harness_log: str, api_errors: str | None = None,
             length_limit: str | None = None, policy_stop: str | None = None, run_limit: str | None = None,
             ) -> tuple[RolloutStatus, float | None, str | None]:
    """(status, reward, error) of a rollout whose harness ran to an exit or a timeout and was then scored.
    `harness_log`: the last lines of its log; `api_errors`: what its log says of API errors from the proxy
    (harness/api_errors.py), which becomes the error of a run that exited 0 or timed out (its status stays the
    evaluator's); `length_limit`: the log's line saying the policy's reply ran into a length limit, which makes a
    non-zero exit the policy's doing: TRUNCATED_CONTEXT, scored from the workspace like a timeout; `policy_stop`:
    its line saying the CLI stopped the run for the policy's behaviour (a loop guard, a turn budget), which makes
    a non-zero exit the policy's doing too: COMPLETED, scored, the line in its error; `run_limit`: the resource
    limit an image run ran into (memory, processes, disk: harness/jail.py ended the whole run), likewise the
    policy's doing: COMPLETED, scored from its workspace, the limit in its error."""
    broke = not h.timed_out and h.exit_code != 0
    why = length_limit or run_limit or policy_stop  # a non-zero exit that was the policy's doing, when one says so
    if broke and why is None:
        # the harness broke (proxy refused it, crash): not the policy's doing, so excluded; the score is kept
        # in the text because it tells whether the agent had got anywhere
        scored = f"evaluator score {ev.score:g}" if ev.error is None else ev.error
        tail = harness_log or "(empty)"
        error = f"harness {describe_exit(h.exit_code)} ({scored}); last lines of {GYRE_DIR}/{HARNESS_LOG}:\n{tail}"
        return RolloutStatus.INFRA_ERROR, None, error[:MAX_ERROR_CHARS]
    if broke:  # the CLI stopped because of the policy (its reply was cut, or it tripped a guard): scored
        what = ("the policy's reply ran into a length limit" if length_limit else
                "the run ended at its resource limit" if run_limit else
                "the CLI stopped the run for the policy's behaviour")
        api_errors = f"harness {describe_exit(h.exit_code)}: {what} (scored from the workspace):\n{why}"
    if ev.error is not None:
        error = ev.error + (f"\n{api_errors}" if api_errors else "")
        return RolloutStatus.EVAL_ERROR, None, error[:MAX_ERROR_CHARS]
    status = (RolloutStatus.TRUNCATED_CONTEXT if broke and length_limit else
              RolloutStatus.TIMEOUT_SCORED if h.timed_out else RolloutStatus.COMPLETED)
    return status, ev.score, api_errors[:MAX_ERROR_CHARS] if api_errors else None


@dataclass
class Clock:
    started_at: float  # wall clock, for the ledger
    t0: float  # monotonic

    def since(self) -> float:
        return time.monotonic() - self.t0


def infra_error(a: RolloutAssignment, worker_id: str, clock: Clock, error: str, h: HarnessResult | None = None,
                eval_s: float = 0.0) -> RolloutDone:
    """The report of a run that failed for a reason outside the policy (excluded from training)."""
    return RolloutDone(rollout_id=a.rollout_id, worker_id=worker_id, status=RolloutStatus.INFRA_ERROR, reward=None,
                       harness_exit=h.exit_code if h else None, timed_out=h.timed_out if h else False,
                       error=error[:MAX_ERROR_CHARS], started_at=clock.started_at,
                       harness_s=h.duration_s if h else clock.since(), eval_s=eval_s)


@dataclass
class _Place:
    """Where a rollout runs: on the host in its workspace, or in its image (`image` set) over `ws/changes`."""

    ws: Path  # the rollout's folder on the host (logs in .gyre/)
    inside: Path  # its workspace as the harness sees it
    image: Image | None = None
    workdir: str | None = None


def _place(task: TaskSpec, ws: Path, images: ImageRuntime | None, images_why: str) -> _Place:
    """Lay the task out; for an image task, fetch (unpack once per node) its image. Raises GyreError/OSError."""
    if task.image is None:
        lay_out(task, ws)
        return _Place(ws, ws)
    if images is None:
        raise GyreError(f"task {task.id} needs its image ({task.image}), but {images_why}")
    image = images.image(task.image)
    workdir = images.workdir(task.workdir, image)
    lay_out(task, ws / CHANGES)  # the working folder's starting changes: TASK.md, the task's files
    (ws / GYRE_DIR).mkdir(exist_ok=True)
    return _Place(ws, Path(workdir), image, workdir)


def execute_rollout(a: RolloutAssignment, worker_id: str, cancel: threading.Event | None = None,
                    eval_retries: int = 1, state_dir: Path = Path("state"), *, sandbox: Sandbox | None = None,
                    limits: Limits | None = None, proxy_socket: Path | None = None,
                    images: ImageRuntime | None = None, images_why: str = "no image runtime") -> RolloutDone:
    """Run one rollout from start to report. Failures of the worker's own steps become INFRA_ERROR. `state_dir`
    is where `gyre harness install` put the CLIs (the run folder's parent; the sandbox hides the rest of it).
    A sandbox with its own network reaches the proxy through `proxy_socket` (the worker's ProxyBridge). A task
    with an image runs in `images` (harness/image_runtime.py), always with its own network."""
    clock = Clock(time.time(), time.monotonic())
    try:
        task = TaskSpec.model_validate(a.task)
    except ValidationError as e:
        first = e.errors()[0]
        return infra_error(a, worker_id, clock, f"bad task in the assignment: {'.'.join(map(str, first['loc']))}: "
                                           f"{first['msg']}")
    ws = Path(a.workspace).resolve()
    try:
        place = _place(task, ws, images, images_why)
    except (GyreError, OSError) as e:
        return infra_error(a, worker_id, clock, f"{'image' if task.image else 'workspace'}: {e}")
    harness_log = ws / GYRE_DIR / HARNESS_LOG
    if cancel is not None and cancel.is_set():  # stopped while the workspace was being laid out
        return infra_error(a, worker_id, clock, "harness not started: the worker is shutting down")
    jail = None
    try:
        own_net = place.image is not None or (sandbox is not None and sandbox.own_network)
        base_url = url_in_sandbox(a.base_url) if own_net else a.base_url
        cli = CliSpec.model_validate(a.cli) if a.cli is not None else None
        run = launch(a.preset, a.harness, place.inside, base_url, a.api_key, task.prompt, state_dir, a.model_name,
                     max_tokens=a.max_tokens, cli=cli, home=ws / HOME_DIR)
        env = {**run.env, "GYRE_ROLLOUT_ID": str(a.rollout_id)}
        preexec = limits.preexec() if limits is not None else None
        timeout_s = task.timeout_s or a.timeout_s
        if place.image is not None and images is not None:
            python = a.preset == "reference" or getattr(cli, "pip", None) is not None
            node = node_dir(state_dir)
            inside_env = harness_env(place.image, env, str(node.absolute()) if (node / "node").exists() else None)
            jail = images.harness(ws=ws, image=place.image, workdir=place.workdir or "", argv=run.argv,
                                  env=inside_env, state_dir=state_dir, proxy_socket=proxy_socket, python=python,
                                  timeout_s=timeout_s)
            argv, env, preexec = jail.argv, {}, None  # the jail sets the limits; the harness gets inside_env only
        else:
            argv = sandbox.wrap(run.argv, ws, state_dir, task.evaluator, proxy_socket) if sandbox is not None \
                else run.argv
        h = run_harness(argv, ws, env, timeout_s, harness_log, cancel=cancel, preexec=preexec)
    except ValidationError as e:
        return infra_error(a, worker_id, clock, f"bad CLI spec in the assignment: {e.errors()[0]['msg']}")
    except (GyreError, OSError, ValueError) as e:  # HarnessError is a GyreError
        return infra_error(a, worker_id, clock, f"harness: {e}")
    finally:
        run_limit = jail.limit() if jail is not None else None
        if jail is not None:
            jail.close()
    if h.cancelled:
        return infra_error(a, worker_id, clock, "harness killed: the worker is shutting down", h)
    attempt = None
    if place.image is not None and images is not None:
        image, workdir = place.image, place.workdir or ""
        attempt = lambda: image_attempt(task, ws, images, image, workdir, cancel)  # noqa: E731
    ev = run_evaluator(task, ws, retries=eval_retries, cancel=cancel, attempt=attempt)
    (ws / GYRE_DIR / EVAL_LOG).write_text(f"attempts: {ev.attempts}\nscore: {ev.score}\nerror: {ev.error}\n"
                                          f"{ev.output}")
    if ev.cancelled:
        return infra_error(a, worker_id, clock, "evaluator killed: the worker is shutting down", h, ev.duration_s)
    tail, end = log_tail(harness_log), log_end(harness_log)
    status, reward, error = classify(h, ev, tail, api_error_reason(end), length_limit_line(end),
                                     policy_stop_line(end, cli.policy_stops if cli is not None else ()),
                                     run_limit=run_limit)
    return RolloutDone(rollout_id=a.rollout_id, worker_id=worker_id, status=status, reward=reward,
                       harness_exit=h.exit_code, timed_out=h.timed_out, error=error, started_at=clock.started_at,
                       harness_s=h.duration_s, eval_s=ev.duration_s, score=ev.score if ev.error is None else None,
                       harness_log=tail)


def log_end(path: Path, max_bytes: int = LOG_SCAN_BYTES) -> str:
    """The end of a log file ('' if there is none): what is searched for API errors."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
