"""The fault campaign (tools/chaos.py), small: a kill of every kind of process in one real run of the embedded
default (elastic, with satellites, so every kind is there; groups of 8 for shorter steps; the sevens asked one way,
whose built-in model the suite's other tests share), then the ledger's checks, among them a `process_restarted`
events row per kill; and a mixed run of the other classes: hangs, a partition, a full and a slow disk, each named
by its events. The full campaigns (20 faults of a class per kind) are `tools/chaos.py` itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KINDS = ("daemon", "proxy", "worker", "agent", "core", "satellite", "engine")


def chaos(tmp_path: Path, *args: str) -> tuple[str, dict[tuple[str, str], list[str]]]:
    """Run tools/chaos.py; its output, and its table's rows by (kind, fault)."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), *args, "--no-baseline", "--group-size", "8",
                        "--suite", "builtin:sevens", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=2400, cwd=REPO)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert out.strip().splitlines()[-1].startswith("chaos: OK:"), out[-3000:]
    rows = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) == 9 and cols[2].isdigit():
            rows[(cols[0], cols[1])] = cols
    return out, rows


@pytest.mark.timeout(2400)  # one run and 7 kills: 10-16 minutes here in the whole suite (beside the model builds)
def test_a_kill_of_every_kind_loses_duplicates_and_corrupts_nothing(tmp_path: Path) -> None:
    out, rows = chaos(tmp_path, "--faults", "kill", "--per-kind", "1", "--mixed", "--per-run", str(len(KINDS)),
                      "--seed", "3")
    assert set(rows) == {(k, "kill") for k in KINDS}, out[-3000:]
    for key, cols in rows.items():
        kills, lost, dups, integrity = map(int, cols[2:6])
        assert kills >= 1 and (lost, dups, integrity) == (0, 0, 0), (key, cols)


@pytest.mark.timeout(2400)  # one run and 5 faults: 2.5-3.5 minutes here in the whole suite, about as long alone
def test_hangs_a_partition_a_full_and_a_slow_disk_lose_nothing_and_each_is_named(tmp_path: Path) -> None:
    """An agent and an engine stopped (the longer draws past the 20 s hang timeout: killed and started again), the
    agent cut off from the daemon, the run's disk full and then slow: each told by its events (the tool checks them:
    process_stalled or process_hung, disk_full and disk_space_back, disk_slow and disk_fast), nothing lost."""
    out, rows = chaos(tmp_path, "--faults", "hang,partition,full,slow", "--kinds", "agent,engine,disk",
                      "--per-kind", "1", "--mixed", "--per-run", "5", "--seed", "4", "--hang-s", "6,40",
                      "--hang-timeout", "20", "--partition-s", "10,20", "--full-s", "8,15", "--slow-s", "12,20")
    want = {("agent", "hang"), ("agent", "partition"), ("engine", "hang"), ("disk", "full"), ("disk", "slow")}
    assert set(rows) == want, out[-3000:]
    for key, cols in rows.items():
        n, lost, dups, integrity = map(int, cols[2:6])
        assert n >= 1 and (lost, dups, integrity) == (0, 0, 0), (key, cols)
