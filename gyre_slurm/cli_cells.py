"""`gyre cells`: list the cells, move one by hand (and pin it there), release it back to the policy, add more."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from gyre_slurm.cli_common import RunArg, StateDir, console, run_dir_of
from gyre_slurm.errors import GyreError

cells_app = typer.Typer(no_args_is_help=True,
                        help="List cells, move one between roles by hand, release it, or add cells.")
CellArg = Annotated[int, typer.Argument(help="Cell index.")]


@cells_app.command("list")
def cells_list(run: RunArg = "last", state_dir: StateDir = Path("state")) -> None:
    """Cells and their node agents, from the ledger."""
    from gyre_slurm.ledger import queries
    from gyre_slurm.ledger.readonly import connect_readonly
    from gyre_slurm.rundir import ledger_path

    conn = connect_readonly(ledger_path(run_dir_of(run, state_dir)))
    try:
        cells, agents = queries.cells(conn), queries.agents(conn)
    finally:
        conn.close()
    t = Table()
    jobs = any(c.get("slurm_job_id") for c in cells)
    for c in ("cell", "kind", "role", "pinned", "nodes (agent status)") + (("slurm job",) if jobs else ()):
        t.add_column(c)
    for c in cells:
        nodes = ", ".join(f"{a['node_name']}#{a['node']} {a['status']}" for a in agents if a["cell"] == c["cell"])
        job = f"{c['slurm_job_id']} {c['slurm_state'] or ''}".strip() if c.get("slurm_job_id") else "-"
        job = (job,) if jobs else ()
        t.add_row(str(c["cell"]), c["kind"], c["role"], "pinned" if c["pinned"] else "-", nodes or "-", *job)
    console.print(t)


def _wait_for_switch(run_dir: Path, sid: int, timeout_s: float) -> None:
    from gyre_slurm.ledger.readonly import connect_readonly, query_dicts
    from gyre_slurm.rundir import ledger_path

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn = connect_readonly(ledger_path(run_dir))
        try:
            row = query_dicts(conn, "SELECT status, duration_s, error FROM role_switches WHERE id = ?", (sid,))[0]
        finally:
            conn.close()
        if row["status"] == "DONE":
            console.print(f"switch {sid} done in {row['duration_s']:.3f} s")
            return
        if row["status"] == "FAILED":
            raise GyreError(f"switch {sid} failed: {row['error']}")
        time.sleep(0.1)
    raise GyreError(f"switch {sid} still pending after {timeout_s:g} s")


@cells_app.command("reassign")
def cells_reassign(
    run: Annotated[str, typer.Argument(help="Run id.")],
    cell: CellArg,
    role: Annotated[str, typer.Option(help="Target role: train or rollout.")],
    state_dir: StateDir = Path("state"),
    wait: Annotated[bool, typer.Option(help="Wait for the switch to finish and print its duration.")] = True,
    timeout_s: Annotated[float, typer.Option(help="How long to wait for the switch (s).")] = 300.0,
) -> None:
    """Move a cell to another role and pin it there: no policy moves it until `gyre cells release`."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import ReassignRequest

    if role.lower() not in ("train", "rollout"):
        raise GyreError(f"--role must be train or rollout, not {role!r}")
    run_dir = run_dir_of(run, state_dir)
    res = request(run_dir, ReassignRequest(cell=cell, role=role.upper()))
    sid = res["switch_id"]
    if sid is None:
        console.print(f"cell {cell} is {role.upper()} already: pinned there until `gyre cells release`")
        return
    console.print(f"switch {sid}: cell {cell} → {role.upper()} requested; pinned until `gyre cells release`")
    if wait:
        _wait_for_switch(run_dir, sid, timeout_s)


@cells_app.command("release")
def cells_release(run: Annotated[str, typer.Argument(help="Run id.")], cell: CellArg,
                  state_dir: StateDir = Path("state")) -> None:
    """Hand a pinned cell back to the scheduling policy."""
    from gyre_slurm.coordinator.client import request
    from gyre_slurm.protocol import ReleaseRequest

    request(run_dir_of(run, state_dir), ReleaseRequest(cell=cell))
    console.print(f"cell {cell} released: the policy may move it again")


@cells_app.command("add")
def cells_add(run: Annotated[str, typer.Argument(help="Run id (started with `gyre submit`).")],
              n: Annotated[int, typer.Argument(help="How many cells to add.", min=1)],
              state_dir: StateDir = Path("state")) -> None:
    """Submit N more cell jobs to a `gyre submit` run while it goes on; they join at the policy's next decision (a DOWN
    cell whose job is over is taken first, so a lost cell comes back under its own number)."""
    from gyre_slurm.launch.submitit_launch import add_cells

    add_cells(run_dir_of(run, state_dir), n, echo=console.print)
