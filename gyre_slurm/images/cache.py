"""The node-local image cache: each image unpacked once, by content address, shared read-only by every run.

ImageCache(root).get(ref) returns an Image: its digest, the root file system folder to run in, and the config's
environment, working folder and user. Layout under root (by default <state_dir>/images):
  sha256-<hex>/rootfs/       the unpacked root file system (never written again once it is there)
  sha256-<hex>/image.json    the image config, the source's text, unpack seconds, size on disk, when
  .locks/sha256-<hex>.lock   an fcntl (flock) lock per digest: one unpacker at a time, threads and processes alike
  .unpack-sha256-<hex>-*/    an unpack in progress: renamed to sha256-<hex> when done, so an entry that is there is
                             complete; one a crash left behind is removed by the next unpacker of that digest
  .refs/<key>.json           ref -> digest memos (archive path, size, mtime_ns): a later process need not re-read a
                             big archive to learn its digest; the same memo is kept in-process
  .fetch/                    oci-archives of registry images being unpacked (removed once unpacked)
Kinds: oci-archive, docker-archive and oci are read by archive.py and unpacked by unpack.py. A registry name goes
through podman.py: when podman has the image locally its image ID is the digest, so a cached image is found without
saving it; otherwise it is fetched into .fetch/ and unpacked like any archive. A `dockerfile:` context is built with
`podman build` (tagged podman.build_tag(path); podman's layer cache makes a rebuild of an unchanged one quick) and
then taken like a name podman has; a process builds a context once while its Dockerfile is unchanged.
A `rootfs:` folder is used in place (no copy, no digest): its environment is the defaults (PATH only), its working
folder and user unset — an Apptainer sandbox's .singularity.d/env/*.sh scripts are not sourced.
An Image's env always holds PATH (Docker's default when the config sets none). remove() takes an entry away even
while runs use it: do that only on an idle node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_slurm.errors import GyreError
from gyre_slurm.images import podman
from gyre_slurm.images.archive import ImageConfig, ImageSource, open_image
from gyre_slurm.images.reference import ARCHIVE_KINDS, BUILD_FILES, ImageRef
from gyre_slurm.images.unpack import LayerStats, rmtree, unpack_image

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_JSON = "image.json"
ROOTFS = "rootfs"
Echo = Callable[[str], None]


@dataclass(frozen=True)
class Image:
    """An image ready to run in: `rootfs` is shared by every run on the node and must be treated as read-only.
    `digest` is None for a rootfs: folder used in place (it has no content address)."""

    digest: str | None
    rootfs: Path
    env: dict[str, str] = field(hash=False)
    workdir: str | None
    user: str | None
    ref_text: str


def default_root(state_dir: Path) -> Path:
    """Where a node keeps its image cache: <state_dir>/images."""
    return Path(state_dir) / "images"


def _entry_name(digest: str) -> str:
    alg, _, hexd = digest.partition(":")
    if alg != "sha256" or len(hexd) != 64 or not all(c in "0123456789abcdef" for c in hexd):
        raise GyreError(f"{digest!r} is not an image digest (sha256:<64 hex digits>)")
    return f"{alg}-{hexd}"


class ImageCache:
    """A folder of unpacked images; safe to use from several threads and processes at once."""

    _memo: dict[tuple, str] = {}  # in-process ref memo, shared by every ImageCache of this process
    _memo_lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # -- getting an image ----------------------------------------------------------------------------------------

    def get(self, ref: ImageRef, echo: Echo = print) -> Image:
        """The image `ref` names, unpacked here first if it is not yet. Raises GyreError (ConfigError for a
        missing path) in one line."""
        if ref.kind == "rootfs":
            assert ref.path is not None
            ref.check()
            return Image(None, ref.path, {"PATH": DEFAULT_PATH}, None, None, ref.text)
        self.root.mkdir(parents=True, exist_ok=True)
        if ref.kind == "registry":
            return self._get_registry(ref, echo)
        if ref.kind == "dockerfile":
            return self._get_built(ref, echo)
        if ref.kind not in ARCHIVE_KINDS:
            raise GyreError(f"image {ref.text!r}: unknown kind {ref.kind}")
        ref.check()
        key = self._memo_key(ref)
        digest = self._recall(key)
        if digest is not None and self._complete(digest):
            return self._image(digest, ref.text)
        source = open_image(ref)
        self._remember(key, source.digest)
        return self._ensure(source, echo)

    def _get_registry(self, ref: ImageRef, echo: Echo) -> Image:
        assert ref.name is not None
        found = self._registry_known(ref)
        if found is not None:
            return found
        # one fetch per name at a time: a second caller waits, then finds the image unpacked
        with self._lock("name-" + hashlib.sha256(ref.name.encode()).hexdigest()[:32], echo, f"to fetch {ref.name}"):
            found = self._registry_known(ref)
            if found is not None:
                return found
            image = self._fetch(ref.name, ref.text, echo)
        assert image.digest is not None
        self._remember(("registry", ref.name), image.digest, disk=False)
        return image

    def _get_built(self, ref: ImageRef, echo: Echo) -> Image:
        assert ref.path is not None
        ref.check()
        dockerfile = next(ref.path / n for n in BUILD_FILES if (ref.path / n).is_file())
        st = dockerfile.stat()
        key = ("dockerfile", str(ref.path), st.st_size, st.st_mtime_ns)
        digest = self._recall(key, disk=False)  # the rest of the context may change: not shared between processes
        if digest is not None and self._complete(digest):
            return self._image(digest, ref.text)
        tag = podman.build_tag(ref.path)
        with self._lock("build-" + tag.rsplit(":", 1)[1], echo, f"to build {ref.path}"):
            echo(f"building image {ref.text} as {tag}")
            podman.build_image(ref.path, tag)
            digest = podman.image_id(tag)
            image = self._image(digest, ref.text) if digest and self._complete(digest) else \
                self._fetch(tag, ref.text, echo)
        assert image.digest is not None
        self._remember(key, image.digest, disk=False)
        return image

    def _fetch(self, name: str, ref_text: str, echo: Echo) -> Image:
        """Fetches `name` through podman or skopeo into .fetch/, unpacks it, removes the archive."""
        echo(f"fetching image {name}")
        t0 = time.monotonic()
        archive = podman.fetch(name, self.root / ".fetch")
        try:
            echo(f"fetched {name} in {time.monotonic() - t0:.1f} s")
            return self._ensure(open_image(ImageRef("oci-archive", archive, None, ref_text)), echo)
        finally:
            archive.unlink(missing_ok=True)

    def _registry_known(self, ref: ImageRef) -> Image | None:
        """The cached image for a registry name, found without saving it: podman's image ID when podman has the
        image, else what this process fetched for the name before (a tag may move: that memo is not shared)."""
        assert ref.name is not None
        digest = podman.image_id(ref.name) or self._recall(("registry", ref.name), disk=False)
        return self._image(digest, ref.text) if digest is not None and self._complete(digest) else None

    def _ensure(self, source: ImageSource, echo: Echo) -> Image:
        """The entry for `source`'s digest, unpacked under its lock unless another caller has done it."""
        name = _entry_name(source.digest)
        if self._complete(source.digest):
            return self._image(source.digest, source.ref.text)
        with self._lock(name, echo, f"to unpack {source.digest[:19]}"):
            if self._complete(source.digest):  # another thread or process did it while we waited
                return self._image(source.digest, source.ref.text)
            self._drop_leftovers(name)
            self._unpack(source, name, echo)
        return self._image(source.digest, source.ref.text)

    def _unpack(self, source: ImageSource, name: str, echo: Echo) -> None:
        n = len(source.layers)
        echo(f"unpacking image {source.ref.text} ({source.digest[:19]}, {n} layer{'s' * (n != 1)}, "
             f"{source.size / 1e6:.0f} MB) into {self.root}")
        tmp = Path(tempfile.mkdtemp(prefix=f".unpack-{name}-", dir=self.root))
        t0 = time.time()

        def progress(done: int, total: int, _stats: LayerStats) -> None:
            if total > 1:
                echo(f"  layer {done}/{total} done ({time.time() - t0:.1f} s)")

        try:
            stats = unpack_image(source, tmp / ROOTFS, progress)
            size = _disk_usage(tmp / ROOTFS)
            meta = {"digest": source.digest, "ref": source.ref.text, "unpack_s": round(stats.seconds, 3),
                    "size_bytes": size, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "layers": n, "config": source.config.raw}
            (tmp / IMAGE_JSON).write_text(json.dumps(meta, indent=1))
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users (a sandbox's uid) out of the rootfs
            os.rename(tmp, self.root / name)  # the one step that makes the entry exist: a crash before it, none
        except BaseException:
            rmtree(tmp)  # a corrupt layer, a full disk: nothing half-done stays (a kill -9 leaves it to the next)
            raise
        _fsync_dir(self.root)
        echo(f"unpacked {source.digest[:19]} in {stats.seconds:.1f} s, {size / 1e6:.0f} MB on disk")

    def _image(self, digest: str, ref_text: str) -> Image:
        entry = self.root / _entry_name(digest)
        try:
            meta = json.loads((entry / IMAGE_JSON).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise GyreError(f"{entry}: the cached image's {IMAGE_JSON} cannot be read: {e}") from None
        config = ImageConfig.from_json(meta.get("config") or {})
        env = dict(config.env)
        env.setdefault("PATH", DEFAULT_PATH)
        return Image(digest, entry / ROOTFS, env, config.workdir, config.user, ref_text)

    def _complete(self, digest: str) -> bool:
        return (self.root / _entry_name(digest) / IMAGE_JSON).is_file()

    # -- listing and removing ------------------------------------------------------------------------------------

    def list(self) -> list[dict[str, Any]]:
        """The cached images: digest, ref (the text it was first unpacked from), size_bytes, unpack_s, time."""
        out = []
        if not self.root.is_dir():
            return out
        for entry in sorted(self.root.glob("sha256-*")):
            try:
                meta = json.loads((entry / IMAGE_JSON).read_text())
            except (OSError, json.JSONDecodeError):
                continue
            out.append({k: meta.get(k) for k in ("digest", "ref", "size_bytes", "unpack_s", "time")}
                       | {"rootfs": str(entry / ROOTFS)})
        return out

    def remove(self, digest: str) -> None:
        """Removes a cached image (under its lock: not while it is being unpacked)."""
        name = _entry_name(digest)
        entry = self.root / name
        if not entry.is_dir():
            raise GyreError(f"image {digest}: not in the image cache {self.root}")
        with self._lock(name, lambda _msg: None, ""):
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}-", dir=self.root))
            os.rename(entry, trash / name)  # gone at once; the slow delete follows
            rmtree(trash)

    # -- locks, memos, leftovers ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self, name: str, echo: Echo, what: str) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                echo(f"waiting for another process {what}")
                fcntl.flock(fd, fcntl.LOCK_EX)  # each open() is its own lock: threads wait for each other too
            yield
        finally:
            os.close(fd)

    def _drop_leftovers(self, name: str) -> None:
        """Removes unpacks of `name` that a crash left behind (we hold its lock: no one else is unpacking it)."""
        for p in self.root.glob(f".unpack-{name}-*"):
            rmtree(p)
        for p in self.root.glob(f".trash-{name}-*"):
            rmtree(p)

    def _memo_key(self, ref: ImageRef) -> tuple:
        assert ref.path is not None
        # an OCI layout changes when its index.json does (blobs are content-addressed)
        target = ref.path / "index.json" if ref.kind == "oci" else ref.path
        st = target.stat()
        return (ref.kind, str(ref.path), ref.name, st.st_size, st.st_mtime_ns, st.st_ino)

    def _memo_file(self, key: tuple) -> Path:
        return self.root / ".refs" / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.json"

    def _recall(self, key: tuple, disk: bool = True) -> str | None:
        with self._memo_lock:
            digest = self._memo.get((str(self.root), *key))
        if digest is not None or not disk:
            return digest
        try:
            memo = json.loads(self._memo_file(key).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if memo.get("key") != list(key) or not isinstance(memo.get("digest"), str):
            return None
        with self._memo_lock:
            self._memo[(str(self.root), *key)] = memo["digest"]
        return memo["digest"]

    def _remember(self, key: tuple, digest: str, disk: bool = True) -> None:
        with self._memo_lock:
            self._memo[(str(self.root), *key)] = digest
        if not disk:
            return
        path = self._memo_file(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"key": list(key), "digest": digest}))
        os.replace(tmp, path)  # atomic: a reader sees the old memo or the new one


def _disk_usage(path: Path) -> int:
    """Bytes on disk under `path` (allocated blocks, each hard-linked inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(path)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
    return total


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
