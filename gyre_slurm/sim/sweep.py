"""`gyre simulate --sweep`: which settings (η, cell count, k, the async split) would have made a run fastest.

Every setting runs colocate, async at each split and elastic on the same tasks (one seed). More cells are faster
by construction, so the table also gives the cell-hours each step costs, and the best setting at the run's own
cell count (the same GPU budget)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from gyre_slurm.sim.compare import MODES, Progress, simulate, sweep_async
from gyre_slurm.sim.report import duration
from gyre_slurm.sim.workload import Workload


@dataclass(frozen=True)
class SweepRow:
    policy: str
    eta: int
    cells: int
    k: int
    train_cells: int  # async's C_T (0 for the others)
    per_step_s: float
    total_s: float
    streaming: bool = False

    @property
    def cell_hours_per_step(self) -> float:
        return self.per_step_s * self.cells / 3600

    def label(self) -> str:
        split = f" C_T={self.train_cells}" if self.policy == "async" else ""
        mode = " streaming" if self.streaming else ""
        return f"{self.policy}{split}{mode} η={self.eta} cells={self.cells} k={self.k}"


def grid(w: Workload) -> tuple[list[int], list[int], list[int]]:
    """η, cell counts and k around the workload's own."""
    cells = sorted({c for c in (w.cells - 1, w.cells, w.cells + 1) if c >= 2})
    ks = sorted({k for k in (max(1, w.runs_per_cell // 2), w.runs_per_cell, w.runs_per_cell * 2)})
    return [0, 1, 2, 3], cells, ks


def run_sweep(w: Workload, *, seed: int = 0, progress: Progress | None = None) -> list[SweepRow]:
    etas, cells, ks = grid(w)
    rows: list[SweepRow] = []
    for n in cells:
        for k in ks:
            wk = w.with_(cells=n, runs_per_cell=k)
            if progress:
                progress(f"cells={n} k={k}: colocate")
            col = simulate(wk, "colocate", seed=seed)
            rows.append(SweepRow("colocate", 0, n, k, 0, col.per_step_s, col.total_s))
            for eta in etas[1:]:
                for r in sweep_async(wk, eta=eta, seed=seed, progress=progress):
                    rows.append(SweepRow("async", eta, n, k, r.train_cells, r.per_step_s, r.total_s, r.streaming))
            for eta in etas:
                for streaming in MODES:
                    if progress:
                        progress(f"cells={n} k={k}: elastic η={eta}{' streaming' if streaming else ''}")
                    el = simulate(wk, "elastic", eta=eta, seed=seed, streaming=streaming)
                    rows.append(SweepRow("elastic", eta, n, k, 0, el.per_step_s, el.total_s, streaming))
    return rows


def sweep_table(rows: list[SweepRow], w: Workload, current: SweepRow | None, top: int = 8) -> Table:
    """The fastest settings, the best of each policy, and the best at the workload's own cell count."""
    title = f"{w.name}: fastest settings (time per step after the warm-up)"
    if current:
        title += f"; now {current.label()}: {duration(current.per_step_s)}"
    t = Table(title=title, title_justify="left")
    for col in ("why", "setting", "per step", "vs now", "cell-h/step"):
        t.add_column(col, justify="left" if col in ("why", "setting") else "right")
    ranked = sorted(rows, key=lambda r: r.per_step_s)
    picks: list[tuple[str, SweepRow]] = [("fastest", r) for r in ranked[:top]]
    for policy in ("colocate", "async", "elastic"):
        best = next((r for r in ranked if r.policy == policy), None)
        if best and best not in ranked[:top]:
            picks.append((f"best {policy}", best))
    same = next((r for r in ranked if r.cells == w.cells), None)
    if same:
        picks.append((f"best at {w.cells} cells", same))
    for why, r in picks:
        vs = f"{current.per_step_s / r.per_step_s:.2f}×" if current and r.per_step_s else "-"
        t.add_row(why, r.label(), duration(r.per_step_s), vs, f"{r.cell_hours_per_step:.2f}")
    return t


def current_row(rows: list[SweepRow], w: Workload, policy: str, eta: int) -> SweepRow | None:
    """The row of the workload as it is (for async: its best split)."""
    mine = [r for r in rows if r.policy == policy and r.cells == w.cells and r.k == w.runs_per_cell
            and r.eta == (0 if policy == "colocate" else eta)]
    return min(mine, key=lambda r: r.per_step_s, default=None)
