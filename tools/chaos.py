"""A fault campaign against real runs of the embedded default: kill -9, hangs and partitions of every kind of process,
a full and a slow disk, at random moments.

    .venv/bin/python tools/chaos.py [--faults kill,hang,partition,full,slow] [--per-kind 20] [--per-run 10]
                                    [--kinds daemon,proxy,...,disk] [--hang-s 5,90] [--hang-timeout 30]
                                    [--partition-s 10,120] [--full-s 10,60] [--slow-s 20,60] [--mixed] [--out DIR]

Each run is a real `gyre run` of configs/tiny-cpu.yaml (daemon, node agents with their embedded engines, the TITO
proxy, a harness worker, torch training), which supervises its processes. The faults:

  kill  kill -9: the supervisor starts the process again and it rejoins (events: process_restarted)
  hang  SIGSTOP, SIGCONT after a draw from --hang-s seconds: the pid lives on and answers nothing. The run's
        control.hang_timeout_s is --hang-timeout: a process silent longer (its beacon, beacon.py) is killed and
        started again (process_hung, then process_restarted); a shorter stop is told when it wakes
        (process_stalled); either way the run must go on, and what the woken process sends must harm nothing
  partition  the process's connections to the daemon's port dropped both ways for a draw from --partition-s
        seconds (tools/faults.py: iptables on loopback; root), every kind but the daemon; the run must go on.
        An agent's is named by agent_lost (heartbeats), a proxy's by proxy_silent, a worker's by worker_silent
  full  the run's folder (kind disk: an ext4 image of its own, tools/disk_faults.py) filled to ENOSPC for a draw
        from --full-s seconds: the daemon must say so (disk_full; DEGRADED), lose nothing, go on (disk_space_back)
  slow  the same file system throttled to 4 writes/s beside a writer syncing big files, for a draw from --slow-s
        seconds: the daemon must say so (disk_slow) and lose nothing

The kinds:

  daemon     the coordinator, at a random moment
  proxy      the TITO proxy, at a random moment
  worker     the harness worker (its harnesses die with it), at a random moment
  agent      a node agent that is not the core's, at a random moment
  core       the core cell's agent while it trains a step (a random moment within the step)
  satellite  a satellite's agent while it is in a step; these runs use the elastic policy with satellites
             (train.satellites: true) instead of the default's colocate
  engine     a cell's rollout engine, which its node agent starts and watches (agent/engine_watch.py), at a
             random moment; kill and hang only
  disk       the run's folder (full and slow only)

A run takes --per-run faults of one class and kind (--mixed: of every class and kind, shuffled); after each the
campaign waits until the process is back (or awake, or the disk well) and a step has finished since; no fault once
the last step has begun (a restart could not be recorded). A run trains 2 steps per kill (4 when all are
satellites, there only during steps), 4 per disk fault and 8 per hang or partition, + 2; a run that ends before its
last faults is topped up by another; a run must end on its own. After it, the ledger is checked:

  runs lost         admitted runs left without a terminal status, groups never closed, scored runs whose model calls
                    have a hole, runs missing a call the proxy journaled (the journal is copied before every kill),
                    and runs trained before their last call was in (events kind call_after_training)
  duplicates        a run trained in two steps, a model call recorded twice, a step done twice
  integrity errors  PRAGMA integrity_check and foreign_key_check
  finished          `gyre run` exited 0, the run is STOPPED with every step DONE exactly once, and every fault
                    has its rows in events: a kill its process_restarted, a hang longer than a few seconds its
                    process_stalled or process_hung (and process_restarted), a full disk its disk_full and
                    disk_space_back, a slow one its disk_slow and disk_fast, a partition over 8 s the
                    row of its kind above

Runs cut short by a fault (a worker's harnesses die with it) end INFRA_ERROR: excluded from training, not lost; the
table counts them. The baseline is a run of the same variant and length without faults, in the same invocation:
"extra s/fault" is (wall time − baseline's) / faults. The last line is the verdict; the exit status is 1 when any
run lost, duplicated or corrupted anything, or did not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import disk_faults as disk  # noqa: E402  (tools/disk_faults.py: full and slow disks)
import faults as net  # noqa: E402  (tools/faults.py: partitions)
from chaos_checks import EVENTS, check, q  # noqa: E402  (tools/chaos_checks.py: the ledger after a run)

from gyre_slurm.beacon import silent_for  # noqa: E402

KINDS = ("daemon", "proxy", "worker", "agent", "core", "satellite", "engine", "disk")
FAULTS = ("kill", "hang", "partition", "full", "slow")
DISK_FAULTS = ("full", "slow")  # of the run's folder (kind "disk"), not of a process


def applies(fault: str, kind: str) -> bool:
    if (fault in DISK_FAULTS) != (kind == "disk"):
        return False
    if kind == "engine":  # started and watched by its node agent, not a peer of the daemon's
        return fault in ("kill", "hang")
    return not (fault == "partition" and kind == "daemon")  # a partition cuts a peer off from the daemon
RECOVERY_TIMEOUT_S = 300.0
START_TIMEOUT_S = 1800.0


@dataclass
class Fault:
    fault: str  # kill, hang, partition
    kind: str
    name: str  # its name in logs/pids.json
    at_s: float  # since the run started
    held_s: float = 0.0  # how long the fault lasted (a hang's stop, a partition, a full or slow disk)
    back_s: float | None = None  # until the process was back (awake) and a step had finished since


@dataclass
class Outcome:
    run_id: str
    variant: str
    faults: list[Fault] = field(default_factory=list)
    wall_s: float = 0.0
    lost: int = 0
    duplicates: int = 0
    integrity: int = 0
    cut: int = 0  # runs ended INFRA_ERROR (cut short by a fault): excluded, not lost
    extra_s: float = 0.0  # wall time beyond the baseline's
    problems: list[str] = field(default_factory=list)


# --- the run ---------------------------------------------------------------------------------------------------
def write_config(out: Path, variant: str, steps: int, seed: int, over: dict[str, dict]) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    cfg["run"].update(name=f"chaos-{variant}", state_dir=str(out / "state"), max_wall_s=6 * 3600, seed=seed)
    models = out / "state" / "models"  # the built-in model: the repository's, built once (under its lock)
    if not models.exists():
        (REPO / "state" / "models").mkdir(parents=True, exist_ok=True)
        models.parent.mkdir(parents=True, exist_ok=True)
        models.symlink_to(REPO / "state" / "models")
    cfg["train"]["steps"] = steps
    # the campaign counts lost and duplicated work, not learning: a gentle lr, so that no run (groups of 8 with
    # --group-size) stalls on a collapsed policy whose every group is dropped
    cfg["train"].update(lr=4e-4, lr_warmup_steps=0)
    for section, values in over.items():  # --group-size, --suite, --hang-timeout
        cfg.setdefault(section, {}).update(values)
    if "group_size" in over.get("tasks", {}):  # smaller groups, shorter steps (the slow test)
        cfg["eval"]["samples"] = 4  # its evaluations too (they still run, and are killed into, at their versions)
    if variant == "satellites":
        cfg["scheduler"] = {"policy": "elastic", "max_staleness": 1}
        cfg["train"]["satellites"] = True
    path = out / f"chaos-{variant}-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def steps_done(db: Path) -> int:
    try:
        return q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'")[0][0]
    except sqlite3.Error:
        return 0


def wait(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except (OSError, ValueError, sqlite3.Error):
            pass  # a file being replaced, a ledger being opened
        time.sleep(poll_s)
    return False


class Run:
    """One `gyre run` under the campaign: its processes by name (logs/pids.json) and its ledger."""

    def __init__(self, config: Path, run_id: str, state: Path, steps: int) -> None:
        self.dir = state / run_id
        self.steps = steps
        self.db = self.dir / "ledger.db"
        self.log = state.parent / f"{run_id}.out"
        self.t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "gyre_slurm", "run", str(config), "--run-id", run_id],
                                         stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        self.core = 0

    def pids(self) -> dict[str, int]:
        """Every process by name: the supervised ones (logs/pids.json) and the engines (their ready files)."""
        pids = json.loads((self.dir / "logs" / "pids.json").read_text())
        for ready in (self.dir / "engines").glob("node*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids[f"engine-{ready.stem[4:]}"] = json.loads(ready.read_text())["pid"]
        return pids

    def running(self) -> bool:
        return self.proc.poll() is None

    def serves(self, engine: str) -> bool:
        """Whether an engine answers GET /health_generate, as its agent waits for before serving it."""
        try:
            url = json.loads((self.dir / "engines" / f"node{engine[7:]}.json").read_text())["url"]
            with urllib.request.urlopen(f"{url}/health_generate", timeout=5) as r:
                ok = r.status == 200
        except (OSError, ValueError, KeyError):
            return False
        time.sleep(0.5)  # the agent's own look, every 0.2 s, has seen it too
        return ok

    def ending(self) -> bool:
        """Gone, or in its last step: no more faults."""
        return not self.running() or steps_done(self.db) >= self.steps - 1

    def step_running(self) -> bool:
        return bool(q(self.db, "SELECT 1 FROM train_steps WHERE status = 'RUNNING'"))

    def satellites_in_step(self) -> list[int]:
        if not self.step_running():
            return []
        return [c for (c,) in q(self.db, "SELECT id FROM cells WHERE role = 'TRAIN' AND NOT is_core")]


def pick(run: Run, kind: str, rng: random.Random, step_s: float) -> str | None:
    """Wait for a moment to kill a process of `kind`; its name, or None if no such moment came."""
    agents = sorted(n for n in run.pids() if n.startswith("agent-"))
    if kind in ("daemon", "proxy", "worker", "agent", "engine", "disk"):
        time.sleep(rng.uniform(0.0, step_s))
        if run.ending():
            return None
        if kind == "engine":  # one its agent serves (an engine still starting is its launcher's to time out)
            name = rng.choice([n for n in run.pids() if n.startswith("engine-")] or [None])
            return name if name is not None and run.serves(name) else None
        if kind == "worker":
            return rng.choice([n for n in run.pids() if n.startswith("worker-")])
        if kind == "agent":
            return rng.choice([a for a in agents if a != f"agent-{run.core}"])
        return kind
    if kind == "core":
        if not wait(lambda: run.ending() or run.step_running(), RECOVERY_TIMEOUT_S, 0.02) or run.ending():
            return None
        time.sleep(rng.uniform(0.0, 1.0))
        return f"agent-{run.core}" if run.step_running() and not run.ending() else None
    sats: list[int] = []
    if not wait(lambda: run.ending() or bool(sats.extend(run.satellites_in_step()) or sats), RECOVERY_TIMEOUT_S,
                0.02) or run.ending():
        return None
    time.sleep(rng.uniform(0.0, 0.5))
    return f"agent-{rng.choice(sats)}" if run.satellites_in_step() and not run.ending() else None


def snapshot_journals(run: Run, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for j in (run.dir / "proxy").glob("journal-*.bin"):
        shutil.copy(j, dest / f"{len(list(dest.iterdir()))}-{j.name}")


def inject(run: Run, fault: str, kind: str, rng: random.Random, step_s: float, snaps: Path,
           held: tuple[float, float]) -> Fault | None:
    """One fault at a random moment, then the wait for the process to be back (awake) and a step done since."""
    for _ in range(5):  # a core or satellite moment can slip away between the look and the fault: look again
        if run.ending():
            return None
        name = pick(run, kind, rng, step_s)
        if name is not None and fault == "partition" and not connected(run, name):
            continue  # between connections (its socket reconnecting): another moment
        if name is not None and (fault != "hang" or (silent_for(run.dir / "alive", name) or 99) < 2):
            break  # a hang is for a process that is up (beating), not one still starting: that is not judged
    else:
        return None
    if fault in DISK_FAULTS:
        return disk_fault(run, Fault(fault, kind, name, time.monotonic() - run.t0), rng, held)
    before, pid = steps_done(run.db), run.pids()[name]
    snapshot_journals(run, snaps)
    try:
        if fault != "partition":
            os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    except ProcessLookupError:
        return None  # the run ended meanwhile, or the process is being started again: no fault

    f = Fault(fault, kind, name, time.monotonic() - run.t0)
    t = time.monotonic()
    if fault == "partition":
        return partitioned(run, f, pid, rng, held)
    if fault == "hang":
        f.held_s = rng.uniform(*held)
        time.sleep(f.held_s)  # meanwhile its supervisor may kill it as hung and start another
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        if run.ending():
            return None  # the run reached its last step meanwhile: nothing more to see (nor to tell: it is over)
        before = steps_done(run.db)
    replaced = lambda: fault == "hang" or run.pids().get(name, pid) != pid  # noqa: E731
    if wait(lambda: replaced() and steps_done(run.db) > before, RECOVERY_TIMEOUT_S, 0.1):
        f.back_s = time.monotonic() - t
    return f


def connected(run: Run, name: str) -> bool:
    """Whether process `name` holds a connection to the daemon's port now (what a partition cuts)."""
    try:
        port = json.loads((run.dir / "control.json").read_text())["port"]
        return bool(net.connections_to(run.pids()[name], port))
    except (OSError, ValueError, KeyError):
        return False  # being started again


