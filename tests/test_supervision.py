"""Supervision: a process that dies is started again with backoff and a budget (the Supervisor, `gyre keep`). That
`gyre run` restarts every kind of process killed with -9 mid-run and still completes every step with nothing counted
twice is the kill -9 campaign's to show (tests/test_chaos.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_slurm.beacon import Beacon, silent_for
from gyre_slurm.launch.supervise import STABLE_S, STALL_S, Supervisor

from .conftest import wait_for

# a main loop as the run's processes have one: it beats its beacon (GYRE_BEACON, set by the supervisor) and counts
BEATING = ("import pathlib, sys, time; from gyre_slurm.beacon import Beacon; b = Beacon(); n = 0\n"
           "while True:\n    b.beat(); n += 1; time.sleep(0.05)")

pytestmark = pytest.mark.slow


def test_a_stopped_process_is_told_as_stalled_when_it_wakes_and_killed_as_hung_past_the_timeout(tmp_path: Path) -> None:
    told: list[tuple[str, str]] = []
    beacons = tmp_path / "alive"
    sup = Supervisor(budget=3, report=lambda kind, msg: told.append((kind, msg)), beacons=beacons, hang_s=STALL_S + 3)
    sup.start("worker-0", [sys.executable, "-c", BEATING], tmp_path / "w.log")
    m = sup.members["worker-0"]
    wait_for(lambda: silent_for(beacons, "worker-0") is not None, 60, "a first beat")
    # stopped a little longer than STALL_S, then woken: alive, told once, not restarted
    os.kill(m.proc.pid, signal.SIGSTOP)
    wait_for(lambda: sup.poll() or silent_for(beacons, "worker-0") > STALL_S + 0.5, 30, "a stall")
    os.kill(m.proc.pid, signal.SIGCONT)
    wait_for(lambda: sup.poll() or told, 30, "the stall told")
    assert [k for k, _ in told] == ["process_stalled"] and "worker-0 gave no sign of life for" in told[0][1]
    assert m.restarts == 0 and m.proc.poll() is None
    # stopped past hang_s: killed, told, started again (its new process beats again)
    pid = m.proc.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: sup.poll() or m.proc.pid != pid, 60, "the hung process started again")
    assert [k for k, _ in told][1:] == ["process_hung", "process_restarted"], told
    assert "hung; killed to be started again" in told[1][1] and "worker-0 was killed as hung" in told[2][1]
    wait_for(lambda: (silent_for(beacons, "worker-0") or 99) < 1, 60, "the new process's beats")
    assert m.restarts == 1 and sup.gave_up is None
    m.proc.kill()


def test_a_beacon_without_its_variable_or_its_folder_costs_nothing_and_fails_nothing(tmp_path: Path) -> None:
    Beacon(None).beat()  # a process started by hand: no file anywhere
    b = Beacon(tmp_path / "gone" / "x")
    b.beat()  # the folder is gone (a run folder removed): no error, the process goes on
    assert not (tmp_path / "gone").exists()
    assert silent_for(tmp_path, "nobody") is None  # not beaten yet: starting, not judged


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
