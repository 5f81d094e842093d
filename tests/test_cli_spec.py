"""Harness preset `cli`: a CLI described by configuration alone (harness/cli_spec.py). The spec's checks, its
argv, variables and HOME files as a run gets them, the config surface, and the shipped specs' real CLIs (Qwen
Code, opencode: installed by tools/test.sh) recording demonstrations through the proxy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.harness.cli_spec import CliSpec, resolve, shipped
from gyre_slurm.harness.install import find_binary, harness_dir, install, installed_version, known, node_path
from gyre_slurm.harness.presets import command, launch

from .conftest import REPO, gyre

STATE = REPO / "state"  # where tools/test.sh installs the CLIs

SPEC = {
    "name": "mycli", "npm": "my-cli", "version": "1.2.3", "binary": "mycli", "api": "openai",
    "argv": ["{binary}", "run", "--model", "p/{model}", "--turns", "{max_turns}", "--", "{prompt}"],
    "env": {"MY_URL": "{base_url}", "MY_KEY": "{api_key}", "MY_ROOT": "{base_root}"},
    "files": {".config/my/config.json": '{"url": "{base_url}", "key": "{api_key}", "out": {max_tokens}}'},
    "shell_tool": {"name": "sh", "argument": "cmd"},
}


@pytest.mark.parametrize(("change", "says"), [
    ({"argv": ["{binary}", "run"]}, "{prompt} once"),
    ({"argv": ["{binary}", "--task={prompt}"]}, "{prompt} once"),
    ({"argv": ["run", "{prompt}"]}, "start with {binary}"),
    ({"env": {"X": "{prompt}"}}, "argv only"),
    ({"env": {"X": "{basse_url}"}}, "unknown placeholder {basse_url}"),
    ({"files": {"/etc/passwd": "x"}}, "relative path"),
    ({"files": {"../../x": "x"}}, "relative path"),
    ({"version": "^1.2.3"}, "exact version"),
    ({"name": "codex"}, "none of"),
    ({"binary": "../bin/sh"}, "command name"),
    ({"api": "gemini"}, "openai"),
    ({"shell_tool": None}, "shell_tool"),
    # where it comes from: npm or PyPI, exactly one, each pinned exactly
    ({"pip": "my-cli"}, "exactly one of npm (an npm package) and pip (a PyPI distribution)"),
    ({"npm": None}, "exactly one of npm"),
    ({"npm": None, "pip": "-e ."}, "not a PyPI distribution name"),
    ({"npm": None, "pip": "https://x/y.whl"}, "not a PyPI distribution name"),
    ({"npm": None, "pip": "my-cli", "version": ">=1.2"}, "exact version"),
    ({"npm": None, "pip": "my-cli", "pip_extra": ["litellm>=1.75"]}, "exact pin (name==version)"),
    ({"npm": None, "pip": "my-cli", "pip_extra": ["--index-url=http://x==1.0"]}, "exact pin"),
    ({"pip_extra": ["litellm==1.0.0"]}, "pip_extra is for a pip CLI"),
    ({"version": "1.2"}, "exact version (x.y.z)"),  # npm: 1.2 is a range
])
def test_a_bad_spec_is_refused_with_what_is_wrong(change: dict, says: str) -> None:
    with pytest.raises(ValueError, match=None) as e:
        CliSpec.model_validate({**SPEC, **change})
    assert says in str(e.value), str(e.value)


def test_a_pip_spec_takes_pypi_versions_and_exact_pins() -> None:
    for version in ("1.2", "2.4.6", "2.0rc1", "1.0.post1"):
        spec = CliSpec.model_validate({**SPEC, "npm": None, "pip": "my.cli_x", "version": version,
                                       "pip_extra": ["litellm==1.110.2", "httpx[http2]==0.28.1"]})
        assert (spec.pip, spec.npm, spec.version) == ("my.cli_x", None, version)


def test_the_shipped_specs_load_and_name_their_shell_tools() -> None:
    specs = shipped()
    assert set(specs) >= {"qwen-code", "opencode", "mini-swe-agent"}
    assert specs["qwen-code"].shell_tool.name == "run_shell_command"
    assert specs["opencode"].shell_tool.name == "bash"
    # mini-swe-agent 2's one tool (minisweagent/models/utils/actions_toolcall.py: BASH_TOOL)
    assert specs["mini-swe-agent"].shell_tool.model_dump() == {"name": "bash", "argument": "command"}
    assert (specs["mini-swe-agent"].pip, specs["mini-swe-agent"].npm) == ("mini-swe-agent", None)
    assert resolve("opencode") is specs["opencode"] and resolve(SPEC).name == "mycli"
    with pytest.raises(GyreError, match="no shipped CLI spec 'nope'"):
        resolve("nope")
    assert set(known()) >= {"claude-code", "codex", "qwen-code", "opencode", "mini-swe-agent"}


def test_a_run_gets_the_spec_filled_in_its_own_home(tmp_path: Path) -> None:
    spec = CliSpec.model_validate(SPEC)
    argv = command("cli", "policy-x", 7, ["--verbose"], cli=spec)
    # the daemon fills what it knows; extra arguments go before the "--" that ends the options
    assert argv == ["{binary}", "run", "--model", "p/policy-x", "--turns", "7", "--verbose", "--", "{prompt}"]
    binary = harness_dir(tmp_path) / "node_modules" / ".bin" / "mycli"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    ws = tmp_path / "workspaces" / "r000001"
    ws.mkdir(parents=True)
    run = launch("cli", argv, ws, "http://127.0.0.1:5/v1", "key-1", "-rf write 7", tmp_path, "policy-x",
                 max_tokens=99, cli=spec)
    assert run.argv == [str(binary), "run", "--model", "p/policy-x", "--turns", "7", "--verbose", "--", "-rf write 7"]
    home = ws / ".gyre" / "home"
    # its own HOME, and PWD at the workspace (opencode runs its tools in $PWD: else in the worker's folder)
    assert (run.env["HOME"], run.env["PWD"]) == (str(home), str(ws))
    assert (run.env["MY_URL"], run.env["MY_KEY"], run.env["MY_ROOT"]) == (
        "http://127.0.0.1:5/v1", "key-1", "http://127.0.0.1:5")
    assert json.loads((home / ".config/my/config.json").read_text()) == {
        "url": "http://127.0.0.1:5/v1", "key": "key-1", "out": 99}
    # the spec's placeholders are filled in argv as in its env and files; extra arguments go before the option
    # whose value the prompt is
    opt = spec.model_copy(update={"argv": ["{binary}", "--out", "{home}/o.json", "--max={max_tokens}",
                                           "--url", "{base_url}", "-t", "{prompt}"]})
    run = launch("cli", command("cli", "m", 1, ["-v"], cli=opt), ws, "http://h/v1", "k", "--help", tmp_path,
                 max_tokens=77, cli=opt)
    assert run.argv[1:] == ["--out", f"{home}/o.json", "--max=77", "--url", "http://h/v1", "-v", "-t", " --help"]
    # without "--" before it, a prompt that starts with "-" cannot pass for a flag
    bare = spec.model_copy(update={"argv": ["{binary}", "{prompt}"]})
    run = launch("cli", command("cli", "m", 1, cli=bare), ws, "http://h/v1", "k", "--help", tmp_path, cli=bare)
    assert run.argv[1:] == [" --help"]


def _config(tmp_path: Path, harness: dict) -> Path:
    doc = yaml.safe_load((REPO / "configs" / "opencode.yaml").read_text())
    doc["harness"] = {**{k: v for k, v in doc["harness"].items() if k not in ("preset", "cli")}, **harness}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_the_config_takes_a_shipped_name_or_a_whole_spec_and_refuses_the_rest(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, {"preset": "cli", "cli": "qwen-code"}))
    assert cfg.harness.cli == shipped()["qwen-code"]
    cfg = load_config(_config(tmp_path, {"preset": "cli", "cli": SPEC}))
    assert cfg.harness.cli.name == "mycli"
    for harness, says in [({"preset": "cli"}, "preset cli needs harness.cli"),
                          ({"preset": "codex", "cli": "opencode"}, "cli is for preset cli"),
                          ({"preset": "cli", "cli": "nope"}, "no shipped CLI spec 'nope'"),
                          ({"preset": "cli", "cli": {**SPEC, "argv": ["{binary}"]}}, "{prompt} once")]:
        with pytest.raises(ConfigError) as e:
            load_config(_config(tmp_path, harness))
        assert says in str(e.value) and "\n" not in str(e.value).strip(), str(e.value)


@pytest.mark.parametrize("name", ["qwen-code", "opencode"])
def test_the_shipped_cli_is_installed_and_reports_its_pinned_version(name: str) -> None:
    spec = shipped()[name]
    path = find_binary(spec, STATE)
    assert path == harness_dir(STATE) / "node_modules" / ".bin" / spec.binary, (
        f"{name} is not under {harness_dir(STATE)}: tools/test.sh runs `gyre harness install all` first")
    assert installed_version(name, STATE) == spec.version
    assert install(name, STATE, echo=lambda _m: None) == spec.version  # already there: nothing to do
    r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60,
                       env={"PATH": node_path(STATE), "HOME": str(REPO / "state")})
    assert r.returncode == 0 and spec.version in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_gyre_harness_install_takes_a_configs_cli_and_refuses_what_it_cannot_install(tmp_path: Path) -> None:
    r = gyre("harness", "install", "--config", REPO / "configs" / "opencode.yaml", "--state-dir", STATE)
    assert r.returncode == 0 and r.stdout.strip() == (
        f"opencode {shipped()['opencode'].version} already installed: {STATE}/harness/node_modules/.bin/opencode"), r
    for args, says in [((), "give a harness's name"), (("codex", "--config", "configs/codex.yaml"), "give a harness's"),
                       (("--config", "configs/tiny-cpu.yaml"), "no CLI to install"), (("nope",), "unknown harness")]:
        r = gyre("harness", "install", *args, "--state-dir", tmp_path)
        assert r.returncode == 1 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "harness").exists()  # nothing installed, nothing half-written


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen-code", "opencode"])
def test_the_shipped_cli_runs_through_the_proxy_by_its_spec_alone(name: str, tmp_path: Path) -> None:
    """The real CLI, started from its spec, against the proxy (scripted replies in the policy's chat format): its
    calls are recorded as the main line of a rollout, it runs the shell tool the spec names (the answer is written
    and read back), and a side call (opencode's session title) is kept off the main line."""
    from gyre_slurm.bootstrap.demos import record_demos
    from gyre_slurm.model.long import create_long_model

    model = tmp_path / "model"
    create_long_model(model, seed=0)
    demos, held_out = record_demos(shipped()[name], model, STATE, 2, seed=3, digits=(7,), p_right=1.0,
                                   held_out=1, max_tokens=256)
    assert len(demos) == 2 and len(held_out) == 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for d in demos + held_out:
        replies = tok.decode([t for t, m in zip(d.ids, d.mask, strict=True) if m])
        assert replies.count(f'"name": "{shipped()[name].shell_tool.name}"') == 2, replies
        assert f"printf {d.answer} > answer.txt" in replies and "Done." in replies
        # the tool's output came back to the CLI and into its next request: the shell tool really ran
        assert d.answer in tok.decode(d.ids).split("cat answer.txt", 1)[1].rsplit("Done.", 1)[0]
