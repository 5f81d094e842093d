"""The run folder's disk, watched by the daemon: short of space, the run stops taking new work and says so; with
space again, it goes on.

The ledger, the segment file, the step batches and the weights all live in the run folder. When its file system
fills, a write fails with ENOSPC (SQLite: SQLITE_FULL): the ledger rolls the transaction back and keeps its rows
queued, the segment file cuts the record off (ledger/store.py, trajectory/segments.py), nothing half-written. To
be able to *say* so in a ledger that cannot grow, the daemon keeps a reserve file of RESERVE_BYTES in the run
folder and deletes it when space runs short: room for the DEGRADED status, the disk_full event and the model calls
of the runs in flight. Below LOW_BYTES free the run is DEGRADED ("disk full"): no group is admitted and no step
starts or takes a new group (a step's batch is a file too) until BACK_BYTES are free beside a new reserve; then it
is RUNNING again (disk_space_back).

A slow disk only gets told (SlowDisk): a thread of the daemon's writes and syncs a small file in the run folder
each second (SyncProbe), and a sync of SLOW_S or more (one still waiting counts) is a disk_slow event; disk_fast
once none took a quarter of that for FAST_AFTER_S. The run goes on meanwhile: commits append to the WAL, which no
sync waits for. (The ledger's checkpoints were the first probe: on a disk at a crawl a checkpoint began too
rarely to tell every slow spell.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.errors import disk_full
from gyre_slurm.statuses import Severity

log = logging.getLogger("gyre.daemon")

RESERVE_BYTES = 32 << 20  # given up when the disk fills: the ledger's room to say so
LOW_BYTES = 16 << 20  # fewer free bytes than this: the run is short of disk
BACK_BYTES = 96 << 20  # free beside a new reserve: the run goes on
RESERVE_NAME = "disk-reserve"
SLOW_S = 0.5  # a small write and sync this long: the disk is slow
FAST_AFTER_S = 10.0
_MB = 1 << 20


@dataclass
class DiskChange:
    kind: str  # its events row: disk_full, disk_space_back, disk_slow or disk_fast
    message: str


class DiskGuard:
    """The reserve file and the short/back decision for one run folder (the daemon's; pure but for the file)."""

    def __init__(self, folder: Path, reserve_bytes: int = RESERVE_BYTES, low_bytes: int = LOW_BYTES,
                 back_bytes: int = BACK_BYTES) -> None:
        self.folder, self.reserve = Path(folder), Path(folder) / RESERVE_NAME
        self.reserve_bytes, self.low_bytes, self.back_bytes = reserve_bytes, low_bytes, back_bytes
        self.short: str | None = None  # why the run is short of disk; None while there is room
        self.since: float | None = None

    def free(self) -> int:
        st = os.statvfs(self.folder)
        return st.f_bavail * st.f_frsize

    def make_reserve(self) -> bool:
        """Write the reserve (real blocks: a sparse file would reserve nothing); False when it does not fit."""
        if self.reserve.exists() and self.reserve.stat().st_size >= self.reserve_bytes:
            return True
        tmp = self.reserve.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                chunk = bytes(_MB)
                for _ in range(self.reserve_bytes // _MB):
                    f.write(chunk)  # blocks taken as written (no sync: the daemon's thread, maybe a slow disk)
            os.replace(tmp, self.reserve)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if not disk_full(e):
                raise
            return False

    def release(self) -> bool:
        """Give the reserve up (whether there was one)."""
        try:
            self.reserve.unlink()
            return True
        except FileNotFoundError:
            return False

    def full(self, what: str, now: float) -> DiskChange:
        """A write found the disk full (`what`), or space ran short: give up the reserve and be short."""
        released = self.release()
        self.short = f"disk full: {what}"
        self.since = now
        return DiskChange("disk_full", f"the run's disk is full ({what}; {self.folder}): no new runs or steps "
                          f"until {self.back_bytes / _MB:.0f} MB are free" + ("; its reserve of "
                          f"{self.reserve_bytes / _MB:.0f} MB given up for the runs in flight" if released else ""))

    def check(self, now: float) -> DiskChange | None:
        """Look at the free space (each daemon tick): a change to tell, or None."""
        free = self.free()
        if self.short is None and free < self.low_bytes:
            return self.full(f"{free / _MB:.1f} MB free", now)
        if self.short is not None and free >= self.back_bytes + self.reserve_bytes and self.make_reserve():
            took = now - (self.since or now)
            self.short, self.since = None, None
            return DiskChange("disk_space_back", f"the run's disk has room again ({self.free() / _MB:.0f} MB free "
                              f"beside the reserve, {took:.0f} s after it filled): the run takes work again")
        return None


class SlowDisk:
    """Whether the run's disk syncs slowly, from the sync probe's times (SyncProbe)."""

    def __init__(self, slow_s: float = SLOW_S, fast_after_s: float = FAST_AFTER_S) -> None:
        self.slow_s, self.fast_after_s = slow_s, fast_after_s
        self.slow_since: float | None = None
        self.last_slow = 0.0
        self.worst = 0.0

    def observe(self, sync_s: float, now: float) -> DiskChange | None:
        """The longest sync since the last look (each daemon tick, SyncProbe): a change to tell, or None."""
        if sync_s >= self.slow_s / 4:
            self.last_slow = now
        if self.slow_since is None and sync_s >= self.slow_s:
            self.slow_since, self.worst = now, sync_s
            return DiskChange("disk_slow", f"the run's disk is slow: a small write and sync took {sync_s:.1f} s "
                              "or more; the run goes on (commits wait for no sync)")
        if self.slow_since is not None:
            self.worst = max(self.worst, sync_s)
            if now - self.last_slow >= self.fast_after_s:
                took, self.slow_since = now - self.slow_since, None
                return DiskChange("disk_fast", f"the run's disk syncs fast again, after {took:.0f} s slow (the "
                                  f"slowest sync {self.worst:.1f} s)")
        return None


def timed_sync(path: Path) -> float:
    """Seconds a small write and fsync of `path` takes (what every sync of the run waits behind)."""
    t = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(4096))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.monotonic() - t


class SyncProbe:
    """A small write and fsync in `folder` once a second, on a thread of its own: what every sync of the run waits
    for. `slowest()` is the longest since the last look, one still waiting counted (a crawling disk may take
    minutes to answer)."""

    def __init__(self, folder: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s = Path(folder) / ".sync-probe", every_s
        self._worst, self._since = 0.0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sync-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._since = time.monotonic()
            with contextlib.suppress(OSError):  # a full disk: the guard tells that
                timed_sync(self.path)
            self._worst = max(self._worst, time.monotonic() - self._since)
            self._since = None

    def slowest(self) -> float:
        since = self._since
        s = max(self._worst, time.monotonic() - since if since is not None else 0.0)
        self._worst = 0.0
        return s

    def stop(self) -> None:
        self._stop.set()


class DiskWatch:
    """The daemon's side of its disk: the guard's and the slow watch's changes into the run's status (DEGRADED
    while short), the loop's admissions (`paused`) and events."""

    def __init__(self, guard: DiskGuard, ledger: Any, degrade: Callable[[str, str | None], None]) -> None:
        self.guard, self.slow, self.ledger, self.degrade = guard, SlowDisk(), ledger, degrade
        self.probe = SyncProbe(guard.folder)
        self.loop: Any = None  # the RL loop, whose admissions stop while the disk is short

    def tick(self, now: float) -> None:
        self.tell(self.guard.check(now))
        self.tell(self.slow.observe(self.probe.slowest(), now))

    def full(self, what: str, now: float) -> None:
        """A write found no space (the ledger's, a payload's, a peer's): short now, unless short already."""
        if self.guard.short is None:
            self.tell(self.guard.full(what, now))

    def tell(self, change: DiskChange | None) -> None:
        if change is None:
            return
        severity = {"disk_full": Severity.ERROR, "disk_slow": Severity.WARNING}.get(change.kind, Severity.INFO)
        log.log(getattr(logging, severity.name), "%s", change.message)  # INFO, WARNING, ERROR alike
        if change.kind in ("disk_full", "disk_space_back"):
            self.degrade("disk", self.guard.short)
            if self.loop is not None:
                self.loop.paused = self.guard.short
        self.ledger.event(change.kind, change.message, severity=severity, data={"free_bytes": self.guard.free()})
