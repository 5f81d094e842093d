"""`gyre harness`: install the coding-agent CLIs run as harnesses (Claude Code, Codex CLI) and list them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_slurm.cli_common import console

harness_app = typer.Typer(no_args_is_help=True,
                          help="Install the coding-agent CLIs (Claude Code, Codex CLI) that run as harnesses, and the "
                               "Node.js they run on.")
HarnessStateDir = Annotated[Path, typer.Option("--state-dir", help="The runs' state folder (run.state_dir); the "
                                                                   "CLIs go to <state-dir>/harness/.")]


@harness_app.command("install")
def harness_install(
    name: Annotated[str, typer.Argument(help="claude-code, codex or all.")],
    state_dir: HarnessStateDir = Path("state"),
) -> None:
    """Install a harness CLI at its pinned version with npm (nothing to do when it is there already)."""
    from gyre_slurm.harness.install import PACKAGES, install, package

    if name != "all":
        package(name)  # an unknown name: one line saying which exist
    for n in PACKAGES if name == "all" else [name]:
        install(n, state_dir, echo=lambda line: console.print(line, highlight=False))


@harness_app.command("list")
def harness_list(
    state_dir: HarnessStateDir = Path("state"),
    offline: Annotated[bool, typer.Option("--offline", help="Do not ask npm's registry for newer releases.")] = False,
) -> None:
    """Node.js and each harness CLI: its pinned version, where it is installed (or 'not installed'), and the newest
    release on npm when it is newer than the pin."""
    from gyre_slurm.harness.install import status

    rows = status(state_dir, check_npm=not offline)
    width = max(len(r["name"] or "") for r in rows)
    for r in rows:
        how = "gyre harness install " + ("all" if r["name"] == "node" else str(r["name"]))
        if r["installed"]:
            where = f"installed {r['installed']}: {r['path']}"
            if r["installed"] != r["pinned"]:
                where += f" (not the pinned version: run `{how}`)"
        elif r["on_path"]:
            where = f"not installed here; on PATH: {r['on_path']}"
        else:
            where = f"not installed (`{how}`)"
        if r["newer"]:
            where += f"; npm has {r['newer']}"
        console.print(f"{r['name']:<{width}}  {r['npm']}@{r['pinned']}  {where}", highlight=False)
