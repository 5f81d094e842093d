"""`gyre harness`: install the coding-agent CLIs run as harnesses (Claude Code, Codex CLI, those CLI specs describe:
from npm or PyPI) and list them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_slurm.cli_common import console
from gyre_slurm.errors import GyreError

harness_app = typer.Typer(no_args_is_help=True,
                          help="Install the coding-agent CLIs (Claude Code, Codex CLI, Qwen Code, opencode, "
                               "mini-swe-agent, any a config's harness.cli describes) that run as harnesses, and the "
                               "Node.js the npm ones run on.")
HarnessStateDir = Annotated[Path, typer.Option("--state-dir", help="The runs' state folder (run.state_dir); the "
                                                                   "CLIs go to <state-dir>/harness/ (PyPI ones: "
                                                                   "harness/pip/NAME/).")]


@harness_app.command("install")
def harness_install(
    name: Annotated[str | None, typer.Argument(help="claude-code, codex, a shipped CLI spec (qwen-code, opencode, "
                                                    "mini-swe-agent), or all.")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="Install the CLI of this run config's harness "
                                                                 "section (harness.cli, or its preset).")] = None,
    state_dir: HarnessStateDir = Path("state"),
) -> None:
    """Install a harness CLI at its pinned version with npm, or with pip into its own environment (nothing to do
    when it is there already)."""
    from gyre_slurm.harness.install import install, known, package

    echo = lambda line: console.print(line, highlight=False)  # noqa: E731
    if (name is None) == (config is None):
        raise GyreError("give a harness's name (claude-code, codex, qwen-code, opencode, mini-swe-agent, all) or "
                        "--config CONFIG")
    if config is not None:
        from gyre_slurm.config import load_config

        cfg = load_config(config)
        h = cfg.harness.which
        if h == "reference":
            raise GyreError(f"{config}: harness.preset reference runs harness.command: there is no CLI to install")
        install(h, cfg.run.state_dir if state_dir == Path("state") else state_dir, echo=echo)
        return
    if name != "all":
        package(name)  # an unknown name: one line saying which exist
    for n in known() if name == "all" else [name]:
        install(n, state_dir, echo=echo)


@harness_app.command("list")
def harness_list(
    state_dir: HarnessStateDir = Path("state"),
    offline: Annotated[bool, typer.Option("--offline", help="Do not ask npm's registry and PyPI for newer "
                                                            "releases.")] = False,
) -> None:
    """Node.js and each harness CLI: its pinned version, where it is installed (or 'not installed'), and the newest
    release on npm (PyPI) when it is newer than the pin."""
    from gyre_slurm.harness.install import status

    rows = status(state_dir, check_registries=not offline)
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
            where += f"; {r['registry']} has {r['newer']}"
        console.print(f"{r['name']:<{width}}  {r['spec']}  {where}", highlight=False)
