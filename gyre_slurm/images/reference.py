"""What a task's `image` field may say, parsed into an ImageRef (no file system or network access at parse time).

Forms (the transport names are skopeo's):
  oci-archive:PATH[:REFNAME]    a tar as `podman save --format oci-archive` or `skopeo copy ... oci-archive:PATH`
                                writes; REFNAME picks one image of several by its org.opencontainers.image.ref.name
  docker-archive:PATH[:NAME]    a tar as `podman save` (default format) or `docker save` writes (manifest.json);
                                NAME picks one image of several by its RepoTags entry
  oci:PATH[:REFNAME]            an OCI image layout folder (oci-layout, index.json, blobs/)
  rootfs:PATH                   a root file system folder, used in place (e.g. `apptainer build --sandbox`'s folder)
  dockerfile:PATH               a build context folder holding a Dockerfile (or Containerfile): built with podman
  docker://NAME or NAME         an image by name (`localhost/gyre-fixtures/swe-calc:1`, `python:3.12-slim`,
                                `NAME@sha256:...`), fetched through podman or skopeo (see podman.py)
As in skopeo, PATH ends at the first ':' after the transport, so a PATH that holds ':' cannot be named. A relative
PATH is resolved against `base` (the folder of the suite file that named the image), else the current folder.
Whether PATH exists is not checked here (a suite may be parsed on a node that does not see it): ImageRef.check does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import ConfigError

ARCHIVE_KINDS = ("oci-archive", "docker-archive", "oci")  # read by archive.py
PATH_KINDS = (*ARCHIVE_KINDS, "rootfs", "dockerfile")
FOLDER_KINDS = ("oci", "rootfs", "dockerfile")
BUILD_FILES = ("Containerfile", "Dockerfile")  # podman build's order
KINDS = (*PATH_KINDS, "registry")

# Docker's reference grammar, narrowed: a lowercase registry host (optional port), lowercase path components,
# an optional tag, an optional sha256 digest. Anything else is refused rather than guessed at.
_DOMAIN = r"(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]{1,5})?/)"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME_RE = re.compile(
    rf"(?P<repo>{_DOMAIN}?{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?"
)
# Other skopeo transports: a bare `containers-storage:x` would otherwise read as the image "containers-storage".
_OTHER_TRANSPORTS = ("containers-storage", "docker-daemon", "dir", "oci-dir", "docker-dir", "sif", "ostree", "tarball")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference. `path` is absolute for the path kinds and None for "registry"; `name` is the
    registry name (without docker://) or the REFNAME/NAME that picks an image inside an archive (else None)."""

    kind: str
    path: Path | None
    name: str | None
    text: str

    def check(self) -> None:
        """Raises ConfigError (one line naming the text) when PATH is missing or of the wrong type. A registry
        reference has nothing to check here."""
        if self.path is None:
            return
        want_dir = self.kind in FOLDER_KINDS
        if not self.path.exists():
            raise ConfigError(f"image {self.text!r}: {self.path} does not exist")
        if want_dir and not self.path.is_dir():
            raise ConfigError(f"image {self.text!r}: {self.path} is not a folder ({self.kind}: names a folder)")
        if not want_dir and not self.path.is_file():
            raise ConfigError(f"image {self.text!r}: {self.path} is not a file ({self.kind}: names a tar archive)")
        if self.kind == "oci" and not (self.path / "index.json").is_file():
            raise ConfigError(f"image {self.text!r}: {self.path} is not an OCI image layout (no index.json in it)")
        if self.kind == "dockerfile" and not any((self.path / n).is_file() for n in BUILD_FILES):
            raise ConfigError(f"image {self.text!r}: {self.path} holds no Dockerfile or Containerfile to build")


def parse_ref(text: str, base: Path | None = None) -> ImageRef:
    """Parses an image reference; raises ConfigError in one line naming the text when it is not one."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"image {text!r}: an image reference must be a non-empty string")
    if text != text.strip() or any(c.isspace() or not c.isprintable() for c in text):
        raise ConfigError(f"image {text!r}: white space or control characters in an image reference")
    transport, sep, rest = text.partition(":")
    if sep and transport in PATH_KINDS:
        return _path_ref(transport, rest, text, base)
    if sep and transport in _OTHER_TRANSPORTS:
        raise ConfigError(f"image {text!r}: the {transport}: transport is not supported (use oci-archive:PATH, "
                          "docker-archive:PATH, oci:PATH, rootfs:PATH, or an image name)")
    name = text.removeprefix("docker://")
    if len(name) > 512 or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"image {text!r}: not an image reference (expected oci-archive:PATH, docker-archive:PATH, "
                          "oci:PATH, rootfs:PATH, or a lowercase image name NAME[:TAG][@sha256:DIGEST])")
    return ImageRef("registry", None, name, text)


def _path_ref(kind: str, rest: str, text: str, base: Path | None) -> ImageRef:
    path_text, sep, name = rest.partition(":")
    if not path_text:
        raise ConfigError(f"image {text!r}: {kind}: needs a path after it")
    if sep and (kind in ("rootfs", "dockerfile") or not name):
        what = "has an empty image name after its path" if kind in ARCHIVE_KINDS else \
            "takes no image name after its path"
        raise ConfigError(f"image {text!r}: {kind}: {what}")
    path = Path(path_text).expanduser()
    if not path.is_absolute():
        path = (base if base is not None else Path.cwd()) / path
    # abspath normalises `..` lexically; the file itself is not touched here
    return ImageRef(kind, Path(os.path.abspath(path)), name or None, text)
