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
    """e.g. "async C_T=2 streaming", "elastic batch" (colocate never streams)."""
    if r.policy == "colocate":
        return r.policy
    split = f" C_T={r.train_cells}" if r.policy == "async" else ""
    return f"{r.policy}{split} {'streaming' if r.streaming else 'batch'}"


def comparison_table(c: Comparison) -> Table:
    w = c.workload
    t = Table(title=f"{w.name}: {w.description or 'replayed run'} · {w.cells} cells × k={w.runs_per_cell} · "
                    f"B={w.groups_per_step}×G={w.group_size} · {w.steps} steps · η={c.eta}", title_justify="left")
    for col in ("policy", "total", "per step", "cell-idle", "slot-idle", "staleness (runs)", "switches", "migrations",
                "cells/step", "overlap"):
        t.add_column(col, justify="left" if col in ("policy", "staleness (runs)") else "right", no_wrap=col == "policy")
    for r in c.results.values():
        mean_cells = sum(r.step_cells) / len(r.step_cells) if r.step_cells else 0.0
        t.add_row(policy_name(r), duration(r.total_s), duration(r.per_step_s), f"{r.cell_idle:.2f}",
                  f"{r.slot_idle:.2f}", format_histogram(r.staleness), str(r.switches), str(r.migrations),
                  f"{mean_cells:.1f}", f"{r.overlap_share:.2f}")
    return t


def summary_lines(c: Comparison) -> list[str]:
    """Elastic's speedups (streaming on and off) beside the paper's, the overlap shares, the async splits, and for
    2.4T the hours."""
    paper = c.workload.paper
    out = []
    for key in c.elastic_keys:
        for base in ("colocate", "async"):
            s = c.speedup(base, key)
            if s is None:
                continue
            what = f"best async ({policy_name(c.results['async'])[6:]})" if base == "async" else base
            ref = f" (paper {span(paper.vs_async if base == 'async' else paper.vs_colocate)})" if paper else ""
            out.append(f"{policy_name(c.results[key])} vs {what}: {s:.2f}×{ref}")
    shares = [f"{policy_name(r)} {r.overlap_share:.2f}" for k, r in c.results.items() if k != "colocate"]
    if shares:
        out.append("overlap share (training seconds while runs still ran): " + ", ".join(shares))
    if len(c.async_splits) > 1:
        out.append("async by C_T: " + ", ".join(f"{r.train_cells}{' streaming' if r.streaming else ''}: "
                                               f"{duration(r.total_s)}" for r in c.async_splits))
    if paper and paper.hours:
        out += hours_lines(c, paper)
    return out


def hours_lines(c: Comparison, paper: PaperResult) -> list[str]:
    out = []
    for r in c.results.values():
        if r.policy not in paper.hours:
            continue
        off = abs(r.total_s / 3600 / paper.hours[r.policy] - 1) > 0.02
        note = "prediction" if r.policy == "elastic" else "fitted, the closest the model reaches" if off else "fitted"
        out.append(f"{policy_name(r)}: {r.total_s / 3600:.2f} h for {len(r.step_ends)} steps "
                   f"(paper {paper.hours[r.policy]:.2f} h, {note})")
    return out


def ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x else "-"


def overview_table(comparisons: list[Comparison]) -> Table:
    """Per workload: elastic streaming and batch against colocate and best async beside the paper, the best async,
    elastic's overlap share (streaming, batch) and its total (streaming / batch)."""
    t = Table(title="elastic's end-to-end speedup (streaming / batch), simulated vs the paper", title_justify="left")
    for col in ("workload", "vs colocate", "paper", "vs best async", "paper", "best async", "overlap",
                "elastic total"):
        t.add_column(col, justify="left" if col == "workload" else "right")
    for c in comparisons:
        p, keys = c.workload.paper, c.elastic_keys
        vs = {base: " / ".join(ratio(c.speedup(base, k)) for k in keys) for base in ("colocate", "async")}
        total = " / ".join(duration(c.results[k].total_s) for k in keys) or "-"
        if keys and p and "elastic" in p.hours:
            total += f" (paper {p.hours['elastic']:.2f} h)"
        best = policy_name(c.results["async"])[6:] if "async" in c.results else "-"
        t.add_row(c.workload.name, vs["colocate"], span(p.vs_colocate) if p else "-", vs["async"],
                  span(p.vs_async) if p else "-", best,
                  " / ".join(f"{c.results[k].overlap_share:.2f}" for k in keys) or "-", total)
    return t
