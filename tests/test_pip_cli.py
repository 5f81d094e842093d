"""CLIs from PyPI (a CLI spec's `pip:`): installed with the real pip into a virtual environment of their own under
<state_dir>/harness/pip/<name>/ (harness/install.py), and the shipped mini-swe-agent spec run for real through the
proxy's own API parsing (the scripted proxy: its replies are a script, its parsing and prompt building are the
proxy's).

The install's checks use a one-file wheel made here (pip installs it from a folder: no network, seconds); the
failure of a version PyPI does not have asks PyPI itself; mini-swe-agent is installed once into the repository's
state/harness/, like the npm CLIs (tools/test.sh's `gyre harness install all`, or this test's first run)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.cli_spec import CliSpec, shipped
from gyre_slurm.harness.install import MARKER, find_binary, install, installed_version, pip_dir

from .conftest import REPO, gyre

STATE = REPO / "state"  # where the CLIs are installed for the tests (as tools/test.sh does)
DIST, BINARY = "gyre-tiny-cli", "gyre-tiny"
TINY = {"name": "tiny", "pip": DIST, "version": "1.0.0", "binary": BINARY, "api": "openai",
        "argv": ["{binary}", "{prompt}"], "shell_tool": {"name": "bash", "argument": "command"}}


def _wheel(folder: Path, version: str) -> Path:
    """A real wheel of a one-module distribution whose console script prints its version."""
    info = f"gyre_tiny_cli-{version}.dist-info"
    files = {"gyre_tiny_cli.py": f"def main():\n    print('gyre-tiny {version}')\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: gyre-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/entry_points.txt": f"[console_scripts]\n{BINARY} = gyre_tiny_cli:main\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gyre_tiny_cli-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in files.items():
            z.writestr(p, t)
    return path


@pytest.fixture()
def wheels(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """pip takes the tiny wheels from a folder and asks no index (this process and those it starts)."""
    for v in ("1.0.0", "1.0.1"):
        _wheel(tmp_path / "wheels", v)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    return dict(os.environ)


def _install_in_a_process(state: Path, env: dict[str, str]) -> subprocess.Popen:
    code = ("import sys; from gyre_slurm.harness.cli_spec import CliSpec; from gyre_slurm.harness.install import "
            f"install; install(CliSpec.model_validate({TINY!r}), sys.argv[1])")
    return subprocess.Popen([sys.executable, "-c", code, str(state)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def test_a_pip_cli_is_installed_once_into_its_own_plain_environment(tmp_path: Path, wheels: dict[str, str]) -> None:
    """Two installs at once: one makes the environment, the other waits for it and finds it done; then nothing to
    do while it is there and runs; a broken or differently pinned one is made again, in the same place."""
    state = tmp_path / "state"
    first, second = _install_in_a_process(state, wheels), _install_in_a_process(state, wheels)
    outs = [p.communicate(timeout=300) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    said = [out.strip().splitlines() for out, _err in outs]
    venv = pip_dir(state) / "tiny"
    binary = venv / "bin" / BINARY
    # exactly one of them installed; each ends saying where the command is
    assert sum(lines[0].startswith("installing tiny (gyre-tiny-cli==1.0.0) into ") for lines in said) == 1, said
    assert sorted(lines[-1] for lines in said) == [f"tiny 1.0.0 already installed: {binary}",
                                                   f"tiny 1.0.0 installed: {binary}"]
    spec = CliSpec.model_validate(TINY)
    assert find_binary(spec, state) == binary and installed_version(spec, state) == "1.0.0"
    r = subprocess.run([str(binary)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.stdout == "gyre-tiny 1.0.0\n", r
    # a plain environment of the Python that runs gyre: nothing of gyre's own packages, its base interpreter only
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    assert cfg["include-system-site-packages"] == "false"
    assert Path(cfg["home"]).is_relative_to(sys.base_prefix), cfg
    marker = json.loads((venv / MARKER).read_text())
    assert marker == {"pip": DIST, "version": "1.0.0", "pip_extra": [], "python": marker["python"],
                      "base_prefix": sys.base_prefix}
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import pydantic"], capture_output=True)
    assert r.returncode != 0  # gyre's own dependencies are not seen from it

    lines: list[str] = []
    before = (venv / MARKER).stat().st_mtime_ns
    assert install(spec, state, echo=lines.append) == "1.0.0"
    assert lines == [f"tiny 1.0.0 already installed: {binary}"] and (venv / MARKER).stat().st_mtime_ns == before
    binary.unlink()  # broken: made again
    install(spec, state, echo=lines.append)
    assert lines[-2].startswith("installing tiny") and binary.exists()
    newer = CliSpec.model_validate({**TINY, "version": "1.0.1"})  # another pin: the same place, the new version
    install(newer, state, echo=lines.append)
    assert lines[-2].startswith("installing tiny (gyre-tiny-cli==1.0.1)") and installed_version(newer, state) == "1.0.1"
    assert subprocess.run([str(binary)], capture_output=True, text=True).stdout == "gyre-tiny 1.0.1\n"
    assert sorted(p.name for p in pip_dir(state).iterdir()) == [".tiny.lock", "tiny"]


def test_a_failed_pip_install_is_one_line_and_leaves_no_environment(tmp_path: Path, wheels: dict[str, str]) -> None:
    state = tmp_path / "state"
    with pytest.raises(GyreError) as e:  # the folder has no 9.9.9
        install(CliSpec.model_validate({**TINY, "version": "9.9.9"}), state, echo=lambda _m: None)
    msg = str(e.value)
    assert msg.startswith("pip install of gyre-tiny-cli==9.9.9 failed (exit code 1): ") and "\n" not in msg, msg
    assert "No matching distribution found for gyre-tiny-cli==9.9.9" in msg and "WARNING" not in msg, msg
    assert not (pip_dir(state) / "tiny").exists()


def test_a_version_pypi_does_not_have_is_one_line_from_gyre_harness_install(tmp_path: Path) -> None:
    """The real index, through `gyre harness install --config` (a config's whole spec)."""
    doc = yaml.safe_load((REPO / "configs" / "opencode.yaml").read_text())
    spec = shipped()["mini-swe-agent"].model_dump()
    doc["harness"] = {"preset": "cli", "cli": {**spec, "version": "0.0.1", "pip_extra": []}}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    r = gyre("harness", "install", "--config", config, "--state-dir", tmp_path / "state")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip()
    assert err.startswith("error: pip install of mini-swe-agent==0.0.1 failed (exit code 1): ") and "\n" not in err
    # the versions there are, cut to the newest three, then pip's verdict
    assert "(from versions: ..., " in err and err.endswith("No matching distribution found for mini-swe-agent==0.0.1")
    assert not (pip_dir(tmp_path / "state") / "mini-swe-agent").exists()


def test_the_docs_show_the_shipped_mini_swe_agent_spec() -> None:
    """docs/proxy-and-harnesses.md quotes the spec (without its comments): the same spec."""
    text = (REPO / "docs" / "proxy-and-harnesses.md").read_text().split("#### From PyPI", 1)[1]
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert CliSpec.model_validate(yaml.safe_load(block)) == shipped()["mini-swe-agent"]


def _run_mini(server, url: str, rid: int, ws: Path, max_turns: int):
    """One run of the shipped spec's mini-swe-agent as a rollout starts it (presets.command and launch, then
    run_harness, as bootstrap/demos.py runs a CLI against the scripted proxy)."""
    from gyre_slurm.bootstrap.demos import MODEL_NAME
    from gyre_slurm.harness.presets import command, launch
    from gyre_slurm.harness.runner import run_harness

    spec = shipped()["mini-swe-agent"]
    ws.mkdir()
    argv = command("cli", MODEL_NAME, max_turns=max_turns, cli=spec)
    run = launch("cli", argv, ws, f"{url}/v1", server.key(rid), "Write 'made by mini' into made.txt.", STATE,
                 MODEL_NAME, max_tokens=200, cli=spec)
    h = run_harness(run.argv, ws, run.env, 180, ws / ".gyre" / "harness.log")
    log = (ws / ".gyre" / "harness.log").read_text()
    traj = json.loads((Path(run.env["HOME"]) / "mini-swe-agent.traj.json").read_text())
    return h, log, traj, Path(run.env["HOME"])


@pytest.mark.slow
def test_mini_swe_agent_runs_through_the_proxy_by_its_spec_alone(tmp_path: Path, caplog) -> None:
    """The shipped spec's real mini-swe-agent against the scripted proxy: its bash tool call writes a file, its
    finishing command ends the run; every call carried the run's key, and the proxy refused none. A policy that
    never finishes is stopped by the step limit, one that answers without a tool call by its format-error limit:
    both with exit status 0 (scored from the workspace: the spec needs no policy_stops)."""
    from transformers import AutoTokenizer

    from gyre_slurm.bootstrap.demos import MODEL_NAME, shell_call
    from gyre_slurm.model.long import create_long_model
    from gyre_slurm.proxy.scripted import ScriptedServer

    spec = shipped()["mini-swe-agent"]
    install(spec, STATE)  # the first time: ~170 MB from PyPI, about a minute here; then nothing to do
    model = create_long_model(tmp_path / "model", seed=0)
    write = shell_call(spec, "printf 'made by mini' > made.txt && wc -c made.txt")
    finish = shell_call(spec, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")  # what its prompt says ends a run
    scripts = {7: [write, finish], 8: [write], 9: ["Done."]}  # 8 never finishes, 9 never calls its tool
    server = ScriptedServer(model, lambda rid, turn, kind: scripts[rid][min(turn, len(scripts[rid]) - 1)]
                            if kind == "main" else "OK")
    caplog.set_level(logging.WARNING, logger="gyre.proxy")
    with server.serving() as url:
        runs = {rid: _run_mini(server, url, rid, tmp_path / f"ws{rid}", max_turns=3) for rid in scripts}
        refused = [r.getMessage() for r in caplog.records if r.name == "gyre.proxy"]
        # what a request without the run's key gets (and that the proxy's refusals are seen here)
        bad = urllib.request.Request(f"{url}/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": MODEL_NAME, "messages": []}).encode(),
                                     headers={"Authorization": "Bearer sk-not-the-run",
                                              "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=30)
    h, log, traj, home = runs[7]
    assert h.exit_code == 0 and not h.timed_out, log[-3000:]
    assert (tmp_path / "ws7" / "made.txt").read_text() == "made by mini"  # the tool call ran, in the workspace
    # every request carried its run's key (the proxy files a call under the rollout its key names), none refused
    assert sorted(server.rollouts) == [7, 8, 9] and refused == [], refused
    assert e.value.code == 401 and [r.getMessage() for r in caplog.records if r.name == "gyre.proxy"][-1:] == [
        "POST /v1/chat/completions answered 401: " + json.loads(e.value.read())["error"]["message"][:300]]
    calls = server.rollouts[7].calls
    assert [(c.kind, c.api) for c in calls] == [("main", "openai-chat")] * 2, calls
    tok = AutoTokenizer.from_pretrained(model)
    first, second = (tok.decode(c.prompt_ids) for c in calls)
    assert '"name": "bash"' in first  # its tool schema: the conversation is in tool calls, not ```bash blocks
    # the tool's result came back to it, and in its next request (its observation: returncode and output)
    assert '<tool_response>\n{\n  "returncode": 0,\n  "output": "12 made.txt\\n"\n}\n</tool_response>' in second
    # its trajectory (in the run's HOME): finished by the command, the run's limits in its config
    assert traj["info"]["exit_status"] == "Submitted" and traj["info"]["model_stats"]["api_calls"] == 2
    assert traj["info"]["config"]["agent"]["step_limit"] == 3
    assert traj["info"]["config"]["model"]["model_kwargs"]["max_tokens"] == 200
    assert traj["info"]["config"]["model"]["model_name"] == f"openai/{MODEL_NAME}"
    assert (home / ".config" / "mini-swe-agent").is_dir()  # its config folder: in the run's HOME
    for rid, status, n_calls in [(8, "LimitsExceeded", 3), (9, "RepeatedFormatError", 3)]:
        h, log, traj, _home = runs[rid]
        assert h.exit_code == 0 and traj["info"]["exit_status"] == status, (rid, log[-2000:])
        assert len(server.rollouts[rid].calls) == n_calls and f"Exit:\n{status}\n" in log, (rid, log[-2000:])
