"""`gyre eval`: evaluate one version of a run on its held-out tasks, during the run or after it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from gyre_slurm.cli_common import RunArg, StateDir, console, run_dir_of
from gyre_slurm.errors import GyreError

POLL_S = 1.0


def _read(run_dir: Path, fn: Callable[[Any], Any]) -> Any:
    """fn(a read-only connection to the run's ledger)."""
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path

    conn = connect_readonly(ledger_path(run_dir))
    try:
        return fn(conn)
    finally:
        conn.close()


def _eval_row(run_dir: Path, eval_id: int | None = None) -> dict | None:
    from gyre_slurm.ledger.queries import eval_row

    return _read(run_dir, lambda conn: eval_row(conn, eval_id))


def _versions(run_dir: Path) -> set[int]:
    from gyre_slurm.ledger.readonly import query_dicts

    return _read(run_dir, lambda conn: {r["version"] for r in query_dicts(conn, "SELECT version FROM "
                                                                                 "weight_versions")}) or {0}


def _run_live(run_dir: Path) -> bool:
    from gyre_slurm.ledger import queries
    from gyre_slurm.rundir import read_control

    try:
        return bool(queries.daemon_alive(read_control(run_dir)))
    except GyreError:
        return False


def _after_the_run(run_dir: Path, version: int | None) -> int:
    """Start the stopped run again in evaluation mode (its daemon serves `version`, evaluates it and stops)."""
    from gyre_slurm.launch.local import start_local_run
    from gyre_slurm.run_context import RunContext

    cfg = RunContext.open(run_dir).config
    if not cfg.eval.enabled:
        raise GyreError(f"run {run_dir.name} has no evaluation tasks: its config sets none of eval.suite, "
                        "eval.holdout_tasks, eval.holdout_share")
    versions = _versions(run_dir)
    if version is not None and version not in versions:
        raise GyreError(f"run {run_dir.name} has no version {version} (its versions: {min(versions)}–{max(versions)})")
    before = _eval_row(run_dir)
    local = start_local_run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"state_dir": run_dir.parent})}),
                            run_dir.name, eval_version=-1 if version is None else version)
    t0, last = time.monotonic(), 0.0
    try:
        while local.supervise():
            row = _eval_row(run_dir)
            if row is not None and row["eval"] != (before or {}).get("eval") and time.monotonic() - last >= 5:
                console.print(f"[{time.monotonic() - t0:6.1f}s] evaluation {row['eval']} of version "
                              f"{row['version']}: {row['ended']}/{row['total']} runs ended", highlight=False)
                last = time.monotonic()
            time.sleep(0.5)
    finally:
        local.wait(timeout_s=30)
    if local.gave_up or local.failed():
        raise GyreError(f"the evaluation's processes failed ({local.gave_up or local.failed()}); see "
                        f"{run_dir}/logs/")
    row = _eval_row(run_dir)
    if row is None or row["eval"] == (before or {}).get("eval") or row["status"] != "DONE":
        raise GyreError(f"the evaluation did not finish; see {run_dir}/logs/daemon.log")
    return row["eval"]


def evaluate(
    run: RunArg = "last",
    version: Annotated[int | None, typer.Option(help="Policy version to evaluate; default: the one served now "
                                                     "(during the run) or the last one (after it).")] = None,
    state_dir: StateDir = Path("state"),
    wait: Annotated[bool, typer.Option(help="Wait for the evaluation's figures (during the run).")] = True,
) -> None:
    """Evaluate a policy version on the run's held-out tasks (pass@1, pass@k, mean score): during the run
    through its daemon, after it by starting the run's processes again for this one evaluation."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import EvalRequest

    run_dir = run_dir_of(run, state_dir)
    if _run_live(run_dir):
        res = request(run_dir, EvalRequest(version=version))
        eid = res["eval"]
        console.print(f"evaluation {eid} of version {res['version']} started")
        while wait:
            row = _eval_row(run_dir, eid)
            if row is not None and row["status"] == "DONE":
                break
            time.sleep(POLL_S)
        if not wait:
            return
    else:
        eid = _after_the_run(run_dir, version)
    r = _eval_row(run_dir, eid)
    fmt = (lambda x: "n/a" if x is None else f"{x:.3f}")  # noqa: E731
    console.print(f"evaluation {eid} of version {r['version']}: pass@1 {fmt(r['pass_at_1'])}, pass@{r['k']} "
                  f"{fmt(r['pass_at_k'])}, mean score {fmt(r['score_mean'])}, timeouts {fmt(r['timeout_share'])} "
                  f"({r['runs']} runs scored, {r['excluded']} excluded) in {r['eval_s']} s")
