"""`gyre harness install|list` and `find_binary`: the real CLIs that tools/test.sh installed into state/harness/
(`gyre harness install all`), and the failures, with a stand-in npm (no download)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.install import (
    NODE_VERSION,
    PACKAGES,
    binary_version,
    find_binary,
    harness_dir,
    install,
    installed_binary,
    installed_version,
    known,
    node_dir,
    node_package,
)

from .conftest import REPO, gyre, wait_for

STATE = REPO / "state"  # where tools/test.sh installs them


@pytest.mark.parametrize("name", list(PACKAGES))
def test_the_installed_harness_runs_and_reports_its_pinned_version(name: str) -> None:
    pkg = PACKAGES[name]
    path = find_binary(name, STATE)
    assert path == harness_dir(STATE) / "node_modules" / ".bin" / pkg.binary, (
        f"{name} is not under {harness_dir(STATE)}: tools/test.sh runs `gyre harness install all` first")
    assert installed_version(name, STATE) == pkg.version
    r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and pkg.version in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert binary_version(path) == r.stdout.strip().splitlines()[0]


def test_codex_in_a_workspace_under_tmp_gets_its_shell_helpers(tmp_path: Path) -> None:
    """The real Codex CLI makes codex-linux-sandbox (through which every shell command runs) in its CODEX_HOME, but
    refuses to under the temporary folder: a state folder under /tmp broke every tool call. The preset gives the
    run a temporary folder of its own, so the helpers are there (the proxy is unreachable here: no call needed)."""
    assert str(tmp_path).startswith("/tmp/")
    from gyre_slurm.harness.presets import command, launch

    ws = tmp_path / "workspaces" / "r000001"
    ws.mkdir(parents=True)
    run = launch("codex", command("codex", "gyre-policy", 6), ws, "http://127.0.0.1:9/v1", "k", "say hi", STATE)
    home = Path(run.env["CODEX_HOME"])
    log = tmp_path / "codex.log"
    with open(log, "wb") as out:
        cli = subprocess.Popen(run.argv, cwd=ws, env={"PATH": os.environ["PATH"], **run.env}, stdin=subprocess.DEVNULL,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:  # it retries the unreachable proxy for minutes: what matters is done within seconds of its start
        wait_for(lambda: list(home.rglob("codex-linux-sandbox")) or cli.poll() is not None, 60,
                 "Codex to make its shell helpers in CODEX_HOME")
    finally:
        os.killpg(cli.pid, signal.SIGKILL)  # with what it started
        cli.wait()
    out = log.read_text(errors="replace")
    assert "could not create PATH aliases" not in out, out[-2000:]
    helpers = list(home.rglob("codex-linux-sandbox"))
    assert helpers and Path(run.env["TMPDIR"]).is_relative_to(ws), (helpers, run.env["TMPDIR"])


def test_install_of_an_installed_harness_says_so_and_does_nothing() -> None:
    lines: list[str] = []
    for name, pkg in known().items():  # the presets' CLIs and the shipped specs' (`gyre harness install all`)
        assert install(name, STATE, echo=lines.append) == pkg.version
    # npm's in node_modules/.bin/, PyPI's (mini-swe-agent) in an environment of its own
    assert lines == [f"{n} {p.version} already installed: {installed_binary(n, STATE)}" for n, p in known().items()]
    assert installed_binary("mini-swe-agent", STATE) == harness_dir(STATE) / "pip" / "mini-swe-agent" / "bin" / "mini"
    doc = json.loads((harness_dir(STATE) / "package.json").read_text())  # the pins, for a reproducible install
    assert doc["dependencies"] == {node_package().npm: NODE_VERSION,
                                   **{p.npm: p.version for p in known().values() if not p.pip}}


def test_the_clis_run_on_the_node_installed_beside_them(tmp_path: Path) -> None:
    """Node.js from npm, pinned, under state/harness: npm installed the CLIs on it, and every run's PATH starts with
    it (Claude Code >= 2.1.198 needs Node >= 22, whatever the machine has: Node 20 here)."""
    from gyre_slurm.harness.presets import command, launch

    node = node_dir(STATE) / "node"
    assert binary_version(node) == f"v{NODE_VERSION}" and int(NODE_VERSION.split(".")[0]) >= 22
    engines = json.loads((harness_dir(STATE) / "node_modules" / PACKAGES["claude-code"].npm /
                          "package.json").read_text())["engines"]["node"]
    assert engines == ">=22.0.0"  # what the pinned Claude Code asks for
    for preset in PACKAGES:
        run = launch(preset, command(preset, "m", 4), tmp_path / preset, "http://127.0.0.1:9/v1", "k", "hi", STATE)
        first = run.env["PATH"].split(os.pathsep)[0]
        assert Path(first) == node_dir(STATE).absolute(), run.env["PATH"]
        r = subprocess.run(["node", "--version"], env={**os.environ, **run.env}, capture_output=True, text=True)
        assert r.stdout.strip() == f"v{NODE_VERSION}"


def test_list_shows_node_and_each_harness_with_its_pinned_and_installed_version(tmp_path: Path) -> None:
    r = gyre("harness", "list", "--state-dir", STATE, "--offline")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(known()) + 1
    node = node_package()
    assert lines[0].startswith("node") and f"{node.npm}@{NODE_VERSION}  installed {NODE_VERSION}: {node_dir(STATE)}" \
        in lines[0]
    for line, (name, pkg) in zip(lines[1:], known().items(), strict=True):
        # as each registry's client writes a pin: name@version (npm), name==version (pip)
        pin = f"{pkg.pip}=={pkg.version}" if pkg.pip else f"{pkg.npm}@{pkg.version}"
        assert line.startswith(name) and f"  {pin}  " in line
        assert f"installed {pkg.version}: {installed_binary(name, STATE)}" in line
    env = {**os.environ, "PATH": "/nonexistent"}
    r = gyre("harness", "list", "--state-dir", tmp_path, env=env)  # no npm to ask: said nothing of newer ones
    assert r.returncode == 0 and r.stdout.count("not installed (`gyre harness install ") == len(known()) + 1
    assert "npm has" not in r.stdout


def test_list_says_when_npm_has_newer_releases(tmp_path: Path) -> None:
    """What the registry answers `npm view SPEC version --json` (a stand-in npm: a newer Claude Code, Node's
    releases of the pinned major, the same Codex)."""
    claude, node = PACKAGES["claude-code"].npm, node_package().npm
    major = NODE_VERSION.split(".")[0]
    env = _fake_npm(tmp_path, f"""
