"""Applies image layers to a root file system folder, with the semantics of OCI image layers (image-spec layer.md).

apply_layer(stream, rootfs) reads one uncompressed layer tar front to back, member by member (tarfile's members and
extractfile; never tarfile.extract*), and changes `rootfs` as the layer says:
  - whiteouts: `.wh.NAME` deletes NAME (a file or a whole tree) as earlier layers left it; `.wh..wh..opq` makes its
    folder opaque: everything earlier layers put in it goes, whatever this layer puts in it stays (before or after
    the marker in tar order: the layer's own paths are remembered). Other `.wh..wh.*` markers are ignored.
  - paths are resolved inside rootfs with chroot semantics: a symlink met in a path's earlier components is followed
    within rootfs (an absolute target starts again at rootfs, `..` stops at rootfs), the last component is never
    followed (a symlink there is replaced, not written through). A hard link's target is resolved the same way. So
    no member, whatever its name or the links before it, writes, deletes or links anything outside rootfs. Missing
    parent folders are made (mode 0755). The tree under rootfs must have no other writer while a layer is applied.
  - an entry replaces what is at its path (a file over a folder, a folder over a file, a symlink over a folder...),
    except that a folder over a folder merges (the folder gets the new entry's owner, mode and mtime).
  - types: regular files, folders, symlinks (their targets stored as they are), hard links (to an earlier entry, of
    this layer or an earlier one), fifos; char and block devices only when running as root (else skipped and
    counted, as is any other member type).
  - metadata: numeric owners kept when running as root (lchown, symlinks too), else everything belongs to the
    caller; modes exactly, setuid, setgid and sticky bits included; mtimes (atime = mtime). A folder's mode and
    mtime are applied once the layer's contents are in (a folder of mode 0555 still takes the files the layer puts
    in it); when not root, a folder an earlier layer made read-only is opened for writing and then restored.
  - extended attributes (capabilities, SELinux labels, ACLs) are ignored.
unpack_image(source, dest) applies an ImageSource's layers in order to a new folder `dest` and checks each layer's
digests as it goes (archive.LayerStream.verify).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import BinaryIO

from gyre_slurm.errors import DiskFull, GyreError, disk_full
from gyre_slurm.images.archive import ImageSource

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_SYMLINK_HOPS = 40  # as Linux's ELOOP limit
COPY_CHUNK = 1 << 20


@dataclass
class LayerStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    fifos: int = 0
    devices: int = 0
    whiteouts: int = 0
    opaque: int = 0
    skipped: int = 0  # devices when not root (or not allowed to make them), unknown member types
    bytes: int = 0  # regular files' contents written

    def add(self, other: LayerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class UnpackStats:
    layers: list[LayerStats] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> LayerStats:
        out = LayerStats()
        for s in self.layers:
            out.add(s)
        return out


Progress = Callable[[int, int, LayerStats], None]  # (layers done, layers in all, the stats of the one just done)


def unpack_image(source: ImageSource, dest: Path, progress: Progress | None = None) -> UnpackStats:
    """Makes `dest` (it must not exist; its parent must) and applies the image's layers to it in order."""
    t0 = time.monotonic()
    dest.mkdir(mode=0o755)
    out = UnpackStats()
    for i, layer in enumerate(source.layers):
        with layer.open() as stream:
            stats = apply_layer(stream, dest, where=layer.where)
            stream.verify()
        out.layers.append(stats)
        if progress is not None:
            progress(i + 1, len(source.layers), stats)
    out.seconds = time.monotonic() - t0
    return out


def apply_layer(stream: BinaryIO, rootfs: Path, where: str = "layer") -> LayerStats:
    """Applies one uncompressed layer tar, read from `stream`, to the folder `rootfs` (see the module's docstring).
    Raises GyreError in one line naming `where` and the member when the layer cannot be applied."""
    return _Applier(rootfs, where).run(stream)


