"""`gyre run` supervises its processes: a proxy, a worker and a node agent killed with -9 mid-run are started again
(each an events row), the daemon too, and the run still completes every step with nothing counted twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_slurm.launch.supervise import STABLE_S, Supervisor

from .conftest import embedded_config, q, wait_for

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


def _pid(db: Path, sql: str) -> int:
    return q(db, sql)[0][0]


def test_gyre_run_restarts_what_dies_and_the_run_completes(tmp_path: Path, warm_model: Path) -> None:
    # the dropped-groups rule off: runs the kills cut short are the subject here, not a policy that collapses
    path = embedded_config(tmp_path, warm_model, "sup", tasks={"suite": "builtin:sevens", "group_size": 8,
                                                                "groups_per_step": 2},
                           run={"name": "sup", "state_dir": str(tmp_path / "state"), "max_wall_s": 600,
                                "degrade_after_dropped_groups": 0},
                           harness={"timeout_s": 20}, train={"steps": 3, "lr": 4e-4})
    out = open(tmp_path / "run.out", "w")  # noqa: SIM115
    run = subprocess.Popen([sys.executable, "-m", "gyre_slurm", "run", str(path), "--run-id", "s1"], stdout=out,
                           stderr=subprocess.STDOUT)
    db = tmp_path / "state" / "s1" / "ledger.db"
    logs = lambda: (tmp_path / "run.out").read_text()[-3000:]  # noqa: E731
    try:
        wait_for(lambda: q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'")[0][0] >= 1, 240,
                 "a first step", logs)
        pidfile = tmp_path / "state" / "s1" / "logs" / "pids.json"
        import json

        pids = json.loads(pidfile.read_text())
        for name in ("proxy", "worker-0", "agent-1"):
            os.kill(pids[name], signal.SIGKILL)
        wait_for(lambda: q(db, "SELECT count(*) FROM events WHERE kind = 'process_restarted'")[0][0] >= 3, 60,
                 "three restarts in the ledger", logs)
        os.kill(json.loads(pidfile.read_text())["daemon"], signal.SIGKILL)
        wait_for(lambda: q(db, "SELECT daemon_starts FROM runs") == [(2,)], 60, "the daemon back", logs)
        assert run.wait(timeout=400) == 0, logs()
    finally:
        if run.poll() is None:
            run.kill()
        out.close()
    assert q(db, "SELECT status FROM runs") == [("STOPPED",)]
    assert q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'") == [(3,)]
    restarted = {m.split(" died")[0] for (m,) in q(db, "SELECT message FROM events WHERE kind = 'process_restarted'")}
    assert {"proxy", "worker-0", "agent-1", "daemon"} <= restarted
    assert q(db, "SELECT count(*) FROM (SELECT rollout_id, call_index FROM model_calls GROUP BY 1, 2 "
                 "HAVING count(*) > 1)") == [(0,)]
    assert q(db, "PRAGMA integrity_check") == [("ok",)]


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
