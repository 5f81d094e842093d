"""How image layers are applied (gyre_slurm.images.unpack), on layers written here with tarfile: whiteouts and
opaque folders, replacing and merging, owners, modes and mtimes, an ordinary user's unpack, and every way a layer
could try to write, delete or link outside its root file system."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
from pathlib import Path

import pytest

from gyre_slurm.errors import GyreError
from gyre_slurm.images import apply_layer

IS_ROOT = os.geteuid() == 0

# -- layers written here (test_images.py writes its layouts with them too) ----------------------------------------


def _m(name: str, kind: bytes, mode: int, data: bytes | None = None, link: str = "", uid: int = 0, gid: int = 0,
       mtime: int = 1_500_000_000, dev: tuple[int, int] = (0, 0)) -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime, ti.linkname = kind, mode, uid, gid, mtime, link
    ti.size, (ti.devmajor, ti.devminor) = len(data or b""), dev
    return ti, data


def F(name: str, data: bytes = b"x", mode: int = 0o644, **kw):
    return _m(name, tarfile.REGTYPE, mode, data, **kw)


def D(name: str, mode: int = 0o755, **kw):
    return _m(name, tarfile.DIRTYPE, mode, **kw)


def L(name: str, target: str, **kw):
    return _m(name, tarfile.SYMTYPE, 0o777, link=target, **kw)


def H(name: str, target: str):
    return _m(name, tarfile.LNKTYPE, 0o644, link=target)


def tar(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def apply(rootfs: Path, *members):
    rootfs.mkdir(exist_ok=True)
    return apply_layer(io.BytesIO(tar(*members)), rootfs)


def tree(root: Path, mtimes: bool = True) -> dict[str, tuple]:
    """Every entry under root: type, mode, owner, mtime, and contents or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for p in (os.path.join(dirpath, n) for n in dirnames + filenames):
            st = os.lstat(p)
            body = (os.readlink(p) if stat.S_ISLNK(st.st_mode) else
                    hashlib.sha256(Path(p).read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns if mtimes else 0, body)
    return out


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


# -- layer semantics, on layers written here --------------------------------------------------------------------


def test_whiteouts_and_opaque_folders(tmp_path):
    r = tmp_path / "r"
    apply(r, D("d"), F("d/a"), D("d/sub"), F("d/sub/b"), F("f"), D("g"), F("g/old"), D("h"), F("h/old"),
          D("keep"), F("keep/k"))
    s = apply(r, F("d/before"), D("d/sub"), F("d/sub/c"),  # this layer's, before the marker in tar order
              F("d/.wh..wh..opq", b""), F("d/after"),  # and after it
              F(".wh.f", b""), F("g/new"), F(".wh.g", b""),  # a whiteout never hides this layer's own entries
              F(".wh.h", b""), D("h"), F("h/new"), F("keep/.wh.missing", b""), F("nowhere/.wh.x", b""))
    listing = {n: sorted(os.listdir(r / n)) for n in ("d", "d/sub", "g", "h", "keep")}
    assert listing == {"d": ["after", "before", "sub"], "d/sub": ["c"], "g": ["new"], "h": ["new"], "keep": ["k"]}
    assert not (r / "f").exists() and not any(n.startswith(".wh.") for _, ds, fs in os.walk(r) for n in ds + fs)
    assert (s.opaque, s.whiteouts) == (1, 5)


def test_replacing_and_merging(tmp_path):
    r = tmp_path / "r"
    apply(r, D("dir2file"), F("dir2file/x"), F("file2dir"), D("dir2link"), F("dir2link/x"), D("merge"),
          F("merge/old"), F("link2file"), L("sym2dir", "merge"), F("target", b"t"))
    apply(r, F("dir2file", b"now a file"), D("file2dir"), F("file2dir/y"), L("dir2link", "target"),
          D("merge", mode=0o700), F("merge/new"), F("link2file", b"replaced"), D("sym2dir"), H("link2file", "target"))
    assert (r / "dir2file").read_bytes() == b"now a file" and os.listdir(r / "file2dir") == ["y"]
    assert os.readlink(r / "dir2link") == "target"
    assert sorted(os.listdir(r / "merge")) == ["new", "old"] and os.stat(r / "merge").st_mode & 0o777 == 0o700
    assert os.stat(r / "link2file").st_ino == os.stat(r / "target").st_ino  # the hard link replaced the file
    assert (r / "sym2dir").is_dir() and not (r / "sym2dir").is_symlink()  # a folder over a symlink replaces it
    with pytest.raises(GyreError, match="names a folder but is not one"):
        apply(r, F("merge/..", b"x"))


def test_read_only_folder_takes_its_files(tmp_path):
    r = tmp_path / "r"
    apply(r, D("ro", mode=0o555, mtime=1_000), F("ro/f"), D("ro/sub", mode=0o500), F("ro/sub/g"))
    assert (r / "ro" / "f").is_file() and (r / "ro" / "sub" / "g").is_file()
    assert os.stat(r / "ro").st_mode & 0o7777 == 0o555 and os.stat(r / "ro").st_mtime == 1_000
    apply(r, F("ro/later"), F("ro/sub/.wh.g", b""))  # a later layer writes into, and deletes from, read-only folders
    assert (r / "ro" / "later").is_file() and not (r / "ro" / "sub" / "g").exists()


def test_symlinked_parents_followed_inside_rootfs(tmp_path):
    r = tmp_path / "r"
    s = apply(r, D("usr"), D("usr/lib"), L("lib", "usr/lib"), F("lib/x/y", b"via relative"),
              L("abs", "/usr/lib"), F("abs/z", b"via absolute"), L("dots", "../../../usr/./lib/.."), F("dots/w"))
    assert (r / "usr" / "lib" / "x" / "y").read_bytes() == b"via relative"
    assert (r / "usr" / "lib" / "z").read_bytes() == b"via absolute" and (r / "usr" / "w").is_file()
    assert os.readlink(r / "lib") == "usr/lib" and os.readlink(r / "abs") == "/usr/lib"  # targets stored as they are
    assert (s.files, s.symlinks, s.dirs) == (3, 3, 2)


def test_owners_modes_mtimes_devices(tmp_path):
    r = tmp_path / "r"
    s = apply(r, D("d", mode=0o2775, uid=1234, gid=5678, mtime=1_111),
              F("d/f", mode=0o6755, uid=1234, gid=5678, mtime=2_222), L("d/l", "f", uid=4321, gid=8765, mtime=3_333),
              D("t", mode=0o1777), F("d/g", mode=0o400), _m("null", tarfile.CHRTYPE, 0o666, dev=(1, 3)),
              _m("blk", tarfile.BLKTYPE, 0o660, dev=(7, 0)), _m("p", tarfile.FIFOTYPE, 0o640))
    st, d, lnk = os.stat(r / "d" / "f"), os.stat(r / "d"), os.lstat(r / "d" / "l")
    assert (st.st_mode & 0o7777, st.st_mtime, d.st_mode & 0o7777, d.st_mtime) == (0o6755, 2_222, 0o2775, 1_111)
    assert lnk.st_mtime == 3_333 and os.stat(r / "t").st_mode & 0o7777 == 0o1777
    assert os.stat(r / "d" / "g").st_mode & 0o7777 == 0o400
    assert stat.S_ISFIFO(os.lstat(r / "p").st_mode) and os.lstat(r / "p").st_mode & 0o777 == 0o640
    if IS_ROOT:
        assert {(st.st_uid, st.st_gid), (d.st_uid, d.st_gid)} == {(1234, 5678)}
        assert (lnk.st_uid, lnk.st_gid) == (4321, 8765)
        assert s.devices + s.skipped == 2  # made, or skipped where root may not make devices (a user namespace)
        if s.devices == 2:
            assert os.stat(r / "null").st_rdev == os.makedev(1, 3) and stat.S_ISBLK(os.stat(r / "blk").st_mode)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to become another user")
def test_not_root():
    """As an ordinary user: devices skipped and counted, everything the caller's, read-only folders still filled."""
    work = Path(tempfile.mkdtemp(prefix="gyre-images-nonroot-"))  # pytest's tmp_path is root's alone
    os.chown(work, 65534, 65534)
    layers = [tar(D("ro", mode=0o555), F("ro/f", uid=1234), _m("null", tarfile.CHRTYPE, 0o666, dev=(1, 3)),
                  F("s", mode=0o4755)), tar(F("ro/g"), F("ro/.wh.f", b""))]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, apply, report
        try:
            os.setgid(65534)
            os.setuid(65534)
            (work / "rootfs").mkdir()
            os.write(w, json.dumps([apply_layer(io.BytesIO(t), work / "rootfs").skipped for t in layers]).encode())
        except BaseException as e:
            os.write(w, json.dumps(repr(e)).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        with os.fdopen(r) as f:
            assert json.loads(f.read()) == [1, 0]
        os.waitpid(pid, 0)
        root = work / "rootfs"
        assert os.listdir(root / "ro") == ["g"] and not (root / "null").exists()
        assert os.stat(root / "ro").st_mode & 0o777 == 0o555 and os.stat(root / "ro" / "g").st_uid == 65534
        assert os.stat(root / "s").st_mode & 0o7777 == 0o4755
    finally:
        shutil.rmtree(work)


# -- escapes: nothing outside rootfs is ever written, deleted or linked to --------------------------------------


@pytest.fixture
def jail(tmp_path):
    """rootfs at tmp/box/rootfs; outside it tmp/outside/sentinel, checked (and every listing above) afterwards."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("untouched")
    os.utime(outside / "sentinel", ns=(10**18, 10**18))
    rootfs = tmp_path / "box" / "rootfs"
    rootfs.mkdir(parents=True)
    before = tree(tmp_path / "outside"), sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "box"))
    yield rootfs, outside
    assert (tree(tmp_path / "outside"), sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "box"))) == before


ESCAPES = {
    "dotdot": [F("../../outside/sentinel", b"evil")],
    "absolute": [F("/../../outside/sentinel", b"evil")],
    "symlink-relative": [L("ev", "../../outside"), F("ev/sentinel", b"evil")],
    "symlink-absolute": [D("a"), L("a/ev", "OUTSIDE"), F("a/ev/sentinel", b"evil")],  # `evil -> /etc`, `evil/passwd`
    "symlink-chain": [D("a"), L("a/b", "../c"), L("c", "../../.."), F("a/b/outside/sentinel", b"evil")],
    "symlink-then-file": [L("ev", "../../outside/sentinel"), F("ev", b"a file in place of the link")],
    "whiteout-through-symlink": [L("ev", "../../outside"), F("ev/.wh.sentinel", b"")],
    "opaque-through-symlink": [L("ev", "../../outside"), F("ev/.wh..wh..opq", b"")],
    "dotdot-whiteout": [F("../../outside/.wh.sentinel", b"")],
    "folder-over-dotdot": [D("../..", mode=0o700), D("..", mode=0o700)],
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_escapes_stay_inside(jail, case):
    rootfs, outside = jail
    members = [(copy.copy(ti), data) for ti, data in ESCAPES[case]]
    for ti, _ in members:
        ti.linkname = str(outside) if ti.linkname == "OUTSIDE" else ti.linkname
    apply(rootfs, *members)
    if case == "symlink-absolute":  # re-rooted: the target's path, inside rootfs
        assert (rootfs / str(outside).lstrip("/") / "sentinel").read_bytes() == b"evil"


@pytest.mark.parametrize("target", ["../../outside/sentinel", "/../outside/sentinel", "ev/sentinel",
                                    "/etc/shadow", ".."])
def test_hard_link_escapes_refused(jail, target):
    rootfs, outside = jail
    with pytest.raises(GyreError) as e:
        apply(rootfs, L("ev", "../../outside"), H("h", target))
    assert "hard link" in one_line(e) and not (rootfs / "h").exists()


def test_hard_link_to_etc_shadow_links_rootfs_own(jail):
    rootfs, outside = jail
    apply(rootfs, D("etc"), F("etc/shadow", b"image's"), D("a"), L("a/ev", "/etc"), H("h", "../../etc/shadow"),
          H("h2", "a/ev/shadow"))
    assert os.stat(rootfs / "h").st_ino == os.stat(rootfs / "h2").st_ino == os.stat(rootfs / "etc/shadow").st_ino
    assert os.stat("/etc/shadow").st_ino != os.stat(rootfs / "h").st_ino
