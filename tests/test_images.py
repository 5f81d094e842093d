"""Container images as task environments (gyre_slurm.images): references, archives, safe unpacking, the node cache,
podman and skopeo. Real tools, no mocks: the podman image is built here, once per session, from a tiny root file
system (the host's dash and a few coreutils with the libraries ldd names); the exact whiteout, opaque and escape
cases are layers written here with tarfile (their semantics and the escapes: test_image_layers.py)."""

from __future__ import annotations

import fcntl
import functools
import gzip
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.images import ImageCache, open_image, parse_ref, podman, unpack_image
from gyre_slurm.images.archive import machine_arch
from tests.test_image_layers import D, F, one_line, tar, tree

HAVE_PODMAN = shutil.which("podman") is not None
def needs_podman(test):  # no silent skip: without podman (tools/setup_env.sh installs it) the test fails, saying so
    def run(*args, **kwargs):
        assert HAVE_PODMAN, "podman is not installed (tools/setup_env.sh installs it: apt-get install podman runc)"
        return test(*args, **kwargs)

    return functools.wraps(test)(run)
IS_ROOT = os.geteuid() == 0
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAYER = "application/vnd.oci.image.layer.v1.tar"

# -- layouts written here (their layers: test_image_layers.py) ---------------------------------------------------


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
    # zstd: only its magic number, enough to be recognised (and refused without the zstandard module)
    data = {"gzip": lambda t: gzip.compress(t, mtime=0), "zstd": lambda t: b"\x28\xb5\x2f\xfd" + t,
            "none": lambda t: t}[compress]
    media = LAYER + ("" if compress == "none" else f"+{compress}")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": _blob(layout, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": [_blob(layout, data(t), media) for t in layers]}
    return _blob(layout, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")


def write_layout(layout: Path, layers: list[bytes], manifests: list[dict] | None = None, **kw) -> Path:
    """An OCI image layout of one image (or of the given index entries)."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    manifests = manifests if manifests is not None else [_image_blobs(layout, layers, **kw)]
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    return layout


def tar_folder(folder: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tf:
        for p in sorted(folder.rglob("*")):
            tf.add(p, str(p.relative_to(folder)), recursive=False)
    return dest


def quiet(_msg: str) -> None:
    pass


# -- the podman image, built here once per session --------------------------------------------------------------

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


def _tiny_rootfs(dest: Path) -> None:
    """A merged-/usr root file system: the host's dash (as sh), a few tools and the libraries ldd names."""
    (dest / "usr" / "bin").mkdir(parents=True)
    (dest / "usr" / "lib64").mkdir()
    for link in ("bin", "lib", "lib64"):
        os.symlink(f"usr/{link}", dest / link)
    for tool in ("sh", "rm", "ln", "chmod", "chown", "mkdir", "touch", "mkfifo", "cat"):
        host = shutil.which("dash" if tool == "sh" else tool)
        assert host, f"the host has no {tool}"
        shutil.copy2(host, dest / "usr" / "bin" / tool)
        for lib in subprocess.run(["ldd", host], capture_output=True, text=True, timeout=30).stdout.split():
            target = dest / "usr" / lib.lstrip("/").removeprefix("usr/")
            if lib.startswith("/") and os.path.exists(lib) and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lib, target)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The test image, built by podman.build (in podman's storage as `tag` for the session) and saved as an
    oci-archive (by build), a docker-archive and an OCI layout folder."""
    assert HAVE_PODMAN, "podman is not installed (tools/setup_env.sh installs it: apt-get install podman runc)"
    d = tmp_path_factory.mktemp("podman-image")
    _tiny_rootfs(d / "ctx" / "rootfs")
    session = uuid.uuid4().hex[:10]
    # a file of its own makes every build its own: no layer cache shared with another session that removes it
    (d / "ctx" / "rootfs" / "session").write_text(session)
    (d / "ctx" / "Dockerfile").write_text(DOCKERFILE)
    tag = f"localhost/gyre-test-images/fixture:{session}"
    oci_archive = podman.build(d / "ctx", tag, d)
    try:
        for fmt, out in (("docker-archive", d / "docker.tar"), ("oci-dir", d / "oci-dir")):
            subprocess.run(podman.podman_argv("save", "--quiet", "--format", fmt, "-o", str(out), tag),
                           env=podman.podman_env(), check=True, timeout=120, capture_output=True)
        yield {"tag": tag, "id": podman.image_id(tag), "oci-archive": oci_archive, "docker-archive": d / "docker.tar",
               "oci": d / "oci-dir", "ctx": d / "ctx"}
    finally:
        podman.remove_image(tag)


@pytest.fixture(scope="session")
def unpacked(built, tmp_path_factory):
    """The test image unpacked from its oci-archive (by unpack_image: no cache)."""
    dest = tmp_path_factory.mktemp("unpacked") / "rootfs"
    unpack_image(open_image(parse_ref(f"oci-archive:{built['oci-archive']}")), dest)
    return dest


# -- references -------------------------------------------------------------------------------------------------


def test_parse_ref_forms(tmp_path):
    for text, base, want in (
            ("oci-archive:img/a.tar", tmp_path, ("oci-archive", tmp_path / "img" / "a.tar", None)),
            ("oci-archive:/x/a.tar:localhost/a/b:1", None, ("oci-archive", Path("/x/a.tar"), "localhost/a/b:1")),
            ("docker-archive:../d.tar", tmp_path / "suite", ("docker-archive", tmp_path / "d.tar", None)),
            ("oci:/layouts/one", None, ("oci", Path("/layouts/one"), None)),
            ("rootfs:sandbox", tmp_path, ("rootfs", tmp_path / "sandbox", None)),
            ("dockerfile:env", tmp_path, ("dockerfile", tmp_path / "env", None)),
            ("docker://python:3.12-slim", None, ("registry", None, "python:3.12-slim")),
            ("python:3.12-slim", None, ("registry", None, "python:3.12-slim")),
            ("localhost/gyre-fixtures/swe-calc:1", None, ("registry", None, "localhost/gyre-fixtures/swe-calc:1")),
            ("registry.example.com:5000/a/b_c/d-e", None, ("registry", None, "registry.example.com:5000/a/b_c/d-e")),
            ("ubuntu@sha256:" + "a" * 64, None, ("registry", None, "ubuntu@sha256:" + "a" * 64)),
            ("x.tar", None, ("registry", None, "x.tar"))):  # no transport: a name (it fails at fetch), not a path
        r = parse_ref(text, base=base)
        assert (r.kind, r.path, r.name, r.text) == (*want, text)


@pytest.mark.parametrize("text", ["", " ", "Python:3", "python:3 ", "docker://", "a//b", "ubuntu@sha256:abc",
                                  "oci-archive:", "rootfs:/x:name", "dockerfile:/x:y", "oci-archive:/x.tar:", "http://x/y",
                                  "containers-storage:foo", "-x", "a\nb", "name:tag:more"])
def test_parse_ref_refusals(text):
    with pytest.raises(ConfigError) as e:
        parse_ref(text)
    assert repr(text) in one_line(e)


def test_ref_check(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    for text, msg in (("oci-archive:missing.tar", "does not exist"), ("oci:missing", "does not exist"),
                      ("rootfs:missing", "does not exist"), ("rootfs:f", "is not a folder"),
                      ("docker-archive:d", "is not a file"), ("oci:d", "not an OCI image layout"),
                      ("dockerfile:d", "holds no Dockerfile or Containerfile")):
        with pytest.raises(ConfigError, match=msg):
            parse_ref(text, base=tmp_path).check()
    parse_ref("rootfs:d", base=tmp_path).check()
    parse_ref("oci-archive:f", base=tmp_path).check()


# -- podman's archives ------------------------------------------------------------------------------------------


@needs_podman
def test_three_forms_one_image(built, unpacked, tmp_path):
    """oci-archive, docker-archive and an OCI layout of one image: one digest (podman's image ID), one config, one
    unpacked tree."""
    for kind in ("oci-archive", "docker-archive", "oci"):
        src = open_image(parse_ref(f"{kind}:{built[kind]}"))
        assert src.digest == built["id"] and len(src.layers) == 3, kind
        assert (src.config.env["FOO"], src.config.workdir, src.config.user) == ("bar", "/work", "1234:5678")
        if kind != "oci-archive":
            unpack_image(src, tmp_path / kind)
            assert tree(tmp_path / kind) == tree(unpacked), kind
    assert open_image(parse_ref(f"docker-archive:{built['docker-archive']}:{built['tag']}")).digest == built["id"]
    with pytest.raises(GyreError, match="no image tagged 'localhost/other:1'"):
        open_image(parse_ref(f"docker-archive:{built['docker-archive']}:localhost/other:1"))


@needs_podman
def test_podman_image_unpacked(unpacked):
    r, srv = unpacked, unpacked / "srv"
    assert not (r / "data" / "gone" / "b").exists() and (r / "data" / "gone").is_dir()  # a whiteout
    assert os.listdir(r / "opt" / "tree") == ["new"]  # an opaque folder: the old one's contents are gone
    assert os.readlink(r / "lib") == "usr/lib" and (r / "usr" / "lib").is_dir()  # merged /usr kept as symlinks
    modes = {n: os.stat(srv / n).st_mode & 0o7777 for n in ("suid", "sgid", "sticky")}
    assert modes == {"suid": 0o4755, "sgid": 0o2750, "sticky": 0o1777}
    assert os.stat(srv / "sticky").st_mtime_ns == 1000000002 * 10**9  # a folder's mtime, set after its contents
    assert os.stat(r / "data" / "keep" / "a").st_mtime_ns == 1000000000 * 10**9
    link = os.lstat(srv / "link")
    assert os.readlink(srv / "link") == "../data/keep/a" and link.st_mtime_ns == 1000000001 * 10**9
    assert os.stat(srv / "hard").st_ino == os.stat(srv / "suid").st_ino
    assert stat.S_ISFIFO(os.lstat(srv / "fifo").st_mode)
    if IS_ROOT:
        owners = {(os.lstat(p).st_uid, os.lstat(p).st_gid) for p in (srv / "owned", srv / "owned" / "f", srv / "link")}
        assert owners == {(1234, 5678)}  # lchown: the symlink itself too
        out = subprocess.run(["chroot", str(r), "/bin/sh", "-c", "cat /opt/tree/new"], capture_output=True,
                             text=True, timeout=30)
        assert out.stdout == "new\n", out.stderr  # it runs: a working root file system


# -- archives: formats, indexes, digests ------------------------------------------------------------------------


def test_layout_and_archive_written_here(tmp_path):
    layers = [tar(D("etc"), F("etc/os", b"one")), tar(F("etc/os", b"two"), F("etc/.wh.gone", b""))]
    layout = write_layout(tmp_path / "layout", layers)
    a = open_image(parse_ref(f"oci:{layout}"))
    b = open_image(parse_ref(f"oci-archive:{tar_folder(layout, tmp_path / 'image.tar')}"))
    assert a.digest == b.digest and a.config == b.config
    assert a.config.env == {"PATH": "/bin", "HOME": "/root"} and (a.config.workdir, a.config.user) == ("/w", "7:8")
    assert len(unpack_image(b, tmp_path / "r").layers) == 2 and (tmp_path / "r/etc/os").read_bytes() == b"two"
    # uncompressed layers, and an empty one (a tar of nothing but its end blocks); etc/'s mtime is the unpacking's
    plain = write_layout(tmp_path / "plain", [*layers, tar()], compress="none")
    assert unpack_image(open_image(parse_ref(f"oci:{plain}")), tmp_path / "r2").total.files == 2
    assert tree(tmp_path / "r2", mtimes=False) == tree(tmp_path / "r", mtimes=False)


def test_index_picks_this_machine_and_refname(tmp_path):
    layout = tmp_path / "layout"
    ours, other = (_image_blobs(layout, [tar(F("which", w))]) for w in (b"ours", b"other"))
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
    for name, want in (("multi", b"ours"), ("single", b"other")):  # multi: through the nested index, to our platform
        unpack_image(open_image(parse_ref(f"oci:{layout}:{name}")), tmp_path / name)
        assert (tmp_path / name / "which").read_bytes() == want
    with pytest.raises(GyreError, match=r"no image named 'nope' in it \(names: multi, single\)"):
        open_image(parse_ref(f"oci:{layout}:nope"))


def test_corrupt_blobs_refused(tmp_path):
    layout = write_layout(tmp_path / "layout", [tar(F("a", b"one" * 1000))], compress="none")
    blob = open_image(parse_ref(f"oci:{layout}")).layers[0].file
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
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    config = layout / "blobs/sha256" / manifest["config"]["digest"][7:]
    config.write_text(config.read_text().replace("/root", "/toor"))
    with pytest.raises(GyreError, match="image config .* does not match its digest") as e:
        open_image(parse_ref(f"oci:{layout}"))
    assert str(layout) in one_line(e)


@needs_podman
def test_docker_archive_layer_checked_against_diff_id(built, tmp_path):
    bad = shutil.copy(built["docker-archive"], tmp_path / "docker.tar")
    with tarfile.open(bad) as tf:
        big = max((m for m in tf.getmembers() if m.isreg()), key=lambda m: m.size)
    with open(bad, "r+b") as f:  # one byte in the middle of the largest layer (in a file's contents)
        f.seek(big.offset_data + big.size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(GyreError, match="does not match its diff_id"):
        unpack_image(open_image(parse_ref(f"docker-archive:{bad}")), tmp_path / "r")


def test_unreadable_archives_refused(tmp_path):
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all" * 100)
    (tmp_path / "gz.tar").write_bytes(gzip.compress(b"x" * 1000))
    oci_tar = tar_folder(write_layout(tmp_path / "layout", [tar(F("a"))]), tmp_path / "oci.tar")
    for text, msg in (("oci-archive:junk.tar", "not a tar archive"), ("oci-archive:gz.tar", "gzip-compressed"),
                      ("docker-archive:junk.tar", "not a tar archive"),
                      (f"docker-archive:{oci_tar}", "manifest.json is missing")):
        with pytest.raises(GyreError, match=msg) as e:
            open_image(parse_ref(text, base=tmp_path))
        assert str(tmp_path) in one_line(e)


def test_zstd_without_the_module_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as a machine without it: `import zstandard` fails
    layout = write_layout(tmp_path / "layout", [tar(F("a"))], compress="zstd")
    with pytest.raises(GyreError, match=r"zstd-compressed \(application/vnd.oci.image.layer.v1.tar\+zstd\)"):
        unpack_image(open_image(parse_ref(f"oci:{layout}")), tmp_path / "r")


# -- the cache --------------------------------------------------------------------------------------------------


def _archive(tmp_path: Path, n: int = 2) -> Path:
    layers = [tar(D("etc"), F("etc/a", b"a"), F("bin/tool", b"#!", mode=0o755)),
              *(tar(F(f"etc/layer{i}", str(i).encode())) for i in range(1, n))]
    return tar_folder(write_layout(tmp_path / "layout", layers, env=["FOO=1"]), tmp_path / "image.tar")


def test_cache_get_list_remove(tmp_path):
    ref, cache, said = parse_ref(f"oci-archive:{_archive(tmp_path)}"), ImageCache(tmp_path / "cache"), []
    img = cache.get(ref, echo=said.append)
    assert any("unpacking image" in s for s in said) and (img.rootfs / "etc" / "layer1").read_bytes() == b"1"
    assert img.rootfs == tmp_path / "cache" / f"sha256-{img.digest[7:]}" / "rootfs"
    assert (img.env, img.workdir, img.user, img.ref_text) == ({"FOO": "1", "PATH": DEFAULT_PATH}, "/w", "7:8", ref.text)
    meta = json.loads((img.rootfs.parent / "image.json").read_text())
    assert meta["config"]["config"]["Env"] == ["FOO=1"] and meta["size_bytes"] > 0 and meta["unpack_s"] >= 0
    assert [(e["digest"], e["ref"]) for e in cache.list()] == [(img.digest, ref.text)]
    before, said[:] = tree(img.rootfs), []
    assert cache.get(ref, echo=said.append) == img and said == []
    assert tree(img.rootfs) == before  # a second get writes nothing into the finished rootfs
    cache.remove(img.digest)
    assert cache.list() == [] and not img.rootfs.exists()
    with pytest.raises(GyreError, match="not in the image cache"):
        cache.remove(img.digest)
    assert cache.get(ref, echo=quiet).rootfs.is_dir()  # unpacked again


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
    assert (img.rootfs, img.digest, img.env, img.workdir, img.user) == (
        tmp_path / "sandbox", None, {"PATH": DEFAULT_PATH}, None, None)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # no copy
    with pytest.raises(ConfigError, match="does not exist"):
        ImageCache(tmp_path / "cache").get(parse_ref("rootfs:nowhere", base=tmp_path))


CHILD = """\
import sys, time
from pathlib import Path
from gyre_slurm.images import ImageCache, parse_ref

def echo(msg):
    print(msg, flush=True)
    if len(sys.argv) > 3 and msg.startswith("  layer 1/"):
        Path(sys.argv[3]).write_text("mid-unpack")
        time.sleep(120)  # stopped half way through: the test kills us here

print("ROOTFS", ImageCache(Path(sys.argv[1])).get(parse_ref(sys.argv[2]), echo=echo).rootfs, flush=True)
"""


def _child(tmp_path: Path, *args: str) -> subprocess.Popen:
    (tmp_path / "child.py").write_text(CHILD)
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_concurrent_processes_unpack_once(tmp_path):
    ref = parse_ref(f"oci-archive:{_archive(tmp_path)}")
    root = tmp_path / "cache"
    (root / ".locks").mkdir(parents=True)
    fd = os.open(root / ".locks" / f"sha256-{open_image(ref).digest[7:]}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held here until both children wait on it
    procs = [_child(tmp_path, str(root), ref.text) for _ in range(2)]
    try:
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            assert line.startswith("waiting for another process to unpack"), line
    finally:
        os.close(fd)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(o.count("unpacking image") for o in outs) == 1, outs
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1  # the same ROOTFS line


def test_concurrent_threads_unpack_once(tmp_path):
    ref, cache, said, results = parse_ref(f"oci-archive:{_archive(tmp_path, n=6)}"), ImageCache(tmp_path / "c"), [], []
    threads = [threading.Thread(target=lambda: results.append(cache.get(ref, echo=said.append))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and len(set(results)) == 1
    assert sum("unpacking image" in s for s in said) == 1


def test_kill_mid_unpack_leaves_no_entry(tmp_path):
    ref = parse_ref(f"oci-archive:{_archive(tmp_path, n=3)}")
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
    assert (cache.get(ref, echo=quiet).rootfs / "etc" / "layer2").read_bytes() == b"2"
    assert not list(root.glob(".unpack-*"))  # the leftover is gone


# -- podman and skopeo ------------------------------------------------------------------------------------------


@needs_podman
def test_registry_ref_through_podman_storage(built, tmp_path):
    cache, said = ImageCache(tmp_path / "cache"), []
    img = cache.get(parse_ref(built["tag"]), echo=said.append)
    assert (img.digest, img.env["FOO"], img.workdir) == (built["id"], "bar", "/work")
    assert any(s.startswith("fetching image") for s in said)
    assert (img.rootfs / "opt" / "tree" / "new").read_text() == "new\n"
    assert not any((tmp_path / "cache" / ".fetch").iterdir())  # the fetched archive is gone once unpacked
    said.clear()
    ImageCache._memo.clear()  # as a fresh process: only podman's image ID can find the entry
    again = cache.get(parse_ref(f"docker://{built['tag']}"), echo=said.append)
    assert (again.digest, again.rootfs, said) == (img.digest, img.rootfs, [])  # found, not saved again


@needs_podman
def test_dockerfile_context_built_with_podman(built, tmp_path):
    ref, cache, said = parse_ref(f"dockerfile:{built['ctx']}"), ImageCache(tmp_path / "cache"), []
    try:
        img = cache.get(ref, echo=said.append)
        assert img.digest == built["id"]  # podman's layer cache: the same context builds the same image
        assert any(s.startswith("building image") for s in said) and (img.rootfs / "opt/tree/new").is_file()
        said.clear()
        assert cache.get(ref, echo=said.append) == img and said == []  # built once by this process
    finally:
        podman.remove_image(podman.build_tag(built["ctx"]))


def test_pulling_needs_podman_or_skopeo(tmp_path, monkeypatch):
    skopeo = shutil.which("skopeo")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    want = ("image 'localhost/gyre/x:1': pulling needs podman or skopeo on this node, neither is installed; give an "
            "OCI archive (oci-archive:PATH) or a root file system (rootfs:PATH) instead")
    with pytest.raises(GyreError) as e:
        podman.fetch("localhost/gyre/x:1", tmp_path / "fetch")
    assert str(e.value) == want
    with pytest.raises(GyreError) as e:
        ImageCache(tmp_path / "cache").get(parse_ref("localhost/gyre/x:1"), echo=quiet)
    assert str(e.value) == want
    assert skopeo, "skopeo is not installed (tools/setup_env.sh installs it: apt-get install skopeo)"
    if skopeo:  # skopeo alone: fetch copies with it (no registry answers on localhost:1: its error, in one line)
        os.symlink(skopeo, tmp_path / "bin" / "skopeo")
        with pytest.raises(GyreError) as e:
            podman.fetch("localhost:1/gyre/none:1", tmp_path / "fetch")
        assert one_line(e).startswith("skopeo copy docker://localhost:1/gyre/none:1 failed")


@needs_podman
def test_failing_podman_is_one_line(tmp_path):
    with pytest.raises(GyreError) as e:
        podman.fetch("localhost:1/gyre/none:1", tmp_path / "fetch")
    assert one_line(e).startswith("podman pull localhost:1/gyre/none:1 failed") and "localhost:1" in str(e.value)[40:]
    assert not any((tmp_path / "fetch").iterdir())
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text("FROM localhost:1/gyre/none:1 AS base\nFROM base\nRUN true\n")
    with pytest.raises(GyreError) as e:
        podman.build(tmp_path / "ctx", f"localhost/gyre-test-images/bad:{uuid.uuid4().hex[:8]}", tmp_path)
    assert one_line(e).startswith(f"{tmp_path / 'ctx'}: FROM localhost:1/gyre/none:1 does not resolve")
    assert podman.from_refs("FROM --platform=linux/amd64 a:1 AS x\nFROM x\nFROM scratch\nFROM $B\nFROM \\\n c") == \
        ["a:1", "c"]
    argv = podman.podman_argv("save", "x")
    assert argv[0] == "podman" and argv[-2:] == ["save", "x"] and ("--runtime" in argv) == bool(shutil.which("runc"))
    if not os.environ.get("CONTAINERS_CONF"):
        conf = Path(podman.podman_env(tmp_path / "conf")["CONTAINERS_CONF"])
        assert conf.read_text() == "[containers]\ndefault_ulimits = []\n"
