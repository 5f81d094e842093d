"""Harness presets: how each known coding-agent CLI is started on one rollout, unmodified.

A preset maps the rollout's proxy address and API key into the CLI's own variables and config files, gives
the run its own HOME inside the workspace (`.gyre/home`: no state shared between runs, nothing read from the
user's real home), turns off telemetry and auto-update, and finds the binary (`gyre harness install NAME` puts
it under the state folder; else PATH).

- `reference`: `harness.command` (default: the built-in reference agent), with the OpenAI and Anthropic
  variables set; any program speaking either API fits here.
- `claude-code`: `claude -p TASK` headless, `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY` at the proxy,
  `--dangerously-skip-permissions` (the run's workspace is the CLI's whole world; as root the CLI needs
  `IS_SANDBOX=1` for it), nonessential traffic off.
- `codex`: `codex exec TASK` with a custom provider in `$CODEX_HOME/config.toml` on the Responses API (the
  only wire API Codex accepts for custom providers), its own `workspace-write` sandbox.
- `cli`: any other CLI, described by `harness.cli` (harness/cli_spec.py: argv, variables and HOME files as
  templates; the shipped specs Qwen Code and opencode are examples).

The daemon builds the argv (`command`, from the config) and the worker resolves it on its node (`launch`):
"{binary}", "{prompt}", "{python}" and "{workspace}" are replaced element by element; nothing goes through a
shell, and the task's prompt comes after "--" so that no prompt can pass for a flag (a spec whose CLI takes no "--"
there: a prompt that starts with "-" gets a leading space).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gyre_slurm.harness.cli_spec import CliSpec, fill
from gyre_slurm.harness.paths import GYRE_DIR

Preset = Literal["reference", "claude-code", "codex", "cli"]
PRESETS: tuple[str, ...] = ("reference", "claude-code", "codex", "cli")
REFERENCE_COMMAND = ("{python}", "-m", "gyre_slurm.harness.reference_agent")
HOME_DIR = f"{GYRE_DIR}/home"
DEFAULT_MAX_TOKENS = 4096  # {max_tokens} of a cli spec when the run gives none


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # added to the worker's environment


def command(preset: str, model_name: str, max_turns: int, extra_args: list[str] | tuple[str, ...] = (),
            reference_command: list[str] | tuple[str, ...] | None = None, cli: CliSpec | None = None) -> list[str]:
    """The harness argv of a run, from the config's harness section: {binary}, {prompt} and what depends on the
    run's node and key left for `launch`."""
    extra = list(extra_args)
    if preset == "reference":
        return list(reference_command or REFERENCE_COMMAND) + extra
    if preset == "cli":
        if cli is None:
            raise ValueError("harness preset cli needs its spec (harness.cli)")
        argv = [fill(a, {"{model}": model_name, "{max_turns}": str(max_turns)}) for a in cli.argv]
        at = argv.index("{prompt}")
        # extra arguments go before the "--" that ends the options, or the option the prompt is the value of (-t)
        at -= at > 0 and argv[at - 1].startswith("-")
        return argv[:at] + extra + argv[at:]
    if preset == "claude-code":
        return ["{binary}", "-p", "--model", model_name, "--max-turns", str(max_turns),
                "--dangerously-skip-permissions", *extra, "--", "{prompt}"]
    if preset == "codex":
        return ["{binary}", "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--model", model_name,
                *extra, "--", "{prompt}"]
    raise ValueError(f"unknown harness preset {preset!r} (known: {', '.join(PRESETS)})")


def _codex_config(base_url: str, model_name: str) -> str:
    def q(s: str) -> str:  # a TOML basic string
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "\n".join([
        f"model = {q(model_name)}",
        'model_provider = "gyre"',
        "check_for_update_on_startup = false",
        "[analytics]",
        "enabled = false",
        "[model_providers.gyre]",
        'name = "gyre TITO proxy"',
        f"base_url = {q(base_url)}",
        'env_key = "OPENAI_API_KEY"',
        'wire_api = "responses"',
        "",
    ])


