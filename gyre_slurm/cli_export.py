"""`gyre export`: replay a run's ledger into TensorBoard or Weights & Biases (gyre_slurm/tracking/export.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_slurm.cli_common import RunArg, StateDir, console, err_console, run_dir_of


def export(
    to: Annotated[str, typer.Option("--to", help="tensorboard or wandb.")],
    run: RunArg = "last",
    out: Annotated[Path | None, typer.Option(
        help="Output folder; default: state/<run>/tb-export/ (tensorboard), state/<run>/wandb-export/ (wandb).")
    ] = None,
    online: Annotated[bool, typer.Option(
        help="W&B: upload as it goes (needs `wandb login`); default offline, unless WANDB_MODE=online.")] = False,
    state_dir: StateDir = Path("state"),
) -> None:
    """Replay a finished or running run's ledger (every DONE step and evaluation) into TensorBoard or W&B."""
    from gyre_slurm.tracking.export import export_run

    run_dir = run_dir_of(run, state_dir)
    with err_console.status(f"exporting {run_dir.name} to {to}") as status:  # a live line on a terminal only
        res = export_run(run_dir, to, out=out, online=online, progress=lambda i, n, p: status.update(
            f"exporting {run_dir.name} to {to}: {i}/{n} points written ({p.kind} {p.ref}, x = {p.x})"))
    console.print(f"{res.points} points written ({res.steps} steps, {res.evals} evaluations) to {res.folder}",
                  highlight=False)
    if res.url:
        console.print(f"W&B run: {res.url}", highlight=False)
    elif to == "wandb":
        console.print(f"upload it with: wandb sync {res.folder}", highlight=False)
    else:
        console.print(f"view it with: tensorboard --logdir {res.folder}", highlight=False)
