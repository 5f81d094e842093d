"""A kill -9 campaign against real runs of the embedded default: every kind of process, at random moments.

    .venv/bin/python tools/chaos.py [--kills-per-kind 20] [--kills-per-run 10] [--kinds daemon,proxy,...]
                                    [--mixed] [--seed 0] [--out DIR]

Each run is a real `gyre run` of configs/tiny-cpu.yaml (daemon, node agents with their embedded engines, the TITO
proxy, a harness worker, torch training), which supervises its processes: a process killed with -9 is started again
and rejoins. The kinds:

  daemon     the coordinator, at a random moment
  proxy      the TITO proxy, at a random moment
  worker     the harness worker (its harnesses die with it), at a random moment
  agent      a node agent that is not the core's, at a random moment
  core       the core cell's agent while it trains a step (a random moment within the step)
  satellite  a satellite's agent while it is in a step; these runs use the elastic policy with satellites
             (train.satellites: true) instead of the default's colocate

A run takes --kills-per-run kills of one kind (with --mixed: of every kind, in a random order, so the slow test
needs one run per variant); after each kill the campaign waits until the process is back and a step has finished
since, then draws the next moment; nothing is killed once the last step has begun (the run is ending: a restart
could not be recorded). A run trains 2 × kills + 2 steps, 4 × kills + 2 when all are satellites (a satellite is
there to kill only while a step has one); a run that ends before its last kills is topped up by another; a run
must end on its own. After it, the ledger is checked:

  runs lost         admitted runs left without a terminal status, groups never closed, scored runs whose model calls
                    have a hole, runs missing a call the proxy journaled (the journal is copied before every kill),
                    and runs trained before their last call was in (events kind call_after_training)
  duplicates        a run trained in two steps, a model call recorded twice, a step done twice
  integrity errors  PRAGMA integrity_check and foreign_key_check
  finished          `gyre run` exited 0, the run is STOPPED with every step DONE exactly once, and every kill
                    has its `process_restarted` row in events

Runs cut short by a kill (a worker's harnesses die with it) end INFRA_ERROR: excluded from training, not lost; the
table counts them. The baseline is a run of the same variant and length without kills, in the same invocation:
"extra s/kill" is (wall time − baseline's) / kills. The last line is the verdict; the exit status is 1 when any run
lost, duplicated or corrupted anything, or did not finish.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import yaml

REPO = Path(__file__).resolve().parents[1]
KINDS = ("daemon", "proxy", "worker", "agent", "core", "satellite")
SCORED = ("COMPLETED", "TIMEOUT_SCORED", "TRUNCATED_CONTEXT")
RECOVERY_TIMEOUT_S = 300.0
START_TIMEOUT_S = 1800.0


@dataclass
class Kill:
    kind: str
    name: str  # its name in logs/pids.json
    at_s: float  # since the run started
    back_s: float | None = None  # until the process was back and a step had finished since


@dataclass
class Outcome:
    run_id: str
    variant: str
    kills: list[Kill] = field(default_factory=list)
    wall_s: float = 0.0
    lost: int = 0
    duplicates: int = 0
    integrity: int = 0
    cut: int = 0  # runs ended INFRA_ERROR (cut short by a kill): excluded, not lost
    extra_s: float = 0.0  # wall time beyond the baseline's
    problems: list[str] = field(default_factory=list)


# --- the run ---------------------------------------------------------------------------------------------------
def write_config(out: Path, variant: str, steps: int, seed: int, group_size: int | None = None) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    cfg["run"].update(name=f"chaos-{variant}", state_dir=str(out / "state"), max_wall_s=1800, seed=seed)
    models = out / "state" / "models"  # the built-in model: the repository's, built once (under its lock)
    if not models.exists():
        (REPO / "state" / "models").mkdir(parents=True, exist_ok=True)
        models.parent.mkdir(parents=True, exist_ok=True)
        models.symlink_to(REPO / "state" / "models")
    cfg["train"]["steps"] = steps
    # the campaign counts lost and duplicated work, not learning: a gentle lr, so that no run (groups of 8 with
    # --group-size) stalls on a collapsed policy whose every group is dropped
    cfg["train"].update(lr=4e-4, lr_warmup_steps=0)
    if group_size:  # --group-size: smaller groups, shorter steps (the slow test)
        cfg["tasks"]["group_size"] = group_size
        cfg["eval"]["samples"] = 4  # its evaluations too (they still run, and are killed into, at their versions)
    if variant == "satellites":
        cfg["scheduler"] = {"policy": "elastic", "max_staleness": 1}
        cfg["train"]["satellites"] = True
    path = out / f"chaos-{variant}-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def q(db: Path, sql: str, *args: Any) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


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
        return json.loads((self.dir / "logs" / "pids.json").read_text())

    def running(self) -> bool:
        return self.proc.poll() is None

    def ending(self) -> bool:
        """Gone, or in its last step: no more kills."""
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
    if kind in ("daemon", "proxy", "worker", "agent"):
        time.sleep(rng.uniform(0.0, step_s))
        if run.ending():
            return None
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


def kill_and_recover(run: Run, kind: str, rng: random.Random, step_s: float, snaps: Path) -> Kill | None:
    for _ in range(5):  # a core or satellite moment can slip away between the look and the kill: look again
        if run.ending():
            return None
        name = pick(run, kind, rng, step_s)
        if name is not None:
            break
    else:
        return None
    before, pid = steps_done(run.db), run.pids()[name]
    snapshot_journals(run, snaps)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None  # the run ended meanwhile, or the process is being started again: no kill

    k = Kill(kind, name, time.monotonic() - run.t0)
    t = time.monotonic()
    if wait(lambda: run.pids()[name] != pid and steps_done(run.db) > before, RECOVERY_TIMEOUT_S, 0.1):
        k.back_s = time.monotonic() - t
    return k


def campaign_run(out: Path, variant: str, run_id: str, kinds: list[str], steps: int, rng: random.Random,
                 base_step_s: float, group_size: int | None = None) -> Outcome:
    o = Outcome(run_id, variant)
    config = write_config(out, variant, steps, rng.randrange(1 << 30), group_size)
    run = Run(config, run_id, out / "state", steps)
    try:
        started = lambda: (run.dir / "logs" / "pids.json").exists()  # noqa: E731
        # the first run may build the built-in model first: minutes, more on a busy machine
        if not wait(lambda: started() or not run.running(), START_TIMEOUT_S, 0.2) or not started():
            o.problems.append(f"the run did not start: see {run.log}")
            kinds = []  # nothing to kill; the checks below still look at whatever it left
        for kind in kinds:
            if not run.running():
                break
            k = kill_and_recover(run, kind, rng, base_step_s, out / "journals" / run_id)
            if k is None:
                if not run.ending():
                    o.problems.append(f"no moment to kill a {kind} came within {RECOVERY_TIMEOUT_S:.0f} s")
                continue
            o.kills.append(k)
            print(f"  {run_id}: kill -9 {k.name} ({kind}) at {k.at_s:.1f} s; back and a step done "
                  + (f"{k.back_s:.1f} s later" if k.back_s is not None else "NEVER"), flush=True)
            if k.back_s is None:
                o.problems.append(f"{k.name} killed at {k.at_s:.0f} s: the run did not go on")
        code = run.proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        code = None
    o.wall_s = time.monotonic() - run.t0
    if code != 0:
        o.problems.append(f"gyre run exited {code}: see {run.log}")
    check(run.db, steps, out / "journals" / run_id, o)
    return o


# --- the checks ------------------------------------------------------------------------------------------------
def journaled_calls(snaps: Path) -> set[tuple[int, int]]:
    """Every (rollout, call) a proxy journaled, from the copies taken before each kill."""
    keys: set[tuple[int, int]] = set()
    for f in snaps.glob("*.bin") if snaps.exists() else ():
        with open(f, "rb") as fh:
            try:
                for e in msgpack.Unpacker(fh, raw=False, strict_map_key=False):
                    if isinstance(e, dict) and e.get("k") == "rec":
                        keys.add((e["rec"]["rollout_id"], e["rec"]["call_index"]))
            except (ValueError, msgpack.UnpackException):
                pass  # the copy caught a record mid-write: what came before it counts
    return keys


def batch_runs(run_dir: Path) -> dict[int, list[int]]:
    """rollout id → the steps whose data holds it (a sharded step's shard files, else its batch file; a step run
    again rewrites its own folder)."""
    from gyre_slurm.train.batch import read_batch

    seen: dict[int, set[int]] = {}
    for folder in sorted(run_dir.glob("batches/step-*")):
        files = sorted(folder.glob("shard-*.msgpack")) or sorted(folder.glob("batch.msgpack"))
        for p in files:
            b = read_batch(p)
            for r in b.runs():
                seen.setdefault(r, set()).add(b.step)
    return {r: sorted(s) for r, s in seen.items()}


def check(db: Path, steps: int, snaps: Path, o: Outcome) -> None:
    if not db.exists():
        o.problems.append("no ledger")
        return
    ok = q(db, "PRAGMA integrity_check")
    fk = q(db, "PRAGMA foreign_key_check")
    o.integrity = (ok != [("ok",)]) + len(fk)
    open_runs = q(db, "SELECT count(*) FROM rollouts WHERE status IN ('QUEUED', 'RUNNING')")[0][0]
    open_groups = q(db, "SELECT count(*) FROM groups WHERE status = 'ADMITTED'")[0][0]
    holes = q(db, f"SELECT r.id FROM rollouts r LEFT JOIN model_calls m ON m.rollout_id = r.id "
                  f"WHERE r.status IN {SCORED} GROUP BY r.id "
                  f"HAVING count(m.call_index) != r.n_calls OR coalesce(max(m.call_index) + 1, 0) != r.n_calls")
    recorded = set(q(db, "SELECT rollout_id, call_index FROM model_calls"))
    missing = journaled_calls(snaps) - recorded
    # a run trained before its last calls were in: trained on a trajectory it did not have
    truncated = {r for (r,) in q(db, "SELECT json_extract(data, '$.rollout_id') FROM events "
                                     "WHERE kind = 'call_after_training'")}
    o.lost = open_runs + open_groups + len(holes) + len({r for r, _ in missing}) + len(truncated)
    if o.lost:
        o.problems.append(f"lost: {open_runs} runs and {open_groups} groups left open, scored runs with holes "
                          f"{[h for (h,) in holes][:5]}, journaled calls missing {sorted(missing)[:5]}, runs "
                          f"trained without their last calls {sorted(truncated)[:5]}")
    twice = {r: s for r, s in batch_runs(db.parent).items() if len(s) > 1}
    dup_calls = q(db, "SELECT count(*) FROM (SELECT 1 FROM model_calls GROUP BY rollout_id, call_index "
                      "HAVING count(*) > 1)")[0][0]
    done = q(db, "SELECT step, count(*) FROM train_steps WHERE status = 'DONE' GROUP BY step")
    o.duplicates = len(twice) + dup_calls + sum(n - 1 for _, n in done)
    if o.duplicates:
        o.problems.append(f"duplicates: runs in two steps {dict(list(twice.items())[:5])}, {dup_calls} calls, "
                          f"steps {[s for s, n in done if n > 1]}")
    status = q(db, "SELECT status FROM runs")
    if status != [("STOPPED",)] or sorted(s for s, _ in done) != list(range(steps)):
        o.problems.append(f"did not finish: run {status}, steps done {sorted(s for s, _ in done)} of {steps}")
    o.cut = q(db, "SELECT count(*) FROM rollouts WHERE status = 'INFRA_ERROR'")[0][0]
    told = q(db, "SELECT count(*) FROM events WHERE kind = 'process_restarted'")[0][0]
    if told < len(o.kills):
        o.problems.append(f"{len(o.kills)} kills but {told} process_restarted rows in events")


# --- the campaign ----------------------------------------------------------------------------------------------
def steps_for(kinds: list[str]) -> int:
    return (4 if kinds and set(kinds) == {"satellite"} else 2) * len(kinds) + 2


def plan(kinds: list[str], per_kind: int, per_run: int, mixed: bool, rng: random.Random) -> list[tuple[str, list]]:
    """(variant, kinds of its kills) per run."""
    runs: list[tuple[str, list[str]]] = []
    for variant, ks in (("default", [k for k in kinds if k != "satellite"]),
                        ("satellites", [k for k in kinds if k == "satellite"])):
        if mixed and variant == "default" and "satellite" in kinds:
            ks = list(kinds)  # one run does it all: the satellite variant has every kind of process
            variant = "satellites"
        elif mixed and variant == "satellites":
            continue
        todo = [k for k in ks for _ in range(per_kind)]
        if mixed:
            rng.shuffle(todo)
            runs += [(variant, todo[i:i + per_run]) for i in range(0, len(todo), per_run)]
        else:
            for k in ks:
                mine = [x for x in todo if x == k]
                runs += [(variant, mine[i:i + per_run]) for i in range(0, len(mine), per_run)]
    return runs


def table(outcomes: list[Outcome], kinds: list[str]) -> list[str]:
    head = f"{'kind':<10} {'kills':>5} {'runs lost':>9} {'duplicates':>10} {'integrity errors':>16} " \
           f"{'extra s/kill':>12} {'recovery p50/max s':>18} {'runs cut':>8}"
    rows = [head, "-" * len(head)]
    for kind in kinds:
        mine = [o for o in outcomes if any(k.kind == kind for k in o.kills)]
        kills = [k for o in mine for k in o.kills if k.kind == kind]
        extra = [o.extra_s / len(o.kills) for o in mine if o.kills]
        back = sorted(k.back_s for k in kills if k.back_s is not None)
        rec = f"{back[len(back) // 2]:.1f}/{back[-1]:.1f}" if back else "-"
        rows.append(f"{kind:<10} {len(kills):>5} {sum(o.lost for o in mine):>9} {sum(o.duplicates for o in mine):>10} "
                    f"{sum(o.integrity for o in mine):>16} {sum(extra) / max(1, len(extra)):>12.1f} {rec:>18} "
                    f"{sum(o.cut for o in mine):>8}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills-per-kind", type=int, default=20)
    ap.add_argument("--kills-per-run", type=int, default=10)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--mixed", action="store_true", help="every kind in the same runs (fewer, longer runs)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the runs without kills (no extra seconds)")
    ap.add_argument("--group-size", type=int, default=None, help="runs per group (default: the default's 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="where runs and logs go (default: a new temp folder)")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown kind(s) {bad}: choose from {','.join(KINDS)}")
    if a.kills_per_kind < 1 or a.kills_per_run < 1:
        ap.error("--kills-per-kind and --kills-per-run must be at least 1")
    out = a.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"gyre-chaos-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    runs = plan(kinds, a.kills_per_kind, a.kills_per_run, a.mixed, rng)
    print(f"chaos: {sum(len(k) for _, k in runs)} kills in {len(runs)} runs (+ a baseline per variant), under {out}",
          flush=True)
    base: dict[str, tuple[int, float]] = {}  # variant → (steps, wall s) of a run without kills
    outcomes: list[Outcome] = []
    todo, topped = list(runs), 0
    while todo:
        variant, ks = todo.pop(0)
        steps = steps_for(ks)
        if variant not in base and a.no_baseline:
            base[variant] = steps, float("nan")
        elif variant not in base:
            b = campaign_run(out, variant, f"base-{variant}", [], steps, rng, 0.0, a.group_size)
            if b.problems:
                print(f"baseline {variant} failed: {'; '.join(b.problems)}", flush=True)
                return 1
            base[variant] = steps, b.wall_s
            print(f"baseline {variant}: {steps} steps in {b.wall_s:.1f} s without kills", flush=True)
        per_step = base[variant][1] / base[variant][0]  # a shorter top-up run is compared pro rata
        o = campaign_run(out, variant, f"chaos-{len(outcomes):02d}", ks, steps, rng,
                         8.0 if math.isnan(per_step) else per_step, a.group_size)  # no baseline: the default's ~8 s
        o.extra_s = o.wall_s - per_step * steps
        outcomes.append(o)
        print(f"run {o.run_id} ({variant}): {len(o.kills)} kills, {o.wall_s:.0f} s ({o.extra_s:+.0f} s), "
              + ("ok" if not o.problems else "; ".join(o.problems)), flush=True)
        left = list(ks)
        for k in o.kills:
            left.remove(k.kind)
        if left and not o.problems and topped < len(runs):  # the run ended before its last kills: another
            todo.append((variant, left))
            topped += 1
    print("\n".join(table(outcomes, kinds)))
    bad_runs = [o for o in outcomes if o.problems]
    short = [k for k in kinds if sum(k == x.kind for o in outcomes for x in o.kills) < a.kills_per_kind]
    if bad_runs or short:
        print(f"chaos: FAILED: {len(bad_runs)} of {len(outcomes)} runs with problems"
              + (f"; too few kills of {short}" if short else ""))
        return 1
    print(f"chaos: OK: {sum(len(o.kills) for o in outcomes)} kills -9 in {len(outcomes)} runs, 0 runs lost, "
          f"0 duplicates, 0 integrity errors, every run finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
