"""Fuzzed control frames against the real daemon, a real node agent and a real TITO proxy's daemon link.

    .venv/bin/python tools/fuzz_frames.py [--frames 10000] [--stale 0.1] [--targets daemon,agent,proxy]
                                          [--seed 0] [--keep]

Each target gets --frames frames: mutations of every real message type that the protocol must refuse
(tools/frame_mutations.py: wrong tokens and versions, truncated and flipped bytes, fields dropped or of another type,
huge arrays and strings, nesting thousands deep, …) and, a --stale share of them, valid frames that name nothing the
run has (unknown rollouts, steps of no attempt, cells that do not exist: a peer that slept through a restart).

  daemon  `gyre daemon`'s code in a process of its own (tools/bench_scale.py's: its ledger, simulated node agents
          holding its cells, a harness worker holding its rollouts) under a valid load of call records from
          simulated proxies while the fuzzer, one more peer, sends its frames one at a time and waits for each answer.
          A refused frame must come back as an Error and be an `events` row (kind bad_message); the load must be
          untouched: every record acked and in model_calls, no error frame to a valid peer, the cells and running
          rollouts as they were, PRAGMA integrity_check ok.
  agent   a real `gyre agent` (a control-plane cell) connected to the fuzzer playing its daemon: every refused frame
          a "dropped a frame" line in its log, heartbeats on after the last frame, a Reregister answered.
  proxy   a real `gyre proxy` (Qwen3 tokenizer) whose daemon link the fuzzer plays: every refused frame a log line,
          its hellos on after the last frame, and an HTTP call routed through the link (RouteQuery → Route).

No crash: the target process alive at the end. No hang: each refused frame answered (daemon) or logged (peers)
within --hang-s. The table gives frames, refusals recorded, stale frames, crashes, hangs and the slowest answer;
the last line is the verdict; the exit status is 1 when any target crashed, hung, missed a refusal or was affected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import bench_scale as bs  # noqa: E402  (the real daemon under a simulated load)
from bench_scale_peers import NodeAgents, take_rollouts  # noqa: E402
from frame_mutations import Mutator, stale  # noqa: E402

from gyre_slurm.errors import ProtocolError  # noqa: E402
from gyre_slurm.peer import connect_to_daemon  # noqa: E402
from gyre_slurm.protocol import (  # noqa: E402
    Error,
    Heartbeat,
    PingRequest,
    ProxyHello,
    Register,
    RegisterAck,
    Reply,
    Reregister,
    Route,
    RouteQuery,
    WireMessage,
    decode,
    encode,
)
from gyre_slurm.roles import Role  # noqa: E402
from gyre_slurm.rundir import ControlInfo, new_token, write_control  # noqa: E402
from gyre_slurm.spawn import gyre_argv, spawn, wait_until  # noqa: E402

DROPPED = "dropped a frame from the daemon"  # what a peer logs for each frame it refuses (peer.drain)
CHUNK = 50  # frames sent to a peer before waiting for its log to count them (its queue never overflows)


@dataclass
class Verdict:
    target: str
    refused: int = 0  # frames sent that decode refuses
    stale: int = 0  # valid frames naming nothing
    recorded: int = 0  # refusals the target recorded (events rows, log lines)
    crashed: bool = False
    hangs: int = 0
    slowest_ms: float = 0.0
    problems: list[str] = field(default_factory=list)


def frames(token: str, seed: int, n: int, stale_share: float, target: str) -> Iterator[tuple[str, bytes]]:
    """n frames, drawn as they are sent (a frame averages ~100 kB): (mutation or "stale:" message type, bytes), the
    stale ones at random places."""
    rng = random.Random(seed)
    at = set(rng.sample(range(n), round(n * stale_share)))
    olds = iter(stale(token, seed, len(at), target))
    mut = Mutator(token, seed)
    for i in range(n):
        if i in at:
            kind, frame = next(olds)
            yield f"stale:{kind}", frame
        else:
            yield mut.frame()


# --- the daemon --------------------------------------------------------------------------------------------------
def fuzz_daemon(a: argparse.Namespace, tmp: Path) -> Verdict:
    v = Verdict("daemon")
    cfg, n_runs = bs.write_config(tmp, 32)
    daemon, run_dir, info = bs.start_daemon(tmp, False)
    agents = NodeAgents(info, -(-n_runs // bs.RUNS_PER_CELL))
    agents.start()
    rollouts = take_rollouts(info, n_runs)
    db = run_dir / "ledger.db"
    cells0 = bs_q(db, "SELECT id, role FROM cells ORDER BY id")
    load_args = argparse.Namespace(clients=1, proxies=2, rate=a.load_rate, new_tokens=300, output_tokens=30,
                                   seed=a.seed, warmup=0.5, duration=a.load_s, max_rss_gb=4.0)
    load: dict = {}
    loader = threading.Thread(target=lambda: load.update(bs.run_load(load_args, tmp, daemon, run_dir, info,
                                                                      rollouts, False)))
    todo = frames(info.token, a.seed, a.frames, a.stale, "daemon")
    sock = connect_to_daemon(info, "fuzzer", linger_ms=0, immediate=False)
    try:
        loader.start()
        time.sleep(1.0)  # the load is on
        for kind, frame in todo:
            sent = time.monotonic()
            sock.send(frame)
            if kind.startswith("stale:"):
                v.stale += 1
                continue
            v.refused += 1
            if not _error_back(sock, info.token, a.hang_s):
                v.hangs += 1
                v.problems.append(f"no Error for a {kind} frame within {a.hang_s:g} s")
                if v.hangs >= 3:
                    break
            v.slowest_ms = max(v.slowest_ms, 1e3 * (time.monotonic() - sent))
            if daemon.poll() is not None:
                break
        loader.join()
        if daemon.poll() is None and not _pinged(sock, info.token, a.hang_s):
            v.hangs += 1
            v.problems.append("the daemon did not answer a ping after the frames")
    finally:
        sock.close()
        v.crashed = daemon.poll() is not None
        if not v.crashed:
            daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        agents.halt.set()
    if v.crashed:
        v.problems.append(f"the daemon died (exit {daemon.returncode}): see {tmp / 'daemon.log'}")
    v.recorded = bs_q(db, "SELECT count(*) FROM events WHERE kind = 'bad_message'")[0][0]
    rows = bs_q(db, "SELECT count(*) FROM model_calls")[0][0]
    running = bs_q(db, "SELECT count(*) FROM rollouts WHERE status = 'RUNNING'")[0][0]
    checks = {"PRAGMA integrity_check": (bs_q(db, "PRAGMA integrity_check"), [("ok",)]),
              "cells": (bs_q(db, "SELECT id, role FROM cells ORDER BY id"), cells0),
              "rollouts RUNNING": (running, n_runs),
              "load: records acked = model_calls rows": (load.get("acked"), rows),
              "load: error frames": (load.get("errors"), {}),
              "load: refused as closed": (load.get("closed"), 0), "load: unacked": (load.get("unacked"), 0)}
    v.problems += [f"{name}: {got!r}, expected {want!r}" for name, (got, want) in checks.items() if got != want]
    return v


def bs_q(db: Path, sql: str) -> list[tuple]:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)) as conn:
        return conn.execute(sql).fetchall()


def _replies(sock: zmq.Socket, token: str, timeout_s: float):
    """The daemon's answers as they come, until timeout_s passes without one."""
    while sock.poll(int(1e3 * timeout_s)):
        try:
            yield decode(sock.recv(), token)
        except ProtocolError as e:
            yield Error(code="undecodable", message=str(e))


