"""The kill -9 campaign (tools/chaos.py), small: a kill of every kind of process in one real run of the embedded
default (elastic, with satellites, so every kind is there; groups of 8 for shorter steps; the sevens asked one way,
whose built-in model the suite's other tests share), then the ledger's checks, among them a `process_restarted`
events row per kill. The full campaign (20 kills per kind, a run per kind) is `tools/chaos.py` itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KINDS = ("daemon", "proxy", "worker", "agent", "core", "satellite")


@pytest.mark.timeout(2400)  # one run and 6 kills: about 3 minutes here, more on a slower machine
def test_a_kill_of_every_kind_loses_duplicates_and_corrupts_nothing(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "chaos.py"), "--faults", "kill", "--per-kind", "1",
                        "--mixed", "--per-run", str(len(KINDS)), "--no-baseline", "--group-size", "8",
                        "--suite", "builtin:sevens", "--seed", "3", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=2400, cwd=REPO)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in [[k] for k in KINDS]}
    assert set(rows) == set(KINDS), out[-3000:]
    for kind, cols in rows.items():
        assert cols[1] == "kill", cols
        kills, lost, dups, integrity = map(int, cols[2:6])
        assert kills >= 1 and (lost, dups, integrity) == (0, 0, 0), (kind, cols)
    assert out.strip().splitlines()[-1].startswith("chaos: OK:")
