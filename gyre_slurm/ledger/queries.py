"""The reads behind `gyre status` and `gyre cells list`: each one an indexed lookup or a small table scan,
never a scan of model_calls (a 700k-token run makes millions of those)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from typing import Any

from gyre_slurm.ledger.readonly import query_dicts


def cells(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return query_dicts(conn, "SELECT * FROM v_cells ORDER BY cell")


def agents(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return query_dicts(conn, "SELECT node_index AS node, cell_id AS cell, node_name, host, pid, status, role, "
                             "registrations, last_heartbeat FROM agents ORDER BY node_index")


def status_summary(conn: sqlite3.Connection, n_switches: int = 5, n_events: int = 5) -> dict[str, Any]:
    now = time.time()
    run = query_dicts(conn, "SELECT * FROM runs LIMIT 1")
    out: dict[str, Any] = {"now": now, "run": run[0] if run else None}
    out["cells"] = cells(conn)
    out["agents"] = agents(conn)
    out["switches"] = query_dicts(conn, "SELECT * FROM v_switch_durations ORDER BY switch DESC LIMIT ?",
                                  (n_switches,))
    evals = has_evals(conn)  # a ledger of schema 4 (older runs) has neither evals nor rollouts.kind
    train = "WHERE kind = 'train'" if evals else ""
    out["rollouts"] = {r["status"]: r["n"] for r in query_dicts(
        conn, f"SELECT status, count(*) AS n FROM rollouts {train} GROUP BY status")}
    out["eval"] = eval_row(conn) if evals else None
    # ids only grow and rows are never deleted, so max(id) is the count, read from the index in O(log n)
    out["model_calls"] = query_dicts(conn, "SELECT coalesce(max(id), 0) AS n FROM model_calls")[0]["n"]
    out["calls_last_min"] = query_dicts(conn, "SELECT count(*) AS n FROM model_calls WHERE started_at > ?",
                                        (now - 60,))[0]["n"]
    out["steps"] = query_dicts(conn, "SELECT * FROM train_steps ORDER BY step DESC LIMIT 3")
    out["version"] = query_dicts(conn, "SELECT max(version) AS v FROM weight_versions")[0]["v"]
    last = query_dicts(conn, "SELECT * FROM v_policy_decisions ORDER BY id DESC LIMIT 1")
    out["decision"] = last[0] if last else None
    cfg = json.loads(run[0]["config"]) if run else {}
    k = cfg.get("cluster", {}).get("rollouts_per_cell", 0)
    out["capacity"] = sum(c["role"] == "ROLLOUT" for c in out["cells"]) * k
    out["events"] = query_dicts(conn, "SELECT ts, kind, severity, message FROM events "
                                      "WHERE severity != 'info' ORDER BY id DESC LIMIT ?", (n_events,))
    out["harness_errors"] = harness_errors(conn)
    out["open_step"] = open_step(conn)
    return out


def has_evals(conn: sqlite3.Connection) -> bool:
    return bool(query_dicts(conn, "SELECT 1 AS x FROM sqlite_master WHERE type = 'table' AND name = 'evals'"))


def eval_row(conn: sqlite3.Connection, eval_id: int | None = None) -> dict[str, Any] | None:
    """An evaluation's v_eval row (the latest one without `eval_id`) with how many of its runs have ended and
    will (`ended`, `total`), and the first DONE evaluation's version and pass@1 (`first`)."""
    rows = query_dicts(conn, "SELECT * FROM v_eval WHERE ? IS NULL OR eval = ? ORDER BY eval DESC LIMIT 1",
                       (eval_id, eval_id))
    if not rows:
        return None
    e = rows[0]
    e["ended"] = query_dicts(conn, "SELECT count(*) AS n FROM rollouts WHERE eval_id = ? AND status NOT IN "
                                   "('QUEUED', 'RUNNING')", (e["eval"],))[0]["n"]
    e["total"] = e["tasks"] * e["samples"]
    first = query_dicts(conn, "SELECT version, pass_at_1 FROM v_eval WHERE status = 'DONE' ORDER BY eval LIMIT 1")
    e["first"] = first[0] if first else None
    return e


