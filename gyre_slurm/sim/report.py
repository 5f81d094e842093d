"""Tables of simulation results (rich): one per workload, an overview beside the paper's numbers, and sweeps."""

from __future__ import annotations

from rich.table import Table

from gyre_slurm.sim.compare import Comparison
from gyre_slurm.sim.metrics import SimResult, format_histogram
from gyre_slurm.sim.workload import PaperResult


def duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def span(r: tuple[float, float]) -> str:
    lo, hi = f"{r[0]:.2f}", f"{r[1]:.2f}"
    return f"{lo}×" if lo == hi else f"{lo}–{hi}×"


def policy_name(r: SimResult) -> str:
    return f"async C_T={r.train_cells}" if r.policy == "async" else r.policy


def comparison_table(c: Comparison) -> Table:
    w = c.workload
    t = Table(title=f"{w.name}: {w.description or 'replayed run'} · {w.cells} cells × k={w.runs_per_cell} · "
                    f"B={w.groups_per_step}×G={w.group_size} · {w.steps} steps · η={c.eta}", title_justify="left")
    for col in ("policy", "total", "per step", "cell-idle", "slot-idle", "staleness (runs)", "switches", "migrations",
                "cells/step"):
        t.add_column(col, justify="left" if col in ("policy", "staleness (runs)") else "right")
    for r in c.results.values():
        mean_cells = sum(r.step_cells) / len(r.step_cells) if r.step_cells else 0.0
        t.add_row(policy_name(r), duration(r.total_s), duration(r.per_step_s), f"{r.cell_idle:.2f}",
                  f"{r.slot_idle:.2f}", format_histogram(r.staleness), str(r.switches), str(r.migrations),
                  f"{mean_cells:.1f}")
    return t


def summary_lines(c: Comparison) -> list[str]:
    """Elastic's speedups beside the paper's, the async splits, and for 2.4T the hours."""
    paper = c.workload.paper
    out = []
    for base in ("colocate", "async"):
        s = c.speedup(base)
        if s is None:
            continue
        what = f"best async (C_T={c.results['async'].train_cells})" if base == "async" else base
        ref = f" (paper {span(paper.vs_async if base == 'async' else paper.vs_colocate)})" if paper else ""
        out.append(f"elastic vs {what}: {s:.2f}×{ref}")
    if len(c.async_splits) > 1:
        out.append("async by C_T: " + ", ".join(f"{r.train_cells}: {duration(r.total_s)}" for r in c.async_splits))
    if paper and paper.hours:
        out += hours_lines(c, paper)
    return out


def hours_lines(c: Comparison, paper: PaperResult) -> list[str]:
    out = []
    for name, r in c.results.items():
        if name not in paper.hours:
            continue
        off = abs(r.total_s / 3600 / paper.hours[name] - 1) > 0.02
        note = "prediction" if name == "elastic" else "fitted, the closest the model reaches" if off else "fitted"
        out.append(f"{policy_name(r)}: {r.total_s / 3600:.2f} h for {len(r.step_ends)} steps "
                   f"(paper {paper.hours[name]:.2f} h, {note})")
    return out


def overview_table(comparisons: list[Comparison]) -> Table:
    t = Table(title="elastic's end-to-end speedup, simulated vs the paper", title_justify="left")
    for col in ("workload", "vs colocate", "paper", "vs best async", "paper", "best C_T", "elastic total"):
        t.add_column(col, justify="left" if col == "workload" else "right")
    for c in comparisons:
        p = c.workload.paper
        sc, sa = c.speedup("colocate"), c.speedup("async")
        el = c.results.get("elastic")
        total = duration(el.total_s) if el else "-"
        if el and p and "elastic" in p.hours:
            total += f" (paper {p.hours['elastic']:.2f} h)"
        t.add_row(c.workload.name, f"{sc:.2f}×" if sc else "-", span(p.vs_colocate) if p else "-",
                  f"{sa:.2f}×" if sa else "-", span(p.vs_async) if p else "-",
                  str(c.results["async"].train_cells) if "async" in c.results else "-", total)
    return t
