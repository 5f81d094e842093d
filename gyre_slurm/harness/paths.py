"""The workspace's fixed names and the rule for paths that come from task data or from the model.

Standard library only: the reference agent imports it, and a worker starts dozens of agents at once.
"""

from __future__ import annotations

from pathlib import PurePosixPath

TASK_FILE = "TASK.md"  # the prompt, in the workspace
GYRE_DIR = ".gyre"  # the worker's own files in the workspace (harness.log, eval.log)


def check_relpath(name: str) -> PurePosixPath:
    """A path from task data, made sure to stay inside the workspace. Raises ValueError saying why not."""
    p = PurePosixPath(name)
    if not name or name.strip() != name:
        raise ValueError(f"file name {name!r} must be a non-empty path without surrounding spaces")
    if p.is_absolute():
        raise ValueError(f"file name {name!r} must be a relative path inside the workspace")
    if ".." in p.parts:
        raise ValueError(f"file name {name!r} must not contain '..' (it would leave the workspace)")
    if p.parts in ((TASK_FILE,), ()) or p.parts[0] == GYRE_DIR:
        raise ValueError(f"file name {name!r} is reserved ({TASK_FILE} holds the prompt, {GYRE_DIR}/ the logs)")
    return p
