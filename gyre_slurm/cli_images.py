"""`gyre images`: the node's image cache (gyre_slurm/images): what is unpacked, fetching an image before a run needs
it (e.g. once per node with `srun`), and removing one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gyre_slurm.cli_common import console

images_app = typer.Typer(no_args_is_help=True,
                         help="The node's cache of unpacked task images (harness.images.cache_dir): list, fetch, rm.")
CacheDir = Annotated[Path | None, typer.Option("--cache-dir", help="The cache folder (default: "
                                                                   "harness.images.cache_dir of --config, else "
                                                                   "state/images).")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="A run config: its harness.images.cache_dir.")]


def _cache(cache_dir: Path | None, config: Path | None):
    from gyre_slurm.images.cache import ImageCache

    if cache_dir is None and config is not None:
        from gyre_slurm.config import load_config

        cfg = load_config(config)
        cache_dir = cfg.harness.images.cache_dir or cfg.run.state_dir / "images"
    return ImageCache(cache_dir or Path("state") / "images")


@images_app.command("list")
def images_list(cache_dir: CacheDir = None, config: ConfigOpt = None) -> None:
    """The images unpacked here: digest, size, how long the unpack took, and the reference it came from."""
    from rich.table import Table

    rows = _cache(cache_dir, config).list()
    if not rows:
        console.print("no image unpacked here yet")
        return
    table = Table("digest", "size", "unpacked in", "from")
    for r in rows:
        table.add_row(str(r["digest"]).removeprefix("sha256:")[:12], f"{int(r['size_bytes']) / 2**20:.0f} MB",
                      f"{float(r['unpack_s']):.1f} s", str(r["ref"]))
    console.print(table)


@images_app.command("fetch")
def images_fetch(ref: Annotated[str, typer.Argument(help="oci-archive:PATH, docker-archive:PATH, oci:PATH, "
                                                         "rootfs:PATH, dockerfile:DIR or an image name (pulled with "
                                                         "podman or skopeo).")],
                 cache_dir: CacheDir = None, config: ConfigOpt = None) -> None:
    """Unpack an image into this node's cache now (nothing to do when it is there): the first run that needs it
    then starts at once."""
    from gyre_slurm.images.reference import parse_ref

    image = _cache(cache_dir, config).get(parse_ref(ref), echo=lambda m: console.print(m, highlight=False))
    console.print(f"{ref}: {image.digest or 'used in place'} at {image.rootfs} (working folder "
                  f"{image.workdir or 'none: tasks give theirs'})", highlight=False)


@images_app.command("rm")
def images_rm(digest: Annotated[str, typer.Argument(help="The digest (sha256:… or its first characters, as "
                                                         "`gyre images list` shows).")],
              cache_dir: CacheDir = None, config: ConfigOpt = None) -> None:
    """Remove an unpacked image from this node's cache (a run that needs it again unpacks it again)."""
    from gyre_slurm.errors import GyreError

    cache = _cache(cache_dir, config)
    found = [str(r["digest"]) for r in cache.list()
             if str(r["digest"]).removeprefix("sha256:").startswith(digest.removeprefix("sha256:"))]
    if len(found) != 1:
        raise GyreError(f"{digest}: {'no' if not found else len(found)} cached images match (gyre images list)")
    cache.remove(found[0])
    console.print(f"removed {found[0]}")
