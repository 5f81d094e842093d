"""`gyre simulate`: the discrete-event simulator of gyre_slurm.sim on the paper's workloads or on a real run's
ledger: time per step per policy, elastic's speedups beside the paper's, idle fractions, staleness, and optionally
a timeline plot, a sweep of settings, or a re-fit of the workloads' constants."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from gyre_slurm.cli_common import StateDir, err_console
from gyre_slurm.cli_common import console as terminal
from gyre_slurm.errors import GyreError

Opt = typer.Option
# the tables need ~110 columns: a pipe or a log file gets them whole instead of rich's default 80
console = terminal if terminal.is_terminal else Console(soft_wrap=True, width=132)


@contextmanager
def progress_bar(total: int | None, what: str) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on a terminal; elsewhere a plain line on stderr every few seconds."""
    if err_console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err_console, transient=True) as bar:
            task = bar.add_task(what, total=total)
            yield lambda msg: bar.update(task, advance=1, description=msg)
        return
    last = [0.0, 0]

    def note(msg: str) -> None:
        last[1] += 1
        if time.monotonic() - last[0] >= 2.0:
            last[0] = time.monotonic()
            err_console.print(f"{what}: {last[1]}{f'/{total}' if total else ''} {msg}", highlight=False)

    yield note


def pick_workloads(names: list[str] | None, cells: int | None, steps: int | None, k: int | None) -> list:
    from gyre_slurm.sim.paper import WORKLOADS

    unknown = [n for n in names or [] if n not in WORKLOADS]
    if unknown:
        raise GyreError(f"unknown workload {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    return [override(WORKLOADS[n], cells, steps, k) for n in names or WORKLOADS]


def override(w, cells: int | None, steps: int | None, k: int | None):
    if cells is not None and cells < 2:
        raise GyreError(f"--cells must be at least 2 (one rollout and one training cell), not {cells}")
    if steps is not None and steps < 1:
        raise GyreError(f"--steps must be at least 1, not {steps}")
    if k is not None and k < 1:
        raise GyreError(f"--k must be at least 1, not {k}")
    return w.with_(cells=cells or w.cells, steps=steps or w.steps, runs_per_cell=k or w.runs_per_cell)


def check_policies(policies: list[str] | None) -> tuple[str, ...]:
    from gyre_slurm.sim.compare import POLICIES

    bad = [p for p in policies or [] if p not in POLICIES]
    if bad:
        raise GyreError(f"unknown policy {', '.join(bad)} (known: {', '.join(POLICIES)})")
    return tuple(p for p in POLICIES if p in (policies or POLICIES))  # always in the table's order


def streaming_modes(streaming: bool | None) -> tuple[bool, ...]:
    """--streaming / --no-streaming: that mode only; neither: both (async's best is taken over both)."""
    from gyre_slurm.sim.compare import MODES

    return MODES if streaming is None else (streaming,)


def run_comparisons(workloads: list, policies: tuple[str, ...], eta: int | None, seed: int, release: str,
                    timeline: bool, modes: tuple[bool, ...]) -> list:
    from gyre_slurm.sim.compare import compare

    per = {"colocate": 1, "elastic": len(modes)}
    total = sum(per.get(p, (w.cells - 1) * len(modes)) for w in workloads for p in policies)
    out = []
    with progress_bar(total, "simulating") as note:
        for w in workloads:
            out.append(compare(w, policies=policies, eta=eta, seed=seed, release=release, modes=modes,
                               timeline=timeline, progress=note))
    return out


def print_comparison(c) -> None:
    from gyre_slurm.sim.report import comparison_table, summary_lines

    console.print(comparison_table(c))
    for line in summary_lines(c):
        console.print(f"  {line}", highlight=False)
    console.print()


def do_sweep(w, seed: int, policy: str, eta: int) -> None:
    from gyre_slurm.sim.sweep import current_row, grid, run_sweep, sweep_table

    etas, cells, ks = grid(w)
    total = sum(1 + 2 * 3 * (n - 1) + 2 * len(etas) for n in cells for _ in ks)
    with progress_bar(total, f"sweeping {w.name}") as note:
        rows = run_sweep(w, seed=seed, progress=note)
    console.print(sweep_table(rows, w, current_row(rows, w, policy, eta)))


def do_calibrate(workloads: list, seed: int) -> None:
    from rich.table import Table

    from gyre_slurm.sim.calibrate import calibrate

    t = Table(title="calibration on the baselines (stored → re-fitted)", title_justify="left")
    for col in ("workload", "parameter", "stored", "re-fitted", "colocate", "best async", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("workload", "parameter") else "right")
    for w in workloads:
        if w.paper is None:
            continue
        with progress_bar(None, f"fitting {w.name}") as note:
            fit = calibrate(w, seed=seed, progress=note)
        a, p = fit.achieved, w.paper
        target = p.hours["colocate"] / p.hours["async"] if "async" in p.hours else p.colocate_over_async
        for i, (name, value) in enumerate(fit.params.items()):
            first = i == 0
            t.add_row(w.name if first else "", name, f"{getattr(w, name):.4g}", f"{value:.4g}",
                      f"{a['colocate_h']:.2f} h" if first else "", f"{a['async_h']:.2f} h (C_T={a['C_T']})"
                      if first else "", f"{a['colocate_over_async']:.3f}" if first else "",
                      f"{target:.3f}" if first else "")
    console.print(t)


def do_replay(run: str, state_dir: Path, policies: tuple[str, ...], eta: int | None, seed: int, release: str | None,
              timeline: bool, overrides: tuple, modes: tuple[bool, ...]) -> tuple[list, str]:
    from gyre_slurm.cli_common import run_dir_of
    from gyre_slurm.rundir import ledger_path
    from gyre_slurm.sim.compare import result_key
    from gyre_slurm.sim.replay import load_replay
    from gyre_slurm.sim.report import duration

    path = Path(run)
    rp = load_replay(path if path.is_file() else ledger_path(run_dir_of(run, state_dir)))
    w = override(rp.workload, *overrides)
    n = sum(len(g) for g in w.replay_groups)
    console.print(f"replaying {w.description}: {n} measured runs in {len(w.replay_groups)} groups (median "
                  f"{duration(w.median_s)}), training {w.train_fix_s:.0f} cell-s per step, {w.cells} cells × "
                  f"k={w.runs_per_cell}, B={w.groups_per_step}×G={w.group_size}, {w.steps} steps", highlight=False)
    [c] = run_comparisons([w], policies, rp.eta if eta is None else eta, seed, release or rp.release, timeline,
                          modes)
    print_comparison(c)
    mine = c.results.get(rp.policy if rp.policy == "async" else result_key(rp.policy, rp.streaming))
    if rp.measured_per_step_s and mine:
        console.print(f"  the run itself ({rp.policy}, {rp.measured_steps} steps): {duration(rp.measured_per_step_s)}"
                      f" per step measured; simulated {duration(mine.per_step_s)}", highlight=False)
    return [c], rp.policy


def simulate(
    workload: Annotated[list[str] | None, Opt("--workload", "-w", help="A paper workload (repeatable); "
                                              "default: all four.")] = None,
    policy: Annotated[list[str] | None, Opt("--policy", "-p", help="colocate, async or elastic (repeatable); "
                                            "default: all three. Async is always tuned over C_T.")] = None,
    eta: Annotated[int | None, Opt(help="η, the bounded staleness of async and elastic (default: the workload's, "
                                   "1 for the paper's; colocate is always 0).")] = None,
    cells: Annotated[int | None, Opt(help="Cell count instead of the workload's.")] = None,
    k: Annotated[int | None, Opt("--k", help="Runs per rollout cell instead of the workload's.")] = None,
    steps: Annotated[int | None, Opt(help="Training steps instead of the workload's.")] = None,
    seed: Annotated[int, Opt(help="Seed of the run durations (every policy sees the same tasks).")] = 0,
    release: Annotated[str | None, Opt(help="How elastic frees a rollout cell: migrate or drain.")] = None,
    streaming: Annotated[bool | None, Opt("--streaming/--no-streaming", help="Steps take groups as they become "
                                          "ready (docs/algorithms.md §8), or B at once; default: both, side by "
                                          "side (async's best over both).")] = None,
    plot: Annotated[Path | None, Opt(help="Write a PNG of every cell's role over time, per policy.")] = None,
    from_ledger: Annotated[str | None, Opt("--from-ledger", help="Replay a run (id, prefix, 'last', folder "
                                           "or ledger file) under each policy.")] = None,
    state_dir: StateDir = Path("state"),
    sweep: Annotated[bool, Opt("--sweep", help="Also sweep η, cell count, k and the async split: which "
                               "settings would have been fastest.")] = False,
    calibrate: Annotated[bool, Opt("--calibrate", help="Re-fit the paper workloads' constants on the "
                                   "baselines and show them beside the stored ones.")] = False,
) -> None:
    """Simulate colocate, async and elastic scheduling on the paper's workloads or on a run's ledger."""
    policies = check_policies(policy)
    if release not in (None, "migrate", "drain"):
        raise GyreError(f"--release must be migrate or drain, not {release!r}")
    if eta is not None and eta < 0:
        raise GyreError(f"--eta must be 0 or more, not {eta}")
    if from_ledger and workload:
        raise GyreError("give either --workload or --from-ledger, not both")
    mine = "elastic" if "elastic" in policies else policies[0]
    if from_ledger:
        comparisons, mine = do_replay(from_ledger, state_dir, policies, eta, seed, release, plot is not None,
                                      (cells, steps, k), streaming_modes(streaming))
    else:
        workloads = pick_workloads(workload, cells, steps, k)
        if calibrate:
            do_calibrate(workloads, seed)
            return
        comparisons = run_comparisons(workloads, policies, eta, seed, release or "migrate", plot is not None,
                                      streaming_modes(streaming))
        for c in comparisons:
            print_comparison(c)
        if len(comparisons) > 1 and {"elastic", "colocate", "async"} <= set(policies):
            from gyre_slurm.sim.report import overview_table

            console.print(overview_table(comparisons))
    if sweep:
        for c in comparisons:
            do_sweep(c.workload, seed, mine, c.eta)
    if plot is not None:
        from gyre_slurm.sim.timeline import plot_timelines

        results = [r for c in comparisons for r in c.results.values()]
        console.print(f"wrote {plot_timelines(results, plot, 'gyre simulate: cell roles per policy')}")
