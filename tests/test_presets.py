"""Harness presets: each CLI's command line, environment and config files for one rollout (no CLI started here;
tests/test_real_harnesses.py runs the real ones)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import tomllib

from gyre_slurm.config import parse_config
from gyre_slurm.errors import ConfigError
from gyre_slurm.harness import install
from gyre_slurm.harness.presets import REFERENCE_COMMAND, command, launch

URL = "http://127.0.0.1:4321/v1"
KEY = "gyre-r7-" + "0" * 40
PROMPT = "--help; rm -rf / $(whoami) `id`"  # a task whose prompt looks like a flag and like shell


@pytest.fixture
def fake_bins(tmp_path: Path) -> Path:
    """A state dir whose harness folder holds the two binaries (stand-ins: launch only resolves paths)."""
    state = tmp_path / "state"
    for name in install.PACKAGES:
        p = install.installed_binary(name, state)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
    return state


def test_the_reference_preset_runs_the_command_with_both_apis_variables(tmp_path: Path) -> None:
    argv = command("reference", "m", 4)
    assert argv == list(REFERENCE_COMMAND)
    run = launch("reference", argv, tmp_path, URL, KEY, PROMPT, tmp_path / "state")
    assert run.argv == [sys.executable, "-m", "gyre_slurm.harness.reference_agent"]
    assert run.env["OPENAI_BASE_URL"] == URL and run.env["OPENAI_API_KEY"] == KEY
    assert run.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4321" and run.env["ANTHROPIC_API_KEY"] == KEY
    assert "HOME" not in run.env  # a custom harness keeps the worker's environment otherwise
    custom = launch("reference", ["prog", "{prompt}", "x{prompt}", "{workspace}/a"], tmp_path, URL, KEY, PROMPT,
                    tmp_path)
    # {prompt} is one whole argument, never spliced into another one
    assert custom.argv == ["prog", PROMPT, "x{prompt}", f"{tmp_path}/a"]


def test_claude_code_gets_its_own_home_the_proxy_and_no_telemetry(tmp_path: Path, fake_bins: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    argv = command("claude-code", "gyre-policy", 6, ["--verbose"])
    run = launch("claude-code", argv, ws, URL, KEY, PROMPT, fake_bins, max_tokens=256)
    assert run.argv[0] == str(install.installed_binary("claude-code", fake_bins))
    assert run.argv[1:] == ["-p", "--model", "gyre-policy", "--max-turns", "6", "--dangerously-skip-permissions",
                            "--verbose", "--", PROMPT]
    env = run.env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4321"  # Anthropic clients add /v1 themselves
    assert env["ANTHROPIC_API_KEY"] == KEY
    assert env["HOME"] == str(ws / ".gyre" / "home") and Path(env["HOME"]).is_dir()
    assert env["CLAUDE_CONFIG_DIR"].startswith(env["HOME"])
    for var in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY",
                "CLAUDE_CODE_DISABLE_AUTO_MEMORY"):
        assert env[var] == "1"
    assert ("IS_SANDBOX" in env) == (os.geteuid() == 0) and env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "256"


def test_codex_gets_a_responses_provider_in_its_own_home(tmp_path: Path, fake_bins: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    run = launch("codex", command("codex", "gyre-policy", 6), ws, URL, KEY, PROMPT, fake_bins, "gyre-policy")
    assert run.argv[0] == str(install.installed_binary("codex", fake_bins))
    assert run.argv[1:] == ["exec", "--skip-git-repo-check", "--sandbox", "workspace-write", "--model", "gyre-policy",
                            "--", PROMPT]
    home = Path(run.env["CODEX_HOME"])
    assert home == ws / ".gyre" / "home" / ".codex"
    conf = tomllib.loads((home / "config.toml").read_text())
    assert conf["model_provider"] == "gyre" and conf["model"] == "gyre-policy"
    provider = conf["model_providers"]["gyre"]
    assert provider == {"name": "gyre TITO proxy", "base_url": URL, "env_key": "OPENAI_API_KEY",
                        "wire_api": "responses"}
    assert run.env["OPENAI_API_KEY"] == KEY


def test_codex_gets_a_temporary_folder_of_its_own_only_under_the_systems(tmp_path: Path, fake_bins: Path,
                                                                         monkeypatch) -> None:
    """Under the temporary folder Codex makes no shell helpers in its CODEX_HOME: such a run gets its own TMPDIR
    (tests/test_harness_install.py runs the real CLI so); elsewhere TMPDIR is left alone (Codex's prompt names it)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run = launch("codex", command("codex", "m", 1), ws, URL, KEY, PROMPT, fake_bins)
    assert run.env["TMPDIR"] == str(ws / ".gyre" / "home" / "tmp") and Path(run.env["TMPDIR"]).is_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "elsewhere"))
    assert "TMPDIR" not in launch("codex", command("codex", "m", 1), ws, URL, KEY, PROMPT, fake_bins).env


def test_a_relative_workspace_gives_the_cli_absolute_paths(tmp_path: Path, fake_bins: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the CLI starts inside the workspace: a relative HOME would point nowhere
    (tmp_path / "ws").mkdir()
    run = launch("codex", command("codex", "m", 1), Path("ws"), URL, KEY, PROMPT, fake_bins.relative_to(tmp_path))
    assert Path(run.env["CODEX_HOME"]).is_absolute() and Path(run.env["HOME"]).is_dir()
    assert Path(run.argv[0]).is_absolute() and run.env["GYRE_WORKSPACE"] == str(tmp_path / "ws")


def test_a_preset_whose_cli_is_not_installed_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH either
    with pytest.raises(Exception, match="gyre harness install codex"):
        launch("codex", command("codex", "m", 1), tmp_path, URL, KEY, PROMPT, tmp_path / "nowhere")


def _config(**harness) -> dict:
    return {"run": {"name": "t"}, "harness": harness, "model": {"builtin": "long"}}


def test_config_refuses_what_a_preset_cannot_use() -> None:
    h = parse_config(_config(preset="claude-code", extra_args=["--verbose"], max_turns=3)).harness
    argv = command(h.preset, h.model_name, h.max_turns, h.extra_args, h.command)
    assert argv[-2:] == ["--", "{prompt}"] and "--verbose" in argv and argv[argv.index("--max-turns") + 1] == "3"
    with pytest.raises(ConfigError, match="harness: command is for preset reference"):
        parse_config(_config(preset="codex", command=["x"]))
    with pytest.raises(ConfigError, match="4,096-token context is shorter than the CLI's first prompt"):
        parse_config({"run": {"name": "t"}, "harness": {"preset": "claude-code"}})
    with pytest.raises(ConfigError, match="harness.preset"):
        parse_config(_config(preset="aider"))
