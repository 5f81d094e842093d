"""Container images as task environments (gyre_slurm.images): references, archives, safe unpacking, the node cache,
podman and skopeo. Real tools, no mocks: the podman images are built here from a tiny root file system (the host's
dash and a few coreutils with the libraries ldd names), once per session; the exact whiteout, opaque and escape
cases are layers written here with tarfile."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.images import ImageCache, apply_layer, open_image, parse_ref, podman, unpack_image
from gyre_slurm.images.archive import machine_arch

HAVE_PODMAN = shutil.which("podman") is not None
needs_podman = pytest.mark.skipif(not HAVE_PODMAN, reason="podman is not installed")
IS_ROOT = os.geteuid() == 0
TOOLS = ("sh", "rm", "ln", "chmod", "chown", "mkdir", "touch", "mkfifo", "cat")

# ---------------------------------------------------------------------------------------------------------------
# layers written here


def _info(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, mtime: int = 1_500_000_000) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, uid, gid, mtime
    return ti


def F(name: str, data: bytes = b"x", mode: int = 0o644, **kw) -> tuple[tarfile.TarInfo, bytes | None]:
    ti = _info(name, tarfile.REGTYPE, mode, **kw)
    ti.size = len(data)
    return ti, data


def D(name: str, mode: int = 0o755, **kw) -> tuple[tarfile.TarInfo, None]:
    return _info(name, tarfile.DIRTYPE, mode, **kw), None


def L(name: str, target: str, **kw) -> tuple[tarfile.TarInfo, None]:
    ti = _info(name, tarfile.SYMTYPE, 0o777, **kw)
    ti.linkname = target
    return ti, None


def H(name: str, target: str) -> tuple[tarfile.TarInfo, None]:
    ti = _info(name, tarfile.LNKTYPE, 0o644)
    ti.linkname = target
    return ti, None


def DEV(name: str, major: int = 1, minor: int = 3, kind: bytes = tarfile.CHRTYPE) -> tuple[tarfile.TarInfo, None]:
    ti = _info(name, kind, 0o666)
    ti.devmajor, ti.devminor = major, minor
    return ti, None


def tar(*members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def apply(rootfs: Path, *members):
    rootfs.mkdir(exist_ok=True)
    return apply_layer(io.BytesIO(tar(*members)), rootfs)


def _blob(layout: Path, data: bytes, media: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def _image_blobs(layout: Path, layers: list[bytes], env: list[str] | None = None, compress: str = "gzip") -> dict:
    """Writes one image's config, layers and manifest into a layout; returns the manifest's descriptor."""
    config = {"architecture": machine_arch(), "os": "linux",
              "config": {"Env": env or ["PATH=/bin", "HOME=/root"], "WorkingDir": "/w", "User": "7:8"},
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(t).hexdigest()}" for t in layers]}}
    media = "application/vnd.oci.image.layer.v1.tar"
    if compress == "zstd":  # only the magic number: enough to be recognised, and refused without the module
        descs = [_blob(layout, b"\x28\xb5\x2f\xfd" + t, media + "+zstd") for t in layers]
    elif compress == "gzip":
        descs = [_blob(layout, gzip.compress(t, mtime=0), media + "+gzip") for t in layers]
    else:
        descs = [_blob(layout, t, media) for t in layers]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": _blob(layout, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": descs}
    return _blob(layout, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")


def write_layout(layout: Path, layers: list[bytes], manifests: list[dict] | None = None, **kw) -> Path:
    """An OCI image layout of one image (or of the given index entries)."""
    layout.mkdir(parents=True, exist_ok=True)
    if manifests is None:
        manifests = [_image_blobs(layout, layers, **kw)]
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return layout


def tar_folder(folder: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tf:
        for p in sorted(folder.rglob("*")):
            tf.add(p, str(p.relative_to(folder)), recursive=False)
    return dest


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: type, mode, owner, mtime, and contents or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            body = (os.readlink(p) if stat.S_ISLNK(st.st_mode) else
                    hashlib.sha256(Path(p).read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None)
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                                             st.st_mtime_ns, body)
    return out


def quiet(_msg: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------------------------
# podman images built here, once per session


def _tiny_rootfs(dest: Path) -> Path:
    """A merged-/usr root file system holding the host's dash (as sh) and a few tools, with the libraries they need."""
    (dest / "usr" / "bin").mkdir(parents=True)
    for link in ("bin", "lib", "lib64"):
        os.symlink(f"usr/{link}", dest / link)
    for tool in TOOLS:
        host = shutil.which("dash" if tool == "sh" else tool)
        assert host, f"the host has no {tool}"
        shutil.copy2(host, dest / "usr" / "bin" / tool)
        ldd = subprocess.run(["ldd", host], capture_output=True, text=True, timeout=30).stdout
        for word in ldd.split():
            if word.startswith("/") and os.path.exists(word):
                rel = word.lstrip("/")
                target = dest / (rel if rel.startswith("usr/") else f"usr/{rel}")
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    shutil.copy2(word, target)
    (dest / "usr" / "lib64").mkdir(exist_ok=True)
    return dest