def partitioned(run: Run, f: Fault, pid: int, rng: random.Random, held: tuple[float, float]) -> Fault | None:
    """A partition of `pid` from the daemon's port, then the wait for a step done after it healed."""
    port = json.loads((run.dir / "control.json").read_text())["port"]
    cut = net.Partition(pid, port)
    if not cut.rules:
        return None  # not connected right now (being started again): no fault
    f.held_s = rng.uniform(*held)
    with cut:
        time.sleep(f.held_s)
    if run.ending():
        return None
    before, t = steps_done(run.db), time.monotonic()
    if wait(lambda: steps_done(run.db) > before, RECOVERY_TIMEOUT_S, 0.1):
        f.back_s = time.monotonic() - t + f.held_s
    return f


def disk_fault(run: Run, f: Fault, rng: random.Random, held: tuple[float, float]) -> Fault | None:
    """The run's folder full (ENOSPC) or slow for a draw from `held` seconds, then the wait for the daemon to say the
    disk is well again (disk_space_back, disk_fast) and a step done after."""
    back = EVENTS[f.fault][-1]
    told = lambda: q(run.db, "SELECT count(*) FROM events WHERE kind = ?", back)[0][0]  # noqa: E731
    n = told()
    f.held_s = rng.uniform(*held)
    with disk.Fill(run.dir) if f.fault == "full" else disk.Slow(run.dir) as fault:
        time.sleep(f.held_s)
    if f.fault == "slow":
        f.name = f"disk (a small fsync {fault.before_ms:.1f} ms → {fault.during_ms:.0f} ms)"
    if run.ending():
        return None
    before, t = steps_done(run.db), time.monotonic()
    if wait(lambda: told() > n and steps_done(run.db) > before, RECOVERY_TIMEOUT_S, 0.1):
        f.back_s = time.monotonic() - t + f.held_s
    return f


