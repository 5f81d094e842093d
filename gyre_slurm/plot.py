"""`gyre plot RUN`: one PNG with what a picture says better than a table — the reward curve with the evaluation
curve beside it (pass@1 on the held-out tasks per version), tokens trained per step, and the timeline of every
cell's role (rollout, switching, training, down)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gyre_slurm.ledger.readonly import query_dicts

ROLE_COLORS = {"ROLLOUT": "#4caf50", "TRAIN": "#9c27b0", "SWITCHING": "#ffb300", "DOWN": "#e53935"}


def plot_run(conn: sqlite3.Connection, out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    steps = query_dicts(conn, "SELECT step, reward_mean, tokens_trained FROM train_steps WHERE status = 'DONE' "
                              "ORDER BY step")
    spans = query_dicts(conn, "SELECT cell_id, role, started_at, ended_at FROM cell_spans ORDER BY id")
    t0 = query_dicts(conn, "SELECT created_at FROM runs LIMIT 1")
    start = t0[0]["created_at"] if t0 else 0.0
    end = max([s["ended_at"] or s["started_at"] for s in spans] + [start])
    fig, (ax_r, ax_t, ax_c) = plt.subplots(3, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [3, 2, 2]})
    fig.suptitle(title)

    _rewards(ax_r, steps, query_dicts(conn, "SELECT version, pass_at_1, score_mean, k, pass_at_k FROM evals "
                                            "WHERE status = 'DONE' AND pass_at_1 IS NOT NULL ORDER BY version, id"))
    xs = [s["step"] for s in steps]
    ax_t.bar(xs, [s["tokens_trained"] or 0 for s in steps], color="#607d8b")
    ax_t.set_ylabel("tokens trained")
    ax_t.set_xlabel("training step")
    ax_t.grid(alpha=0.3, axis="y")

    for s in spans:
        stop = s["ended_at"] or end
        ax_c.barh(s["cell_id"], stop - s["started_at"], left=s["started_at"] - start, height=0.6,
                  color=ROLE_COLORS.get(s["role"], "#9e9e9e"), edgecolor="none")
    cells = sorted({s["cell_id"] for s in spans})
    ax_c.set_yticks(cells, [f"cell {c}" for c in cells])
    ax_c.set_xlabel("seconds since the run started")
    ax_c.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLORS.values()]
    ax_c.legend(handles, [r.lower() for r in ROLE_COLORS], loc="upper center", bbox_to_anchor=(0.5, -0.35),
                ncol=4, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _rewards(ax, steps: list[dict], evals: list[dict]) -> None:
    """The training reward per step and, at x = the steps done when it was taken, each evaluation's pass@1."""
    xs = [s["step"] for s in steps]
    rewards = [s["reward_mean"] for s in steps]
    ax.plot(xs, rewards, "o-", color="#1565c0", label="mean reward of the step's runs")
    if len(rewards) >= 5:  # a moving average shows the trend through the per-step noise
        avg = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        ax.plot(xs, avg, "-", color="#ef6c00", label="moving average (5 steps)")
    if evals:
        vx = [e["version"] for e in evals]
        ax.plot(vx, [e["pass_at_1"] for e in evals], "s-", color="#2e7d32", lw=2, label="held-out pass@1")
        ax.plot(vx, [e["pass_at_k"] for e in evals], "^:", color="#2e7d32",
                label=f"held-out pass@{evals[-1]['k']}")
        ax.plot(vx, [e["score_mean"] for e in evals], "d--", color="#8bc34a", label="held-out mean score")
    ax.set_ylabel("reward / pass rate")
    ax.set_xlabel("training step (evaluations: after that many steps)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", framealpha=0.6)