assert sys.argv[1:3] == ['view'] + sys.argv[2:3] and sys.argv[3:] == ['version', '--json'], sys.argv
spec = sys.argv[2]
answers = {{'{claude}': '"2.1.999"', '{node}@{major}': '["{major}.0.1", "{major}.99.0", "{major}.100.0-rc.1"]'}}
print(answers.get(spec, json.dumps('{PACKAGES["codex"].version}')))
""")
    r = gyre("harness", "list", "--state-dir", tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert lines["claude-code"].endswith("; npm has 2.1.999")
    assert lines["node"].endswith(f"; npm has {major}.99.0")  # the newest release of the major, not a pre-release
    assert "npm has" not in lines["codex"]


def test_a_missing_harness_is_one_line_saying_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(GyreError) as e:
        find_binary("codex", tmp_path)
    assert "\n" not in str(e.value) and str(e.value).endswith("run `gyre harness install codex`")
    with pytest.raises(GyreError, match="unknown harness 'aider': one of claude-code, codex"):
        find_binary("aider", tmp_path)
    (tmp_path / "bin").mkdir()  # not under the state folder, but on PATH: that one
    on_path = tmp_path / "bin" / "codex"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert find_binary("codex", tmp_path) == on_path


def _fake_npm(tmp_path: Path, body: str) -> dict[str, str]:
    """A stand-in `npm` first on PATH (python, so it can lay out node_modules like npm does)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir(exist_ok=True)
    npm = bindir / "npm"
    npm.write_text(f"#!{sys.executable}\nimport sys, os, json, pathlib\n{body}\n")
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}


