"""Runs in a task's container image: the harness inside the image over the run's writable layer, and the evaluator in
a fresh copy of the image with the run's changes laid over it (harness/jail.py does the mounting).

A rollout of an image task keeps, in its workspace folder on the host (`state/<run>/workspaces/r<id>/`):
  changes/        the run's writable layer: what it changed in the image's working folder (new and changed files;
                  a deleted file is a 0/0 character device, overlayfs's whiteout), TASK.md and the task's files;
  .gyre/          logs, the CLI's HOME, `limit.json` when the run hit a limit — bound into the sandbox at this same
                  path, so the CLI's HOME and config files keep the paths harness/presets.py gives them;
  .overlay-work/  overlayfs's own work folder.
Inside, the image's root file system is `/`, read-only; the working folder (`workdir`) is writable; /tmp is private;
the CLIs' install (`state/harness`) is bound read-only at its own path, and for a Python harness (the reference
agent, a CLI installed from PyPI) the worker's interpreter and its virtual environment too. Nothing else of the
host is there: no state folder, no run token, no ledger, no other run, no home folder. The evaluator's copy has
the task's hidden tests at `tests_at` (they exist nowhere in the harness's view) and a fresh `/logs`.

Two runtimes run the same jail: bubblewrap (`image`: no daemon, no root where user namespaces are allowed) and
podman (`podman`: the same mounts, limits and network rule, in a podman container; run as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import gyre_slurm
from gyre_slurm.errors import GyreError
from gyre_slurm.harness.cgroups import RunLimits, how_limits_apply, make_group
from gyre_slurm.harness.jail import Bind, JailSpec
from gyre_slurm.harness.paths import GYRE_DIR
from gyre_slurm.harness.sandbox import DROPPED_CAPS, HARNESS_INSTALLS, bwrap_works
from gyre_slurm.images.cache import Image, ImageCache
from gyre_slurm.images.reference import parse_ref

CHANGES = "changes"
OVERLAY_WORK = ".overlay-work"
LIMIT_FILE = "limit.json"
DEFAULT_WORKDIR = "/workspace"
RESOLVE_AGAIN_S = 600.0
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the host folders that must never be bound over an image's own (a Python harness's interpreter living there)
SYSTEM = tuple(Path(p) for p in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/var", "/opt"))


@dataclass
class Jail:
    """One jailed process: the argv the worker runs, and its files (removed by `close`)."""

    argv: list[str]
    folder: Path  # private: the spec, the jail's mount point
    limit_report: Path
    scratch: list[Path] = field(default_factory=list)  # an evaluator's own writable layer, its logs, its tests

    def limit(self) -> str | None:
        """The limit the run ran into (jail.py wrote it), or None."""
        try:
            return str(json.loads(self.limit_report.read_text())["limit"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def close(self) -> None:
        for p in [self.folder, *self.scratch]:
            shutil.rmtree(p, ignore_errors=True)


def python_binds() -> list[Bind]:
    """The worker's interpreter, its virtual environment and this package, read-only at their own paths: what a
    Python harness needs inside an image. Refused when one lives in a system folder, which would hide the image's."""
    out: list[Bind] = []
    for p in dict.fromkeys(Path(x).resolve() for x in (sys.base_prefix, sys.prefix,
                                                        Path(gyre_slurm.__file__).parent)):
        under = next((s for s in SYSTEM if p == s or p.is_relative_to(s)), None)
        if under is not None:
            raise GyreError(f"a Python harness inside an image needs the worker's Python outside the system folders "
                            f"(it would cover the image's own): {p} is under {under} (use a virtual environment of a "
                            "Python installed elsewhere: pyenv, conda, uv)")
        if not any(p.is_relative_to(Path(b.src)) for b in out):
            out.append(Bind(src=str(p), dest=str(p)))
    return out


