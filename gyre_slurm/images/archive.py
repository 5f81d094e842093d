"""Reads an image from an archive or an OCI layout without unpacking it: its digest, its config, its layers.

`open_image(ref)` takes an ImageRef of kind oci-archive, docker-archive or oci and returns an ImageSource:
  - digest: the image ID, "sha256:<hex>" of the config blob's bytes (what `podman images` shows; the same for an
    image saved in any of the three forms), the content address of its unpacked root file system;
  - config: the parts of the image config a run needs (Env, WorkingDir, User, Entrypoint, Cmd) and the rest raw;
  - layers: in order; Layer.open() gives a readable binary stream of the layer as an uncompressed tar (gzip through
    the gzip module, zstd through the `zstandard` module when it is installed, else refused naming the media type).
The members of an outer tar are read in place (found once by tarfile, then read by offset), never extracted first.
An OCI index is followed down (nested indexes too) to the manifest for linux/<this machine's architecture>, or to
the one whose org.opencontainers.image.ref.name annotation is the ref's REFNAME.
Checked: the config's bytes against its descriptor's digest; each layer while it streams, its bytes against the
manifest's digest (when the form has one) and its uncompressed bytes against the config's rootfs.diff_ids (which
binds the unpacked content to the image ID) — LayerStream.verify() after the tar has been read. A corrupt or
unexpected archive raises GyreError in one line saying what is wrong and naming the file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import platform
import posixpath
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gyre_slurm.errors import GyreError
from gyre_slurm.images.reference import ImageRef

MAX_JSON_BYTES = 16 << 20  # a manifest, an index or a config larger than this is not one
MAX_INDEX_DEPTH = 4
READ_CHUNK = 1 << 20
REF_NAME = "org.opencontainers.image.ref.name"
_DIGEST_RE = re.compile(r"(sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})")
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
_MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                   "application/vnd.docker.distribution.manifest.v2+json")
_GZIP_MAGIC, _ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv7l": "arm",
         "ppc64le": "ppc64le", "s390x": "s390x", "riscv64": "riscv64", "i686": "386", "i386": "386"}


def machine_arch() -> str:
    """This machine's architecture as OCI platforms name it (amd64, arm64, ...)."""
    m = platform.machine().lower()
    return _ARCH.get(m, m)


@dataclass(frozen=True)
class ImageConfig:
    """What a run takes from the image config (config.Env, WorkingDir, User, Entrypoint, Cmd); `raw` is all of it."""

    env: dict[str, str]
    workdir: str | None
    user: str | None
    entrypoint: list[str] | None
    cmd: list[str] | None
    architecture: str | None
    os: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ImageConfig:
        c = raw.get("config") or {}
        env: dict[str, str] = {}
        for item in c.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and key:  # a bare KEY (no '=') passes the caller's value through in Docker: nothing to set here
                env[key] = value
        return cls(env=env, workdir=c.get("WorkingDir") or None, user=c.get("User") or None,
                   entrypoint=_str_list(c.get("Entrypoint")), cmd=_str_list(c.get("Cmd")),
                   architecture=raw.get("architecture"), os=raw.get("os"), raw=raw)


def _str_list(v: Any) -> list[str] | None:
    return [str(x) for x in v] if isinstance(v, list) else None


@dataclass(frozen=True)
class Layer:
    """One layer: `size` bytes at `offset` in `file` (the outer archive, or the blob's own file in a layout)."""

    file: Path
    offset: int
    size: int
    where: str  # how errors name it: "ARCHIVE: blobs/sha256/..."
    media_type: str
    digest: str | None  # of the bytes as stored (compressed); docker-archive has none
    diff_id: str | None  # of the uncompressed tar, from the config

    def open(self) -> LayerStream:
        return LayerStream(self)


class _HashingReader(io.RawIOBase):
    """Reads at most `limit` bytes of `raw` (all when None), hashing them as they pass."""

    def __init__(self, raw: BinaryIO, limit: int | None, algorithm: str | None) -> None:
        self._raw, self._left = raw, limit
        self.hash = hashlib.new(algorithm) if algorithm else None
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        n = len(b) if self._left is None else min(len(b), self._left)
        if n <= 0:
            return 0
        data = self._raw.read(n)
        b[: len(data)] = data
        if self._left is not None:
            self._left -= len(data)
        if self.hash is not None:
            self.hash.update(data)
        self.count += len(data)
        return len(data)

    def drain(self) -> None:
        while self.read(READ_CHUNK):
            pass


