"""Supervision: a process that dies is started again with backoff and a budget (the Supervisor, `gyre keep`). That
`gyre run` restarts every kind of process killed with -9 mid-run and still completes every step with nothing counted
twice is the kill -9 campaign's to show (tests/test_chaos.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_slurm.launch.supervise import STABLE_S, Supervisor

pytestmark = pytest.mark.slow


def test_the_supervisor_restarts_with_backoff_and_gives_up_past_its_budget(tmp_path: Path) -> None:
    told = []
    sup = Supervisor(budget=2, report=lambda kind, msg: told.append((kind, msg)))
    sup.start("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "c.log")
    sup.start("fine", [sys.executable, "-c", "pass"], tmp_path / "f.log")
    for m in sup.members.values():
        m.proc.wait()
    t = time.monotonic()
    assert sup.poll(t) == [] and sup.members["crasher"].due == pytest.approx(t + 1.0)  # first backoff 1 s
    assert sup.poll(t + 1.0) == ["crasher"]
    sup.members["crasher"].proc.wait()
    sup.poll(t + 1.5)
    assert sup.members["crasher"].due == pytest.approx(t + 3.5)  # then 2 s
    assert sup.poll(t + 3.5) == ["crasher"]
    sup.members["crasher"].proc.wait()
    sup.poll(t + 10)
    assert sup.gave_up == "crasher died 3 times (last: exit 3)"
    assert sup.restarts() == {"crasher": 2}  # a process that exited 0 is done, never restarted
    assert [k for k, _ in told] == ["process_restarted"] * 2 and "restart 1 of 2" in told[0][1]


def test_a_process_that_ran_a_while_before_it_died_starts_a_fresh_budget(tmp_path: Path) -> None:
    sup = Supervisor(budget=1)
    sup.start("rare", [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "r.log")
    m = sup.members["rare"]
    t = m.started
    for k in range(3):  # dies three times, each after running STABLE_S: never given up, backoff stays 1 s
        m.proc.wait()
        now = m.started + STABLE_S
        sup.poll(now)
        assert m.due == pytest.approx(now + 1.0) and sup.gave_up is None
        assert sup.poll(now + 1.0) == ["rare"] and m.restarts == k + 1
    m.proc.wait()
    sup.poll(m.started + 1.0)  # but one that dies at once after a restart is a crash loop: past the budget
    assert sup.gave_up == "rare died 2 times (last: exit 3)" and t < m.started


def test_gyre_keep_restarts_a_dying_command_passes_sigterm_on_and_exits_with_its_status(tmp_path: Path) -> None:
    count = tmp_path / "count"
    # dies (exit 3) the first two times, then exits 0: kept running until then
    flaky = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text() or 0) if p.exists() "
             "else 0; p.write_text(str(n + 1)); sys.exit(3 if n < 2 else 0)")
    r = subprocess.run([sys.executable, "-m", "gyre_slurm", "keep", "flaky", "--", sys.executable, "-c", flaky],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and count.read_text() == "3", r.stderr
    assert "flaky died (exit 3) and was started again (restart 2 of 10 in a row" in r.stderr
    r = subprocess.run([sys.executable, "-m", "gyre_slurm", "keep", "--budget", "1", "crash", "--", sys.executable,
                        "-c", "import sys; sys.exit(4)"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "giving up: crash died 2 times (last: exit 4)" in r.stderr
    p = subprocess.Popen([sys.executable, "-m", "gyre_slurm", "keep", "sleeper", "--", sys.executable, "-c",
                          "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
                          "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"  # the command writes where keep does
    p.terminate()
    assert p.wait(timeout=20) == 7  # SIGTERM reached the command; it was not started again
