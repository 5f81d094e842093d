"""Benchmark the scheduling policies on this machine: colocate, the best async split and elastic, one after another.

    .venv/bin/python tools/bench_policies.py [--cells 2] [--k 8] [--steps 8] [--eta 1] [--groups 4] [--group-size 8]
                                             [--timeout-s 12] [--warmup-steps 2] [--seed 0] [--out DIR]

Every run is a real `gyre run` on the embedded engine (daemon, node agents, engines, proxy, workers, torch
training) with the same seed, η, cell count and task suite: `builtin:longtail`, where an agent's time is mostly tool
latency (a log-normal wait drawn from the rollout id, so every policy meets the same durations; some runs reach the
harness timeout and are scored from their workspace), as in real coding agents.

Baselines: colocate, and async tuned by sweeping its split (scheduler.train_cells = 1 .. cells − 1; the fastest is
the baseline, as ALGORITHMS.md §5.2 asks). Seconds per step are measured from the ledger: the time from the end of
step `--warmup-steps − 1` to the end of the last step, divided by the steps in between (the first steps pay for
engine start-up and the trainer's first load, alike for every policy). For each run the report prints seconds per
step, switches (count and mean time per direction), the reward curve, and writes the run's plot (`gyre plot`: the
reward curve and the cell-role timeline) under --out. The last line is the figure: elastic's speed-up against
colocate and against the best async split; the script exits 1 unless both are ≥ 1.2× (the target of issue 10)
and elastic's mean reward over the second half of the steps is behind neither baseline's by more than --reward-slack
(8 steps of a tiny policy are noisy: a few hundredths per step).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.2


def config(a: argparse.Namespace, policy: str, state_dir: Path, train_cells: int = 1) -> dict[str, Any]:
    sched: dict[str, Any] = {"policy": policy, "max_staleness": a.eta}
    if policy == "async":
        sched["train_cells"] = train_cells
    return {
        "run": {"name": "bench", "state_dir": str(state_dir), "seed": a.seed, "max_wall_s": 1800},
        "cluster": {"cells": a.cells, "rollouts_per_cell": a.k, "engine": "embedded"},
        "control": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0},
        "scheduler": sched,
        "model": {"warmup_steps": 100},
        "tasks": {"suite": "builtin:longtail", "group_size": a.group_size, "groups_per_step": a.groups},
        "harness": {"timeout_s": a.timeout_s, "workers": 1, "concurrency": a.cells * a.k},
        "train": {"steps": a.steps, "lr": 4.0e-4},
    }


def query(db: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def measure(run_dir: Path, warmup: int) -> dict[str, Any]:
    db = run_dir / "ledger.db"
    ends = [e for (e,) in query(db, "SELECT ended_at FROM train_steps WHERE status = 'DONE' ORDER BY step")]
    rewards = [r for (r,) in query(db, "SELECT reward_mean FROM train_steps WHERE status = 'DONE' ORDER BY step")]
    if len(ends) <= warmup:
        raise SystemExit(f"{run_dir.name}: only {len(ends)} steps done; nothing to measure after the warm-up")
    per_step = (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup) if warmup else None
    if per_step is None:
        start = query(db, "SELECT created_at FROM runs")[0][0]
        per_step = (ends[-1] - start) / len(ends)
    switches = query(db, "SELECT direction, switches, mean_s FROM v_switch_phases")
    infra = query(db, "SELECT count(*) FROM rollouts WHERE status = 'INFRA_ERROR'")[0][0]
    timeouts = query(db, "SELECT count(*) FROM rollouts WHERE status = 'TIMEOUT_SCORED'")[0][0]
    return {"s_per_step": per_step, "rewards": rewards, "switches": switches, "infra_errors": infra,
            "timeouts": timeouts}


def run_one(a: argparse.Namespace, label: str, cfg: dict[str, Any]) -> dict[str, Any]:
    cfg_path = a.out / f"{label}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_id = f"bench-{label}"
    gyre = [sys.executable, "-m", "gyre_slurm"]
    t0 = time.monotonic()
    print(f"[{label}] gyre run ({cfg['train']['steps']} steps) …", file=sys.stderr, flush=True)
    with open(a.out / f"{label}.log", "w") as log:
        rc = subprocess.run([*gyre, "run", str(cfg_path), "--run-id", run_id], stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO).returncode
    if rc != 0:
        raise SystemExit(f"[{label}] gyre run exited {rc}: see {a.out / f'{label}.log'}")
    run_dir = Path(cfg["run"]["state_dir"]) / run_id
    subprocess.run([*gyre, "plot", str(run_dir), "--out", str(a.out / f"{label}.png")], check=True,
                   capture_output=True, cwd=REPO)
    m = measure(run_dir, a.warmup_steps)
    m["wall_s"] = time.monotonic() - t0
    sw = ", ".join(f"{d} {n}× {s:.2f}s" for d, n, s in m["switches"]) or "none"
    print(f"[{label}] {m['s_per_step']:.2f} s per step (wall {m['wall_s']:.0f} s); switches: {sw}; "
          f"timeouts {m['timeouts']}, infra errors {m['infra_errors']}", file=sys.stderr, flush=True)
    return m


def second_half(rewards: list[float]) -> float:
    half = rewards[len(rewards) // 2:]
    return sum(half) / len(half)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=2)
    p.add_argument("--k", type=int, default=8, help="rollouts per cell")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eta", type=int, default=1, help="max staleness, the same for every policy but colocate")
    p.add_argument("--groups", type=int, default=4, help="groups per step (B)")
    p.add_argument("--group-size", type=int, default=8, help="runs per group (G)")
    p.add_argument("--timeout-s", type=float, default=12.0, help="harness timeout of a run (s)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--reward-slack", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "state" / "bench-policies")
    a = p.parse_args()
    if a.cells < 2:
        p.error("--cells must be at least 2 (async needs a training and a rollout cell)")
    a.out.mkdir(parents=True, exist_ok=True)
    state = a.out / "state"
    results: dict[str, dict[str, Any]] = {"colocate": run_one(a, "colocate", config(a, "colocate", state))}
    for ct in range(1, a.cells):
        results[f"async-{ct}"] = run_one(a, f"async-{ct}", config(a, "async", state, ct))
    results["elastic"] = run_one(a, "elastic", config(a, "elastic", state))

    best_async = min((k for k in results if k.startswith("async")), key=lambda k: results[k]["s_per_step"])
    el, co, asy = results["elastic"], results["colocate"], results[best_async]
    print(f"\n{a.cells} cells × k={a.k}, B={a.groups} × G={a.group_size}, η={a.eta}, timeout {a.timeout_s:g} s, "
          f"{a.steps} steps (the first {a.warmup_steps} not timed), suite builtin:longtail, seed {a.seed}")
    for name, m in results.items():
        curve = " ".join(f"{r:.2f}" for r in m["rewards"])
        mark = "  (best async split)" if name == best_async else ""
        print(f"  {name:<10} {m['s_per_step']:7.2f} s/step   reward per step: {curve}{mark}")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    vs_co, vs_async = co["s_per_step"] / el["s_per_step"], asy["s_per_step"] / el["s_per_step"]
    behind = any(second_half(el["rewards"]) < second_half(m["rewards"]) - a.reward_slack for m in (co, asy))
    ok = vs_co >= TARGET and vs_async >= TARGET and not behind
    print(f"plots and logs in {a.out}; reward over the second half: elastic {second_half(el['rewards']):.3f}, "
          f"colocate {second_half(co['rewards']):.3f}, {best_async} {second_half(asy['rewards']):.3f}"
          + ("  (elastic behind)" if behind else ""))
    print(f"elastic speed-up: {vs_co:.2f}x against colocate, {vs_async:.2f}x against the best async split "
          f"({best_async}); target ≥ {TARGET}x each: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