class LayerStream(io.RawIOBase):
    """A layer as an uncompressed tar, read front to back (it does not seek). Use it as a context manager; call
    verify() once the tar has been read: it reads what is left and checks both digests."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self._file = open(layer.file, "rb")  # noqa: SIM115 - closed by close()
        try:
            self._file.seek(layer.offset)
            self._raw = _HashingReader(self._file, layer.size, _algorithm(layer.digest))
            buffered = io.BufferedReader(self._raw, READ_CHUNK)
            self._plain = _HashingReader(_decompressed(buffered, layer), None, _algorithm(layer.diff_id))
        except BaseException:
            self._file.close()
            raise

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        try:
            return self._plain.readinto(b)
        except _decompress_errors() as e:
            raise GyreError(f"{self.layer.where}: the layer cannot be read or decompressed: {e}") from None

    def verify(self) -> None:
        """Reads the rest of the layer (a tar's end padding, a compressor's trailer) and checks its digests."""
        while self.readinto(bytearray(READ_CHUNK)):
            pass
        self._raw.drain()
        layer = self.layer
        if self._raw.count != layer.size:
            raise GyreError(f"{layer.where}: the layer is truncated ({self._raw.count} of {layer.size} bytes)")
        for name, want, h in (("digest", layer.digest, self._raw.hash), ("diff_id", layer.diff_id, self._plain.hash)):
            if want and h is not None and f"{h.name}:{h.hexdigest()}" != want:
                raise GyreError(f"{layer.where}: the layer does not match its {name} {want} (got "
                                f"{h.name}:{h.hexdigest()}): the archive is corrupt")

    def close(self) -> None:
        self._file.close()
        super().close()

    def __enter__(self) -> LayerStream:
        return self


def _decompress_errors() -> tuple[type[BaseException], ...]:
    # gzip.BadGzipFile is an OSError, zlib.error is not; zstandard's errors are its own
    import zlib
    try:
        import zstandard
    except ModuleNotFoundError:
        return (OSError, EOFError, zlib.error)
    return (OSError, EOFError, zlib.error, zstandard.ZstdError)


def _algorithm(digest: str | None) -> str | None:
    return digest.split(":", 1)[0] if digest else None


def _decompressed(buffered: io.BufferedReader, layer: Layer) -> BinaryIO:
    magic = buffered.peek(4)[:4]
    if magic.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=buffered, mode="rb")  # type: ignore[return-value]
    if magic == _ZSTD_MAGIC:
        try:
            import zstandard
        except ModuleNotFoundError:
            raise GyreError(f"{layer.where}: the layer is zstd-compressed ({layer.media_type or 'no media type'}) and "
                            "the zstandard module is not installed (pip install zstandard)") from None
        return zstandard.ZstdDecompressor().stream_reader(buffered, read_across_frames=True)
    return buffered  # an uncompressed tar (tarfile says so if it is not one)


@dataclass(frozen=True)
class ImageSource:
    """An image read from `ref` without unpacking it."""

    ref: ImageRef
    digest: str
    config: ImageConfig
    layers: tuple[Layer, ...]

    @property
    def size(self) -> int:
        """The layers' stored (compressed) size in bytes."""
        return sum(layer.size for layer in self.layers)


def open_image(ref: ImageRef) -> ImageSource:
    """Reads an image's config and layer list from an oci-archive, a docker-archive or an OCI layout folder."""
    if ref.kind not in ("oci-archive", "docker-archive", "oci") or ref.path is None:
        raise GyreError(f"image {ref.text!r}: {ref.kind} is not an archive or an OCI layout")
    ref.check()
    if ref.kind == "oci":
        store: _Store = _LayoutStore(ref.path)
        return _open_oci(ref, store)
    store = _TarStore(ref.path)
    return _open_oci(ref, store) if ref.kind == "oci-archive" else _open_docker(ref, store)


