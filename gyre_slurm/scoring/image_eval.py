"""One evaluation of an image task: the task's evaluator inside a fresh copy of its image, the run's changes laid over
the working folder, the hidden tests (tests_dir's files and eval_files) added at tests_at only now, a fresh /logs,
no network, no key (harness/image_runtime.py). Then the output is graded (scoring/grading.py).

What the policy did can change how its code behaves under the tests (as in SWE-bench, where the tests run on the
policy's repository), but not the tests themselves (they are added after the run, read-only), the grading (on the
host, from the output) or the run's own workspace (the copy writes to a layer of its own, thrown away).

A `stdout` grade needs exit 0, as on the host. A `pytest` or `harbor` grade reads the output or the reward file
whatever the exit status (pytest exits 1 when a test fails). A jail that could not start, a timeout and a limit
the evaluation ran into are evaluator errors (excluded, never scored 0): the run's score would say nothing of it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.image_runtime import ImageRuntime
from gyre_slurm.harness.jail import LIMIT_EXIT
from gyre_slurm.harness.runner import describe_exit
from gyre_slurm.harness.tasks import TaskSpec, substitute
from gyre_slurm.harness.workspace import file_inside
from gyre_slurm.images.cache import Image
from gyre_slurm.scoring.evaluator import Attempt, ended, last_line, run_captured
from gyre_slurm.scoring.grading import grade

JAIL_FAILED = 126  # jail.py: it could not prepare the sandbox


def hidden_tests(task: TaskSpec) -> Path:
    """A fresh folder holding the task's hidden tests: tests_dir's files, then eval_files."""
    folder = Path(tempfile.mkdtemp(prefix="gyre-tests-"))
    if task.tests_dir is not None:
        shutil.copytree(task.tests_dir, folder, symlinks=True, dirs_exist_ok=True)
    for name, text in task.eval_files.items():
        target = file_inside(folder, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    os.chmod(folder, 0o755)
    return folder


def image_attempt(task: TaskSpec, ws: Path, runtime: ImageRuntime, image: Image, workdir: str,
                  cancel: threading.Event | None) -> Attempt:
    hidden = hidden_tests(task)
    argv = substitute(task.evaluator, Path(workdir))
    jail = runtime.evaluator(ws=ws, image=image, workdir=workdir, argv=argv, hidden=hidden, tests_at=task.tests_at,
                             timeout_s=task.eval_timeout_s)
    try:
        c = run_captured(jail.argv, ws, dict(os.environ), task.eval_timeout_s, cancel)
        stop = ended(c, task.eval_timeout_s)
        if stop is not None:
            return stop
        assert c.result is not None and c.result.exit_code is not None
        code = c.result.exit_code
        limit = jail.limit()
        if code == LIMIT_EXIT and limit:
            return None, f"evaluator ended at its {limit}", c.output, False
        if code == JAIL_FAILED and "jail:" in c.stderr:
            return None, f"evaluator's sandbox could not start: {last_line(c.stderr)}", c.output, False
        if task.grade.kind == "stdout" and code != 0:
            return None, f"evaluator failed ({describe_exit(code)}): {last_line(c.stderr)}", c.output, False
        logs = next((p / "logs" for p in jail.scratch), None)
        try:
            return grade(task.grade, c.stdout, f"{c.stdout}\n{c.stderr}", logs, code), None, c.output, False
        except (ValueError, GyreError) as e:  # GyreError: harbor_verify's VerifyError (a reward file that is none)
            return None, f"evaluator gave no valid score: {e}", c.output, False
    finally:
        jail.close()
        shutil.rmtree(hidden, ignore_errors=True)