def test_npm_missing_or_failing_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    r = gyre("harness", "install", "codex", "--state-dir", tmp_path, env={**os.environ, "PATH": "/nonexistent"})
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: npm is not on PATH: install Node.js (>= 18) and npm (e.g. `apt-get install "
                                "nodejs npm`), then run `gyre harness install` again")
    env = _fake_npm(tmp_path, "sys.stderr.write('npm error code E404\\nnpm error 404 Not Found - GET '\n"
                              "'https://registry.npmjs.org/@openai%2fcodex - Not found\\n'\n"
                              "'npm error A complete log of this run can be found in: /root/.npm/x.log\\n')\n"
                              "sys.exit(1)")
    r = gyre("harness", "install", "all", "--state-dir", tmp_path, env=env)
    assert r.returncode == 1
    assert r.stdout.startswith(f"installing Node.js ({node_package().npm}@{NODE_VERSION})")  # Node first
    err = r.stderr.strip()
    assert err.startswith(f"error: npm install of {node_package().npm}@{NODE_VERSION}") and "\n" not in err
    assert err.endswith("failed (exit code 1): code E404; 404 Not Found - GET "
                        "https://registry.npmjs.org/@openai%2fcodex - Not found")


def test_a_skipped_install_script_is_run_by_install(tmp_path: Path) -> None:
    """npm with ignore-scripts leaves Claude Code's stub in place: install runs its postinstall itself."""
    pkg = PACKAGES["claude-code"]
    script = tmp_path / "install.cjs"  # what the real one does: put the working binary over the stub
    script.write_text("require('fs').writeFileSync('bin/claude.exe', "
                      f"'#!/bin/sh\\necho \"{pkg.version} (Claude Code)\"\\n')\n")
    node = node_package()
    env = _fake_npm(tmp_path, f"""
import shutil
prefix = pathlib.Path(sys.argv[sys.argv.index('--prefix') + 1])
doc = json.loads((prefix / 'package.json').read_text())
assert doc['allowScripts'] == {{'{pkg.npm}@{pkg.version}': True}}, doc
n = prefix / 'node_modules' / '{node.npm}'
if doc['dependencies'] == {{'{node.npm}': '{NODE_VERSION}'}}:  # first: Node, which the rest runs on
    (n / 'bin').mkdir(parents=True)
    (n / 'package.json').write_text(json.dumps({{'version': '{NODE_VERSION}'}}))
    real = shutil.which('node')  # the machine's, saying it is the pinned one
    (n / 'bin' / 'node').write_text(f'#!/bin/sh\\n[ "$1" = --version ] && exec echo v{NODE_VERSION}\\n'
                                    f'exec {{real}} "$@"\\n')
    (n / 'bin' / 'node').chmod(0o755)
    sys.exit(0)
assert doc['dependencies'] == {{'{node.npm}': '{NODE_VERSION}', '{pkg.npm}': '{pkg.version}'}}, doc
assert os.environ['PATH'].startswith(str(n / 'bin') + os.pathsep), os.environ['PATH']
d = prefix / 'node_modules' / '{pkg.npm}'
(d / 'bin').mkdir(parents=True)
(d / 'package.json').write_text(json.dumps({{'version': '{pkg.version}'}}))
(d / 'bin' / 'claude.exe').write_text('#!/bin/sh\\necho not installed >&2; exit 1\\n')
(d / 'bin' / 'claude.exe').chmod(0o755)
shutil.copy('{script}', d / 'install.cjs')
(prefix / 'node_modules' / '.bin').mkdir()
(prefix / 'node_modules' / '.bin' / 'claude').symlink_to('../{pkg.npm}/bin/claude.exe')
""")
    r = gyre("harness", "install", "claude-code", "--state-dir", tmp_path / "st", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == (f"claude-code {pkg.version} installed: {tmp_path}/st/harness/node_modules/"
                                         f".bin/claude ({pkg.version} (Claude Code))")
