"""Images by name, through the container tools this node has: podman (its local storage, then pulls) or skopeo.

fetch(name, dest_dir) writes an oci-archive of the named image under dest_dir and returns its path:
  - podman installed: the image from podman's local storage when `podman image exists NAME`, else `podman pull
    NAME`; then `podman save --format oci-archive`;
  - else skopeo installed: `skopeo copy docker://NAME oci-archive:PATH`;
  - else GyreError: pulling needs podman or skopeo.
build(context_dir, tag, dest_dir) runs `podman build -t TAG CONTEXT` (the Dockerfile or Containerfile in it:
build_image) and saves the result the same way. image_id(name) is podman's image ID of a local image (the sha256
of its config, the digest archive.py computes), without saving it.

Why podman_argv and podman_env: podman's default OCI runtime (crun, or runc when crun is absent) fails to start
containers on machines like this one ("setrlimit RLIMIT_NPROC: Operation not permitted", "cgroups in hybrid mode
not supported"): podman asks the runtime to set its default rlimits, which the node does not allow. Running with
`--runtime runc` (when runc is installed) and with CONTAINERS_CONF naming a containers.conf that sets
`[containers] default_ulimits = []` works. CONTAINERS_CONF replaces the system's containers.conf files rather than
adding to them (podman 4.3 has no CONTAINERS_CONF_OVERRIDE), so a CONTAINERS_CONF the caller already set is kept.
Every tool runs from an argv list with a timeout; a failure is one GyreError line ending in the tool's last stderr
line.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.images.reference import BUILD_FILES

# the node does not let the runtime set podman's default rlimits (see the module's docstring)
CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\n"
QUICK_TIMEOUT_S = 60.0  # image exists, image inspect, rmi
PULL_TIMEOUT_S = 3600.0
SAVE_TIMEOUT_S = 1800.0
BUILD_TIMEOUT_S = 3600.0
_conf_dir: Path | None = None


def podman_env(conf_dir: Path | None = None) -> dict[str, str]:
    """The environment to run podman in: this process's, with CONTAINERS_CONF naming a containers.conf written
    under `conf_dir` (when None: this user's private folder under the temporary folder) unless the caller has set
    CONTAINERS_CONF already."""
    env = dict(os.environ)
    if env.get("CONTAINERS_CONF"):
        return env
    if conf_dir is None:
        conf_dir = _private_dir()
    conf_dir.mkdir(parents=True, exist_ok=True)
    conf = conf_dir / "containers.conf"
    if not conf.is_file() or conf.read_text() != CONTAINERS_CONF:
        tmp = conf.with_name(f".containers.conf.{os.getpid()}.tmp")
        tmp.write_text(CONTAINERS_CONF)
        os.replace(tmp, conf)  # other processes may read it at the same time
    env["CONTAINERS_CONF"] = str(conf)
    return env


def _private_dir() -> Path:
    """/tmp/gyre-podman-<uid>, made 0700 and used only when it is this user's own real folder (not a link someone
    else planted), else a fresh temporary folder for this process."""
    global _conf_dir
    if _conf_dir is None:
        shared = Path(tempfile.gettempdir()) / f"gyre-podman-{os.getuid()}"
        try:
            shared.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(shared)
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o022 == 0
        _conf_dir = shared if ours else Path(tempfile.mkdtemp(prefix="gyre-podman-"))
    return _conf_dir


def podman_argv(*args: str) -> list[str]:
    """podman's argv for `args`, with `--runtime runc` when runc is installed (run it in podman_env())."""
    runc = shutil.which("runc")
    return ["podman", *(["--runtime", runc] if runc else []), *args]


def available(tool: str) -> bool:
    return shutil.which(tool) is not None


def fetch(name: str, dest_dir: Path, timeout_s: float = PULL_TIMEOUT_S) -> Path:
    """An oci-archive of the image `name` (a registry reference, without docker://) under dest_dir."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = _archive_path(dest_dir, name)
    if available("podman"):
        if not image_exists(name):
            _run(podman_argv("pull", "--quiet", name), f"podman pull {name}", timeout_s)
        _save(name, dest)
        return dest
    if available("skopeo"):
        _run(["skopeo", "copy", "--quiet", f"docker://{name}", f"oci-archive:{dest}:{name}"],
             f"skopeo copy docker://{name}", timeout_s)
        return dest
    raise GyreError(f"image {name!r}: pulling needs podman or skopeo on this node, neither is installed; give an OCI "
                    "archive (oci-archive:PATH) or a root file system (rootfs:PATH) instead")


def image_exists(name: str) -> bool:
    """Whether podman's local storage holds `name` (podman must be installed)."""
    p = _run(podman_argv("image", "exists", name), f"podman image exists {name}", QUICK_TIMEOUT_S, ok=(0, 1))
    return p.returncode == 0


