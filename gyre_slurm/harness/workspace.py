"""Laying a task out in a rollout's workspace: the template folder, then the task's files, then TASK.md.

The workspace is kept after the run (the evaluator scores it, people debug from it); nothing here deletes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.paths import TASK_FILE, check_relpath
from gyre_slurm.harness.tasks import TaskSpec


class WorkspaceError(GyreError):
    """A workspace could not be laid out (bad file name, missing template, folder already used)."""


def file_inside(workspace: Path, name: str) -> Path:
    """The file's path, after making sure it stays inside the workspace even through symlinks of a template."""
    try:
        rel = check_relpath(name)
    except ValueError as e:
        raise WorkspaceError(str(e)) from None
    root = workspace.resolve()
    target = (root / rel).resolve()
    if not target.is_relative_to(root):
        raise WorkspaceError(f"file name {name!r} leads outside the workspace (through a symlink) to {target}")
    return target


def lay_out(task: TaskSpec, workspace: Path) -> None:
    """Create `workspace` and fill it from the task. Refuses a folder that already holds files, so no rollout
    starts from another one's leftovers."""
    workspace = Path(workspace)
    if workspace.exists() and (not workspace.is_dir() or any(workspace.iterdir())):
        raise WorkspaceError(f"workspace {workspace} already exists and is not an empty folder")
    workspace.mkdir(parents=True, exist_ok=True)
    if task.template_dir is not None:
        if not task.template_dir.is_dir():
            raise WorkspaceError(f"task {task.id}: template_dir {task.template_dir} is not a folder on this node")
        # symlinks stay links: copying what they point to could pull files from anywhere on the machine
        shutil.copytree(task.template_dir, workspace, symlinks=True, dirs_exist_ok=True)
    for name, text in task.files.items():
        target = file_inside(workspace, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    prompt = workspace.resolve() / TASK_FILE
    if prompt.is_symlink():
        prompt.unlink()  # a template's TASK.md link must not redirect the prompt elsewhere
    prompt.write_text(task.prompt)
