"""Load test of the coordinator at ten times the paper's rates: call records into the real daemon and ledger.

    .venv/bin/python tools/bench_scale.py [--agents 256] [--proxies 8] [--rate 1100] [--new-tokens 5000]
        [--duration 10] [--proxy-long 100000] [--encrypt] [--profile] [--keep]

The real daemon (`gyre daemon`'s code in a process of its own, with its ledger and segment file) gets simulated
peers over ZeroMQ: node agents (Register with an engine URL, heartbeats) make its cells ROLLOUT, a harness worker
takes every admitted rollout (RUNNING from then on, never finished), and --proxies TITO proxies (DEALER sockets in
--clients processes) carry --agents agent runs. Each run sends CallRecords that extend its history (parent_call =
its previous call, reused_tokens = that call's prompt + output) by --new-tokens ids (--output-tokens sampled, with
log-probs), one at a time, each at its share of --rate calls/s or as soon as the last ack came. Over --duration s
after --warmup s: call records/s and new tokens/s acked, p50/p99 ack latency (send → CallAck), CPU, the daemon's
garbage-collection pauses; over the whole load: ledger growth (ledger.db + WAL + segment file) per M tokens and
daemon RSS growth per token held in open trajectory trees. Then the proxy's calls/s per core at --proxy-short and
--proxy-long history tokens (bench_proxy.py's real `gyre proxy`, Qwen3 tokenizer and engine stand-in, over HTTP):
calls / the proxy process's CPU seconds. --profile: py-spy samples the daemon over the window (cProfile over its
whole life where py-spy cannot attach) and the top entries by own time are printed. --encrypt: the control channel
under CURVE (control.encrypt), measured after the same load without it in the same invocation; the goals apply to
the encrypted run, and a line gives its cost as ratios to the plain one.

Baseline: the paper's 2.4T run as estimated (192 nodes, ~1,000 agent runs, ~700k tokens per trajectory): 100
calls/s and 0.5 M recorded tokens/s; ledger bytes also as a ratio to the packed floor (4-byte ids and log-probs).
Goals, ten times the paper on this 2-core machine: >= 1,000 calls/s, >= 5 M tokens/s, p99 ack < 100 ms, <= 8 bytes
of daemon memory per open token; each missed goal is named and the exit status is 1. The last line is the
headline: calls/s and tokens/s as ratios to the goals and to the paper, and the p99.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing
from dataclasses import asdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_scale_peers import NodeAgents, take_rollouts  # noqa: E402  (the simulated peers)

from gyre_slurm.errors import GyreError  # noqa: E402
from gyre_slurm.rundir import ControlInfo, read_control  # noqa: E402
from gyre_slurm.spawn import spawn, wait_until  # noqa: E402

PAPER_CALLS_S, PAPER_TOKENS_S = 100.0, 0.5e6  # the baseline: the paper's 2.4T run as estimated
RUNS_PER_CELL, GROUP_SIZE = 32, 16


def cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads, to the nanosecond (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread just ended
    return total / 1e9


def sched(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a process's main thread."""
    on, wait = (Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split())[:2]
    return int(on) / 1e9, int(wait) / 1e9


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (/proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise GyreError(f"no VmRSS for pid {pid}")


def ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# --- the daemon and its other peers ----------------------------------------------------------------------------
def write_config(tmp: Path, agents: int, encrypt: bool = False) -> tuple[Path, int]:
    """A run whose rollouts stay RUNNING through the load: cells and groups for `agents` runs in flight, a harness
    time limit far beyond the benchmark, colocate (it admits one step's groups, then waits for them). Returns the
    config and the rollouts it admits (agents rounded up to whole groups)."""
    groups = -(-agents // GROUP_SIZE)
    n = groups * GROUP_SIZE
    model = tmp / "model"  # what the daemon reads of version 0: its folder (no engine ever loads it here)
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cfg = {"run": {"name": "bench-scale", "state_dir": str(tmp / "state"), "max_wall_s": 3600},
           "cluster": {"cells": -(-n // RUNS_PER_CELL), "rollouts_per_cell": RUNS_PER_CELL, "engine": "embedded"},
           "control": {"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 30.0, "encrypt": encrypt},
           "scheduler": {"policy": "colocate"}, "model": {"path": str(model)},
           "tasks": {"group_size": GROUP_SIZE, "groups_per_step": groups},
           "harness": {"timeout_s": 3600, "workers": 0}}
    (tmp / "bench-scale.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "bench-scale.yaml", n


def serve_daemon(tmp: Path) -> None:
    """`gyre daemon bench-scale.yaml --run-id bench`, in this process with its collections timed into gc.log (and,
    when daemon.prof is asked for, under cProfile)."""
    import gc

    log = open(tmp / "gc.log", "a", buffering=1)  # noqa: SIM115 - written until the process ends
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            log.write(f"{time.time():.4f} {info['generation']} {time.perf_counter() - started[0]:.6f}\n")

    gc.callbacks.append(timed)
    sys.argv = ["gyre", "daemon", str(tmp / "bench-scale.yaml"), "--run-id", "bench"]
    from gyre_slurm.cli import main as gyre_main

    if not (tmp / "daemon.prof.wanted").exists():
        gyre_main()
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(gyre_main)
    finally:
        prof.dump_stats(tmp / "daemon.prof")


def gc_pauses(tmp: Path, t0: float, t1: float) -> dict[str, float]:
    """The daemon's collections in [t0, t1]: full ones (generation 2), their longest, and the time in all."""
    rows = [ln.split() for ln in (tmp / "gc.log").read_text().splitlines()]
    win = [(int(g), float(s)) for t, g, s in rows if t0 <= float(t) <= t1]
    full = [s for g, s in win if g == 2]
    return {"full": len(full), "full_max_ms": 1e3 * max(full, default=0.0), "ms": 1e3 * sum(s for _, s in win),
            "share": sum(s for _, s in win) / max(1e-9, t1 - t0)}


def start_daemon(tmp: Path, cprofile: bool) -> tuple[subprocess.Popen, Path, ControlInfo]:
    run_dir = tmp / "state" / "bench"
    if cprofile:  # py-spy cannot attach here: the daemon runs under cProfile
        (tmp / "daemon.prof.wanted").touch()
    proc = spawn([sys.executable, __file__, "--serve-daemon", str(tmp)], tmp / "daemon.log", cwd=REPO)

    def control() -> ControlInfo | None:
        try:
            return read_control(run_dir)
        except GyreError:
            return None

    return proc, run_dir, wait_until(control, what="the daemon", timeout_s=120, procs=proc, log=tmp / "daemon.log")


def ledger_bytes(run_dir: Path) -> dict[str, int]:
    files = {"db": run_dir / "ledger.db", "wal": run_dir / "ledger.db-wal", "seg": run_dir / "segments" / "calls.seg"}
    return {k: (p.stat().st_size if p.exists() else 0) for k, p in files.items()}


# --- the load ----------------------------------------------------------------------------------------------------
def start_clients(a: argparse.Namespace, tmp: Path, info: ControlInfo, rollouts: list[int],
                  procs: list[subprocess.Popen]) -> list[dict]:
    """Spawn the client processes and wait until each has connected its proxies (its ready file)."""
    k = max(1, min(a.clients, len(rollouts)))
    per_client = -(-a.proxies // k)
    specs = []
    for c in range(k):
        mine = rollouts[c::k]
        spec = {"client": c, "control": asdict(info), "rollouts": mine, "proxies": per_client,
                "rate": a.rate * len(mine) / len(rollouts), "new_tokens": a.new_tokens,
                "output_tokens": a.output_tokens, "seed": a.seed + c, "go_file": str(tmp / "go.json"),
                "stop_file": str(tmp / "stop"), "ready": str(tmp / f"client{c}.ready"),
                "out": str(tmp / f"client{c}.json")}
        path = tmp / f"client{c}.spec.json"
        path.write_text(json.dumps(spec))
        procs.append(spawn([sys.executable, str(REPO / "tools" / "bench_scale_peers.py"), str(path)],
                           tmp / f"client{c}.log", cwd=REPO))
        specs.append(spec)
    for spec, proc in zip(specs, procs[-k:], strict=True):
        wait_until(lambda s=spec: Path(s["ready"]).exists(), what=f"client {spec['client']}", timeout_s=60,
                   procs=proc, log=tmp / f"client{spec['client']}.log")
    return specs


def py_spy() -> str | None:
    exe = REPO / ".venv" / "bin" / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


def start_py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    return subprocess.Popen([py_spy(), "record", "--format", "raw", "-o", str(out), "--pid", str(pid), "--duration",
                             str(max(1, round(seconds))), "--rate", "100", "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def py_spy_attaches() -> bool:
    """Whether py-spy is here and may read another process (ptrace), tried on a throwaway child."""
    if py_spy() is None:
        return False
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        return subprocess.run([py_spy(), "dump", "--pid", str(child.pid)], capture_output=True,
                              timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        child.kill()
        child.wait()


def run_load(a: argparse.Namespace, tmp: Path, daemon: subprocess.Popen, run_dir: Path, info: ControlInfo,
             rollouts: list[int], spy: bool) -> dict:
    """The load: warm-up, the measured window, then every ack; the figures of the daemon's side."""
    procs: list[subprocess.Popen] = []
    try:
        specs = start_clients(a, tmp, info, rollouts, procs)
        with closing(sqlite3.connect(run_dir / "ledger.db")) as conn:  # an empty WAL: the growth is the load's
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        rss0, ledger0 = rss_bytes(daemon.pid), ledger_bytes(run_dir)
        t_start = time.time() + 0.1
        t0 = t_start + a.warmup
        t1 = t0 + a.duration
        (tmp / "go.json").write_text(json.dumps({"t_start": t_start, "t0": t0, "t1": t1}))
        time.sleep(max(0.0, t0 - time.time()))
        cpu0 = {p.pid: cpu_s(p.pid) for p in [daemon, *procs]}
        main0, busy0 = sched(daemon.pid), machine_busy_s()
        prof = start_py_spy(daemon.pid, a.duration, tmp / "py-spy.txt") if spy else None
        peak = 0
        while time.time() < t1:
            peak = max(peak, rss_bytes(daemon.pid))
            if peak > a.max_rss_gb * 2**30:  # the trees fill the machine: end the window here
                t1 = time.time()
                (tmp / "stop").write_text(repr(t1))
                print(f"daemon RSS {peak / 2**30:.1f} GiB > --max-rss-gb: window ended early", file=sys.stderr)
                break
            time.sleep(0.25)
        cpu1 = {p.pid: cpu_s(p.pid) for p in [daemon, *procs]}
        main1, busy1 = sched(daemon.pid), machine_busy_s()
        wall = time.time() - t0
        for p in procs:
            p.wait(timeout=60)
        time.sleep(0.5)  # the daemon's last batch reaches the ledger
        rss1 = rss_bytes(daemon.pid)
        err = prof.communicate(timeout=60)[1] if prof is not None else ""
        if prof is not None and prof.returncode:
            print(f"py-spy failed: {err.strip()[-500:]}", file=sys.stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = [json.loads(Path(s["out"]).read_text()) for s in specs]
    lat = [x for r in res for x in r["lat_ms"]]
    errors = Counter()
    for r in res:
        errors.update(r["errors"])
    total = {k: sum(r[k] for r in res) for k in ("win_acked", "win_tokens", "acked", "tokens", "closed", "unacked")}
    return {"wall": wall, "calls_s": total["win_acked"] / wall, "tokens_s": total["win_tokens"] / wall,
            "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "n_lat": len(lat), "clients": len(procs),
            "daemon_cores": (cpu1[daemon.pid] - cpu0[daemon.pid]) / wall, "machine_cores": (busy1 - busy0) / wall,
            "main_on": (main1[0] - main0[0]) / wall, "main_wait": (main1[1] - main0[1]) / wall,
            "client_cores": sum(cpu1[p.pid] - cpu0[p.pid] for p in procs) / wall, **total, "errors": dict(errors),
            "rss": (rss0, rss1, max(peak, rss1)), "ledger0": ledger0, "gc": gc_pauses(tmp, t0, t0 + wall)}


# --- the profile -------------------------------------------------------------------------------------------------
def _short(frame: str) -> str:
    """'fn (/abs/path/gyre_slurm/x.py:12)' → 'fn (gyre_slurm/x.py:12)'."""
    name, _, where = frame.partition(" (")
    for root in (str(REPO) + "/", "site-packages/", "lib/python3"):
        where = where.split(root, 1)[-1]
    return f"{name} ({where.rstrip(')')})"


def print_py_spy(raw: Path, n: int = 12) -> None:
    """The daemon's top functions by own time (the leaf of each sample), with their inclusive share and hottest
    line; then the daemon's own functions by inclusive time."""
    own, incl, hot, total = Counter(), Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_short(f) for f in stack.split(";") if " (" in f]
        if not frames or not count.isdigit():
            continue
        c, funcs = int(count), [f.rsplit(":", 1)[0] + ")" for f in frames]
        total += c
        own[funcs[-1]] += c
        hot[frames[-1]] += c
        incl.update({f: c for f in set(funcs)})
    print(f"profile (py-spy, {total} samples of the daemon over the window; own = in the function itself, incl = "
          "with what it calls; a collection's pause counts to the line whose allocation set it off):")
    for f, c in own.most_common(n):
        line = max((h for h in hot if h.rsplit(":", 1)[0] + ")" == f), key=lambda h: hot[h]).rsplit(":", 1)[1]
        print(f"  own {100 * c / total:5.1f}%  incl {100 * incl[f] / total:5.1f}%  {f}  (hottest line {line[:-1]})")
    print("  the daemon's own code, by inclusive time:")
    for f, c in [(f, c) for f, c in incl.most_common() if "gyre_slurm/" in f][:n]:
        print(f"  incl {100 * c / total:5.1f}%  {f}")


def print_cprofile(path: Path, n: int = 12) -> None:
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("tottime").print_stats(n)
    body = buf.getvalue().splitlines()
    start = next((i for i, ln in enumerate(body) if ln.strip().startswith("ncalls")), 0)
    print("profile (cProfile over the daemon's whole life: py-spy could not attach here), top by own time:\n  "
          + "\n  ".join(body[start:start + n + 1]))


# --- the proxy's calls per core (bench_proxy.py's real proxy, tokenizer and engine stand-in) ------------------------
def proxy_per_core(a: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Calls per CPU-second of the proxy process at --proxy-short and --proxy-long history tokens."""
    import bench_proxy as bp  # heavy (transformers): imported only where needed
    import httpx

    from gyre_slurm.model.qwen3_tokenizer import load_qwen3_tokenizer

    procs: list[subprocess.Popen] = []
    (tmp / "proxy").mkdir()
    out: dict[str, float] = {}
    try:
        _engine_url, daemon, url = bp.start_servers(tmp / "proxy", a.proxy_long + 65_536, procs)
        proxy_pid = procs[1].pid
        ns = argparse.Namespace(short=a.proxy_short, long=a.proxy_long, rollouts=a.proxy_rollouts,
                                calls=a.proxy_calls, api="openai")
        with httpx.Client(timeout=600) as http:
            rollouts = bp.build_rollouts(ns, http, url, daemon.token, load_qwen3_tokenizer(), random.Random(a.seed))
            for name in bp.NAMES:
                c0 = cpu_s(proxy_pid)
                for _ in range(a.proxy_calls):
                    for ro in rollouts[name]:
                        ro.call()
                out[name] = a.proxy_calls * len(rollouts[name]) / max(1e-9, cpu_s(proxy_pid) - c0)
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return out


# --- the report ----------------------------------------------------------------------------------------------------
def report(a: argparse.Namespace, n_runs: int, r: dict, proxy: dict[str, float]) -> list[str]:
    """Print every figure but the headline; the missed goals."""
    grow = {k: r["ledger1"][k] - r["ledger0"][k] for k in r["ledger0"]}
    per_m = sum(grow.values()) / max(1e-9, r["tokens"] / 1e6)
    floor = 4e6 * (1 + a.output_tokens / a.new_tokens)  # packed: a 4-byte id per token, a 4-byte log-prob per output
    rss0, rss1, peak = r["rss"]
    per_tok = (rss1 - rss0) / max(1, r["tokens"])
    g, mib = r["gc"], 2**20
    print(f"load: {n_runs} agent runs RUNNING on {a.proxies} simulated proxies in {r['clients']} client processes, "
          f"offered {a.rate:,.0f} calls/s, {a.new_tokens:,} new tokens per call ({a.output_tokens:,} sampled); "
          f"window {r['wall']:.1f} s after {a.warmup:g} s of warm-up")
    print(f"ingest: {r['calls_s']:,.0f} call records/s, {r['tokens_s'] / 1e6:.2f} M new tokens/s acked; ack latency "
          f"p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms ({r['n_lat']:,} calls)")
    print(f"cpu: daemon {r['daemon_cores']:.2f} cores ({1e6 * r['daemon_cores'] / max(1e-9, r['calls_s']):,.0f} us "
          f"per call; its main thread on a CPU {100 * r['main_on']:.0f}% of the window, waiting for one "
          f"{100 * r['main_wait']:.0f}%), clients {r['client_cores']:.2f} cores, the rest of the machine (this "
          f"tool, py-spy, anyone else) {r['machine_cores'] - r['daemon_cores'] - r['client_cores']:.2f} of "
          f"{os.cpu_count()}")
    print(f"gc: the daemon made {g['full']} full collections in the window (longest {g['full_max_ms']:,.0f} ms) and "
          f"spent {g['ms']:,.0f} ms in all collections ({100 * g['share']:.0f}% of the window)")
    print(f"records: {r['acked']:,} acked, {r['rows']:,} model_calls rows, refused (rollout closed) {r['closed']}, "
          f"error frames {r['errors'] or 0}, unacked at the end {r['unacked']}")
    print(f"ledger: {per_m:,.0f} bytes per M tokens (ledger.db {grow['db'] / mib:.1f} MiB + WAL {grow['wal'] / mib:.1f}"
          f" MiB + segments {grow['seg'] / mib:.1f} MiB for {r['tokens'] / 1e6:.1f} M tokens), {per_m / floor:.2f}x "
          f"the packed floor of {floor:,.0f}")
    print(f"memory: {per_tok:.1f} bytes of daemon RSS per token held in open trajectory trees (RSS {rss0 / mib:,.0f}"
          f" → {rss1 / mib:,.0f} MiB, peak {peak / mib:,.0f} MiB, {r['tokens'] / 1e6:.1f} M tokens in {n_runs} open "
          f"rollouts), {ratio(per_tok, a.goal_bytes_per_token):.1f}x the goal")
    short_k, long_k = f"{a.proxy_short / 1000:g}k", f"{a.proxy_long / 1000:g}k"
    print(f"proxy: {proxy['short']:,.1f} calls/s per core at {short_k}-token histories, {proxy['long']:,.1f} at "
          f"{long_k} ({a.proxy_rollouts * a.proxy_calls} calls each / the proxy process's CPU seconds): "
          f"{ratio(10 * PAPER_CALLS_S, proxy['long']):,.1f} proxy cores for {10 * PAPER_CALLS_S:,.0f} calls/s at "
          f"{long_k}")
    missed = [f"calls/s {r['calls_s']:,.0f} < {a.goal_calls:,.0f}"] if r["calls_s"] < a.goal_calls else []
    if r["tokens_s"] < a.goal_tokens:
        missed.append(f"tokens/s {r['tokens_s'] / 1e6:.2f} M < {a.goal_tokens / 1e6:g} M")
    if not r["p99"] < a.goal_p99_ms:
        missed.append(f"p99 ack {r['p99']:.1f} ms >= {a.goal_p99_ms:g} ms")
    if per_tok > a.goal_bytes_per_token:
        missed.append(f"memory per open token {per_tok:.1f} B > {a.goal_bytes_per_token:g} B")
    return missed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg = p.add_argument
    arg("--agents", type=int, default=256, help="agent runs in flight (rounded up to whole groups of 16)")
    arg("--proxies", type=int, default=8, help="simulated TITO proxies (DEALER sockets)")
    arg("--clients", type=int, default=2, help="client processes the proxies run in")
    arg("--rate", type=float, default=1100, help="offered calls/s in all, 10%% above the goal so that meeting it is "
                                                "measured, not the pacing (0: each run as fast as it is acked)")
    arg("--new-tokens", type=int, default=5000, help="new tokens per call (the paper: 0.5 M/s over 100 calls/s)")
    arg("--output-tokens", type=int, default=500, help="of them sampled (with log-probs)")
    arg("--warmup", type=float, default=3.0, help="seconds of load before the window")
    arg("--duration", type=float, default=10.0, help="seconds of the measured window")
    arg("--max-rss-gb", type=float, default=6.0, help="end the window early past this daemon RSS")
    arg("--proxy-short", type=int, default=1_000, help="short history for the proxy's calls per core (tokens)")
    arg("--proxy-long", type=int, default=100_000, help="long history for the proxy's calls per core (tokens)")
    arg("--proxy-rollouts", type=int, default=2, help="proxy rollouts per history length")
    arg("--proxy-calls", type=int, default=8, help="timed proxy calls per rollout")
    arg("--profile", action="store_true", help="profile the daemon (py-spy, else cProfile)")
    arg("--encrypt", action="store_true", help="the control channel encrypted (control.encrypt: CURVE); the same "
                                               "load without encryption runs first, as the baseline of its cost")
    arg("--keep", action="store_true", help="keep the temporary folder (logs, ledger, raw profile)")
    arg("--goal-calls", type=float, default=1_000.0, help="goal: call records/s, at least")
    arg("--goal-tokens", type=float, default=5e6, help="goal: new tokens/s, at least")
    arg("--goal-p99-ms", type=float, default=100.0, help="goal: p99 ack latency below (ms)")
    arg("--goal-bytes-per-token", type=float, default=8.0, help="goal: daemon bytes per open token, at most")
    arg("--seed", type=int, default=0)
    arg("--serve-daemon", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if not 0 <= a.output_tokens < a.new_tokens:
        p.error("--output-tokens must be below --new-tokens")
    return a


def load_once(a: argparse.Namespace, tmp: Path, encrypt: bool) -> tuple[int, dict, bool]:
    """One daemon under the load, encrypted or not: (agent runs, the figures, whether py-spy profiled it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg, n_runs = write_config(tmp, a.agents, encrypt)
    spy = a.profile and py_spy_attaches()
    daemon, run_dir, info = start_daemon(tmp, a.profile and not spy)
    agents = NodeAgents(info, -(-n_runs // RUNS_PER_CELL))
    print(f"daemon pid {daemon.pid} ({cfg}{', CURVE' if encrypt else ''}); registering cells, taking {n_runs} "
          "rollouts...", file=sys.stderr)
    try:
        agents.start()
        r = run_load(a, tmp, daemon, run_dir, info, take_rollouts(info, n_runs), spy)
        r["alive"] = daemon.poll() is None
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)  # a clean stop: closing the ledger checkpoints its WAL
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        agents.halt.set()
    r["ledger1"] = ledger_bytes(run_dir)
    with closing(sqlite3.connect(run_dir / "ledger.db")) as conn:
        r["rows"] = conn.execute("SELECT count(*) FROM model_calls").fetchone()[0]
    bad = [ln for ln in (tmp / "daemon.log").read_text(errors="replace").splitlines()
           if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln]
    if bad:
        print(f"daemon log: {len(bad)} warning/error lines; the first:\n  " + "\n  ".join(bad[:5]), file=sys.stderr)
    return n_runs, r, spy


def run(a: argparse.Namespace, tmp: Path) -> list[str]:
    plain = load_once(a, tmp / "plain", False)[1] if a.encrypt else None  # the baseline of --encrypt, same run
    n_runs, r, spy = load_once(a, tmp / ("curve" if a.encrypt else "plain"), a.encrypt)
    print("measuring the proxy's calls per core...", file=sys.stderr)
    missed = report(a, n_runs, r, proxy_per_core(a, tmp))
    if plain is not None:
        us = [1e6 * x["daemon_cores"] / max(1e-9, x["calls_s"]) for x in (r, plain)]
        print(f"encryption: CURVE on {r['calls_s']:,.0f} calls/s, off {plain['calls_s']:,.0f} "
              f"({ratio(r['calls_s'], plain['calls_s']):.2f}x); p99 ack on {r['p99']:.1f} ms, off "
              f"{plain['p99']:.1f} ms; daemon CPU per call on {us[0]:,.0f} us, off {us[1]:,.0f} us "
              f"({ratio(us[0], us[1]):.2f}x)")
    wanted = tmp / ("curve" if a.encrypt else "plain")
    if spy and (wanted / "py-spy.txt").exists():
        print_py_spy(wanted / "py-spy.txt")
    elif (wanted / "daemon.prof").exists():
        print_cprofile(wanted / "daemon.prof")
    missed += [] if r["alive"] else ["the daemon died under the load"]
    for line in missed:
        print(f"MISSED TARGET: {line}")
    print(f"into daemon + ledger{' (CURVE)' if a.encrypt else ''}: {r['calls_s']:,.0f} calls/s "
          f"({ratio(r['calls_s'], a.goal_calls):.2f}x the "
          f"{a.goal_calls:,.0f} goal, {r['calls_s'] / PAPER_CALLS_S:.1f}x the paper's {PAPER_CALLS_S:.0f}), "
          f"{r['tokens_s'] / 1e6:.2f} M tokens/s ({ratio(r['tokens_s'], a.goal_tokens):.2f}x the "
          f"{a.goal_tokens / 1e6:g} M goal, {r['tokens_s'] / PAPER_TOKENS_S:.1f}x the paper's "
          f"{PAPER_TOKENS_S / 1e6:g} M), p99 ack {r['p99']:.1f} ms (goal < {a.goal_p99_ms:g})")
    return missed


def main() -> None:
    a = parse_args()
    if a.serve_daemon:
        serve_daemon(a.serve_daemon)
        return
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-scale-"))
    try:
        missed = run(a, tmp)
    finally:
        if a.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if missed:
        sys.exit(1)


if __name__ == "__main__":
    main()