def image_id(name: str) -> str | None:
    """podman's image ID of a local image as "sha256:<hex>", or None when podman lacks it or is not installed."""
    if not available("podman") or not image_exists(name):
        return None
    p = _run(podman_argv("image", "inspect", "--format", "{{.Id}}", name), f"podman image inspect {name}",
             QUICK_TIMEOUT_S)
    ident = p.stdout.strip()
    return f"sha256:{ident}" if re.fullmatch(r"[a-f0-9]{64}", ident) else None


def build(context_dir: Path, tag: str, dest_dir: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """`podman build -t TAG CONTEXT`, then an oci-archive of the image under dest_dir."""
    build_image(context_dir, tag, timeout_s)
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = _archive_path(dest_dir, tag)
    _save(tag, dest)
    return dest


def build_image(context_dir: Path, tag: str, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """`podman build -t TAG CONTEXT` into podman's local storage (its layer cache makes an unchanged one quick)."""
    if not available("podman"):
        raise GyreError(f"{context_dir}: building an image needs podman on this node, and it is not installed")
    dockerfile = next((context_dir / n for n in BUILD_FILES if (context_dir / n).is_file()), None)
    if dockerfile is None:
        raise GyreError(f"{context_dir}: no Dockerfile or Containerfile in it to build")
    missing = [ref for ref in from_refs(dockerfile.read_text()) if not image_exists(ref)]
    try:
        _run(podman_argv("build", "--quiet", "-t", tag, str(context_dir)), f"podman build {context_dir}", timeout_s)
    except GyreError:
        unresolved = [ref for ref in missing if not image_exists(ref)]
        if unresolved:  # the FROM image was neither local nor pullable: say that, not buildah's whole story
            raise GyreError(f"{context_dir}: FROM {unresolved[0]} does not resolve: it is not in podman's local "
                            "storage and it cannot be pulled") from None
        raise


def build_tag(context_dir: Path) -> str:
    """The tag a `dockerfile:` context is built under: localhost/gyre-build/<its folder's names>:<hash of its path>."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{context_dir.parent.name}-{context_dir.name}".lower()).strip("-")[:60]
    return f"localhost/gyre-build/{slug or 'context'}:{hashlib.sha256(str(context_dir).encode()).hexdigest()[:16]}"


def from_refs(dockerfile: str) -> list[str]:
    """The images a Dockerfile's FROM lines name: not `scratch`, not earlier stages, not ones built from ARGs."""
    stages: set[str] = set()
    refs: list[str] = []
    text = re.sub(r"\\\n", " ", dockerfile)  # continuation lines
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]  # --platform=...
        if not args:
            continue
        ref = args[0]
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2].lower())
        if ref != "scratch" and ref.lower() not in stages and "$" not in ref and ref not in refs:
            refs.append(ref)
    return refs


def remove_image(name: str) -> None:
    """`podman rmi NAME`, if it is there (for tests and cleanup)."""
    if available("podman"):
        _run(podman_argv("rmi", "--force", name), f"podman rmi {name}", QUICK_TIMEOUT_S, ok=(0, 1))


def _save(name: str, dest: Path) -> None:
    _run(podman_argv("save", "--quiet", "--format", "oci-archive", "-o", str(dest), name), f"podman save {name}",
         SAVE_TIMEOUT_S)


def _archive_path(dest_dir: Path, name: str) -> Path:
    """A new file name under dest_dir for `name`'s archive: no ':' (skopeo's PATH ends at one), unique per call."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80]
    return dest_dir / f"{slug}.{uuid.uuid4().hex[:12]}.oci.tar"


def _run(argv: list[str], what: str, timeout_s: float, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=podman_env(),
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise GyreError(f"{what} did not finish in {timeout_s:.0f} s") from None
    except OSError as e:
        raise GyreError(f"{what}: {argv[0]} cannot be started: {e.strerror}") from None
    if p.returncode not in ok:
        raise GyreError(f"{what} failed (exit {p.returncode}): {last_line(p.stderr) or last_line(p.stdout)}")
    return p


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"
