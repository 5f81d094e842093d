"""The daemon and node agents as real processes over real ZeroMQ: switches, bad input, loss and restarts."""

from __future__ import annotations

import os
import signal

import msgpack
import pytest
import zmq

from gyre_slurm.protocol import (
    PROTOCOL_VERSION,
    AddCellsRequest,
    CellJobsRequest,
    PingRequest,
    Register,
    ShutdownRequest,
    decode,
    encode,
)
from gyre_slurm.rundir import read_control
from gyre_slurm.spawn import gyre_argv, spawn

from .conftest import gyre, q, wait_for

pytestmark = pytest.mark.slow






def test_reassign_through_the_cli_is_timed_in_role_switches(local_run) -> None:
    run_dir = local_run.run_dir
    sd = run_dir.parent
    r = gyre("cells", "reassign", "r1", "1", "--role", "train", "--state-dir", sd)
    assert r.returncode == 0, r.stderr
    assert "done in" in r.stdout
    (status, frm, to, dur, started, ended), = q(run_dir, "SELECT status, from_role, to_role, duration_s, started_at,"
                                                 " ended_at FROM role_switches")
    assert (status, frm, to) == ("DONE", "ROLLOUT", "TRAIN")
    assert 0 < dur < 10 and started <= ended
    assert q(run_dir, "SELECT role FROM cells ORDER BY id") == [("ROLLOUT",), ("TRAIN",)]
    # the agent itself reports the new role in its heartbeats
    wait_for(lambda: q(run_dir, "SELECT role FROM agents WHERE node_index = 1") == [("TRAIN",)], what="agent role")
    # refusals are one clear line each, and change nothing
    for args, why in [(["1", "--role", "train"], "already TRAIN"), (["7", "--role", "train"], "no cell 7"),
                      (["0", "--role", "sleep"], "--role must be train or rollout")]:
        r = gyre("cells", "reassign", "r1", *args, "--state-dir", sd)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert q(run_dir, "SELECT count(*) FROM role_switches") == [(1,)]
    # a cell moved by hand is pinned (no policy moves it) until released
    assert q(run_dir, "SELECT id, pinned FROM cells ORDER BY id") == [(0, 0), (1, 1)]
    r = gyre("cells", "list", "r1", "--state-dir", sd)
    assert r.returncode == 0 and "pinned" in r.stdout, r.stdout
    r = gyre("cells", "release", "r1", "1", "--state-dir", sd)
    assert r.returncode == 0 and "released" in r.stdout, r.stderr
    assert q(run_dir, "SELECT pinned FROM cells WHERE id = 1") == [(0,)]
    r = gyre("cells", "release", "r1", "1", "--state-dir", sd)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["error: cell 1 is not pinned"], r.stderr
    r = gyre("cells", "reassign", "r1", "1", "--role", "rollout", "--state-dir", sd)
    assert r.returncode == 0, r.stderr
    rows = q(run_dir, "SELECT cell, from_role, to_role, status FROM v_switch_durations ORDER BY switch")
    assert rows == [(1, "ROLLOUT", "TRAIN", "DONE"), (1, "TRAIN", "ROLLOUT", "DONE")]
    roles = dict(((c, role), s) for c, role, s in q(run_dir, "SELECT cell, role, seconds FROM v_cell_role_time"))
    assert roles[(1, "TRAIN")] > 0 and roles[(1, "SWITCHING")] > 0
    r = gyre("status", "r1", "--state-dir", sd)
    assert r.returncode == 0 and "TRAIN → ROLLOUT" in r.stdout and "ROLLOUT" in r.stdout, r.stdout


def test_malformed_messages_get_errors_and_the_daemon_serves_on(local_run) -> None:
    info = read_control(local_run.run_dir)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info.endpoint)

    def ask(frames) -> dict:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no answer"
        env = msgpack.unpackb(sock.recv())
        return env["msg"]

    bad = {
        "malformed": [b"\x93garbage"],
        "auth": [msgpack.packb({"v": PROTOCOL_VERSION, "token": "guess", "msg": ShutdownRequest().wire_body()})],
        "version": [msgpack.packb({"v": 999, "token": info.token, "msg": {}})],
        "unknown_type": [msgpack.packb({"v": PROTOCOL_VERSION, "token": info.token, "msg": {"type": "rm -rf"}})],
        "invalid": [msgpack.packb({"v": PROTOCOL_VERSION, "token": info.token,
                                   "msg": {"type": "heartbeat", "node_index": "zero"}})],
        "refused": [encode(Register(node_index=99, node_name="x", host="x", pid=1), info.token)],
    }
    for code, frames in bad.items():
        reply = ask(frames)
        assert reply["type"] == "error" and reply["code"] == code, (code, reply)
    # a frame in several parts is dropped without an answer (an event too); the daemon goes on
    sock.send_multipart([b"a", b"b"])
    sock.send(encode(PingRequest(), info.token))
    assert sock.poll(5000)
    reply = decode(sock.recv(), info.token)
    assert reply.ok and reply.result["run_id"] == "r1"
    sock.close()
    assert local_run.daemon.poll() is None
    wait_for(lambda: q(local_run.run_dir, "SELECT count(*) FROM events WHERE kind = 'bad_message'") == [(6,)],
             what="bad_message events")
    # the wrong-token shutdown did nothing
    assert q(local_run.run_dir, "SELECT status FROM runs") == [("RUNNING",)]


