"""What the `gyre` command's modules share: the consoles, the common options, and how a run is found."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console(soft_wrap=True)
err_console = Console(stderr=True)

StateDir = Annotated[Path, typer.Option("--state-dir", help="Folder that holds the runs.")]
RunArg = Annotated[str, typer.Argument(help="Run id (or a unique prefix, or 'last', or a run folder).")]


def run_dir_of(run: str, state_dir: Path) -> Path:
    from gyre_slurm.rundir import resolve_run

    return resolve_run(run, state_dir)


# how a run's processes (agent, proxy, worker) find their run: a folder, or the config and the run id
# (run_context.RunContext.of_process)
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="The run's folder (state/<run>), on a shared disk.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Instead of --run-dir: the run config ...")]
RunIdOpt = Annotated[str | None, typer.Option("--run-id", help="... and the run id (default: <run.name>-<job id>).")]

