"""`gyre simulate --plot`: every cell's role over time, one panel per simulated policy (the colours of
`gyre plot`), with the end of each step marked."""

from __future__ import annotations

from pathlib import Path

from gyre_slurm.sim.metrics import SimResult


def plot_timelines(results: list[SimResult], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    from gyre_slurm.plot import ROLE_COLORS

    n = max(1, len(results))
    cells = max((r.cells for r in results), default=1)
    fig, axes = plt.subplots(n, 1, figsize=(11, 0.9 + n * (0.35 * cells + 0.7)), squeeze=False)
    fig.suptitle(title)
    hours = max((r.total_s for r in results), default=0.0) > 7200
    unit, scale = ("hours", 3600.0) if hours else ("seconds", 1.0)
    for ax, r in zip(axes[:, 0], results, strict=False):
        for cell, t0, t1, role in r.timeline:
            ax.barh(cell, (t1 - t0) / scale, left=t0 / scale, height=0.7, color=ROLE_COLORS.get(role, "#9e9e9e"),
                    edgecolor="none")
        for t in r.step_ends:
            ax.axvline(t / scale, color="#37474f", linewidth=0.4, alpha=0.5)
        ax.set_yticks(range(r.cells), [f"cell {c}" for c in range(r.cells)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{r.workload} · {r.label} · {r.total_s / scale:.2f} {unit}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel(f"{unit} since the start (thin lines: a step's weights published)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    fig.legend(handles, [r.lower() for r in ROLE_COLORS], loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
