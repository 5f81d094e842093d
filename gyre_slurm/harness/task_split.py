"""Which tasks train and which are held out for evaluation (pure; the daemon records the split in `tasks.split`).

With `eval.suite` the evaluation tasks are a suite of their own and every task of `tasks.suite` trains. Otherwise
`eval.holdout_tasks` names the held-out tasks of `tasks.suite`, or `eval.holdout_share` draws that share of them
(at least one, never all) with the run's seed: a restarted daemon draws the same split.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gyre_slurm.config_eval import EvalSection
from gyre_slurm.errors import ConfigError
from gyre_slurm.harness.tasks import TaskSpec, load_suite


@dataclass(frozen=True)
class TaskSplit:
    tasks: list[TaskSpec]  # training tasks first, then the evaluation suite's (when it has its own)
    train: list[int]  # indices into tasks
    eval: list[int]


def split_tasks(train_suite: list[TaskSpec], ev: EvalSection, seed: int,
                eval_suite: list[TaskSpec] | None = None) -> TaskSplit:
    n = len(train_suite)
    if eval_suite is not None:
        return TaskSplit(train_suite + eval_suite, list(range(n)), list(range(n, n + len(eval_suite))))
    if not ev.enabled:
        return TaskSplit(train_suite, list(range(n)), [])
    ids = [t.id for t in train_suite]
    if ev.holdout_tasks:
        unknown = sorted(set(ev.holdout_tasks) - set(ids))
        if unknown:
            raise ConfigError(f"eval.holdout_tasks: no such task in tasks.suite: {', '.join(unknown)} (it has "
                              f"{', '.join(ids[:8])}{', …' if n > 8 else ''})")
        held = {i for i, t in enumerate(ids) if t in set(ev.holdout_tasks)}
    else:
        k = min(n - 1, max(1, math.floor(ev.holdout_share * n)))
        held = set(random.Random(f"holdout:{seed}").sample(range(n), k)) if k > 0 else set()
    if len(held) >= n:
        raise ConfigError(f"eval holds out all {n} tasks of tasks.suite: none would be left to train on")
    if not held:
        raise ConfigError("eval.holdout_share leaves no task to evaluate on: tasks.suite has one task")
    return TaskSplit(train_suite, [i for i in range(n) if i not in held], sorted(held))


def check_runtime(tasks: list[TaskSpec], runtime: str) -> None:
    """ConfigError in one line for a task the run's `harness.runtime` cannot run: one naming an image under `host`,
    one naming none under `image` or `podman`."""
    if runtime == "host":
        bad = [t.id for t in tasks if t.image is not None]
        if bad:
            raise ConfigError(f"harness.runtime is host, but task {bad[0]} names an image ({len(bad)} such tasks): "
                              "use runtime auto, image or podman")
    elif runtime in ("image", "podman"):
        bad = [t.id for t in tasks if t.image is None]
        if bad:
            raise ConfigError(f"harness.runtime is {runtime}, but task {bad[0]} names no image ({len(bad)} such "
                              "tasks): use runtime auto")


def load_split(suite: str, ev: EvalSection, seed: int, refused: list[str] | None = None,
               runtime: str = "auto") -> TaskSplit:
    """The run's suites loaded and split (ConfigError in one line for a bad suite, held-out id, or a task the
    runtime cannot run)."""
    split = split_tasks(load_suite(suite, refused), ev, seed,
                        load_suite(ev.suite, refused) if ev.suite is not None else None)
    check_runtime(split.tasks, runtime)
    return split


def split_line(suite: str, ev: EvalSection, seed: int, runtime: str = "auto") -> str:
    """What `gyre run` and `gyre check` say of the tasks, once the suites loaded."""
    refused: list[str] = []
    s = load_split(suite, ev, seed, refused, runtime)
    held = f", {len(s.eval)} held out for evaluation" if s.eval else ""
    return f"tasks: {len(s.train)} to train on{held}" + (f" ({len(refused)} refused: see above)" if refused else "")