def _cli_files(cli: CliSpec, home: Path, values: dict[str, str]) -> dict[str, str]:
    """Write the spec's files under the run's HOME; the spec's variables, filled."""
    for rel, text in cli.files.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fill(text, values))
    return {k: fill(v, values) for k, v in cli.env.items()}


def launch(preset: str, argv: list[str], workspace: Path, base_url: str, api_key: str, prompt: str,
           state_dir: Path, model_name: str = "gyre-policy", max_tokens: int | None = None,
           cli: CliSpec | None = None, home: Path | None = None) -> Launch:
    """Resolve a run's argv on this node and lay out what its CLI reads (HOME, config files).

    `base_url` is the proxy's OpenAI base URL (…/v1); Anthropic clients take it without /v1. `workspace` is the
    run's folder as the CLI sees it, `home` its HOME (default: `workspace/.gyre/home`), on this node's file
    system and, in an image (harness/image_runtime.py), at the same path inside."""
    workspace = Path(workspace).absolute()  # the CLI starts in it: every path it is given must be absolute
    root = base_url.rstrip("/").removesuffix("/v1")
    # PWD too: a CLI that takes its folder from $PWD (opencode) ran its tools in the folder the worker started in
    env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "ANTHROPIC_BASE_URL": root,
           "ANTHROPIC_API_KEY": api_key, "GYRE_WORKSPACE": str(workspace), "PWD": str(workspace)}
    binary = ""
    if preset != "reference":
        from gyre_slurm.harness.install import find_binary, node_path

        binary = os.path.abspath(find_binary(cli if preset == "cli" else preset, state_dir))  # run in the workspace
        home = Path(home).absolute() if home is not None else workspace / HOME_DIR
        home.mkdir(parents=True, exist_ok=True)
        # the Node installed beside the CLIs first: Codex's codex.js is a node script, and the Node it needs
        env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache"), "DO_NOT_TRACK": "1", "PATH": node_path(state_dir)})
    if preset == "claude-code":
        env.update({"CLAUDE_CONFIG_DIR": str(home / ".claude"), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                    "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
                    "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
                    # memory written in one run would die with its HOME; its prompt section names the run's folder
                    "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1"})
        if max_tokens:  # else it asks for 32,000 a call: a policy that loops would fill them all
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_tokens)
        if os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # the CLI refuses --dangerously-skip-permissions as root without it
    elif preset == "cli":
        if cli is None:
            raise ValueError("harness preset cli needs its spec (harness.cli)")
        values = {"{base_url}": base_url, "{base_root}": root, "{api_key}": api_key, "{model}": model_name,
                  "{max_tokens}": str(max_tokens or DEFAULT_MAX_TOKENS), "{home}": str(home),
                  "{workspace}": str(workspace)}
        env.update(_cli_files(cli, home, values))
        at = argv.index("{prompt}")
        if prompt.startswith("-") and (at == 0 or argv[at - 1] != "--"):
            prompt = " " + prompt  # no "--" before it (a spec's CLI may take none): never passes for a flag
    elif preset == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(_codex_config(base_url, model_name))
        env["CODEX_HOME"] = str(codex_home)
        if codex_home.is_relative_to(tempfile.gettempdir()):
            # Codex makes no helper binaries (codex-linux-sandbox, through which every shell command runs) in a
            # CODEX_HOME under the temporary folder: with the state folder under /tmp, as on many clusters'
            # node-local disks, every tool call of every run failed. There the run gets a temporary folder of its
            # own (elsewhere nothing changes: Codex names TMPDIR in its prompt's writable roots).
            tmp = home / "tmp"
            tmp.mkdir(exist_ok=True)
            env["TMPDIR"] = str(tmp)
    subs = {"{binary}": binary, "{prompt}": prompt, "{python}": sys.executable, "{workspace}": str(workspace)}
    out = []
    for a in argv:
        if a in ("{prompt}", "{binary}"):  # whole elements only: a prompt is never spliced into another argument
            out.append(subs[a])
        else:
            a = a.replace("{python}", subs["{python}"]).replace("{workspace}", subs["{workspace}"])
            out.append(fill(a, values) if preset == "cli" else a)  # a spec's placeholders, as in its env and files
    return Launch(out, env)