def campaign_run(out: Path, variant: str, run_id: str, todo: list[tuple[str, str]], steps: int, rng: random.Random,
                 base_step_s: float, a: argparse.Namespace) -> Outcome:
    o = Outcome(run_id, variant)
    config = write_config(out, variant, steps, rng.randrange(1 << 30), a.over)
    mount = (disk.LoopDisk(out / "state" / run_id) if any(f in DISK_FAULTS for f, _ in todo)
             else contextlib.nullcontext())
    with mount:
        o = run_and_check(out, o, config, todo, steps, rng, base_step_s, a)
        if not isinstance(mount, contextlib.nullcontext):  # its own disk, gone with the mount: a copy to look at
            shutil.copytree(out / "state" / run_id, out / "kept" / run_id, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("weights", "workspaces", "batches", "disk-reserve"))
    return o


def run_and_check(out: Path, o: Outcome, config: Path, todo: list[tuple[str, str]], steps: int, rng: random.Random,
                  base_step_s: float, a: argparse.Namespace) -> Outcome:
    run_id = o.run_id
    run = Run(config, run_id, out / "state", steps)
    try:
        started = lambda: (run.dir / "logs" / "pids.json").exists()  # noqa: E731
        # the first run may build the built-in model first: minutes, more on a busy machine
        if not wait(lambda: started() or not run.running(), START_TIMEOUT_S, 0.2) or not started():
            o.problems.append(f"the run did not start: see {run.log}")
            todo = []  # no fault; the checks below still look at whatever it left
        for fault, kind in todo:
            if not run.running():
                break
            f = inject(run, fault, kind, rng, base_step_s, out / "journals" / run_id, a.ranges[fault])
            if f is None:
                if not run.ending():
                    o.problems.append(f"no moment for a {fault} of a {kind} came within {RECOVERY_TIMEOUT_S:.0f} s")
                continue
            o.faults.append(f)
            what = {"kill": "kill -9", "hang": f"SIGSTOP for {f.held_s:.0f} s:",
                    "partition": f"cut off from the daemon for {f.held_s:.0f} s:",
                    "full": f"full for {f.held_s:.0f} s:", "slow": f"slow for {f.held_s:.0f} s:"}[fault]
            print(f"  {run_id}: {what} {f.name} ({kind}) at {f.at_s:.1f} s; back and a step done "
                  + (f"{f.back_s:.1f} s later" if f.back_s is not None else "NEVER"), flush=True)
            if f.back_s is None:
                o.problems.append(f"{f.name}: {fault} at {f.at_s:.0f} s, and the run did not go on")
        code = run.proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        code = None
    o.wall_s = time.monotonic() - run.t0
    if code != 0:
        o.problems.append(f"gyre run exited {code}: see {run.log}")
    check(run.db, steps, out / "journals" / run_id, o, a.hang_timeout)
    return o