class _Store:
    """Named files of an archive or a folder: where they lie and their bytes."""

    label: Path

    def locate(self, name: str) -> tuple[Path, int, int] | None:
        raise NotImplementedError

    def where(self, name: str) -> str:
        return f"{self.label}: {name}"

    def read(self, name: str, what: str) -> bytes:
        loc = self.locate(name)
        if loc is None:
            raise GyreError(f"{self.label}: {what} {name} is missing")
        file, offset, size = loc
        if size > MAX_JSON_BYTES:
            raise GyreError(f"{self.label}: {what} {name} is {size} bytes: too large to be one")
        with open(file, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise GyreError(f"{self.label}: {what} {name} is truncated")
        return data

    def json(self, name: str, what: str, digest: str | None = None) -> tuple[dict[str, Any], bytes]:
        data = self.read(name, what)
        if digest is not None:
            alg, want = digest.split(":", 1)
            got = hashlib.new(alg, data).hexdigest()
            if got != want:
                raise GyreError(f"{self.label}: {what} {name} does not match its digest (got {alg}:{got}): "
                                "the archive is corrupt")
        try:
            value = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GyreError(f"{self.label}: {what} {name} is not valid JSON: {e}") from None
        if not isinstance(value, (dict, list)):
            raise GyreError(f"{self.label}: {what} {name} is not a JSON object")
        return value, data  # type: ignore[return-value]


class _TarStore(_Store):
    """An uncompressed tar: its members are listed once (tarfile seeks over their data) and read by offset."""

    def __init__(self, path: Path) -> None:
        self.label = path
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic.startswith(_GZIP_MAGIC) or magic == _ZSTD_MAGIC:
            kind = "gzip" if magic.startswith(_GZIP_MAGIC) else "zstd"
            raise GyreError(f"{path}: the archive is {kind}-compressed; image archives are plain tars "
                            "(decompress it first)")
        try:
            with tarfile.open(path, "r:") as tf:
                self._members = {_norm(m.name): m for m in tf.getmembers()}
        except (tarfile.TarError, EOFError, OSError) as e:
            raise GyreError(f"{path}: not a tar archive ({e})") from None

    def locate(self, name: str) -> tuple[Path, int, int] | None:
        name = _norm(name)
        for _ in range(8):  # docker save's legacy <id>/layer.tar entries are links to the real member
            m = self._members.get(name)
            if m is not None and m.isreg():
                return self.label, m.offset_data, m.size
            if m is None or not (m.issym() or m.islnk()):
                return None
            relative = m.issym() and not m.linkname.startswith("/")
            name = _lexical(posixpath.join(posixpath.dirname(name), m.linkname) if relative else m.linkname)
        return None


class _LayoutStore(_Store):
    def __init__(self, path: Path) -> None:
        self.label = path

    def locate(self, name: str) -> tuple[Path, int, int] | None:
        p = self.label / name
        try:
            st = p.stat()
        except OSError:
            return None
        return (p, 0, st.st_size) if p.is_file() else None


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


def _lexical(name: str) -> str:
    out: list[str] = []
    for part in name.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part not in ("", "."):
            out.append(part)
    return "/".join(out)


def _blob_name(digest: Any, label: Path) -> str:
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise GyreError(f"{label}: {digest!r} is not a sha256 or sha512 digest")
    return "blobs/" + digest.replace(":", "/", 1)


def _open_oci(ref: ImageRef, store: _Store) -> ImageSource:
    layout, _ = store.json("oci-layout", "the OCI layout marker")
    if not isinstance(layout, dict) or layout.get("imageLayoutVersion") != "1.0.0":
        raise GyreError(f"{store.label}: oci-layout: not an OCI image layout 1.0.0")
    index, _ = store.json("index.json", "the image index")
    desc = _pick_manifest(store, index, ref.name, "index.json", 0)
    manifest, _ = store.json(_blob_name(desc.get("digest"), store.label), "the image manifest", desc["digest"])
    config_desc = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(config_desc, dict) or not isinstance(layers, list):
        raise GyreError(f"{store.label}: the image manifest {desc['digest']} has no config or no layers")
    config_name = _blob_name(config_desc.get("digest"), store.label)
    raw, data = store.json(config_name, "the image config", config_desc["digest"])
    diff_ids = _diff_ids(raw, len(layers), store.label)
    out = []
    for i, ld in enumerate(layers):
        if not isinstance(ld, dict):
            raise GyreError(f"{store.label}: the image manifest {desc['digest']}: layer {i} is not a descriptor")
        name = _blob_name(ld.get("digest"), store.label)
        loc = store.locate(name)
        if loc is None:
            raise GyreError(f"{store.label}: layer {name} is missing")
        if isinstance(ld.get("size"), int) and ld["size"] != loc[2]:
            raise GyreError(f"{store.label}: layer {name} is {loc[2]} bytes, its manifest says {ld['size']}")
        out.append(Layer(*loc, where=store.where(name), media_type=str(ld.get("mediaType", "")),
                         digest=ld["digest"], diff_id=diff_ids[i]))
    return ImageSource(ref, "sha256:" + hashlib.sha256(data).hexdigest(), ImageConfig.from_json(raw), tuple(out))


def _pick_manifest(store: _Store, index: Any, refname: str | None, where: str, depth: int) -> dict[str, Any]:
    """The descriptor of the one image manifest the index names for this machine (or for REFNAME)."""
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
        raise GyreError(f"{store.label}: {where} is not an image index (no manifests list)")
    if refname is not None:
        named = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) == refname]
        if not named:
            there = sorted({str((m.get("annotations") or {}).get(REF_NAME)) for m in manifests})
            raise GyreError(f"{store.label}: no image named {refname!r} in it (names: {', '.join(there) or 'none'})")
        manifests = named
    if not manifests:
        raise GyreError(f"{store.label}: {where} lists no images")
    arch = machine_arch()
    if len(manifests) > 1:  # a multi-platform index: the one for this machine
        ours = [m for m in manifests if _platform(m) == f"linux/{arch}"]
        if len(ours) != 1:
            there = ", ".join(sorted({_platform(m) for m in manifests}))
            names = ", ".join(sorted({str((m.get("annotations") or {}).get(REF_NAME)) for m in manifests}))
            raise GyreError(f"{store.label}: {where} lists {len(manifests)} images, {len(ours)} of them for "
                            f"linux/{arch} (platforms: {there}; names: {names}): name one with :REFNAME")
        manifests = ours
    desc = manifests[0]
    media = desc.get("mediaType")
    if media in _INDEX_TYPES:
        if depth >= MAX_INDEX_DEPTH:
            raise GyreError(f"{store.label}: image indexes nested more than {MAX_INDEX_DEPTH} deep")
        name = _blob_name(desc.get("digest"), store.label)
        nested, _ = store.json(name, "the nested image index", desc["digest"])
        return _pick_manifest(store, nested, None, name, depth + 1)
    if media is not None and media not in _MANIFEST_TYPES:
        raise GyreError(f"{store.label}: {where} names an unsupported manifest type {media}")
    _blob_name(desc.get("digest"), store.label)  # validates it
    return desc


