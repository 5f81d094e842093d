"""Disk faults for tools/chaos.py: the run's folder on a file system of its own, filled to ENOSPC or flooded with
writes that make its syncs slow.

The folder is an ext4 image on a loop device (`LoopDisk`, made before the run starts, no root-reserved blocks, so
a full disk is full for root too). `Fill` writes one file until the disk refuses (ENOSPC) and holds it, as another
job filling a shared scratch would; its exit deletes it. `Slow` throttles the loop device (blkio, cgroup v1) and
syncs large files through it (in place: a file rewritten from scratch frees its blocks only when the throttled
journal commits, and the disk filled), as a disk at a crawl behind another job's checkpoint writer; it probes how
long a small fsync takes before and during (here 0.3 ms → 2.6 s). A flood alone on this machine's fast disk
raised a small fsync from 0.1 ms to 0.1–0.25 s only. Needs root, a loop device (`losetup -f`) and the blkio controller.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
from pathlib import Path

from gyre_slurm.coordinator.disk_guard import timed_sync

FLOOD_MB = 64  # the writer's dd writes this much, syncs it, then again
THROTTLE = Path("/sys/fs/cgroup/blkio/blkio.throttle.write_iops_device")


def usable() -> str | None:
    """Why disk faults cannot be made here, or None."""
    if os.geteuid() != 0:
        return "disk faults need root (a loop-mounted file system for the run's folder)"
    if shutil.which("mkfs.ext4") is None:
        return "disk faults need mkfs.ext4 (apt-get install e2fsprogs)"
    if subprocess.run(["losetup", "-f"], capture_output=True).returncode != 0:
        return "disk faults need a free loop device (losetup -f found none)"
    if not THROTTLE.exists():
        return f"slow disks need the blkio cgroup controller (no {THROTTLE})"
    return None


class LoopDisk:
    """`folder` mounted on an ext4 image of `size_mb` while open (the image beside it, deleted on exit)."""

    def __init__(self, folder: Path, size_mb: int = 768) -> None:
        self.folder, self.image, self.size_mb = folder, folder.with_name(folder.name + ".img"), size_mb

    def __enter__(self) -> LoopDisk:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(self.image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.folder)], check=True)
        return self

    def __exit__(self, *_exc: object) -> None:
        subprocess.run(["umount", "-l", str(self.folder)], check=False)
        self.image.unlink(missing_ok=True)


def fill(path: Path) -> Path:
    """Write `path` until its file system refuses (ENOSPC) and leave it there: the file to delete for room."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (bytes(1 << 20), bytes(4096)):  # MBs, then the last pages
            try:
                while True:
                    f.write(chunk)
            except OSError:
                pass
    return path


class Fill:
    """The file system of `folder` full (ENOSPC) while open."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "chaos-fill"

    def __enter__(self) -> Fill:
        fill(self.path)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.path.unlink(missing_ok=True)


def fsync_ms(folder: Path) -> float:
    """How long a small write and fsync takes in `folder` (the daemon's probe: what a ledger checkpoint waits for)."""
    return timed_sync(folder / "chaos-probe") * 1000


class Slow:
    """The file system of `folder` slow while open: its device throttled to `iops` writes a second (the blkio
    cgroup of the machine's root group, which every process and the kernel's writeback are in) and one writer
    syncing big files through it, so every sync of the ledger queues behind them. `before_ms`/`during_ms`: the
    median small fsync before and during."""

    def __init__(self, folder: Path, iops: int = 4) -> None:
        self.folder, self.iops = folder, iops
        src = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(folder)], capture_output=True, text=True,
                             check=True).stdout.strip()
        rdev = os.stat(src).st_rdev
        self.device = f"{os.major(rdev)}:{os.minor(rdev)}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._probes: list[float] = []
        self.before_ms = statistics.median(fsync_ms(folder) for _ in range(5))
        self.during_ms = 0.0

    def _throttle(self, iops: int) -> None:
        THROTTLE.write_text(f"{self.device} {iops}\n")

    def _write(self) -> None:
        out = self.folder / "chaos-flood"
        while not self._stop.is_set():
            subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=1M", f"count={FLOOD_MB}", "conv=notrunc,fdatasync"],
                           capture_output=True, check=False)

    def _probe(self) -> None:
        while not self._stop.wait(0.5):
            self._probes.append(fsync_ms(self.folder))

    def __enter__(self) -> Slow:
        self._throttle(self.iops)
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._write, self._probe)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._throttle(0)  # first: the writer's last dd then ends at the disk's speed
        self._stop.set()
        for t in self._threads:
            t.join()
        for p in (self.folder / "chaos-flood", self.folder / "chaos-probe"):
            p.unlink(missing_ok=True)
        self.during_ms = statistics.median(self._probes) if self._probes else 0.0


def unthrottle_all() -> None:
    """Lift every throttle a campaign set (one stopped mid-fault leaves it behind)."""
    if THROTTLE.exists():
        for line in THROTTLE.read_text().splitlines():
            if line.strip():
                THROTTLE.write_text(f"{line.split()[0]} 0\n")