class _Applier:
    def __init__(self, rootfs: Path, where: str) -> None:
        self.root = os.path.realpath(rootfs)
        self.where = where
        self.as_root = os.geteuid() == 0
        self.stats = LayerStats()
        self.touched: set[str] = {self.root}  # paths this layer put there, and their folders: opaque keeps them
        self.dir_meta: dict[str, tarfile.TarInfo] = {}  # folders' metadata, applied after the contents
        self.opened: dict[str, int] = {}  # folders opened for writing (not root): their modes to restore
        self.parents: dict[str, str] = {}  # resolved parent folders by member parent; emptied on every removal
        self.member = ""  # the member being applied, for errors

    def run(self, stream: BinaryIO) -> LayerStats:
        try:
            with tarfile.open(fileobj=_Forward(stream), mode="r:") as tf:
                for member in tf:
                    self.member = member.name
                    self._apply(tf, member)
        except tarfile.TarError as e:
            raise GyreError(f"{self.where}: not a valid layer tar: {e}") from None
        except OSError as e:
            if e.errno is None:  # a read error of the stream, not of the file system
                raise GyreError(f"{self.where}: the layer cannot be read: {e}") from None
            if disk_full(e):
                raise DiskFull(f"{self.where}: no space left to unpack member {self.member!r} into {self.root}") \
                    from None
            raise GyreError(f"{self.where}: member {self.member!r}: {e.strerror}"
                            f"{f' ({e.filename})' if e.filename else ''}") from None
        self._finish_dirs()
        return self.stats

    # -- one member ---------------------------------------------------------------------------------------------

    def _apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _parts(m.name)
        base = parts[-1] if parts else ""
        if base.startswith(WHITEOUT):
            self._whiteout(parts[:-1], base)
            return
        if not parts or base == "..":  # the root folder itself, or `a/..`: a folder, never a name to write
            if not m.isdir():
                raise GyreError(f"{self.where}: member {m.name!r} names a folder but is not one")
            folder = self._parent(parts, create=True)
            assert folder is not None
            self._note(folder)
            self.dir_meta[folder] = m
            return
        parent = self._parent(parts[:-1], create=True)
        assert parent is not None
        path = os.path.join(parent, base)
        self._note(path)
        if m.isdir():
            self._dir(path, m)
        elif m.isreg():
            self._file(tf, path, m)
        elif m.issym():
            self._clear(path)
            os.symlink(m.linkname, path)
            self.stats.symlinks += 1
            self._meta(path, m)
        elif m.islnk():
            self._hardlink(path, m)
        elif m.isfifo():
            self._clear(path)
            os.mkfifo(path, 0o600)
            self.stats.fifos += 1
            self._meta(path, m)
        elif m.ischr() or m.isblk():
            self._device(path, m)
        else:
            self.stats.skipped += 1

    def _dir(self, path: str, m: tarfile.TarInfo) -> None:
        st = _lstat(path)
        if st is None or not stat.S_ISDIR(st.st_mode):  # a real folder merges; anything else is replaced
            self._clear(path)
            os.mkdir(path, 0o700)
        self.dir_meta[path] = m
        self.stats.dirs += 1

    def _file(self, tf: tarfile.TarFile, path: str, m: tarfile.TarInfo) -> None:
        self._clear(path)
        src = tf.extractfile(m)
        assert src is not None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb", closefd=True) as f:
            shutil.copyfileobj(src, f, COPY_CHUNK)
            f.flush()
            if self.as_root:
                os.fchown(fd, m.uid, m.gid)  # before the mode: chown clears setuid and setgid
            os.fchmod(fd, stat.S_IMODE(m.mode))
            os.utime(fd, ns=(_ns(m), _ns(m)))
        self.stats.files += 1
        self.stats.bytes += m.size

    def _hardlink(self, path: str, m: tarfile.TarInfo) -> None:
        tparts = _parts(m.linkname)
        tparent = self._parent(tparts[:-1], create=False) if tparts and tparts[-1] != ".." else None
        target = os.path.join(tparent, tparts[-1]) if tparent is not None else None
        st = _lstat(target) if target is not None else None
        if target is None or st is None:
            raise GyreError(f"{self.where}: member {m.name!r}: hard link to {m.linkname!r}, which is not in the image")
        if stat.S_ISDIR(st.st_mode):
            raise GyreError(f"{self.where}: member {m.name!r}: hard link to {m.linkname!r}, a folder")
        if target == path:
            return  # a link to itself: nothing to do (and clearing it first would lose it)
        self._clear(path)
        os.link(target, path, follow_symlinks=False)
        self.stats.hardlinks += 1

    def _device(self, path: str, m: tarfile.TarInfo) -> None:
        if not self.as_root:
            self.stats.skipped += 1
            return
        self._clear(path)
        kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
        try:
            os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
        except PermissionError:  # root without CAP_MKNOD (a user namespace, a container)
            self.stats.skipped += 1
            return
        self.stats.devices += 1
        self._meta(path, m)

    def _meta(self, path: str, m: tarfile.TarInfo) -> None:
        """Owner, mode and mtime of anything but a regular file (done on its descriptor) or a folder (deferred)."""
        link = m.issym()
        if self.as_root:
            os.lchown(path, m.uid, m.gid)
        if not link:  # a symlink's own mode means nothing on Linux (and lchmod does not exist)
            os.chmod(path, stat.S_IMODE(m.mode))
        os.utime(path, ns=(_ns(m), _ns(m)), follow_symlinks=False)

    # -- whiteouts ---------------------------------------------------------------------------------------------

    def _whiteout(self, dir_parts: list[str], base: str) -> None:
        if base == OPAQUE:
            folder = self._parent(dir_parts, create=True)
            assert folder is not None
            self._note(folder)
            self._make_opaque(folder)
            self.stats.opaque += 1
            return
        if base.startswith(WHITEOUT + WHITEOUT):  # other AUFS markers (.wh..wh.plnk, ...): nothing to do
            return
        self.stats.whiteouts += 1
        name = base[len(WHITEOUT):]
        folder = self._parent(dir_parts, create=False)
        if folder is None or name in ("", ".", ".."):
            return
        path = os.path.join(folder, name)
        # a whiteout hides what earlier layers put there, never this layer's own entries (image-spec): a folder
        # this layer also fills keeps only what the layer put in it
        if path not in self.touched:
            self._remove(path)
        elif os.path.isdir(path) and not os.path.islink(path):
            self._make_opaque(path)

    def _make_opaque(self, folder: str) -> None:
        st = _lstat(folder)
        if st is None or not stat.S_ISDIR(st.st_mode):
            return
        self._writable(folder)
        with os.scandir(folder) as it:
            entries = list(it)
        for e in entries:
            if e.path not in self.touched:
                self._remove(e.path)
            elif e.is_dir(follow_symlinks=False):
                self._make_opaque(e.path)  # this layer's folder over an earlier one: the earlier contents go

    # -- paths -------------------------------------------------------------------------------------------------

    def _parent(self, parts: list[str], create: bool) -> str | None:
        """The real folder that `parts` names inside rootfs (chroot semantics), made when missing and `create`;
        None when missing and not `create`. Never a path outside rootfs."""
        key = "/".join(parts)
        hit = self.parents.get(key)
        if hit is not None:
            return hit
        done: list[str] = []
        todo = list(reversed(parts))  # a stack: symlink targets are pushed in front of what is left
        hops = 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            path = os.path.join(self.root, *done, part)
            st = _lstat(path)
            if st is None:
                if not create:
                    return None
                self._writable(os.path.dirname(path))
                os.mkdir(path, 0o755)
                self._note(path)
                done.append(part)
            elif stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise GyreError(f"{self.where}: member {self.member!r}: too many levels of symbolic links")
                target = os.readlink(path)
                if target.startswith("/"):
                    done = []
                todo.extend(reversed(_parts(target, keep_dots=True)))
            elif stat.S_ISDIR(st.st_mode):
                done.append(part)
            else:
                raise GyreError(f"{self.where}: member {self.member!r}: /{'/'.join([*done, part])} is not a folder")
        resolved = os.path.join(self.root, *done)
        if resolved != self.root and not resolved.startswith(self.root + os.sep):  # cannot happen: belt and braces
            raise GyreError(f"{self.where}: member {self.member!r} resolves outside the root file system")
        self.parents[key] = resolved
        return resolved

    def _note(self, path: str) -> None:
        """Remembers `path` and its folders up to rootfs as this layer's (an opaque marker keeps them)."""
        while path not in self.touched and path != os.path.dirname(path):
            self.touched.add(path)
            path = os.path.dirname(path)

    # -- changing the tree -------------------------------------------------------------------------------------

    def _clear(self, path: str) -> None:
        """Makes room for a new entry at `path` (its parent is a real folder inside rootfs)."""
        self._writable(os.path.dirname(path))
        self._remove(path)

    def _remove(self, path: str) -> None:
        """Removes a file, a symlink (not what it points to) or a whole tree."""
        st = _lstat(path)
        if st is None:
            return
        self._writable(os.path.dirname(path))
        if stat.S_ISREG(st.st_mode):
            os.unlink(path)  # no resolved folder goes through a file: the cache stays
            return
        self.parents.clear()  # a cached folder may have been this one, or gone through this symlink
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        rmtree(path)
        for p in [p for p in self.opened if p == path or p.startswith(path + os.sep)]:
            del self.opened[p]

    def _writable(self, folder: str) -> None:
        """Not root: opens a folder an earlier layer made read-only, to be restored after this layer."""
        if self.as_root or folder in self.opened:
            return
        st = os.lstat(folder)
        if stat.S_IMODE(st.st_mode) & 0o300 != 0o300:
            self.opened[folder] = stat.S_IMODE(st.st_mode)
            os.chmod(folder, stat.S_IMODE(st.st_mode) | 0o700)

    def _finish_dirs(self) -> None:
        deepest_first = sorted(self.dir_meta.items(), key=lambda kv: -kv[0].count(os.sep))
        for path, m in deepest_first:
            st = _lstat(path)
            if st is None or not stat.S_ISDIR(st.st_mode):
                continue  # replaced later in the layer
            try:
                if self.as_root:
                    os.lchown(path, m.uid, m.gid)
                os.chmod(path, stat.S_IMODE(m.mode))
                os.utime(path, ns=(_ns(m), _ns(m)), follow_symlinks=False)
            except OSError as e:
                raise GyreError(f"{self.where}: folder {m.name!r}: {e.strerror}") from None
        for path, mode in sorted(self.opened.items(), key=lambda kv: -kv[0].count(os.sep)):
            if path not in self.dir_meta and os.path.isdir(path):
                os.chmod(path, mode)