# --- the campaign ----------------------------------------------------------------------------------------------
Todo = list[tuple[str, str]]  # (fault, kind) of a run's faults, in order


def steps_for(todo: Todo, ranges: dict[str, tuple[float, float]]) -> int:
    """Steps enough for a run's faults: a kill and its recovery take about 2 steps (4 when only satellites, which
    are there only during steps); a longer fault a step per 10 s of its longest draw, 3 to 8 (steps go on
    meanwhile: a 90 s hang took about 8)."""
    per_kill = 4 if todo and {k for _, k in todo} == {"satellite"} else 2
    return sum(per_kill if f == "kill" else max(3, min(8, math.ceil(ranges[f][1] / 10))) for f, _ in todo) + 2


def plan(faults: list[str], kinds: list[str], per_kind: int, per_run: int, mixed: bool,
         rng: random.Random) -> list[tuple[str, Todo]]:
    """(variant, its faults) per run: a run per fault class and kind, or with `mixed` runs of everything."""
    runs: list[tuple[str, Todo]] = []
    for variant, ks in (("default", [k for k in kinds if k != "satellite"]),
                        ("satellites", [k for k in kinds if k == "satellite"])):
        if mixed and variant == "default" and "satellite" in kinds:
            ks = list(kinds)  # one run does it all: the satellite variant has every kind of process
            variant = "satellites"
        elif mixed and variant == "satellites":
            continue
        todo = [(f, k) for f in faults for k in ks for _ in range(per_kind) if applies(f, k)]
        if mixed:
            rng.shuffle(todo)
            runs += [(variant, todo[i:i + per_run]) for i in range(0, len(todo), per_run)]
        else:
            for f in faults:
                for k in ks:
                    mine = [x for x in todo if x == (f, k)]
                    runs += [(variant, mine[i:i + per_run]) for i in range(0, len(mine), per_run)]
    return runs


