"""A full disk (ENOSPC) under the ledger and the files appended to beside it: nothing half-written, nothing lost,
everything written once there is room; the daemon's guard gives its reserve up and takes it back; a slow disk is
told. On a real small file system: a tmpfs the test mounts (as root, like the rest of the suite's set-up)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest

from gyre_slurm.coordinator.disk_guard import DiskGuard, SlowDisk
from gyre_slurm.errors import DiskFull
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.peer import connect_to_daemon
from gyre_slurm.protocol import CallAck, CallRecord, decode, encode
from gyre_slurm.trajectory.segments import SegmentFile

from .conftest import fill_disk, mount_tmpfs, q, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_scale as bs  # noqa: E402  (the real daemon under simulated peers)
from bench_scale_peers import NodeAgents, take_rollouts  # noqa: E402


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
    assert fast is not None and fast.kind == "disk_fast" and "slowest sync 2.5 s" in fast.message


# --- the daemon on a full disk ------------------------------------------------------------------------------------
def record(rid: int, i: int) -> CallRecord:
    """Call i of run rid: 3,000 new prompt ids (12 KB: more than the slack of a file's last page, so that its
    payload needs new blocks) and 10 output ids on top of call i-1 (a chain, as an agent's turns)."""
    return CallRecord(rollout_id=rid, call_index=i, api="openai-chat", prompt_ids=array("i", [7 + i] * 3000),
                      output_ids=array("i", [9] * 10), output_logprobs=array("d", [-0.5] * 10), weight_version=0,
                      cell=None, finish_reason="tool_calls", started_at=1.0, latency_s=0.1, reused_tokens=3010 * i,
                      parent_call=i - 1 if i else None, branch_reason=None, kind="main")


def acks(sock, token: str, n: int, timeout_s: float) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and sock.poll(max(1, int(1e3 * (deadline - time.monotonic())))):
        msg = decode(sock.recv(), token)
        if isinstance(msg, CallAck):
            got.append(msg.call_index)
    return got


def test_a_daemon_on_a_full_disk_acks_nothing_it_has_not_written_says_so_and_goes_on(tmp_path: Path) -> None:
    """The real daemon (bench_scale's: simulated agents and a worker that holds its runs), its run folder on a
    tmpfs of 200 MB. Filled: it gives its 32 MB reserve up and says DEGRADED (disk_full); filled again, a call's
    payload does not fit and nothing is acked until there is room; then every call is in, in order, once."""
    mount_tmpfs(tmp_path / "state", "200m")
    try:
        _cfg, n_runs = bs.write_config(tmp_path, 8)
        daemon, run_dir, info = bs.start_daemon(tmp_path, False)
        agents = NodeAgents(info, -(-n_runs // bs.RUNS_PER_CELL))
        agents.start()
        rid = take_rollouts(info, n_runs)[0]
        proxy = connect_to_daemon(info, "proxy-test", linger_ms=0)
        db = run_dir / "ledger.db"
        try:
            for i in range(3):
                proxy.send(encode(record(rid, i), info.token))
            assert acks(proxy, info.token, 3, 30) == [0, 1, 2]
            first = fill_disk(tmp_path / "state")
            wait_for(lambda: q(db, "SELECT status FROM runs") == [("DEGRADED",)], timeout=30, what="DEGRADED")
            assert not (run_dir / "disk-reserve").exists()  # given up: room to say so
            (tmp_path / "state" / "more").mkdir()
            second = fill_disk(tmp_path / "state" / "more")  # what the reserve gave, taken by the other writer
            for i in range(3, 6):
                proxy.send(encode(record(rid, i), info.token))
            assert acks(proxy, info.token, 3, 5) == []  # not written, not acked
            first.unlink()
            second.unlink()
            assert acks(proxy, info.token, 3, 60) == [3, 4, 5]
            wait_for(lambda: q(db, "SELECT status FROM runs") == [("RUNNING",)], timeout=30, what="RUNNING again")
            assert (run_dir / "disk-reserve").stat().st_size == 32 << 20  # taken back
            proxy.send(encode(record(rid, 6), info.token))
            assert acks(proxy, info.token, 1, 30) == [6]
        finally:
            proxy.close()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            agents.halt.set()
        assert q(db, "SELECT call_index FROM model_calls WHERE rollout_id = ? ORDER BY call_index", rid) == \
            [(i,) for i in range(7)]
        assert q(db, "PRAGMA integrity_check") == [("ok",)]
        kinds = [k for (k,) in q(db, "SELECT kind FROM events WHERE kind LIKE 'disk%' ORDER BY id")]
        assert kinds == ["disk_full", "disk_space_back"], kinds
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "state")], check=False)
