"""A full disk (ENOSPC) under the ledger and the files appended to beside it: nothing half-written, nothing lost,
everything written once there is room; the daemon's guard gives its reserve up and takes it back; a slow disk is
told. On a real small file system: a tmpfs the test mounts (as root, like the rest of the suite's set-up)."""

from __future__ import annotations

import sqlite3
import subprocess
from array import array
from pathlib import Path

import pytest

from gyre_slurm.coordinator.disk_guard import DiskGuard, SlowDisk
from gyre_slurm.errors import DiskFull
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.trajectory.segments import SegmentFile

from .conftest import fill_disk, mount_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path):
    d = tmp_path / "disk"
    mount_tmpfs(d, "8m")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_leaves_the_ledgers_rows_queued_in_order_and_a_flush_with_room_writes_them(small_disk):
    w = LedgerWriter(small_disk / "ledger.db")
    w.event("before", "written before the disk filled")
    assert w.flush() == 1
    filler = fill_disk(small_disk)
    for i in range(3000):
        w.event("while_full", f"{i:05d}" + "x" * 400)
    assert w.flush() == 0 and isinstance(w.full, DiskFull) and "cannot grow" in str(w.full)
    assert w.pending == 3000  # rolled back whole: nothing lost, nothing half-written
    w.event("after", "queued after the failed flush")
    assert w.flush() == 0 and w.pending == 3001
    filler.unlink()
    assert w.flush() == 3001 and w.full is None and w.pending == 0
    w.close()
    conn = sqlite3.connect(small_disk / "ledger.db")
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    kinds = [k for (k,) in conn.execute("SELECT kind FROM events ORDER BY id")]
    assert kinds == ["before"] + ["while_full"] * 3000 + ["after"]  # in the order they were made
    msgs = [m[:5] for (m,) in conn.execute("SELECT message FROM events WHERE kind = 'while_full' ORDER BY id")]
    assert msgs == [f"{i:05d}" for i in range(3000)]


def call(i: int, n: int = 2000) -> dict:
    return {"rollout_id": 1, "call_index": i, "prompt_ids": array("i", range(n)), "output_ids": array("i", [i] * 50),
            "output_logprobs": array("d", [-0.5] * 50), "weight_version": 0, "finish_reason": "stop"}


def test_a_segment_record_that_does_not_fit_is_cut_off_and_the_file_stays_whole_records(small_disk):
    seg = SegmentFile(small_disk / "segments" / "calls.seg")
    fill_disk(small_disk)
    (small_disk / "filler").unlink()
    filler = small_disk / "filler2"
    filler.write_bytes(bytes((8 << 20) - (1 << 20)))  # about 1 MB left: a few hundred records fit
    written = []
    with pytest.raises(DiskFull, match="cannot grow"):
        for i in range(10_000):
            written.append(seg.append(call(i)))
    assert 10 < len(written) < 10_000
    end = written[-1][0] + written[-1][1]
    assert seg.path.stat().st_size == end  # what did not fit was cut off
    filler.unlink()
    off, _n = seg.append(call(len(written)))  # room again: the next record follows the last whole one
    assert off == end
    got = [rec["call_index"] for _off, rec in seg.scan()]
    assert got == list(range(len(written) + 1))
    seg.close()


def test_the_guard_gives_its_reserve_up_when_the_disk_fills_and_takes_it_back_with_room(small_disk):
    mb = 1 << 20
    g = DiskGuard(small_disk, reserve_bytes=2 * mb, low_bytes=mb, back_bytes=2 * mb)
    assert g.make_reserve() and g.reserve.stat().st_size == 2 * mb
    assert g.check(0.0) is None and g.short is None
    filler = fill_disk(small_disk)
    change = g.check(1.0)
    assert change is not None and change.kind == "disk_full" and "reserve of 2 MB given up" in change.message
    assert g.short is not None and not g.reserve.exists() and g.free() >= 2 * mb  # room to say so
    assert g.check(2.0) is None  # short still: told once
    filler.unlink()
    change = g.check(12.0)
    assert change is not None and change.kind == "disk_space_back" and "11 s after it filled" in change.message
    assert g.short is None and g.reserve.stat().st_size == 2 * mb


def test_a_slow_disk_is_told_once_and_fast_again_after_quiet_checkpoints():
    s = SlowDisk(slow_s=0.5, fast_after_s=30)
    assert s.observe(0.01, 0.0) is None
    slow = s.observe(1.7, 1.0)
    assert slow is not None and slow.kind == "disk_slow" and "1.7 s" in slow.message
    assert s.observe(2.5, 2.0) is None and s.observe(0.2, 20.0) is None  # still slow: 0.2 s is over a quarter
    assert s.observe(0.01, 40.0) is None  # 20 s quiet only
    fast = s.observe(0.01, 51.0)
    assert fast is not None and fast.kind == "disk_fast" and "slowest checkpoint 2.5 s" in fast.message
