"""A real harness worker process driven by a test-side ZeroMQ ROUTER that plays the daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from gyre_slurm.harness.builtin_suite import task_id
from gyre_slurm.harness.netrelay import RELAY_PORT
from gyre_slurm.harness.tasks import load_suite
from gyre_slurm.protocol import (
    DoneAck,
    NoWork,
    RolloutAssignment,
    RolloutDone,
    Shutdown,
    TakeRollout,
    WireMessage,
    WorkerHello,
    decode,
    encode,
)
from gyre_slurm.rundir import ControlInfo, new_token, write_control

from .conftest import alive

PY = sys.executable
DIGITS_7X4 = next(t for t in load_suite("builtin:digits") if t.id == task_id(7, 4)).model_dump(mode="json")



class FakeDaemon:
    """The daemon's side of the worker protocol, over a real ROUTER socket and the real protocol module."""

    def __init__(self, run_dir: Path) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.token = new_token()
        self.acking = True
        self.hellos: list[WorkerHello] = []
        write_control(run_dir, ControlInfo(endpoint=f"tcp://127.0.0.1:{port}", port=port, token=self.token,
                                           daemon_pid=os.getpid(), daemon_host="localhost", started_at=time.time()))

    def recv(self, timeout: float = 20.0) -> tuple[bytes, WireMessage]:
        """The worker's next message but its hellos (kept in `hellos`)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.sock.poll(timeout=max(1, int((deadline - time.monotonic()) * 1000))):
                raise AssertionError(f"no message from the worker in {timeout} s")
            ident, frame = self.sock.recv_multipart()
            msg = decode(frame, self.token)
            if isinstance(msg, WorkerHello):
                self.hellos.append(msg)
                continue
            if isinstance(msg, RolloutDone) and self.acking:  # as the daemon does once the ledger has it
                self.send(ident, DoneAck(rollout_id=msg.rollout_id))
            return ident, msg

    def send(self, ident: bytes, msg: WireMessage) -> None:
        self.sock.send_multipart([ident, encode(msg, self.token)])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def daemon(tmp_path: Path):
    d = FakeDaemon(tmp_path)
    yield d
    d.close()


@pytest.fixture
def start_worker(tmp_path: Path):
    procs, logs = [], []

    def start(concurrency: int) -> subprocess.Popen:
        log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (kept open for the process's life)
        logs.append(log)
        p = subprocess.Popen([PY, "-m", "gyre_slurm", "worker", "--run-dir", str(tmp_path), "--worker-id", "w1",
                              "--concurrency", str(concurrency), "--eval-retries", "1"], stdout=log,
                             stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
    for log in logs:
        log.close()




def assignment(rid: int, ws: Path, code: str, task: dict | None = None, timeout_s: float = 60) -> RolloutAssignment:
    return RolloutAssignment(rollout_id=rid, task=task or DIGITS_7X4, api_key=f"sk-rollout-{rid}",
                             base_url="http://127.0.0.1:9/v1", workspace=str(ws / f"r{rid}"), timeout_s=timeout_s,
                             harness=["{python}", "-c", code])


WRITES_ENV = ("import json, os; open('answer.txt', 'w').write('7777'); json.dump({k: os.environ[k] for k in "
              "('OPENAI_BASE_URL', 'OPENAI_API_KEY', 'GYRE_WORKSPACE', 'GYRE_ROLLOUT_ID')}, open('env.json', 'w'))")
PARTIAL_THEN_HANGS = "import time; open('answer.txt', 'w').write('77'); print('thinking', flush=True); time.sleep(60)"
CRASHES = ("import sys; open('answer.txt', 'w').write('7777'); "
           "sys.stderr.write('openai.AuthenticationError: 401 unknown key\\n'); sys.exit(1)")
API_ERROR_EXIT_0 = ("open('answer.txt', 'w').write('7777'); print('working'); "  # Claude Code's words for a 400
                    "print('API Error: 400 tools: unsupported tool type web_search_20250305')")


def test_rollout_statuses(tmp_path: Path, daemon: FakeDaemon, start_worker) -> None:
    ws = tmp_path / "ws"
    crashing_eval = {"id": "crash-eval", "prompt": "p", "evaluator": ["{python}", "-c", "raise SystemExit('grader "
                                                                      "crashed')"]}
    todo = [
        assignment(1, ws, WRITES_ENV),
        assignment(2, ws, PARTIAL_THEN_HANGS, task={**DIGITS_7X4, "timeout_s": 1.0}),  # the task's limit wins
        assignment(3, ws, CRASHES),
        assignment(4, ws, "pass", task=crashing_eval),
        assignment(5, ws, "pass", task={**DIGITS_7X4, "files": {"../escaped.txt": "x"}}),
        assignment(6, ws, API_ERROR_EXIT_0),
    ]
    n_rollouts = len(todo)
    worker = start_worker(concurrency=3)
    ident, first = daemon.recv()
    assert isinstance(first, TakeRollout) and first.worker_id == "w1" and first.free_slots == 3
    daemon.send(ident, NoWork(retry_after_s=0.5))
    t0 = time.monotonic()
    done: dict[int, RolloutDone] = {}
    in_flight = 0
    while len(done) < n_rollouts:
        ident, msg = daemon.recv()
        if isinstance(msg, TakeRollout):
            if not todo:
                daemon.send(ident, NoWork(retry_after_s=0.1))
                continue
            assert time.monotonic() - t0 >= 0.45  # NoWork's retry_after_s was respected
            assert msg.free_slots + in_flight <= 3, "the worker asked for more than it can run"
            for _ in range(min(msg.free_slots, len(todo))):  # up to free_slots per request
                daemon.send(ident, todo.pop(0))
                in_flight += 1
        else:
            assert isinstance(msg, RolloutDone) and msg.worker_id == "w1", msg
            done[msg.rollout_id] = msg
            in_flight -= 1
    assert worker.poll() is None

    ok = done[1]
    assert (ok.status, ok.reward, ok.harness_exit, ok.timed_out, ok.error) == ("COMPLETED", 1.0, 0, False, None)
    assert ok.started_at <= time.time() and ok.harness_s > 0 and ok.eval_s > 0
    r1 = ws / "r1"
    assert json.loads((r1 / "env.json").read_text()) == {  # sandboxed: the proxy is reached through the relay
        "OPENAI_BASE_URL": f"http://127.0.0.1:{RELAY_PORT}/v1", "OPENAI_API_KEY": "sk-rollout-1",
        "GYRE_WORKSPACE": str(r1.resolve()), "GYRE_ROLLOUT_ID": "1"}
    assert (r1 / "TASK.md").read_text() == "Write the digit 7 four times to answer.txt."
    assert (r1 / "README.md").is_file() and "score: 1.0" in (r1 / ".gyre" / "eval.log").read_text()

    timeout = done[2]  # partial scoring: the evaluator ran on what the workspace held when time ran out
    assert (timeout.status, timeout.reward, timeout.timed_out, timeout.harness_exit) == ("TIMEOUT_SCORED", 0.5,
                                                                                          True, None)
    assert 1.0 <= timeout.harness_s < 5
    assert (ws / "r2" / "answer.txt").read_text() == "77"
    assert "thinking" in (ws / "r2" / ".gyre" / "harness.log").read_text()

    crash = done[3]
    assert (crash.status, crash.reward, crash.harness_exit, crash.timed_out) == ("INFRA_ERROR", None, 1, False)
    assert "harness exit code 1 (evaluator score 1)" in crash.error and "401 unknown key" in crash.error

    bad_eval = done[4]
    assert (bad_eval.status, bad_eval.reward, bad_eval.harness_exit) == ("EVAL_ERROR", None, 0)
    assert "grader crashed" in bad_eval.error and "(after 2 attempts)" in bad_eval.error  # re-evaluated once

    api = done[6]  # exited 0: scored as usual, and the API error it printed is the run's error
    assert (api.status, api.reward, api.harness_exit) == ("COMPLETED", 1.0, 0)
    assert api.error == ("harness exited 0 but its log shows API errors from the proxy:\n"
                         "API Error: 400 tools: unsupported tool type web_search_20250305")
    assert api.harness_log == "working\nAPI Error: 400 tools: unsupported tool type web_search_20250305"
    assert ok.harness_log == ""  # the daemon quotes it for a run that never called the model

    bad_task = done[5]
    assert bad_task.status == "INFRA_ERROR" and bad_task.reward is None
    assert "bad task in the assignment: files:" in bad_task.error and "'..'" in bad_task.error
    assert not (ws / "escaped.txt").exists()

    # the worker lived through all of that; Shutdown stops it
    daemon.send(ident, Shutdown(reason="test over"))
    assert worker.wait(timeout=10) == 0
    assert sorted(p.name for p in ws.iterdir()) == ["r1", "r2", "r3", "r4", "r6"]  # workspaces are kept


HANGS_WITH_GRANDCHILD = """
import os, subprocess, sys, time  # gyre-hang-marker
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # gyre-hang-marker"])
open("pids", "w").write(f"{os.getpid()} {g.pid}")
time.sleep(120)
"""


def marked_pids(marker: str = "gyre-hang-marker") -> list[int]:
    """Host pids of the processes whose command line holds `marker` (a sandboxed harness has pids of its own
    PID namespace: what it writes down is not what the host sees)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker.encode() in (d / "cmdline").read_bytes() and alive(int(d.name)):
                out.append(int(d.name))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_stopping_kills_running_harnesses(tmp_path: Path, daemon: FakeDaemon, start_worker, how: str) -> None:
    ws = tmp_path / "ws"
    worker = start_worker(concurrency=1)
    ident, msg = daemon.recv()
    assert isinstance(msg, TakeRollout)
    daemon.send(ident, assignment(7, ws, HANGS_WITH_GRANDCHILD, timeout_s=100))
    pids_file = ws / "r7" / "pids"
    deadline = time.monotonic() + 15
    while not (pids_file.is_file() and len(pids_file.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the harness never started"
        time.sleep(0.05)
    pids = marked_pids()
    assert len(pids) >= 2, pids  # the harness and its grandchild (and bwrap's copy of the harness's argv)
    t0 = time.monotonic()
    if how == "shutdown":
        daemon.send(ident, Shutdown(reason="run over"))
    else:
        worker.send_signal(signal.SIGTERM)
    ident, done = daemon.recv(timeout=10)
    assert isinstance(done, RolloutDone) and done.rollout_id == 7
    assert done.status == "INFRA_ERROR" and done.reward is None and "shutting down" in done.error
    assert worker.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 6
    assert not any(alive(p) for p in pids), "a harness process outlived the worker"
    while daemon.sock.poll(timeout=100):  # and no new work was asked for after the stop
        assert not isinstance(daemon.recv()[1], TakeRollout)


def test_a_report_is_sent_again_until_the_daemon_acks_it(tmp_path: Path, daemon: FakeDaemon, start_worker) -> None:
    """A RolloutDone the daemon never confirmed (it died before its ledger had it) is sent again; once acked,
    never again."""
    daemon.acking = False
    start_worker(concurrency=1)
    ident, first = daemon.recv()
    assert isinstance(first, TakeRollout)
    daemon.send(ident, assignment(1, tmp_path / "ws", WRITES_ENV))

    def next_done(timeout: float) -> RolloutDone | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ident, msg = daemon.recv(timeout=max(0.1, deadline - time.monotonic()))
            except AssertionError:
                return None
            if isinstance(msg, TakeRollout):
                daemon.send(ident, NoWork(retry_after_s=0.2))
            elif isinstance(msg, RolloutDone):
                return msg
        return None

    done = next_done(30)
    assert done is not None and done.rollout_id == 1 and done.status == "COMPLETED"
    t_first = time.monotonic()
    daemon.acking = True  # the next copy is acked (FakeDaemon.recv)
    again = next_done(15)
    assert again is not None and again == done and time.monotonic() - t_first >= 4.0
    assert next_done(7) is None  # acked: not sent a third time
