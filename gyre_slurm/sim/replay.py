"""`gyre simulate --from-ledger RUN`: a workload made of a real run's measurements, to replay under each policy.

From the ledger (read-only): the durations of its terminal runs (rollouts.started_at → ended_at, grouped as they
were, so a task's runs stay together), which runs were valid, their generated tokens; the training work of each
step (train_steps.train_s × n·eff(n), the median as c_fix: train_s already holds the weight hand-over, so
t_sync = 0); the measured switch times; and from the run's config the cluster (C, k), B, G, the steps and the
scheduler settings. The ledger is imported lazily: `import gyre_slurm.sim` stays free of it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.sim.metrics import WARMUP_STEPS
from gyre_slurm.sim.workload import SWITCH_RT_S, SWITCH_TR_S, RunSample, Workload

VALID = ("COMPLETED", "TIMEOUT_SCORED", "TRUNCATED_CONTEXT")
TERMINAL = (*VALID, "EVAL_ERROR", "INFRA_ERROR")


@dataclass
class Replay:
    workload: Workload
    policy: str  # the policy the run used
    eta: int
    train_cells: int
    release: str
    measured_steps: int
    measured_per_step_s: float | None  # the run's own time per step (after the warm-up where it can)
    streaming: bool = False  # whether its steps streamed (train.streaming, its null default resolved as config.py)


def section(cfg: dict, name: str) -> dict:
    return cfg.get(name) or {}


def measured_per_step(ends: list[float], start: float) -> float | None:
    if not ends:
        return None
    if len(ends) > WARMUP_STEPS + 1:
        return (ends[-1] - ends[WARMUP_STEPS - 1]) / (len(ends) - WARMUP_STEPS)
    return (ends[-1] - start) / len(ends)


def load_replay(ledger: Path) -> Replay:
    from gyre_slurm.ledger.readonly import connect_readonly, query_dicts

    conn = connect_readonly(ledger)
    try:
        run = query_dicts(conn, "SELECT policy, config, created_at FROM runs ORDER BY created_at LIMIT 1")
        runs = query_dicts(conn, f"SELECT group_id, status, started_at, ended_at, completion_tokens FROM rollouts "
                                 f"WHERE started_at IS NOT NULL AND ended_at IS NOT NULL AND status IN "
                                 f"({', '.join(repr(s) for s in TERMINAL)}) ORDER BY group_id, id")
        steps = query_dicts(conn, "SELECT train_s, n_cells, ended_at FROM train_steps WHERE status = 'DONE' "
                                  "ORDER BY step")
        switches = query_dicts(conn, "SELECT to_role, duration_s FROM role_switches WHERE status = 'DONE' AND "
                                     "duration_s IS NOT NULL")
    finally:
        conn.close()
    if not run:
        raise GyreError(f"{ledger} has no run row: not a gyre ledger, or the run never started")
    if not runs:
        raise GyreError(f"{ledger} has no finished rollout with a start and an end time: nothing to replay")
    trained = [s for s in steps if s["train_s"] is not None and (s["n_cells"] or 0) >= 1]
    if not trained:
        raise GyreError(f"{ledger} has no finished training step: no training time to replay")
    cfg = run[0]["config"]
    cfg = json.loads(cfg) if isinstance(cfg, str) else (cfg or {})
    return build(cfg, run[0], runs, trained, switches, ledger)


def build(cfg: dict, run: dict, runs: list[dict], steps: list[dict], switches: list[dict], ledger: Path) -> Replay:
    cluster, tasks, sched = section(cfg, "cluster"), section(cfg, "tasks"), section(cfg, "scheduler")
    groups: dict[int, list[RunSample]] = {}
    for r in runs:
        d = max(1e-3, r["ended_at"] - r["started_at"])
        tokens = float(r["completion_tokens"] or 0)
        groups.setdefault(r["group_id"], []).append(RunSample(d, r["status"] in VALID, tokens))
    durations = sorted(s.duration_s for g in groups.values() for s in g)
    base = Workload(
        name=f"replay:{Path(ledger).parent.name or ledger}", description=str(ledger),
        cells=int(cluster.get("cells", 2)), nodes_per_cell=int(cluster.get("nodes_per_cell", 1)),
        runs_per_cell=int(cluster.get("rollouts_per_cell", 32)), groups_per_step=int(tasks.get("groups_per_step", 2)),
        group_size=int(tasks.get("group_size", 16)), steps=int(section(cfg, "train").get("steps", len(steps))),
        median_s=statistics.median(durations),
        timeout_s=float(section(cfg, "harness").get("timeout_s", durations[-1])),
        train_s_per_mtok=0.0, sync_s=0.0, migrate_s=0.0, eta=int(sched.get("max_staleness", 1)),
        replay_groups=tuple(tuple(g) for g in groups.values()))
    work = statistics.median(s["train_s"] * base.train_rate(int(s["n_cells"])) for s in steps)
    to = {role: statistics.median(x["duration_s"] for x in switches if x["to_role"] == role) for role in
          {x["to_role"] for x in switches}}
    w = base.with_(train_fix_s=work, switch_rt_s=to.get("TRAIN", SWITCH_RT_S),
                   switch_tr_s=to.get("ROLLOUT", SWITCH_TR_S))
    ends = [s["ended_at"] for s in steps if s["ended_at"] is not None]
    train = section(cfg, "train")
    streaming = train.get("streaming")
    if streaming is None:
        streaming = run["policy"] != "colocate" and int(train.get("minibatches", 1)) == 1
    return Replay(w, run["policy"], w.eta, int(sched.get("train_cells", 1)), str(sched.get("release", "migrate")),
                  len(steps), measured_per_step(ends, run["created_at"]), bool(streaming))
