"""Installing the real coding-agent CLIs (Claude Code, Codex CLI) that run as harnesses through the proxy.

They are npm packages, installed unmodified into `<state_dir>/harness/` (a package.json there lists the pinned
versions, npm writes its package-lock.json next to it), so every run of this checkout uses the same builds and
nothing global is touched. `gyre harness install NAME` calls `install`; harness presets call `find_binary`.

Both packages ship a native binary in a per-platform optional dependency:

- Claude Code (`@anthropic-ai/claude-code`): `bin/claude.exe` is a shell stub until its postinstall script
  (`install.cjs`) links the native binary of `@anthropic-ai/claude-code-<platform>` over it. npm 11 warns that
  install scripts not listed in package.json's `allowScripts` will be blocked; ours lists this one (pinned to
  its version), and should npm skip it anyway (`ignore-scripts` in a user's config) we run it ourselves.
- Codex CLI (`@openai/codex`): `bin/codex.js` (node) starts the musl binary of `@openai/codex-<platform>`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import GyreError


@dataclass(frozen=True)
class HarnessPackage:
    npm: str  # the npm package
    version: str  # the pinned version (exact)
    binary: str  # its command, in node_modules/.bin/
    postinstall: str | None = None  # its install script (relative to the package), run by npm when allowed
    approx_mb: int = 0  # what the first install downloads and unpacks, for the progress line


# The pins: what `npm install` resolves here (Node 20, npm 11, linux-x64), checked by installing and running
# `--version`. Claude Code releases from 2.1.198 on declare engines.node >= 22; npm skips versions whose engines
# do not match the running node when it resolves a range (which is why `npm i @anthropic-ai/claude-code` gives
# 2.1.197 on Node 20 while `npm view` says latest is newer). 2.1.197 is the last one for Node >= 18.
# Codex CLI 0.171.0 is the latest release (engines.node >= 16).
PACKAGES: dict[str, HarnessPackage] = {
    "claude-code": HarnessPackage("@anthropic-ai/claude-code", "2.1.197", "claude", postinstall="install.cjs",
                                  approx_mb=240),
    "codex": HarnessPackage("@openai/codex", "0.171.0", "codex", approx_mb=430),
}

NPM_TIMEOUT_S = 1800.0  # a slow mirror may take long over ~650 MB; a hung npm must not hang the caller forever
VERSION_TIMEOUT_S = 60.0


def harness_dir(state_dir: Path) -> Path:
    """Where the harness CLIs are installed: `<state_dir>/harness/` (package.json, node_modules/)."""
    return Path(state_dir) / "harness"


def package(name: str) -> HarnessPackage:
    try:
        return PACKAGES[name]
    except KeyError:
        raise GyreError(f"unknown harness {name!r}: one of {', '.join(PACKAGES)}") from None


def installed_binary(name: str, state_dir: Path) -> Path:
    """The path the binary has once installed under state_dir (it may not exist)."""
    return harness_dir(state_dir) / "node_modules" / ".bin" / package(name).binary


def installed_version(name: str, state_dir: Path) -> str | None:
    """The version npm installed under state_dir (from the package's package.json), None if it is not there."""
    meta = harness_dir(state_dir) / "node_modules" / package(name).npm / "package.json"
    try:
        return str(json.loads(meta.read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_binary(name: str, state_dir: Path) -> Path:
    """The harness's command: the one installed under state_dir, else one on PATH, else a GyreError saying how
    to install it."""
    p = installed_binary(name, state_dir)
    if p.exists():
        return p
    on_path = shutil.which(package(name).binary)
    if on_path:
        return Path(on_path)
    raise GyreError(f"{name} is not installed (no {p}, no `{package(name).binary}` on PATH): "
                    f"run `gyre harness install {name}`")


def binary_version(path: Path) -> str | None:
    """What `path --version` prints first (e.g. '2.1.197 (Claude Code)'), None if it does not run cleanly."""
    try:
        r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = r.stdout.strip()
    return out.splitlines()[0] if r.returncode == 0 and out else None


def _reports(version_line: str | None, version: str) -> bool:
    return version_line is not None and re.search(rf"(?<![\d.]){re.escape(version)}(?![\d.])", version_line) is not None


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise GyreError("npm is not on PATH: install Node.js (>= 18) and npm (e.g. `apt-get install nodejs npm`), "
                        "then run `gyre harness install` again")
    return npm


def _one_line(stderr: str, n: int = 3) -> str:
    lines = [re.sub(r"^npm (error|ERR!|warn|WARN) ?", "", ln).strip() for ln in stderr.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("A complete log of this run")]
    return "; ".join(lines[-n:]) or "(no output)"


def write_package_json(name: str, state_dir: Path) -> Path:
    """package.json of the harness folder: the pinned versions of `name` and of the harnesses already there (npm
    removes what package.json does not list), and `allowScripts` for the install scripts we rely on."""
    d = harness_dir(state_dir)
    keep = [n for n in PACKAGES if n == name or installed_version(n, state_dir) is not None]
    doc = {
        "name": "gyre-harnesses",
        "private": True,
        "description": "Coding-agent CLIs run as harnesses by gyre_slurm (written by `gyre harness install`)",
        "dependencies": {PACKAGES[n].npm: PACKAGES[n].version for n in keep},
        "allowScripts": {f"{p.npm}@{p.version}": True for p in PACKAGES.values() if p.postinstall},
    }
    path = d / "package.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[None]:
    """One install at a time per folder (two test runs on one checkout would otherwise race in node_modules)."""
    with open(d / ".install.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def install(name: str, state_dir: Path, echo: Callable[[str], object] = print) -> str:
    """Install harness `name` at its pinned version under state_dir (nothing to do if it is there and runs);
    returns the version. Raises GyreError with one line when npm is missing or fails."""
    pkg = package(name)
    spec = f"{pkg.npm}@{pkg.version}"
    binary = installed_binary(name, state_dir)
    if installed_version(name, state_dir) == pkg.version and _reports(binary_version(binary), pkg.version):
        echo(f"{name} {pkg.version} already installed: {binary}")
        return pkg.version
    npm = _npm()
    d = harness_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    with _locked(d):
        write_package_json(name, state_dir)
        size = f", about {pkg.approx_mb} MB the first time" if pkg.approx_mb else ""
        echo(f"installing {name} ({spec}) into {d} with npm{size} ...")
        env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
               "npm_config_audit": "false"}
        argv = [npm, "install", "--prefix", str(d), "--no-audit", "--no-fund", "--include=optional"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=NPM_TIMEOUT_S,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise GyreError(f"npm install of {spec} did not finish within {NPM_TIMEOUT_S:.0f} s") from None
        if r.returncode != 0:
            raise GyreError(f"npm install of {spec} failed (exit code {r.returncode}): {_one_line(r.stderr)}")
        got = installed_version(name, state_dir)
        if got != pkg.version:
            raise GyreError(f"npm install of {spec} left {got or 'nothing'} in {d / 'node_modules' / pkg.npm}")
        line = binary_version(binary)
        if not _reports(line, pkg.version) and pkg.postinstall:  # npm skipped its install script: run it
            script = d / "node_modules" / pkg.npm / pkg.postinstall
            node = shutil.which("node") or "node"
            s = subprocess.run([node, str(script)], cwd=script.parent, capture_output=True, text=True,
                               timeout=VERSION_TIMEOUT_S * 5, stdin=subprocess.DEVNULL)
            if s.returncode != 0:
                raise GyreError(f"{spec}: its install script {pkg.postinstall} failed: {_one_line(s.stderr)}")
            line = binary_version(binary)
        if not _reports(line, pkg.version):
            raise GyreError(f"{spec} is installed but `{binary} --version` does not report {pkg.version} "
                            f"(it printed {line!r})")
    echo(f"{name} {pkg.version} installed: {binary} ({line})")
    return pkg.version


def status(state_dir: Path) -> list[dict[str, str | None]]:
    """Each known harness: its pinned version, what is installed under state_dir (version, path), and the
    command on PATH when there is none here."""
    out: list[dict[str, str | None]] = []
    for name, pkg in PACKAGES.items():
        binary = installed_binary(name, state_dir)
        here = installed_version(name, state_dir) if binary.exists() else None
        out.append({"name": name, "npm": pkg.npm, "pinned": pkg.version, "installed": here,
                    "path": str(binary) if here else None,
                    "on_path": None if here else shutil.which(pkg.binary)})
    return out
