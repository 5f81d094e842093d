"""The checks of tools/chaos.py: after a run, its ledger (and the copies of its proxy journals) against what its
faults must not have done, and the events each fault must have left (tools/chaos.py's docstring lists them)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgpack

from gyre_slurm.launch.supervise import STALL_S

SCORED = ("COMPLETED", "TIMEOUT_SCORED", "TRUNCATED_CONTEXT")
EVENTS = {"full": ("disk_full", "disk_space_back"), "slow": ("disk_slow", "disk_fast")}  # each disk fault's events
# what names a partition of each kind: an agent's heartbeats stop (cells.py), a proxy's or a worker's hellos
PARTITIONED = {"agent": "agent_lost", "core": "agent_lost", "satellite": "agent_lost", "proxy": "proxy_silent",
               "worker": "worker_silent"}
PARTITION_TOLD_S = 8.0  # a partition longer than this is told (hellos every 2 s, silent past 6 s)


def q(db: Path, sql: str, *args: Any) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


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


def check(db: Path, steps: int, snaps: Path, o: Any, hang_timeout_s: float) -> None:
    """Fill `o` (chaos.Outcome): lost, duplicates, integrity, cut and problems."""
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
    told = dict(q(db, "SELECT kind, count(*) FROM events WHERE kind LIKE 'process_%' GROUP BY kind"))
    kills = sum(f.fault == "kill" for f in o.faults)
    hangs = [f for f in o.faults if f.fault == "hang" and f.held_s > STALL_S + 1]  # a shorter one may go unseen
    if told.get("process_hung", 0) + told.get("process_stalled", 0) < len(hangs):
        o.problems.append(f"{len(hangs)} hangs but {told.get('process_hung', 0)} process_hung and "
                          f"{told.get('process_stalled', 0)} process_stalled rows in events")
    if told.get("process_restarted", 0) < kills + told.get("process_hung", 0):
        o.problems.append(f"{kills} kills and {told.get('process_hung', 0)} processes killed as hung but "
                          f"{told.get('process_restarted', 0)} process_restarted rows in events")
    long = sum(f.held_s > hang_timeout_s + 5 for f in hangs)  # the supervisor looks every 0.5 s
    if told.get("process_hung", 0) < long:
        o.problems.append(f"{long} hangs longer than control.hang_timeout_s but {told.get('process_hung', 0)} "
                          "process_hung rows in events")
    for told_by in set(PARTITIONED.values()):
        n = sum(f.fault == "partition" and PARTITIONED[f.kind] == told_by and f.held_s > PARTITION_TOLD_S
                for f in o.faults)
        rows = q(db, "SELECT count(*) FROM events WHERE kind = ?", told_by)[0][0]
        if rows < n:
            o.problems.append(f"{n} partitions but {rows} {told_by} rows in events")
    for fault, kinds in EVENTS.items():
        n = sum(f.fault == fault for f in o.faults)
        for kind in kinds:
            rows = q(db, "SELECT count(*) FROM events WHERE kind = ?", kind)[0][0]
            if rows < n:
                o.problems.append(f"{n} {fault} disks but {rows} {kind} rows in events")