# a finished run whose harness failed, never called the model, or reported API errors (views.sql: v_harness_errors;
# spelled out here too, so that `gyre status` reads a ledger written before the view existed)
HARNESS_ERROR = "(status = 'INFRA_ERROR' OR (status IN ('COMPLETED', 'TIMEOUT_SCORED') AND error IS NOT NULL))"


def harness_errors(conn: sqlite3.Connection, last_n: int = 100) -> dict[str, Any]:
    """Of the last `last_n` finished rollouts (by id: a backward walk of the primary key), how many are harness
    errors, and the most recent one (id, status, error)."""
    rows = query_dicts(conn, f"SELECT id, status, error, {HARNESS_ERROR} AS bad FROM rollouts "
                             "WHERE ended_at IS NOT NULL ORDER BY id DESC LIMIT ?", (last_n,))
    bad = [r for r in rows if r["bad"]]
    latest = {k: bad[0][k] for k in ("id", "status", "error")} if bad else None
    return {"finished": len(rows), "count": len(bad), "latest": latest}


def daemon_alive(control: Any) -> bool | None:
    """True/False when the daemon ran on this host (checked by pid), None when it is elsewhere."""
    if control is None:
        return False
    if control.daemon_host != socket.gethostname():
        return None
    try:
        os.kill(control.daemon_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_step(conn: sqlite3.Connection) -> dict[str, Any] | None:
    """The step in flight: its number, whether its groups are all in (sealed), its shards by status and the cells
    computing them; None between steps."""
    row = query_dicts(conn, "SELECT step, n_groups, started_at FROM train_steps WHERE status = 'RUNNING' "
                            "ORDER BY step DESC LIMIT 1")
    if not row:
        return None
    step = row[0]["step"]
    by = {r["status"]: r["n"] for r in query_dicts(
        conn, "SELECT status, count(*) AS n FROM shards WHERE step = ? AND status != 'FAILED' "
              "GROUP BY status", (step,))}
    cells = [r["cell_id"] for r in query_dicts(conn, "SELECT DISTINCT cell_id FROM shards WHERE step = ? AND "
                                                     "status = 'TAKEN' ORDER BY cell_id", (step,))]
    return {"step": step, "sealed": bool(row[0]["n_groups"]), "done": by.get("DONE", 0),
            "taken": by.get("TAKEN", 0), "queued": by.get("QUEUED", 0), "computing": cells}


def open_step_text(st: dict[str, Any] | None) -> str:
    """One line for `gyre status` and the progress line: "step 6: shards 3 done, 1 on cell 0, 2 queued, …"."""
    if st is None:
        return "no step open"
    on = f", {st['taken']} on cell {', '.join(map(str, st['computing']))}" if st["taken"] else ""
    groups = "all groups in" if st["sealed"] else "taking groups as they become ready"
    return f"step {st['step']}: shards {st['done']} done{on}, {st['queued']} queued ({groups})"


def progress(conn: sqlite3.Connection) -> dict[str, Any]:
    """Where the RL loop stands: steps done, this step's rollouts, the last step's reward."""
    run = query_dicts(conn, "SELECT config FROM runs LIMIT 1")
    cfg = json.loads(run[0]["config"]) if run else {}
    steps = query_dicts(conn, "SELECT count(*) AS n FROM train_steps WHERE status = 'DONE'")[0]["n"]
    last = query_dicts(conn, "SELECT reward_mean FROM train_steps WHERE status = 'DONE' ORDER BY step DESC LIMIT 1")
    cur = query_dicts(conn, "SELECT count(*) AS admitted, sum(r.status NOT IN ('QUEUED', 'RUNNING')) AS done "
                            "FROM rollouts r JOIN groups g ON g.id = r.group_id "
                            "WHERE g.status IN ('ADMITTED', 'READY')")[0]
    return {"steps_done": steps, "max_steps": cfg.get("train", {}).get("steps"),
            "last_reward": last[0]["reward_mean"] if last else None,
            "admitted": cur["admitted"] or 0, "done": cur["done"] or 0}