def _error_back(sock: zmq.Socket, token: str, timeout_s: float) -> bool:
    """Wait for the Error that answers a refused frame (answers to earlier stale frames are passed over)."""
    return any(isinstance(m, Error) for m in _replies(sock, token, timeout_s))


def _pinged(sock: zmq.Socket, token: str, timeout_s: float) -> bool:
    ping = PingRequest()
    sock.send(encode(ping, token))
    return any(isinstance(m, Reply) and m.req_id == ping.req_id for m in _replies(sock, token, timeout_s))


# --- a peer's daemon, played by the fuzzer -----------------------------------------------------------------------
class PlayedDaemon:
    """A ROUTER where a run's control.json says the daemon is; it answers what keeps a peer going and keeps the
    messages peers send. One thread (the caller's) does everything."""

    def __init__(self, run_dir: Path) -> None:
        self.token = new_token()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_control(run_dir, ControlInfo(endpoint=f"tcp://127.0.0.1:{port}", port=port, token=self.token,
                                           daemon_pid=os.getpid(), daemon_host="localhost", started_at=time.time()))
        self.got: list[tuple[float, bytes, WireMessage]] = []

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.sock.poll(int(1e3 * left)):
                return
            ident, frame = self.sock.recv_multipart()
            msg = decode(frame, self.token)
            self.got.append((time.monotonic(), ident, msg))
            if isinstance(msg, Register):
                self.send(ident, encode(RegisterAck(cell=0, role=Role.ROLLOUT, heartbeat_interval_s=0.2), self.token))
            elif isinstance(msg, RouteQuery):
                self.send(ident, encode(Route(rollout_id=msg.rollout_id, open=False), self.token))

    def send(self, ident: bytes, frame: bytes) -> None:
        self.sock.send_multipart([ident, frame])

    def first(self, kind: type, after: float = 0.0, timeout_s: float = 60.0) -> tuple[float, bytes, WireMessage]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for got in self.got:
                if isinstance(got[2], kind) and got[0] > after:
                    return got
            self.pump(0.1)
        raise TimeoutError(f"no {kind.__name__} within {timeout_s:g} s")


