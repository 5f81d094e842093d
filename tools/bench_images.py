"""Benchmark image runs: unpacking an image, the start-up a run adds over today's sandbox, and the disk a run costs.

    .venv/bin/python tools/bench_images.py [--repeats 15] [--image localhost/gyre-fixtures/swe-calc:1]

Uses the fixture images (tools/fixture_images.py builds them from Debian's packages the first time). Three figures,
each for both runtimes where it applies (image: bubblewrap over the image; podman):

  1. unpack: a fresh cache's first `ImageCache.get` of the image (saved from podman's storage as an OCI archive,
     layers unpacked in order), and a second `get` (the content-addressed entry found again);
  2. start-up: the wall time of a run that does nothing (`true`) from the worker's call to its end, through the
     worker's own code — today's sandbox (harness.sandbox bwrap: the host's root read-only, its own network with the
     relay) against an image run (harness/jail.py: namespaces, overlays, relay, control group, then bubblewrap or
     podman) — interleaved, --repeats of each, medians; the added time is image minus host (baseline: host);
  3. disk: the run's writable layer (its `changes/`) after a run that writes 0, 1 and 10 MB, against the image's
     size: the layer grows with what the run changes, not with the image.

The last line is the main figure: the start-up the bubblewrap image runtime adds over today's sandbox (median;
target <= 0.3 s); the script exits 1 when the target is missed. Podman's is printed beside it, not held to the
target (a podman run starts conmon and runc: its price is its own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import fixture_images  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

from gyre_slurm.harness.cgroups import RunLimits  # noqa: E402
from gyre_slurm.harness.image_runtime import CHANGES, harness_env, make_image_runtime  # noqa: E402
from gyre_slurm.harness.netrelay import ProxyBridge  # noqa: E402
from gyre_slurm.harness.runner import run_harness  # noqa: E402
from gyre_slurm.harness.sandbox import make_sandbox  # noqa: E402
from gyre_slurm.images.cache import ImageCache  # noqa: E402
from gyre_slurm.images.reference import parse_ref  # noqa: E402

TARGET_S = 0.3
LIMITS = RunLimits(cpus=1.0, memory_mb=1024, processes=512, disk_mb=1024)


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def bench_unpack(ref: str, tmp: Path, echo) -> tuple[float, float, int]:
    cache = ImageCache(tmp / "fresh-cache")
    t0 = time.monotonic()
    image = cache.get(parse_ref(ref), echo=lambda _m: None)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    cache.get(parse_ref(ref), echo=lambda _m: None)
    again = time.monotonic() - t0
    size = _du(image.rootfs)
    shutil.rmtree(tmp / "fresh-cache", ignore_errors=True)
    return first, again, size


def _host_run(tmp: Path, n: int, sandbox, bridge) -> float:
    ws = tmp / f"host-{n}"
    ws.mkdir()
    argv = sandbox.wrap(["true"], ws, tmp / "state", ["true"], bridge.path)
    t0 = time.monotonic()
    h = run_harness(argv, ws, {}, 60, ws / ".gyre" / "harness.log")
    took = time.monotonic() - t0
    assert h.exit_code == 0, (ws / ".gyre" / "harness.log").read_text()
    return took


def _image_run(tmp: Path, n: int, rt, image, bridge, argv=("true",)) -> tuple[float, Path]:
    ws = tmp / f"{rt.kind}-{n}"
    (ws / CHANGES).mkdir(parents=True)
    t0 = time.monotonic()
    jail = rt.harness(ws=ws, image=image, workdir=image.workdir or "/workspace", argv=list(argv),
                      env=harness_env(image, {}, None), state_dir=tmp / "state", proxy_socket=bridge.path,
                      python=False, timeout_s=60)
    h = run_harness(jail.argv, ws, {}, 60, ws / ".gyre" / "harness.log")
    took = time.monotonic() - t0
    jail.close()
    assert h.exit_code == 0, (ws / ".gyre" / "harness.log").read_text()
    return took, ws


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--image", default=fixture_images.fixture_name("swe-calc"))
    a = ap.parse_args(argv)
    console = Console()
    fixture_images.ensure(echo=lambda m: console.print(m, highlight=False))
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-images-"))
    (tmp / "state").mkdir()
    try:
        first, again, size = bench_unpack(a.image, tmp, console.print)
        console.print(f"unpack {a.image}: first get {first:.2f} s (fetched from podman's storage and unpacked, "
                      f"{size / 2**20:.0f} MB on disk), again {again * 1000:.1f} ms", highlight=False)
        sandbox = make_sandbox("bwrap", "proxy-only")
        bridge = ProxyBridge(lambda: "http://127.0.0.1:9/v1")
        runtimes = {}
        for kind in ("bwrap", "podman"):
            rt, why = make_image_runtime(kind, REPO / "state" / "images", LIMITS)
            if rt is None:
                console.print(f"{kind}: not measured ({why})", highlight=False)
                continue
            runtimes[kind] = (rt, rt.image(a.image))
        times: dict[str, list[float]] = {"host": [], **{k: [] for k in runtimes}}
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("start-up", total=a.repeats)
            for i in range(a.repeats):  # interleaved: machine noise falls on every kind alike
                times["host"].append(_host_run(tmp, i, sandbox, bridge))
                for kind, (rt, image) in runtimes.items():
                    times[kind].append(_image_run(tmp, i, rt, image, bridge)[0])
                progress.advance(bar)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            console.print(f"start-up {k:6s}: median {med[k]:.3f} s (min {min(v):.3f}, max {max(v):.3f}, "
                          f"n={len(v)})", highlight=False)
        for kind, (rt, image) in runtimes.items():
            image_mb = _du(image.rootfs) / 2**20
            sizes = []
            for mb in (0, 1, 10):
                _took, ws = _image_run(tmp, 1000 + mb, rt, image, bridge,
                                       ("sh", "-c", f"head -c {mb}M /dev/zero > written.bin"))
                sizes.append((mb, _du(ws / CHANGES) / 2**20))
            said = ", ".join(f"{mb} MB written: {got:.2f} MB" for mb, got in sizes)
            console.print(f"disk {kind}: the run's layer after {said}; the image {image_mb:.0f} MB", highlight=False)
        bridge.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    added = med.get("bwrap", float("inf")) - med["host"]
    podman = f"; podman adds {med['podman'] - med['host']:.3f} s" if "podman" in med else ""
    ok = added <= TARGET_S
    console.print(f"start-up added by an image run (bubblewrap) over today's sandbox: {added:.3f} s (target <= "
                  f"{TARGET_S} s){podman} — {'OK' if ok else 'MISSED'}", highlight=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
