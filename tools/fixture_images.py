"""The container images of the shipped fixture tasks (tests/fixtures/{swe,nl2repo,harbor-images}), built here from
Debian's packages: no registry is needed or reached.

  localhost/gyre-fixtures/base:bookworm   debootstrap's minbase of Debian 12 plus python3, pytest, git and lua5.4 (a
                                          program this project's machines lack: a task that needs it is solved only
                                          inside the image), imported into podman's local storage;
  localhost/gyre-fixtures/<name>:1        each folder tests/fixtures/images/<name>/, `podman build` FROM the base with
                                          its own Dockerfile, or swe.Dockerfile for a SWE fixture (its repo/).

Each is built once (podman keeps it; a lock file under the state folder makes parallel test workers wait for one
build) and then found by name: tasks name them as image references, which the image cache saves from podman's
storage and unpacks (gyre_slurm/images). Run it by hand with `python tools/fixture_images.py`: about a minute the
first time (debootstrap downloads ~60 MB from deb.debian.org), then nothing to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm.images.podman import podman_argv, podman_env  # noqa: E402

BASE = "localhost/gyre-fixtures/base:bookworm"
PACKAGES = ("python3", "python3-pytest", "python-is-python3", "git", "lua5.4")
MIRROR = os.environ.get("GYRE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
DOCKERFILES = REPO / "tests" / "fixtures" / "images"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def fixture_name(folder: str) -> str:
    return f"localhost/gyre-fixtures/{folder}:1"


def _podman(*args: str, stdin: int | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(podman_argv(*args), env=podman_env(), stdin=stdin, capture_output=True, text=True,
                          timeout=timeout)


def exists(name: str) -> bool:
    return _podman("image", "exists", name, timeout=60).returncode == 0


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "fixture-images.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _fail(what: str, r: subprocess.CompletedProcess) -> None:
    tail = (r.stderr or r.stdout or "").strip().splitlines()[-3:]
    raise SystemExit(f"fixture images: {what} failed (exit {r.returncode}): {' | '.join(tail)}")


def build_base(echo=print) -> None:
    if exists(BASE):
        return
    if shutil.which("debootstrap") is None:
        raise SystemExit("fixture images: debootstrap is not installed (Debian: apt-get install debootstrap)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gyre-base-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        echo(f"fixture images: debootstrap of Debian 12 minbase + {', '.join(PACKAGES)} into {root} ...")
        r = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm",
                            str(root), MIRROR], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            _fail("debootstrap", r)
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):  # the downloads, not needed in the image
            shutil.rmtree(root / d, ignore_errors=True)
            (root / d).mkdir(parents=True, exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        r = _podman("import", "--change", f"ENV PATH={IMAGE_PATH}", "--change", "ENV LANG=C.UTF-8", "-", BASE,
                    stdin=tar.stdout)
        tar.wait()
        if r.returncode != 0 or tar.returncode != 0:
            _fail("podman import", r)
    echo(f"fixture images: {BASE} built in {time.monotonic() - t0:.0f} s")


def build_fixture(folder: Path, echo=print) -> str:
    name = fixture_name(folder.name)
    if not exists(name):
        t0 = time.monotonic()
        own = folder / "Dockerfile"
        dockerfile = own if own.is_file() else DOCKERFILES / "swe.Dockerfile"
        r = _podman("build", "--network", "none", "-f", str(dockerfile), "-t", name, str(folder))
        if r.returncode != 0:
            _fail(f"podman build of {folder}", r)
        echo(f"fixture images: {name} built in {time.monotonic() - t0:.0f} s")
    return name


def ensure(state: Path = REPO / "state", echo=print) -> dict[str, str]:
    """Every fixture image built (once): folder name → image reference, with "base" → the base image."""
    with _locked(state):
        build_base(echo)
        out = {"base": BASE}
        for d in sorted(p for p in DOCKERFILES.iterdir() if (p / "Dockerfile").is_file() or (p / "repo").is_dir()):
            out[d.name] = build_fixture(d, echo)
    return out


if __name__ == "__main__":
    for k, v in ensure().items():
        print(f"{k}: {v}")