def fuzz_peer(a: argparse.Namespace, target: str, tmp: Path, proc: subprocess.Popen, played: PlayedDaemon,
              log: Path, ident: bytes, probe) -> Verdict:
    """Send the frames to one peer in chunks, each chunk counted in its log before the next; then `probe`."""
    v = Verdict(target)
    todo = frames(played.token, a.seed, a.frames, a.stale, target)
    while chunk := list(itertools.islice(todo, CHUNK)):
        sent = time.monotonic()
        for kind, frame in chunk:
            played.send(ident, frame)
            v.stale += kind.startswith("stale:")
            v.refused += not kind.startswith("stale:")
        while (n := log.read_text(errors="replace").count(DROPPED)) < v.refused:
            if proc.poll() is not None or time.monotonic() - sent > a.hang_s:
                break
            played.pump(0.02)
        v.recorded = n
        if n < v.refused:
            break
        v.slowest_ms = max(v.slowest_ms, 1e3 * (time.monotonic() - sent) / len(chunk))
    v.crashed = proc.poll() is not None
    if v.crashed:
        v.problems.append(f"the {target} died (exit {proc.returncode}): see {log}")
    elif v.recorded < v.refused:
        v.hangs += 1
        v.problems.append(f"{v.refused - v.recorded} refused frames not logged within {a.hang_s:g} s")
    else:
        try:
            probe()
        except (TimeoutError, httpx.HTTPError, AssertionError) as e:
            v.hangs += 1
            v.problems.append(f"after the frames: {e}")
    return v


def fuzz_agent(a: argparse.Namespace, tmp: Path) -> Verdict:
    import yaml

    from gyre_slurm.config import load_config
    from gyre_slurm.run_context import RunContext

    (tmp / "agent.yaml").write_text(yaml.safe_dump({
        "run": {"name": "fuzz", "state_dir": str(tmp / "state")}, "cluster": {"cells": 1, "engine": "none"},
        "control": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 5.0}}))
    ctx = RunContext.create(load_config(tmp / "agent.yaml"), "fuzz-agent")
    played = PlayedDaemon(ctx.run_dir)
    log = tmp / "agent.log"
    proc = spawn(gyre_argv("agent", "--run-dir", str(ctx.run_dir), "--node-index", "0"), log, cwd=REPO)
    try:
        _, ident, _ = played.first(Register)
        played.first(Heartbeat)

        def probe() -> None:
            now = time.monotonic()
            played.first(Heartbeat, after=now, timeout_s=10)
            played.send(ident, encode(Reregister(reason="the fuzzer asks"), played.token))
            played.first(Register, after=now, timeout_s=10)

        return fuzz_peer(a, "agent", tmp, proc, played, log, ident, probe)
    finally:
        proc.terminate()
        proc.wait(30)