def table(outcomes: list[Outcome], faults: list[str], kinds: list[str]) -> list[str]:
    head = f"{'kind':<10} {'fault':<9} {'count':>5} {'runs lost':>9} {'duplicates':>10} {'integrity errors':>16} " \
           f"{'extra s/fault':>13} {'recovery p50/max s':>18} {'runs cut':>8}"
    rows = [head, "-" * len(head)]
    for kind in kinds:
        for fault in [f for f in faults if applies(f, kind)]:
            mine = [o for o in outcomes if any((f.fault, f.kind) == (fault, kind) for f in o.faults)]
            done = [f for o in mine for f in o.faults if (f.fault, f.kind) == (fault, kind)]
            extra = [o.extra_s / len(o.faults) for o in mine if o.faults]
            back = sorted(f.back_s for f in done if f.back_s is not None)
            rec = f"{back[len(back) // 2]:.1f}/{back[-1]:.1f}" if back else "-"
            rows.append(f"{kind:<10} {fault:<9} {len(done):>5} {sum(o.lost for o in mine):>9} "
                        f"{sum(o.duplicates for o in mine):>10} {sum(o.integrity for o in mine):>16} "
                        f"{sum(extra) / max(1, len(extra)):>13.1f} {rec:>18} {sum(o.cut for o in mine):>8}")
    return rows