class _Forward(io.RawIOBase):
    """A layer stream that tarfile may `seek` forward in (seeking ahead reads and drops; back is refused), so that
    its random-access mode reads straight from the stream: its stream mode ("r|") copies every read through a
    buffer of its own (about 1 s of 7 in a profile of a 390 MB layer)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self._pos = raw, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        data = self._raw.read(size)
        self._pos += len(data)
        return data

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset + (self._pos if whence == io.SEEK_CUR else 0)
        if whence == io.SEEK_END or target < self._pos:
            raise OSError("a layer is read once, front to back: tarfile asked to seek back")
        while self._pos < target and self.read(min(target - self._pos, COPY_CHUNK)):
            pass
        return self._pos


def rmtree(path: str | Path) -> None:
    """shutil.rmtree that, when not root, opens a read-only folder inside (an image's mode 0555) and tries again."""

    def retry(func, p, _exc) -> None:
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def _parts(name: str, keep_dots: bool = False) -> list[str]:
    """A member name's components; '.' and '' dropped ('..' kept: the resolver stops it at rootfs)."""
    return [p for p in name.split("/") if p not in ("", ".")] if not keep_dots else name.split("/")


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return None
        raise


def _ns(m: tarfile.TarInfo) -> int:
    return int(m.mtime * 1_000_000_000)