def _platform(desc: dict[str, Any]) -> str:
    p = desc.get("platform") or {}
    return f"{p.get('os', '?')}/{p.get('architecture', '?')}"


def _diff_ids(raw: Any, n: int, label: Path) -> list[str]:
    ids = (raw.get("rootfs") or {}).get("diff_ids") if isinstance(raw, dict) else None
    if not isinstance(ids, list) or len(ids) != n or not all(isinstance(d, str) and _DIGEST_RE.fullmatch(d)
                                                             for d in ids):
        raise GyreError(f"{label}: the image config's rootfs.diff_ids do not match its {n} layers")
    return ids


def _open_docker(ref: ImageRef, store: _Store) -> ImageSource:
    entries, _ = store.json("manifest.json", "the docker-archive manifest")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise GyreError(f"{store.label}: manifest.json is not a list of images (not a docker-archive?)")
    if ref.name is not None:
        named = [e for e in entries if ref.name in (e.get("RepoTags") or [])]
        if not named:
            tags = sorted({t for e in entries for t in (e.get("RepoTags") or [])})
            raise GyreError(f"{store.label}: no image tagged {ref.name!r} in it (tags: {', '.join(tags) or 'none'})")
        entries = named
    if len(entries) > 1:
        raise GyreError(f"{store.label}: holds {len(entries)} images: name one with docker-archive:PATH:TAG")
    entry = entries[0]
    config_name, layer_names = entry.get("Config"), entry.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layer_names, list):
        raise GyreError(f"{store.label}: manifest.json has no Config or no Layers")
    # the config's file is named after its digest (<hex>.json, or blobs/sha256/<hex> since Docker 25)
    stem = Path(config_name).name.removesuffix(".json")
    want = f"sha256:{stem}" if re.fullmatch(r"[a-f0-9]{64}", stem) else None
    raw, data = store.json(config_name, "the image config", want)
    diff_ids = _diff_ids(raw, len(layer_names), store.label)
    out = []
    for name, diff_id in zip(layer_names, diff_ids, strict=True):
        loc = store.locate(str(name))
        if loc is None:
            raise GyreError(f"{store.label}: layer {name} is missing")
        out.append(Layer(*loc, where=store.where(str(name)), media_type="", digest=None, diff_id=diff_id))
    return ImageSource(ref, "sha256:" + hashlib.sha256(data).hexdigest(), ImageConfig.from_json(raw), tuple(out))
