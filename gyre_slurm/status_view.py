"""Rendering `gyre status` (and the live display of `gyre run`) with rich: readable at a glance."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from gyre_slurm.ledger.queries import open_step_text

ROLE_STYLE = {"ROLLOUT": "green", "TRAIN": "magenta", "SWITCHING": "yellow", "DOWN": "bold red"}


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _clip(line: str, n: int = 160) -> str:
    line = line.strip()
    return line if len(line) <= n else line[:n - 1] + "…"


def harness_errors_text(he: dict[str, Any] | None, run_id: str) -> Text | None:
    """The "harness errors" block: how many of the last finished runs failed in their harness, and the latest one
    (its error's first line, and its last line when there are more: the end of the log it quotes)."""
    if not he or not he["count"]:
        return None
    last = he["latest"]
    lines = [ln for ln in (last["error"] or "").splitlines() if ln.strip()] or ["(no error text)"]
    t = Text.assemble(("harness errors ", "bold red"), f"{he['count']} of the last {he['finished']} finished runs",
                      ("   (gyre sql ", "dim"), (f'{run_id} "select * from v_harness_errors"', "dim"), (")", "dim"))
    t.append(f"\n  rollout {last['id']} {last['status']}: {_clip(lines[0])}")
    if len(lines) > 1:
        t.append(f"\n    … {_clip(lines[-1])}", "dim")
    return t


def render_status(s: dict[str, Any], daemon: str) -> Group:
    run = s["run"] or {}
    now = s["now"]
    up = now - run.get("created_at", now)
    header = Text.assemble(
        ("run ", "dim"), (str(run.get("id", "?")), "bold"), ("  status ", "dim"),
        (str(run.get("status", "?")), {"RUNNING": "bold green", "DEGRADED": "bold red"}.get(run.get("status"),
                                                                                              "bold")),
        ("  policy ", "dim"), str(run.get("policy", "?")), ("  age ", "dim"), _age(up),
        ("  daemon ", "dim"), daemon,
        ("  restarts ", "dim"), str(max(0, (run.get("daemon_starts") or 1) - 1)),
    )
    if run.get("slurm_job_id"):
        header.append(f"  slurm job {run['slurm_job_id']}", "dim")

    cells = Table(title="cells", title_justify="left", expand=False)
    jobs = any(c.get("slurm_job_id") for c in s["cells"])  # gyre submit: each cell is a Slurm job of its own
    for col in ("cell", "kind", "role", "agents", "heartbeat", "in role") + (("slurm job",) if jobs else ()):
        cells.add_column(col)
    for c in s["cells"]:
        role = c["role"] + (f" → {c['target_role']}" if c.get("target_role") else "") + (" (pinned)" if c.get(
            "pinned") else "")
        job = ()
        if jobs:
            state = c.get("slurm_state") or ""
            job = (Text(f"{c.get('slurm_job_id') or '-'} {state}".strip(),
                        "" if state in ("RUNNING", "") else "yellow" if state == "PENDING" else "red"),)
        cells.add_row(str(c["cell"]), c["kind"], Text(role, ROLE_STYLE.get(c["role"], "")),
                      f"{c['agents_up']}/{c['n_nodes']}", _age(c["heartbeat_age_s"]), _age(c["in_role_s"]), *job)

    switches = Table(title="last switches", title_justify="left")
    for col in ("#", "cell", "switch", "reason", "status", "duration"):
        switches.add_column(col)
    for w in s["switches"]:
        switches.add_row(str(w["switch"]), str(w["cell"]), f"{w['from_role']} → {w['to_role']}", w["reason"],
                         w["status"], "-" if w["duration_s"] is None else f"{w['duration_s']:.3f}s")

    roll = s["rollouts"]
    work = Text.assemble(
        ("rollouts ", "dim"),
        "  ".join(f"{k.lower()} {v}" for k, v in sorted(roll.items())) or "none yet",
        ("   model calls ", "dim"), f"{s['model_calls']:,} ({s['calls_last_min']}/min)",
        ("   weights ", "dim"), "-" if s["version"] is None else f"v{s['version']}",
    )
    w = roll.get("QUEUED", 0) + roll.get("RUNNING", 0)
    sched = Text.assemble(("W ", "dim"), (str(w), "bold red" if w > s["capacity"] else "bold"),
                          (" against rollout capacity ", "dim"), str(s["capacity"]))
    d = s.get("decision")
    if d:
        sched.append_text(Text.assemble(("   last decision ", "dim"), f"{d['kind']} {d['what']}".strip(),
                                        (f" ({_age(s['now'] - d['ts_epoch'])} ago): ", "dim"), d["reason"]))
    parts: list[Any] = [header]
    if run.get("degraded_reason"):
        parts.append(Text.assemble(("DEGRADED: ", "bold red"), run["degraded_reason"],
                                   ("  (no new work but a probe group now and then; see events)", "dim")))
    training = [str(c["cell"]) for c in s["cells"] if c["role"] == "TRAIN"]
    train_line = Text.assemble(("training ", "dim"), f"cells {', '.join(training)}" if training else "no cell",
                               ("   ", "dim"), open_step_text(s.get("open_step")))
    parts += [cells, sched, train_line]
    if s["switches"]:
        parts.append(switches)
    parts.append(work)
    if s["steps"]:
        st = s["steps"][0]
        parts.append(Text.assemble(("last step ", "dim"), f"{st['step']} ({st['status']})",
                                   ("  reward ", "dim"), _num(st["reward_mean"]),
                                   ("  tokens ", "dim"), f"{st['tokens_trained']:,}"))
    ev = eval_text(s.get("eval"))
    if ev is not None:
        parts.append(ev)
    he = harness_errors_text(s.get("harness_errors"), str(run.get("id", "RUN")))
    if he is not None:
        parts.append(he)
    for e in s["events"]:
        ts = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
        parts.append(Text(f"{ts} {e['severity']}: {e['message']}", "red" if e["severity"] == "error" else "yellow"))
    return Group(*parts)


def eval_text(e: dict[str, Any] | None) -> Text | None:
    """The latest evaluation on the held-out tasks: running (runs ended) or its pass@1, beside the first one's."""
    if e is None:
        return None
    out = Text.assemble(("held-out eval ", "dim"), f"#{e['eval']} of v{e['version']} ")
    if e["status"] != "DONE":
        return out.append(f"running: {e['ended']}/{e['total']} runs ended")
    out.append_text(Text.assemble(("pass@1 ", "dim"), _num(e["pass_at_1"]), (f"  pass@{e['k']} ", "dim"),
                                  _num(e["pass_at_k"]), ("  mean score ", "dim"), _num(e["score_mean"])))
    f = e.get("first")
    if f is not None and f["version"] != e["version"]:
        out.append_text(Text.assemble(("   (v", "dim"), str(f["version"]), (": pass@1 ", "dim"), _num(f["pass_at_1"]),
                                      (")", "dim")))
    return out


def run_summary(conn: Any) -> str:
    """What `gyre run` prints at the end: steps, time per step, the reward's change, the runs by status, and the
    held-out pass@1 at each evaluation."""
    from gyre_slurm.ledger.queries import has_evals
    from gyre_slurm.ledger.readonly import query_dicts

    steps = query_dicts(conn, "SELECT step, reward_mean, step_s FROM v_step_times WHERE status = 'DONE' ORDER BY step")
    runs = query_dicts(conn, "SELECT status, rollouts FROM v_rollouts_by_status")
    evals = query_dicts(conn, "SELECT version, pass_at_1 FROM v_eval WHERE status = 'DONE' AND pass_at_1 IS NOT "
                              "NULL ORDER BY eval") if has_evals(conn) else []
    if not steps:
        return "no training step finished"
    r = [s["reward_mean"] for s in steps]
    k = min(5, len(r))
    first, last = sum(r[:k]) / k, sum(r[-k:]) / k
    per_step = [s["step_s"] for s in steps if s["step_s"] is not None]
    held = ("; held-out pass@1 by version: " + ", ".join(f"v{e['version']} {e['pass_at_1']:.3f}" for e in evals)
            if evals else "")
    return (f"{len(steps)} steps, {sum(per_step) / max(1, len(per_step)):.1f} s per step (rollouts, switches and "
            f"training); mean reward of the first {k} steps {first:.3f}, of the last {k} steps {last:.3f} (change "
            f"{last - first:+.3f}); rollouts: " + ", ".join(f"{x['status'].lower()} {x['rollouts']}" for x in runs)
            + held)