def fuzz_proxy(a: argparse.Namespace, tmp: Path) -> Verdict:
    import bench_proxy as bp

    from gyre_slurm.proxy.keys import make_key

    run_dir = tmp / "proxy-run"
    played = PlayedDaemon(run_dir)
    log, ready = tmp / "proxy.log", tmp / "proxy.json"
    proc = spawn(gyre_argv("proxy", "--run-dir", str(run_dir), "--model-path", str(bp.model_dir(tmp, 32_768)),
                           "--port", "0", "--ready-file", str(ready), "--proxy-id", "fuzz", "--log-level", "WARNING"),
                 log, cwd=REPO)
    try:
        played.pump(0.1)
        url = wait_until(lambda: ready.exists() and json.loads(ready.read_text())["url"], what="the proxy",
                         timeout_s=120, procs=proc, log=log)
        _, ident, _ = played.first(ProxyHello)

        def probe() -> None:
            now = time.monotonic()
            played.first(ProxyHello, after=now, timeout_s=10)
            holder: dict = {}
            key = make_key(played.token, 5)
            call = threading.Thread(target=lambda: holder.update(r=httpx.post(
                f"{url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})))
            call.start()  # its route query comes here: answered closed, so the call is refused
            played.first(RouteQuery, after=now, timeout_s=10)
            while call.is_alive():
                played.pump(0.05)
            assert "r" in holder and 400 <= holder["r"].status_code < 500, f"the routed call: {holder}"

        return fuzz_peer(a, "proxy", tmp, proc, played, log, ident, probe)
    finally:
        proc.terminate()
        proc.wait(30)


# --- the report --------------------------------------------------------------------------------------------------
def table(verdicts: list[Verdict]) -> list[str]:
    head = (f"{'target':<7} {'frames':>7} {'refused':>8} {'recorded':>9} {'stale':>6} {'crashes':>8} {'hangs':>6} "
            f"{'slowest ms':>10}")
    rows = [head, "-" * len(head)]
    for v in verdicts:
        rows.append(f"{v.target:<7} {v.refused + v.stale:>7,} {v.refused:>8,} {v.recorded:>9,} {v.stale:>6,} "
                    f"{int(v.crashed):>8} {v.hangs:>6} {v.slowest_ms:>10.1f}")
    return rows


TARGETS = {"daemon": fuzz_daemon, "agent": fuzz_agent, "proxy": fuzz_proxy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=10_000, help="frames per target")
    ap.add_argument("--stale", type=float, default=0.1, help="share of valid frames naming nothing")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--hang-s", type=float, default=30.0, help="a frame not answered or logged within this is a hang")
    ap.add_argument("--load-rate", type=float, default=100.0, help="the daemon's valid load: call records/s")
    ap.add_argument("--load-s", type=float, default=10.0, help="the daemon's valid load: seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, ledger)")
    a = ap.parse_args()
    targets = [t for t in a.targets.split(",") if t]
    if bad := [t for t in targets if t not in TARGETS]:
        ap.error(f"unknown target(s) {bad}: choose from {','.join(TARGETS)}")
    if a.frames < 1 or not 0 <= a.stale < 1:
        ap.error("--frames must be at least 1 and --stale in [0, 1)")
    tmp = Path(tempfile.mkdtemp(prefix="gyre-fuzz-"))
    verdicts = []
    try:
        for t in targets:
            print(f"fuzzing the {t} with {a.frames:,} frames...", file=sys.stderr, flush=True)
            (tmp / t).mkdir()
            verdicts.append(TARGETS[t](a, tmp / t))
    finally:
        if a.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(table(verdicts)))
    for v in verdicts:
        for p in v.problems:
            print(f"{v.target}: {p}")
    n = sum(v.refused + v.stale for v in verdicts)
    if any(v.problems for v in verdicts):
        print(f"fuzz: FAILED: {sum(bool(v.problems) for v in verdicts)} of {len(verdicts)} targets with problems")
        return 1
    print(f"fuzz: OK: {n:,} frames to {', '.join(targets)}: 0 crashes, 0 hangs, every refusal recorded, the run "
          "unaffected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