DOCKERFILE = """\
FROM scratch
COPY rootfs/ /
RUN mkdir -p /data/keep /data/gone /opt/tree/sub /srv/owned && echo a > /data/keep/a && echo b > /data/gone/b \
 && echo t > /opt/tree/sub/t && echo old > /opt/tree/old
RUN rm /data/gone/b && rm -rf /opt/tree && mkdir /opt/tree && echo new > /opt/tree/new \
 && echo s > /srv/suid && chmod 4755 /srv/suid && echo g > /srv/sgid && chmod 2750 /srv/sgid \
 && mkdir /srv/sticky && chmod 1777 /srv/sticky && echo o > /srv/owned/f && ln -s ../data/keep/a /srv/link \
 && chown -R 1234:5678 /srv/owned && chown -h 1234:5678 /srv/link && ln /srv/suid /srv/hard && mkfifo /srv/fifo \
 && touch -d @1000000000 /data/keep/a && touch -h -d @1000000001 /srv/link && touch -d @1000000002 /srv/sticky
ENV FOO=bar
WORKDIR /work
USER 1234:5678
"""


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The test image, built by podman.build (it is in podman's storage under `tag` for the session) and saved as an
    oci-archive (by build), a docker-archive and an OCI layout folder."""
    if not HAVE_PODMAN:
        pytest.skip("podman is not installed")
    d = tmp_path_factory.mktemp("podman-image")
    ctx = d / "ctx"
    _tiny_rootfs(ctx / "rootfs")
    session = uuid.uuid4().hex[:10]
    # a file of its own makes every build its own: no layer cache shared with another session that removes it
    (ctx / "rootfs" / "session").write_text(session)
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    tag = f"localhost/gyre-test-images/fixture:{session}"
    oci_archive = podman.build(ctx, tag, d)
    try:
        env = podman.podman_env()
        for fmt, out in (("docker-archive", d / "docker.tar"), ("oci-dir", d / "oci-dir")):
            subprocess.run(podman.podman_argv("save", "--quiet", "--format", fmt, "-o", str(out), tag), env=env,
                           check=True, timeout=120, capture_output=True)
        image_id = podman.image_id(tag)
        yield {"tag": tag, "id": image_id, "oci-archive": oci_archive, "docker-archive": d / "docker.tar",
               "oci": d / "oci-dir", "dir": d}
    finally:
        podman.remove_image(tag)


@pytest.fixture(scope="session")
def unpacked(built, tmp_path_factory):
    """The test image unpacked from its oci-archive (by unpack_image: no cache)."""
    dest = tmp_path_factory.mktemp("unpacked") / "rootfs"
    unpack_image(open_image(parse_ref(f"oci-archive:{built['oci-archive']}")), dest)
    return dest


# ---------------------------------------------------------------------------------------------------------------
# references


def test_parse_ref_forms(tmp_path):
    r = parse_ref("oci-archive:img/a.tar", base=tmp_path)
    assert (r.kind, r.path, r.name) == ("oci-archive", tmp_path / "img" / "a.tar", None)
    r = parse_ref("oci-archive:/x/a.tar:localhost/gyre-fixtures/swe-calc:1")
    assert (r.kind, r.path, r.name) == ("oci-archive", Path("/x/a.tar"), "localhost/gyre-fixtures/swe-calc:1")
    assert parse_ref("docker-archive:../d.tar", base=tmp_path / "suite").path == tmp_path / "d.tar"
    assert parse_ref("oci:/layouts/one").kind == "oci"
    r = parse_ref("rootfs:sandbox", base=tmp_path)
    assert (r.kind, r.path, r.text) == ("rootfs", tmp_path / "sandbox", "rootfs:sandbox")
    for text, name in (("docker://python:3.12-slim", "python:3.12-slim"), ("python:3.12-slim", "python:3.12-slim"),
                       ("localhost/gyre-fixtures/swe-calc:1", "localhost/gyre-fixtures/swe-calc:1"),
                       ("registry.example.com:5000/a/b_c/d-e", "registry.example.com:5000/a/b_c/d-e"),
                       ("ubuntu@sha256:" + "a" * 64, "ubuntu@sha256:" + "a" * 64)):
        r = parse_ref(text)
        assert (r.kind, r.path, r.name, r.text) == ("registry", None, name, text)
    assert parse_ref("x.tar").kind == "registry"  # no transport: a name (it fails at fetch), never a guessed path


@pytest.mark.parametrize("text", ["", " ", "Python:3", "python:3 ", "docker://", "a//b", "ubuntu@sha256:abc",
                                  "oci-archive:", "rootfs:/x:name", "oci-archive:/x.tar:", "http://x/y",
                                  "containers-storage:foo", "-x", "a\nb", "name:tag:more"])
def test_parse_ref_refusals(text):
    with pytest.raises(ConfigError) as e:
        parse_ref(text)
    msg = str(e.value)
    assert "\n" not in msg and repr(text) in msg


def test_ref_check(tmp_path):
    for text in ("oci-archive:missing.tar", "oci:missing", "rootfs:missing"):
        with pytest.raises(ConfigError, match="does not exist"):
            parse_ref(text, base=tmp_path).check()
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="is not a folder"):
        parse_ref("rootfs:f", base=tmp_path).check()
    with pytest.raises(ConfigError, match="is not a file"):
        parse_ref("docker-archive:d", base=tmp_path).check()
    with pytest.raises(ConfigError, match="not an OCI image layout"):
        parse_ref("oci:d", base=tmp_path).check()
    parse_ref("rootfs:d", base=tmp_path).check()
    parse_ref("oci-archive:f", base=tmp_path).check()


# ---------------------------------------------------------------------------------------------------------------
# podman's archives


@needs_podman
def test_three_forms_one_image(built, unpacked, tmp_path):
    """oci-archive, docker-archive and an OCI layout of one image: one digest (podman's image ID), one config, one
    unpacked tree."""
    want = tree(unpacked)
    for kind in ("oci-archive", "docker-archive", "oci"):
        src = open_image(parse_ref(f"{kind}:{built[kind]}"))
        assert src.digest == built["id"], kind
        assert src.config.env["FOO"] == "bar" and src.config.workdir == "/work" and src.config.user == "1234:5678"
        assert len(src.layers) == 3
        if kind != "oci-archive":
            unpack_image(src, tmp_path / kind)
            assert tree(tmp_path / kind) == want, kind


@needs_podman
def test_podman_image_unpacked(unpacked):
    r = unpacked
    assert not (r / "data" / "gone" / "b").exists() and (r / "data" / "gone").is_dir()  # a whiteout
    assert sorted(os.listdir(r / "opt" / "tree")) == ["new"]  # an opaque folder: the old one's contents are gone
    assert os.readlink(r / "lib") == "usr/lib" and (r / "usr" / "lib").is_dir()  # merged /usr kept as symlinks
    assert os.stat(r / "srv" / "suid").st_mode & 0o7777 == 0o4755
    assert os.stat(r / "srv" / "sgid").st_mode & 0o7777 == 0o2750
    assert os.stat(r / "srv" / "sticky").st_mode & 0o7777 == 0o1777
    assert os.stat(r / "srv" / "sticky").st_mtime_ns == 1000000002 * 10**9  # a folder's mtime, after its contents
    assert os.stat(r / "data" / "keep" / "a").st_mtime_ns == 1000000000 * 10**9
    link = os.lstat(r / "srv" / "link")
    assert os.readlink(r / "srv" / "link") == "../data/keep/a" and link.st_mtime_ns == 1000000001 * 10**9
    assert os.stat(r / "srv" / "hard").st_ino == os.stat(r / "srv" / "suid").st_ino
    assert stat.S_ISFIFO(os.lstat(r / "srv" / "fifo").st_mode)
    if IS_ROOT:
        for p in (r / "srv" / "owned", r / "srv" / "owned" / "f"):
            assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 5678)
        assert (link.st_uid, link.st_gid) == (1234, 5678)  # lchown: the symlink itself
        # it runs: the unpacked tree is a working root file system
        out = subprocess.run(["chroot", str(r), "/bin/sh", "-c", "cat /opt/tree/new"], capture_output=True,
                             text=True, timeout=30)
        assert out.stdout == "new\n", out.stderr


# ---------------------------------------------------------------------------------------------------------------
# layer semantics, on layers written here


def test_whiteouts_and_opaque_folders(tmp_path):
    r = tmp_path / "r"
    apply(r, D("d"), F("d/a"), D("d/sub"), F("d/sub/b"), F("f"), D("g"), F("g/old"), D("h"), F("h/old"),
          D("keep"), F("keep/k"))
    s = apply(r, F("d/before"), D("d/sub"), F("d/sub/c"),  # this layer's, before the marker in tar order
              F("d/.wh..wh..opq", b""), F("d/after"),  # and after it
              F(".wh.f", b""),
              F("g/new"), F(".wh.g", b""),  # a whiteout never hides this layer's own entries
              F(".wh.h", b""), D("h"), F("h/new"),
              F("keep/.wh.missing", b""), F("nowhere/.wh.x", b""))
    assert sorted(os.listdir(r / "d")) == ["after", "before", "sub"]
    assert sorted(os.listdir(r / "d" / "sub")) == ["c"]
    assert not (r / "f").exists()
    assert sorted(os.listdir(r / "g")) == ["new"]
    assert sorted(os.listdir(r / "h")) == ["new"]
    assert sorted(os.listdir(r / "keep")) == ["k"]
    assert not any(n.startswith(".wh.") for _, ds, fs in os.walk(r) for n in ds + fs)
    assert (s.opaque, s.whiteouts) == (1, 5)


def test_replacing_and_merging(tmp_path):
    r = tmp_path / "r"
    apply(r, D("dir2file"), F("dir2file/x"), F("file2dir"), D("dir2link"), F("dir2link/x"), D("merge"),
          F("merge/old"), F("link2file"), L("sym2dir", "merge"), F("target", b"t"))
    apply(r, F("dir2file", b"now a file"), D("file2dir"), F("file2dir/y"), L("dir2link", "target"),
          D("merge", mode=0o700), F("merge/new"), F("link2file", b"replaced"), D("sym2dir"), H("link2file", "target"))
    assert (r / "dir2file").read_bytes() == b"now a file"
    assert sorted(os.listdir(r / "file2dir")) == ["y"]
    assert os.readlink(r / "dir2link") == "target"
    assert sorted(os.listdir(r / "merge")) == ["new", "old"] and os.stat(r / "merge").st_mode & 0o777 == 0o700
    assert os.stat(r / "link2file").st_ino == os.stat(r / "target").st_ino  # the hard link replaced the file
    assert (r / "sym2dir").is_dir() and not (r / "sym2dir").is_symlink()  # a folder over a symlink replaces it


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
    assert (r / "usr" / "lib" / "z").read_bytes() == b"via absolute"
    assert (r / "usr" / "w").is_file()
    assert os.readlink(r / "lib") == "usr/lib" and os.readlink(r / "abs") == "/usr/lib"  # targets stored as they are
    assert (s.files, s.symlinks, s.dirs) == (3, 3, 2)


def test_owners_modes_mtimes_devices(tmp_path):
    r = tmp_path / "r"
    s = apply(r, D("d", mode=0o2775, uid=1234, gid=5678, mtime=1_111), F("d/f", mode=0o6755, uid=1234, gid=5678,
              mtime=2_222), L("d/l", "f", uid=4321, gid=8765, mtime=3_333), D("t", mode=0o1777),
              F("d/g", mode=0o400), DEV("null"), DEV("blk", 7, 0, tarfile.BLKTYPE),
              (_info("p", tarfile.FIFOTYPE, 0o640), None))
    st = os.stat(r / "d" / "f")
    assert st.st_mode & 0o7777 == 0o6755 and st.st_mtime == 2_222
    assert os.stat(r / "d").st_mode & 0o7777 == 0o2775 and os.stat(r / "d").st_mtime == 1_111
    assert os.lstat(r / "d" / "l").st_mtime == 3_333
    assert os.stat(r / "t").st_mode & 0o7777 == 0o1777 and os.stat(r / "d" / "g").st_mode & 0o7777 == 0o400
    assert stat.S_ISFIFO(os.lstat(r / "p").st_mode) and os.lstat(r / "p").st_mode & 0o777 == 0o640
    if IS_ROOT:
        assert (st.st_uid, st.st_gid) == (1234, 5678) and os.stat(r / "d").st_uid == 1234
        assert (os.lstat(r / "d" / "l").st_uid, os.lstat(r / "d" / "l").st_gid) == (4321, 8765)
        assert s.devices + s.skipped == 2  # made, or skipped where root may not make devices (a user namespace)
        if s.devices == 2:
            assert os.stat(r / "null").st_rdev == os.makedev(1, 3) and stat.S_ISBLK(os.stat(r / "blk").st_mode)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to become another user")
def test_not_root(tmp_path):
    """As an ordinary user: devices skipped and counted, everything the caller's, read-only folders still filled."""
    work = Path(tempfile.mkdtemp(prefix="gyre-images-nonroot-"))  # pytest's tmp_path is root's alone
    try:
        os.chown(work, 65534, 65534)
        layers = [tar(D("ro", mode=0o555), F("ro/f", uid=1234), DEV("null"), F("s", mode=0o4755)),
                  tar(F("ro/g"), F("ro/.wh.f", b""))]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become nobody, apply, report
            code = 1
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                (work / "rootfs").mkdir()
                stats = [apply_layer(io.BytesIO(t), work / "rootfs") for t in layers]
                os.write(w, json.dumps([s.skipped for s in stats]).encode())
                code = 0
            except BaseException as e:
                os.write(w, json.dumps(repr(e)).encode())
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            report = json.loads(f.read())
        assert os.waitpid(pid, 0)[1] == 0, report
        assert report == [1, 0]
        root = work / "rootfs"
        assert sorted(os.listdir(root / "ro")) == ["g"] and not (root / "null").exists()
        assert os.stat(root / "ro").st_mode & 0o777 == 0o555 and os.stat(root / "ro" / "g").st_uid == 65534
        assert os.stat(root / "s").st_mode & 0o7777 == 0o4755
    finally:
        shutil.rmtree(work)


# ---------------------------------------------------------------------------------------------------------------
# escapes: nothing outside rootfs is ever written, deleted or linked to


@pytest.fixture
def jail(tmp_path):
    """rootfs at tmp/box/rootfs, and outside it tmp/outside/sentinel (and an outside folder's listing) to check."""
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
    apply(rootfs, *ESCAPES[case])
    assert not (rootfs.parent / "outside").exists()


def test_escape_through_absolute_symlink(jail):
    """`a/evil -> /real/outside/path` then `a/evil/sentinel`: the absolute target starts again at rootfs."""
    rootfs, outside = jail
    apply(rootfs, D("a"), L("a/evil", str(outside)), F("a/evil/sentinel", b"evil"))
    assert (rootfs / str(outside).lstrip("/") / "sentinel").read_bytes() == b"evil"


@pytest.mark.parametrize("target", ["../../outside/sentinel", "/../outside/sentinel", "ev/sentinel",
                                    "/etc/shadow", ".."])
def test_hard_link_escapes_refused(jail, target):
    rootfs, outside = jail
    with pytest.raises(GyreError) as e:
        apply(rootfs, L("ev", "../../outside"), H("h", target))
    assert "\n" not in str(e.value) and "hard link" in str(e.value)
    assert not (rootfs / "h").exists()


def test_hard_link_to_etc_shadow_links_rootfs_own(jail):
    rootfs, outside = jail
    apply(rootfs, D("etc"), F("etc/shadow", b"image's"), D("a"), L("a/ev", "/etc"), H("h", "../../etc/shadow"),
          H("h2", "a/ev/shadow"))
    for h in ("h", "h2"):
        assert os.stat(rootfs / h).st_ino == os.stat(rootfs / "etc" / "shadow").st_ino
    assert os.stat("/etc/shadow").st_ino != os.stat(rootfs / "h").st_ino


def test_file_named_as_folder_refused(tmp_path):
    with pytest.raises(GyreError, match="names a folder but is not one"):
        apply(tmp_path / "r", D("a"), F("a/..", b"x"))


# ---------------------------------------------------------------------------------------------------------------
# archives: formats, indexes, digests


def test_layout_and_archive_written_here(tmp_path):
    layers = [tar(D("etc"), F("etc/os", b"one")), tar(F("etc/os", b"two"), F("etc/.wh.gone", b""))]
    layout = write_layout(tmp_path / "layout", layers)
    archive = tar_folder(layout, tmp_path / "image.tar")
    a = open_image(parse_ref(f"oci:{layout}"))
    b = open_image(parse_ref(f"oci-archive:{archive}"))
    assert a.digest == b.digest and a.config == b.config
    assert a.config.env == {"PATH": "/bin", "HOME": "/root"} and (a.config.workdir, a.config.user) == ("/w", "7:8")
    stats = unpack_image(b, tmp_path / "r")
    assert (tmp_path / "r" / "etc" / "os").read_bytes() == b"two" and len(stats.layers) == 2
    # uncompressed layers, and an empty one (a layer tar of nothing but its end blocks)
    plain = write_layout(tmp_path / "plain", [*layers, tar()], compress="none")
    stats = unpack_image(open_image(parse_ref(f"oci:{plain}")), tmp_path / "r2")
    no_mtimes = [{k: v[:4] + v[5:] for k, v in tree(tmp_path / r).items()} for r in ("r", "r2")]  # etc/ was written
    assert no_mtimes[0] == no_mtimes[1] and stats.total.files == 2


def test_index_picks_this_machine_and_refname(tmp_path):
    layout = tmp_path / "layout"
    layout.mkdir()
    ours = _image_blobs(layout, [tar(F("which", b"ours"))])
    other = _image_blobs(layout, [tar(F("which", b"other"))])
    foreign = "arm64" if machine_arch() != "arm64" else "amd64"
    nested = _blob(layout, json.dumps({"schemaVersion": 2, "manifests": [
        {**other, "platform": {"os": "linux", "architecture": foreign}},
        {**ours, "platform": {"os": "linux", "architecture": machine_arch()}},
        {**other, "platform": {"os": "unknown", "architecture": "unknown"}}]}).encode(),
        "application/vnd.oci.image.index.v1+json")
    write_layout(layout, [], manifests=[{**nested, "annotations": {"org.opencontainers.image.ref.name": "multi"}},
                                        {**other, "annotations": {"org.opencontainers.image.ref.name": "single"}}])
    with pytest.raises(GyreError, match="lists 2 images, 0 of them for linux/"):
        open_image(parse_ref(f"oci:{layout}"))

    def which(text: str) -> bytes:
        unpack_image(open_image(parse_ref(text)), tmp_path / text.rsplit(":", 1)[-1])
        return (tmp_path / text.rsplit(":", 1)[-1] / "which").read_bytes()

    assert which(f"oci:{layout}:multi") == b"ours"  # through the nested index, to this machine's platform
    assert which(f"oci:{layout}:single") == b"other"
    with pytest.raises(GyreError, match=r"no image named 'nope' in it \(names: multi, single\)"):
        open_image(parse_ref(f"oci:{layout}:nope"))


@needs_podman
def test_docker_archive_by_tag(built):
    src = open_image(parse_ref(f"docker-archive:{built['docker-archive']}:{built['tag']}"))
    assert src.digest == built["id"]
    with pytest.raises(GyreError, match="no image tagged 'localhost/other:1'"):
        open_image(parse_ref(f"docker-archive:{built['docker-archive']}:localhost/other:1"))


def test_corrupt_blobs_refused(tmp_path):
    layers = [tar(F("a", b"one" * 1000))]
    layout = write_layout(tmp_path / "layout", layers, compress="none")
    src = open_image(parse_ref(f"oci:{layout}"))
    blob = src.layers[0].file
    blob.write_bytes(tar(F("a", b"two" * 1000)))  # a valid layer of the same size, but not this one
    with pytest.raises(GyreError, match="does not match its digest"):
        unpack_image(open_image(parse_ref(f"oci:{layout}")), tmp_path / "r1")
    cache = ImageCache(tmp_path / "cache")
    with pytest.raises(GyreError, match="does not match its digest"):
        cache.get(parse_ref(f"oci:{layout}"), echo=quiet)
    assert cache.list() == [] and not list((tmp_path / "cache").glob(".unpack-*"))  # nothing half-done stays
    blob.write_bytes(b"\x1f\x8b" + b"garbage" * 100)
    with pytest.raises(GyreError, match=f"layer blobs/sha256/{blob.name} is 702 bytes, its manifest says 10240"):
        open_image(parse_ref(f"oci:{layout}"))
    blob.write_bytes((b"\x1f\x8b" + b"garbage" * 2000)[:10240])
    with pytest.raises(GyreError, match="cannot be read or decompressed|not a valid layer tar"):
        unpack_image(open_image(parse_ref(f"oci:{layout}")), tmp_path / "r2")
    manifest = json.loads((layout / "blobs" / "sha256" / json.loads((layout / "index.json").read_text())
                           ["manifests"][0]["digest"].split(":")[1]).read_text())
    config = layout / "blobs" / "sha256" / manifest["config"]["digest"].split(":")[1]
    config.write_text(config.read_text().replace("/root", "/toor"))
    with pytest.raises(GyreError, match="image config .* does not match its digest") as e:
        open_image(parse_ref(f"oci:{layout}"))
    assert str(layout) in str(e.value) and "\n" not in str(e.value)


@needs_podman
def test_docker_archive_layer_checked_against_diff_id(built, tmp_path):
    bad = tmp_path / "docker.tar"
    shutil.copy(built["docker-archive"], bad)
    with tarfile.open(bad) as tf:
        big = max((m for m in tf.getmembers() if m.isreg()), key=lambda m: m.size)
    with open(bad, "r+b") as f:  # one byte in the middle of the largest layer (in a file's contents)
        f.seek(big.offset_data + big.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(GyreError, match="does not match its diff_id"):
        unpack_image(open_image(parse_ref(f"docker-archive:{bad}")), tmp_path / "r")


def test_unreadable_archives_refused(tmp_path):
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    (tmp_path / "gz.tar").write_bytes(gzip.compress(b"x" * 1000))
    (tmp_path / "empty").mkdir()
    for text, msg in ((f"oci-archive:{tmp_path}/junk.tar", "not a tar archive"),
                      (f"oci-archive:{tmp_path}/gz.tar", "gzip-compressed"),
                      (f"docker-archive:{tmp_path}/junk.tar", "not a tar archive")):
        with pytest.raises(GyreError, match=msg) as e:
            open_image(parse_ref(text))
        assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)
    layout = write_layout(tmp_path / "layout", [tar(F("a"))])
    with pytest.raises(GyreError, match="manifest.json is missing"):
        open_image(parse_ref(f"docker-archive:{tar_folder(layout, tmp_path / 'oci.tar')}"))


def test_zstd_without_the_module_refused(tmp_path):
    try:
        import zstandard  # noqa: F401
        pytest.skip("zstandard is installed here: zstd layers are read")
    except ModuleNotFoundError:
        pass
    layout = write_layout(tmp_path / "layout", [tar(F("a"))], compress="zstd")
    with pytest.raises(GyreError, match=r"zstd-compressed \(application/vnd.oci.image.layer.v1.tar\+zstd\)"):
        unpack_image(open_image(parse_ref(f"oci:{layout}")), tmp_path / "r")


# ---------------------------------------------------------------------------------------------------------------
# the cache


def _archive(tmp_path: Path, n: int = 2) -> Path:
    layers = [tar(D("etc"), F("etc/a", b"a"), F("bin/tool", b"#!", mode=0o755))] + \
             [tar(F(f"etc/layer{i}", str(i).encode())) for i in range(1, n)]
    return tar_folder(write_layout(tmp_path / "layout", layers, env=["FOO=1"]), tmp_path / "image.tar")


def test_cache_get_list_remove(tmp_path):
    archive = _archive(tmp_path)
    cache = ImageCache(tmp_path / "cache")
    said: list[str] = []
    img = cache.get(parse_ref(f"oci-archive:{archive}"), echo=said.append)
    assert any("unpacking image" in s for s in said)
    assert img.rootfs == tmp_path / "cache" / f"sha256-{img.digest.split(':')[1]}" / "rootfs"
    assert (img.rootfs / "etc" / "layer1").read_bytes() == b"1"
    assert img.env == {"FOO": "1", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    assert (img.workdir, img.user, img.ref_text) == ("/w", "7:8", f"oci-archive:{archive}")
    meta = json.loads((img.rootfs.parent / "image.json").read_text())
    assert meta["config"]["config"]["Env"] == ["FOO=1"] and meta["size_bytes"] > 0 and meta["unpack_s"] >= 0
    [entry] = cache.list()
    assert entry["digest"] == img.digest and entry["ref"] == f"oci-archive:{archive}"
    before = tree(img.rootfs)
    said.clear()
    assert cache.get(parse_ref(f"oci-archive:{archive}"), echo=said.append) == img and said == []
    assert tree(img.rootfs) == before  # a second get writes nothing into the finished rootfs
    cache.remove(img.digest)
    assert cache.list() == [] and not img.rootfs.exists()
    with pytest.raises(GyreError, match="not in the image cache"):
        cache.remove(img.digest)
    assert cache.get(parse_ref(f"oci-archive:{archive}"), echo=quiet).rootfs.is_dir()  # unpacked again


def test_cache_memo_does_not_reread_the_archive(tmp_path):
    """ref -> digest is remembered by (path, size, mtime): an archive whose bytes changed behind an unchanged size
    and mtime is not read again, in this process or (through the memo on disk) in another one."""
    archive = _archive(tmp_path)
    ref = parse_ref(f"oci-archive:{archive}")
    img = ImageCache(tmp_path / "cache").get(ref, echo=quiet)
    st = archive.stat()
    archive.write_bytes(b"x" * st.st_size)  # garbage now: reading it would fail
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ImageCache(tmp_path / "cache").get(ref, echo=quiet) == img
    script = ("import sys; from pathlib import Path; from gyre_slurm.images import ImageCache, parse_ref; "
              "print(ImageCache(Path(sys.argv[1])).get(parse_ref(sys.argv[2]), echo=print).digest)")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache"), ref.text], capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == img.digest, out.stderr  # a fresh process: the memo on disk
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(GyreError, match="not a tar archive"):
        ImageCache(tmp_path / "cache").get(ref, echo=quiet)


def test_rootfs_used_in_place(tmp_path):
    (tmp_path / "sandbox" / ".singularity.d" / "env").mkdir(parents=True)
    (tmp_path / "sandbox" / ".singularity.d" / "env" / "90-environment.sh").write_text("export FOO=never\n")
    img = ImageCache(tmp_path / "cache").get(parse_ref("rootfs:sandbox", base=tmp_path), echo=quiet)
    assert img.rootfs == tmp_path / "sandbox" and img.digest is None
    assert img.env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    assert (img.workdir, img.user) == (None, None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    with pytest.raises(ConfigError, match="does not exist"):
        ImageCache(tmp_path / "cache").get(parse_ref("rootfs:nowhere", base=tmp_path))


CHILD = """\
import sys, time
from pathlib import Path
from gyre_slurm.images import ImageCache, parse_ref

marker = Path(sys.argv[3]) if len(sys.argv) > 3 else None

def echo(msg):
    print(msg, flush=True)
    if marker is not None and msg.startswith("  layer 1/"):
        marker.write_text("mid-unpack")
        time.sleep(120)  # stopped half way through: the test kills us here

img = ImageCache(Path(sys.argv[1])).get(parse_ref(sys.argv[2]), echo=echo)
print("ROOTFS", img.rootfs, flush=True)
"""


def _child(tmp_path: Path, *args: str) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_concurrent_processes_unpack_once(tmp_path):
    archive = _archive(tmp_path)
    ref = parse_ref(f"oci-archive:{archive}")
    digest = open_image(ref).digest
    root = tmp_path / "cache"
    (root / ".locks").mkdir(parents=True)
    fd = os.open(root / ".locks" / f"sha256-{digest.split(':')[1]}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held here until both children wait on it
    procs = [_child(tmp_path, str(root), ref.text) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("waiting for another process to unpack"), line
    finally:
        os.close(fd)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(o.count("unpacking image") for o in outs) == 1, outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1  # the same ROOTFS line


def test_concurrent_threads_unpack_once(tmp_path):
    archive = _archive(tmp_path, n=6)
    said: list[str] = []
    cache = ImageCache(tmp_path / "cache")
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(parse_ref(f"oci-archive:{archive}"),
                                                                        echo=said.append))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and len(set(results)) == 1
    assert sum("unpacking image" in s for s in said) == 1


def test_kill_mid_unpack_leaves_no_entry(tmp_path):
    archive = _archive(tmp_path, n=3)
    ref = parse_ref(f"oci-archive:{archive}")
    root, marker = tmp_path / "cache", tmp_path / "marker"
    p = _child(tmp_path, str(root), ref.text, str(marker))
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read() if p.stdout else ""
            time.sleep(0.05)
        [half] = list(root.glob(".unpack-*"))
        assert (half / "rootfs" / "etc" / "a").is_file()  # the first layer is in: a half rootfs
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=30)
    cache = ImageCache(root)
    assert cache.list() == [] and not list(root.glob("sha256-*"))
    img = cache.get(ref, echo=quiet)
    assert (img.rootfs / "etc" / "layer2").read_bytes() == b"2"
    assert not list(root.glob(".unpack-*"))  # the leftover is gone


# ---------------------------------------------------------------------------------------------------------------
# podman and skopeo


@needs_podman
def test_registry_ref_through_podman_storage(built, tmp_path):
    cache = ImageCache(tmp_path / "cache")
    said: list[str] = []
    img = cache.get(parse_ref(built["tag"]), echo=said.append)
    assert img.digest == built["id"] and img.env["FOO"] == "bar" and img.workdir == "/work"
    assert any(s.startswith("fetching image") for s in said)
    assert (img.rootfs / "opt" / "tree" / "new").read_text() == "new\n"
    assert not any((tmp_path / "cache" / ".fetch").iterdir())  # the fetched archive is gone once unpacked
    said.clear()
    ImageCache._memo.clear()  # as a fresh process: only podman's image ID can find the entry
    again = cache.get(parse_ref(f"docker://{built['tag']}"), echo=said.append)
    assert (again.digest, again.rootfs) == (img.digest, img.rootfs)
    assert said == []  # found by podman's image ID: not saved again


def test_pulling_needs_podman_or_skopeo(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    want = ("image 'localhost/gyre/x:1': pulling needs podman or skopeo on this node, neither is installed; give an "
            "OCI archive (oci-archive:PATH) or a root file system (rootfs:PATH) instead")
    with pytest.raises(GyreError) as e:
        podman.fetch("localhost/gyre/x:1", tmp_path / "fetch")
    assert str(e.value) == want
    with pytest.raises(GyreError) as e:
        ImageCache(tmp_path / "cache").get(parse_ref("localhost/gyre/x:1"), echo=quiet)
    assert str(e.value) == want


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed")
def test_skopeo_without_podman(tmp_path, monkeypatch):
    """With skopeo alone on PATH, fetch copies with it (here no registry answers: its error, in one line)."""
    only = tmp_path / "bin"
    only.mkdir()
    os.symlink(shutil.which("skopeo"), only / "skopeo")
    monkeypatch.setenv("PATH", str(only))
    with pytest.raises(GyreError) as e:
        podman.fetch("gyre.invalid/none:1", tmp_path / "fetch")
    assert str(e.value).startswith("skopeo copy docker://gyre.invalid/none:1 failed") and "\n" not in str(e.value)


@needs_podman
def test_failing_pull_is_one_line(tmp_path):
    with pytest.raises(GyreError) as e:
        podman.fetch("gyre.invalid/none:1", tmp_path)
    msg = str(e.value)
    assert msg.startswith("podman pull gyre.invalid/none:1 failed") and "gyre.invalid" in msg.split(":", 2)[-1]
    assert "\n" not in msg and not list(tmp_path.iterdir())


@needs_podman
def test_build_with_unresolvable_from(tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM gyre.invalid/none:1 AS base\nFROM base\nRUN true\n")
    with pytest.raises(GyreError) as e:
        podman.build(ctx, f"localhost/gyre-test-images/bad:{uuid.uuid4().hex[:8]}", tmp_path)
    assert str(e.value).startswith(f"{ctx}: FROM gyre.invalid/none:1 does not resolve")
    assert podman.from_refs("FROM --platform=linux/amd64 a:1 AS x\nFROM x\nFROM scratch\nFROM $B\nFROM \\\n c") == \
        ["a:1", "c"]


def test_podman_argv_and_env(tmp_path):
    env = podman.podman_env(tmp_path / "conf") if not os.environ.get("CONTAINERS_CONF") else {}
    if env:
        assert Path(env["CONTAINERS_CONF"]).read_text() == "[containers]\ndefault_ulimits = []\n"
    argv = podman.podman_argv("save", "x")
    assert argv[0] == "podman" and argv[-2:] == ["save", "x"]
    assert ("--runtime" in argv) == (shutil.which("runc") is not None)
