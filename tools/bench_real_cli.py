"""Does a real coding-agent CLI *learn* through the proxy? `gyre run` of a CLI's config for N steps, then its curve
from the ledger.

    .venv/bin/python tools/bench_real_cli.py --preset claude-code --steps 20
    .venv/bin/python tools/bench_real_cli.py --preset qwen-code --steps 20      # configs/<preset>.yaml
    .venv/bin/python tools/bench_real_cli.py --config my-cli.yaml --steps 20 --set train.lr=2e-4

Prints, per step: the mean reward of the runs trained at it, the share of model calls that were tool calls (the
policy speaking the CLI's tool format), model calls per run and the step's seconds; then the gain: mean reward of the
last 5 steps minus that of the first 5 (the baseline is the run's own start: the warmed-up policy before RL). Exits
non-zero unless the gain is at least --min-gain (0.15) and the run ended with every step done and not FAILED.
The model (state/models/) is built first when it is not cached (minutes; not counted in s/step).
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
GYRE = REPO / ".venv" / "bin" / "gyre"
# per DONE step: its reward, seconds, and the model calls, tool calls and runs of the groups it trained
PER_STEP = """
SELECT t.step, t.reward_mean, round(t.ended_at - t.started_at, 1) AS step_s, count(c.id) AS calls,
       coalesce(sum(c.finish_reason IN ('tool_calls', 'tool_use')), 0) AS tool_calls, count(DISTINCT r.id) AS runs,
       json_extract(t.metrics, '$.kl') AS kl
FROM train_steps t
LEFT JOIN groups g ON g.train_step = t.step
LEFT JOIN rollouts r ON r.group_id = g.id
LEFT JOIN model_calls c ON c.rollout_id = r.id
WHERE t.status = 'DONE' GROUP BY t.step ORDER BY t.step
"""


def _config(args: argparse.Namespace, run_id: str, out: Path) -> Path:
    src = Path(args.config) if args.config else REPO / "configs" / f"{args.preset}.yaml"
    if not src.is_file():
        sys.exit(f"no config {src} (--preset names configs/<preset>.yaml; or give --config)")
    doc = yaml.safe_load(src.read_text())
    doc.setdefault("run", {}).update({"id": run_id, "max_wall_s": args.steps * args.max_step_s + 600})
    doc.setdefault("train", {})["steps"] = args.steps
    for item in args.set:  # section.field=value, the value read as YAML
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not sep or not dot:
            sys.exit(f"--set {item!r}: expected section.field=value (e.g. tasks.group_size=8)")
        doc.setdefault(section, {})[field] = yaml.safe_load(value)
    p = out / "bench.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def _run(cfg: Path) -> tuple[int, float]:
    """gyre model create (not timed), then gyre run with its progress shown; (exit code, seconds of the run)."""
    build = subprocess.run([str(GYRE), "model", "create", str(cfg)], cwd=REPO)
    if build.returncode != 0:
        sys.exit(f"gyre model create failed (exit code {build.returncode})")
    t0 = time.monotonic()
    rc = subprocess.run([str(GYRE), "run", str(cfg)], cwd=REPO).returncode
    return rc, time.monotonic() - t0


def report(db: Path, window: int) -> dict:
    """The curve and the figures the verdict reads, from a run's ledger."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute(PER_STEP).fetchall()
    status = con.execute("SELECT status FROM runs").fetchone()
    by_status = dict(con.execute("SELECT status, count(*) FROM rollouts GROUP BY status").fetchall())
    con.close()
    print(f"{'step':>4} {'reward':>7} {'runs':>5} {'tool calls':>10} {'calls/run':>9} {'step s':>7} {'KL':>7}")
    for step, reward, step_s, calls, tools, runs, kl in rows:
        share = f"{tools / calls:.0%}" if calls else "-"
        kl_s = f"{kl:.4f}" if kl is not None else "-"  # the policy's KL to version 0 (train.kl_coef > 0)
        print(f"{step:>4} {reward if reward is not None else float('nan'):>7.3f} {runs:>5} {share:>10} "
              f"{calls / max(runs, 1):>9.2f} {step_s:>7.1f} {kl_s:>7}")
    rewards = [r[1] for r in rows if r[1] is not None]
    calls, tools, runs = (sum(r[i] for r in rows) for i in (3, 4, 5))
    first, last = rewards[:window], rewards[-window:]
    return {"steps": len(rows), "status": status[0] if status else None, "by_status": by_status,
            "first": sum(first) / len(first) if first else float("nan"),
            "last": sum(last) / len(last) if last else float("nan"),
            "tool_share": tools / calls if calls else 0.0, "calls_per_run": calls / max(runs, 1),
            "step_s": sum(r[2] for r in rows) / max(len(rows), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="claude-code", help="configs/<preset>.yaml (claude-code, codex, qwen-code, "
                                                            "opencode)")
    ap.add_argument("--config", help="a run config of your own instead of --preset's")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    ap.add_argument("--min-gain", type=float, default=0.15)
    ap.add_argument("--max-step-s", type=float, default=240.0, help="wall-clock allowance per step (run.max_wall_s)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a config field for this run (repeatable), e.g. --set tasks.group_size=8")
    ap.add_argument("--ledger", type=Path, help="report on this run's ledger.db instead of running")
    args = ap.parse_args()
    if args.ledger is None:
        name = args.preset if not args.config else Path(args.config).stem
        run_id = f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(args, run_id, Path(tmp))
            state = Path(yaml.safe_load(cfg.read_text()).get("run", {}).get("state_dir", "state"))
            rc, wall = _run(cfg)
        db = (REPO / state if not state.is_absolute() else state) / run_id / "ledger.db"
        print(f"gyre run exited {rc} after {wall:.0f} s; ledger {db}")
    else:
        db = args.ledger
    r = report(db, args.window)
    gain = r["last"] - r["first"]
    ok = gain >= args.min_gain and r["status"] != "FAILED" and r["steps"] >= (args.steps if not args.ledger else 1)
    print(f"run {r['status']}, {r['steps']} steps; runs by status {r['by_status']}; tool calls {r['tool_share']:.0%} "
          f"of model calls, {r['calls_per_run']:.2f} calls per run, {r['step_s']:.1f} s per step")
    print(f"reward first {args.window} steps {r['first']:.3f}, last {args.window} steps {r['last']:.3f}: gain "
          f"{gain:+.3f} (target >= {args.min_gain}) {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