def test_a_lost_agent_marks_its_cell_down_and_comes_back(local_run) -> None:
    run_dir = local_run.run_dir
    victim = local_run.agents[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    wait_for(lambda: q(run_dir, "SELECT role FROM cells WHERE id = 1") == [("DOWN",)], what="cell 1 DOWN")
    assert q(run_dir, "SELECT status FROM agents WHERE node_index = 1") == [("LOST",)]
    assert q(run_dir, "SELECT count(*) FROM events WHERE kind = 'agent_lost' AND cell_id = 1") == [(1,)]
    assert q(run_dir, "SELECT role FROM cells WHERE id = 0") == [("ROLLOUT",)]
    r = gyre("cells", "reassign", "r1", "1", "--role", "train", "--state-dir", run_dir.parent)
    assert r.returncode == 1 and "DOWN" in r.stderr
    # a replacement agent for the node brings the cell back
    local_run.agents[1] = spawn(gyre_argv("agent", "--run-dir", str(run_dir), "--node-index", "1"),
                                run_dir / "logs" / "agent-1b.log")
    wait_for(lambda: q(run_dir, "SELECT role FROM cells WHERE id = 1") == [("ROLLOUT",)], what="cell 1 back")
    assert q(run_dir, "SELECT status, registrations FROM agents WHERE node_index = 1") == [("UP", 2)]


def test_daemon_kill9_and_restart_loses_and_duplicates_nothing(local_run, config_file) -> None:
    run_dir = local_run.run_dir
    sd = run_dir.parent
    assert gyre("cells", "reassign", "r1", "0", "--role", "train", "--state-dir", sd).returncode == 0
    tables = ["cells", "agents", "role_switches", "cell_spans", "runs"]
    before = {t: q(run_dir, f"SELECT * FROM {t}") for t in ["role_switches", "cells"]}
    n_events = q(run_dir, "SELECT count(*) FROM events")[0][0]
    port = read_control(run_dir).port
    os.kill(local_run.daemon.pid, signal.SIGKILL)
    local_run.daemon.wait()
    assert q(run_dir, "PRAGMA integrity_check") == [("ok",)]
    local_run.daemon = spawn(gyre_argv("daemon", str(config_file), "--run-id", "r1"), run_dir / "logs" / "daemon2.log")
    wait_for(lambda: q(run_dir, "SELECT daemon_starts FROM runs") == [(2,)], what="daemon restart")
    # both agents re-register by themselves, with the roles they hold
    wait_for(lambda: q(run_dir, "SELECT count(*) FROM agents WHERE status = 'UP' AND registrations = 2") == [(2,)],
             what="agents re-registered")
    assert read_control(run_dir).port == port
    assert q(run_dir, "SELECT node_index, role FROM agents ORDER BY node_index") == [(0, "TRAIN"), (1, "ROLLOUT")]
    assert q(run_dir, "SELECT * FROM role_switches") == before["role_switches"]
    assert [r[:3] for r in q(run_dir, "SELECT * FROM cells")] == [r[:3] for r in before["cells"]]
    for t in tables:
        assert q(run_dir, f"SELECT count(*) FROM {t}")[0][0] == len(set(q(run_dir, f"SELECT * FROM {t}")))
    assert q(run_dir, "SELECT count(*) FROM cell_spans WHERE ended_at IS NULL") == [(2,)]  # one open span per cell
    assert q(run_dir, "SELECT count(*) FROM events")[0][0] > n_events
    assert q(run_dir, "PRAGMA integrity_check") == [("ok",)]
    # and the restarted daemon works: a switch goes through
    r = gyre("cells", "reassign", "r1", "0", "--role", "rollout", "--state-dir", sd)
    assert r.returncode == 0, r.stderr
    assert q(run_dir, "SELECT id, status FROM role_switches ORDER BY id") == [(1, "DONE"), (2, "DONE")]


def test_cell_job_requests_are_refused_in_one_line_where_they_do_not_apply(local_run) -> None:
    """`gyre cells add` on a run whose cells are not Slurm jobs of their own, and a job for a cell the run does not
    have: a clear refusal each, nothing written, the daemon serves on. (Malformed requests never validate: the
    protocol refuses them, tests/test_protocol.py.)"""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.errors import ControlError

    r = gyre("cells", "add", str(local_run.run_dir), "1")
    assert r.returncode != 0 and "only a run started with `gyre submit` can add cells" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    with pytest.raises(ControlError, match="only a run started with `gyre submit` can add cells"):
        request(local_run.run_dir, AddCellsRequest(n=1))
    with pytest.raises(ControlError, match="no cell 7"):
        request(local_run.run_dir, CellJobsRequest(jobs={7: "12"}))
    assert q(local_run.run_dir, "SELECT count(*) FROM cells WHERE slurm_job_id IS NOT NULL") == [(0,)]
    assert request(local_run.run_dir, PingRequest())["run_id"] == "r1"


def test_shutdown_request_stops_everything_cleanly(local_run) -> None:
    from gyre_slurm.coordinator.client import request

    assert request(local_run.run_dir, ShutdownRequest())["stopping"]
    for p in local_run.procs:
        assert p.wait(timeout=15) == 0
    rd = local_run.run_dir
    assert q(rd, "SELECT status FROM runs") == [("STOPPED",)]
    assert q(rd, "SELECT DISTINCT status FROM agents") == [("STOPPED",)]
    assert q(rd, "SELECT count(*) FROM cell_spans WHERE ended_at IS NULL") == [(0,)]