@dataclass(frozen=True)
class ImageRuntime:
    kind: str  # "bwrap" (harness.runtime image) or "podman"
    program: list[str]
    program_env: dict[str, str]
    cache: ImageCache
    limits: RunLimits
    why: str  # how image runs run on this node, in one line
    _resolved: dict[str, tuple[float, Image]] = field(default_factory=dict, compare=False)

    def image(self, ref: str) -> Image:
        """The task's image, unpacked on this node (once). A reference is looked up again at most every
        RESOLVE_AGAIN_S: asking podman whether a tag moved costs a run's start 0.05-0.2 s."""
        now = time.monotonic()
        known = self._resolved.get(ref)
        if known is not None and now - known[0] < RESOLVE_AGAIN_S and known[1].rootfs.is_dir():
            return known[1]
        image = self.cache.get(parse_ref(ref))
        self._resolved[ref] = (now, image)
        return image

    @staticmethod
    def workdir(task_workdir: str | None, image: Image) -> str:
        return task_workdir or image.workdir or DEFAULT_WORKDIR

    def _jail(self, name: str, image: Image, workdir: str, upper: Path, work: Path, argv: list[str],
              env: dict[str, str], binds: list[Bind], report: Path, layers: list[Path] = (),
              proxy_socket: Path | None = None, timeout_s: float | None = None) -> Jail:
        folder = Path(tempfile.mkdtemp(prefix="gyre-jail-"))
        (folder / "mnt").mkdir()
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        spec = JailSpec(runtime=self.kind, name=name, rootfs=str(image.rootfs), workdir=workdir,
                        layers=[str(p) for p in layers], upper=str(upper), overlay_work=str(work), binds=binds,
                        env=env, argv=argv, proxy_socket=str(proxy_socket) if proxy_socket else None,
                        limits=self.limits, limit_report=str(report), dropped_caps=list(DROPPED_CAPS),
                        program=self.program, program_env=self.program_env, timeout_s=timeout_s)
        path = folder / "spec.json"
        path.write_text(spec.to_json())
        os.chmod(path, 0o600)  # it holds the run's key
        return Jail([sys.executable, "-m", "gyre_slurm.harness.jail", str(path)], folder, report)

    def harness(self, *, ws: Path, image: Image, workdir: str, argv: list[str], env: dict[str, str],
                state_dir: Path, proxy_socket: Path | None, python: bool, timeout_s: float) -> Jail:
        """The harness's jail: `argv` runs in `workdir` inside the image, over the rollout's own `changes/`."""
        gyre = ws / GYRE_DIR
        gyre.mkdir(parents=True, exist_ok=True)
        binds = [Bind(src=str(gyre), dest=str(gyre), ro=False)]
        installs = (Path(state_dir) / HARNESS_INSTALLS).resolve()
        if installs.is_dir():
            binds.append(Bind(src=str(installs), dest=str(installs)))
        if python:
            binds += python_binds()
        report = gyre / LIMIT_FILE
        report.unlink(missing_ok=True)
        return self._jail(f"gyre-{ws.name}-{uuid.uuid4().hex[:8]}", image, workdir, ws / CHANGES, ws / OVERLAY_WORK,
                          argv, env, binds, report, proxy_socket=proxy_socket, timeout_s=timeout_s)

    def evaluator(self, *, ws: Path, image: Image, workdir: str, argv: list[str], hidden: Path, tests_at: str,
                  timeout_s: float) -> Jail:
        """A fresh copy of the image, the run's changes laid over its working folder (read-only, under a writable
        layer of its own: the evaluator changes nothing of the run's), `hidden` bound read-only at `tests_at` and
        a fresh folder at /logs. No network at all, no key, no Python of the worker's."""
        scratch = Path(tempfile.mkdtemp(prefix=".eval-", dir=ws))
        logs = scratch / "logs"
        for d in ("verifier", "agent"):  # Harbor's test.sh writes /logs/verifier/reward.txt
            (logs / d).mkdir(parents=True)
        env = {"PATH": IMAGE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        binds = [Bind(src=str(hidden), dest=tests_at), Bind(src=str(logs), dest="/logs", ro=False)]
        jail = self._jail(f"gyre-eval-{ws.name}-{uuid.uuid4().hex[:8]}", image, workdir, scratch / "upper",
                          scratch / "work", argv, {**env, **_image_env(image, keep_path=True)}, binds,
                          scratch / LIMIT_FILE, layers=[ws / CHANGES], timeout_s=timeout_s)
        jail.scratch.append(scratch)
        return jail


def _image_env(image: Image, keep_path: bool) -> dict[str, str]:
    env = dict(image.env)
    if not keep_path:
        env.pop("PATH", None)
    return env


def harness_env(image: Image, preset_env: dict[str, str], node_path: str | None) -> dict[str, str]:
    """The harness's whole environment inside the image: the image's own (its PATH), then the preset's (proxy,
    key, HOME…), with the CLIs' Node first on the image's PATH. Nothing of the worker's environment."""
    path = image.env.get("PATH", IMAGE_PATH)
    env = {"PATH": path, "LANG": "C.UTF-8", "TERM": "dumb", **image.env, **preset_env}
    env["PATH"] = f"{node_path}{os.pathsep}{path}" if node_path else path
    return env


def _podman() -> tuple[list[str], dict[str, str]]:
    """podman's argv start and what its environment needs beyond ours (images/podman.py says why)."""
    from gyre_slurm.images.podman import podman_argv, podman_env

    env = podman_env()
    return podman_argv(), {k: v for k, v in env.items() if os.environ.get(k) != v}


def make_image_runtime(kind: str, cache_dir: Path, limits: RunLimits) -> tuple[ImageRuntime | None, str]:
    """The image runtime `harness.runtime` asks for, as this node can give it, or (None, why not)."""
    cache = ImageCache(cache_dir)
    if kind == "podman":
        if shutil.which("podman") is None:
            return None, "podman is not installed (Debian: apt-get install podman runc)"
        if os.geteuid() != 0:
            return None, ("podman runs containers in the jail's own network namespace, which needs "
                          "root; as this user use harness.runtime image (bubblewrap)")
        try:
            program, env = _podman()
            subprocess.run([*program, "--version"], env={**os.environ, **env}, capture_output=True, check=True,
                           timeout=60)
        except (GyreError, OSError, subprocess.SubprocessError) as e:
            return None, f"podman does not run here: {e}"
    else:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            return None, "bwrap is not installed (Debian: apt-get install bubblewrap): tasks with images cannot run"
        why = bwrap_works(bwrap)
        if why is not None:
            return None, f"bwrap cannot start a sandbox here: {why}"
        program, env = [bwrap], {}
    group, how = make_group(f"probe-{os.getpid()}", limits) if limits.any_group_limit() else (None, "no limits")
    if group is not None:
        group.remove()
    applied = how_limits_apply(limits, how, group is not None)
    what = "bubblewrap" if kind != "podman" else "podman"
    lim = "; ".join(f"{k}: {v}" for k, v in applied.items()) or "no limits"
    return ImageRuntime(kind if kind == "podman" else "bwrap", program, env, cache, limits,
                        f"tasks with images run in {what} over the image (limits: {lim})"), ""


def image_runtime_of(harness, state_dir: Path) -> tuple[ImageRuntime | None, str]:
    """The worker's image runtime from its config's harness section (config_harness.HarnessSection), or (None, why
    not) under `auto`; a runtime the config requires (image, podman) that this node cannot give is a GyreError: the
    worker refuses to start rather than fail every run."""
    if harness.runtime == "host":
        return None, "harness.runtime is host"
    im = harness.images
    rt, why = make_image_runtime("podman" if harness.runtime == "podman" else "bwrap",
                                 Path(im.cache_dir or Path(state_dir) / "images"),
                                 RunLimits(im.cpus, im.memory_mb, im.processes, im.disk_mb))
    if rt is None and harness.runtime != "auto":
        raise GyreError(f"harness.runtime is {harness.runtime}, but {why}")
    return rt, why