def seconds(ap: argparse.ArgumentParser, name: str, text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        ap.error(f"{name} must be two numbers of seconds, low,high (not {text!r})")
    if not 0 < lo <= hi:
        ap.error(f"{name}: 0 < low <= high")
    return lo, hi


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", default="kill", help=f"fault classes, of {','.join(FAULTS)}")
    ap.add_argument("--per-kind", type=int, default=20, help="faults of each class per kind of process")
    ap.add_argument("--per-run", type=int, default=10, help="faults per run")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--hang-s", default="5,90", help="a hang's SIGSTOP lasts a draw from this range (s)")
    ap.add_argument("--hang-timeout", type=float, default=30.0, help="the runs' control.hang_timeout_s")
    ap.add_argument("--partition-s", default="10,120", help="a partition lasts a draw from this range (s)")
    ap.add_argument("--full-s", default="10,60", help="a full disk lasts a draw from this range (s)")
    ap.add_argument("--slow-s", default="20,60", help="a slow disk lasts a draw from this range (s)")
    ap.add_argument("--mixed", action="store_true", help="every class and kind in the same runs (fewer, longer runs)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs without faults (no extra seconds)")
    ap.add_argument("--group-size", type=int, default=None, help="runs per group (default: the default's 16)")
    ap.add_argument("--suite", default=None, help="the task suite (default: the default's); the slow test takes "
                                                  "builtin:sevens, whose built-in model the suite's other tests share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="where runs and logs go (default: a new temp folder)")
    a = ap.parse_args()
    a.kinds, a.faults = [k for k in a.kinds.split(",") if k], [f for f in a.faults.split(",") if f]
    if bad := [k for k in a.kinds if k not in KINDS] + [f for f in a.faults if f not in FAULTS]:
        ap.error(f"unknown kind(s) or fault(s) {bad}: choose kinds from {','.join(KINDS)}, faults from "
                 f"{','.join(FAULTS)}")
    if a.per_kind < 1 or a.per_run < 1:
        ap.error("--per-kind and --per-run must be at least 1")
    a.ranges = {f: seconds(ap, f"--{f}-s", getattr(a, f"{f}_s")) for f in FAULTS if f != "kill"} | {"kill": (0, 0)}
    if "partition" in a.faults and (why := net.usable()):
        ap.error(why)
    if set(a.faults) & set(DISK_FAULTS) and (why := disk.usable()):
        ap.error(why)
    a.over = {"tasks": {k: v for k, v in (("group_size", a.group_size), ("suite", a.suite)) if v is not None},
              "control": {"hang_timeout_s": a.hang_timeout}}
    if a.suite:  # the default's held-out tasks are its own suite's: hold out the new suite's last task instead
        from gyre_slurm.harness.tasks import load_suite

        a.over["eval"] = {"holdout_tasks": [load_suite(a.suite)[-1].id]}
    return a


def main() -> int:
    a = parse_args()
    try:
        return campaign(a)
    finally:
        if "partition" in a.faults:
            net.heal_all()  # whatever a stopped campaign left in the firewall
        if "slow" in a.faults:
            disk.unthrottle_all()


def campaign(a: argparse.Namespace) -> int:
    out = a.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"gyre-chaos-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    runs = plan(a.faults, a.kinds, a.per_kind, a.per_run, a.mixed, rng)
    print(f"chaos: {sum(len(t) for _, t in runs)} faults in {len(runs)} runs (+ a baseline per variant), under {out}",
          flush=True)
    base: dict[str, tuple[int, float]] = {}  # variant → (steps, wall s) of a run without faults
    outcomes: list[Outcome] = []
    todo, topped = list(runs), 0
    while todo:
        variant, mine = todo.pop(0)
        steps = steps_for(mine, a.ranges)
        if variant not in base and a.no_baseline:
            base[variant] = steps, float("nan")
        elif variant not in base:
            b = campaign_run(out, variant, f"base-{variant}", [], steps, rng, 0.0, a)
            if b.problems:
                print(f"baseline {variant} failed: {'; '.join(b.problems)}", flush=True)
                return 1
            base[variant] = steps, b.wall_s
            print(f"baseline {variant}: {steps} steps in {b.wall_s:.1f} s without faults", flush=True)
        per_step = base[variant][1] / base[variant][0]  # a shorter top-up run is compared pro rata
        o = campaign_run(out, variant, f"chaos-{len(outcomes):02d}", mine, steps, rng,
                         8.0 if math.isnan(per_step) else per_step, a)  # no baseline: the default's ~8 s
        o.extra_s = o.wall_s - per_step * steps
        outcomes.append(o)
        print(f"run {o.run_id} ({variant}): {len(o.faults)} faults, {o.wall_s:.0f} s ({o.extra_s:+.0f} s), "
              + ("ok" if not o.problems else "; ".join(o.problems)), flush=True)
        left = list(mine)
        for f in o.faults:
            left.remove((f.fault, f.kind))
        if left and not o.problems and topped < 3 * len(runs):  # the run ended before its last faults: another
            todo.append((variant, left))
            topped += 1
    print("\n".join(table(outcomes, a.faults, a.kinds)))
    bad_runs = [o for o in outcomes if o.problems]
    short = [(f, k) for f in a.faults for k in a.kinds if applies(f, k)
             and sum((f, k) == (x.fault, x.kind) for o in outcomes for x in o.faults) < a.per_kind]
    if bad_runs or short:
        print(f"chaos: FAILED: {len(bad_runs)} of {len(outcomes)} runs with problems"
              + (f"; too few faults of {short}" if short else ""))
        return 1
    n = {f: sum(x.fault == f for o in outcomes for x in o.faults) for f in a.faults}
    print(f"chaos: OK: {', '.join(f'{v} {k}s' for k, v in n.items())} in {len(outcomes)} runs, 0 runs lost, "
          f"0 duplicates, 0 integrity errors, every run finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
