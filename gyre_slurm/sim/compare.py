"""Running the three policies on one workload: colocate, async tuned over its split C_T (the fastest is the
baseline, ALGORITHMS.md §5.4 lesson 2), and elastic."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gyre_slurm.scheduler.policy import make_policy
from gyre_slurm.sim.engine import Simulation
from gyre_slurm.sim.metrics import SimResult
from gyre_slurm.sim.workload import Workload

POLICIES = ("colocate", "async", "elastic")
Progress = Callable[[str], None]


def simulate(w: Workload, policy: str, *, eta: int | None = None, seed: int = 0, train_cells: int = 1,
             release: str = "migrate", max_train_cells: int | None = None, timeline: bool = False) -> SimResult:
    """One run of one policy. η defaults to the workload's; colocate is always η = 0 (one version per step)."""
    eta = w.eta if eta is None else eta
    eta = 0 if policy == "colocate" else eta
    p = make_policy(policy, max_staleness=eta, train_cells=train_cells, max_train_cells=max_train_cells)
    return Simulation(w, p, seed=seed, release=release, eta=eta, keep_timeline=timeline).run()


def sweep_async(w: Workload, *, eta: int | None = None, seed: int = 0, timeline: bool = False,
                progress: Progress | None = None) -> list[SimResult]:
    """Async at every split C_T = 1 .. C − 1 (one cell always rolls out)."""
    out = []
    for c in range(1, max(2, w.cells)):
        if progress:
            progress(f"{w.name}: async C_T={c}")
        out.append(simulate(w, "async", eta=eta, seed=seed, train_cells=c, timeline=timeline))
    return out


def fastest(results: list[SimResult]) -> SimResult:
    return min(results, key=lambda r: r.total_s)


@dataclass
class Comparison:
    workload: Workload
    eta: int
    results: dict[str, SimResult]  # by policy; "async" is the fastest split
    async_splits: list[SimResult]

    def speedup(self, baseline: str) -> float | None:
        """T_baseline / T_elastic over the whole run (the paper's end-to-end speedup)."""
        el, base = self.results.get("elastic"), self.results.get(baseline)
        return base.total_s / el.total_s if el and base and el.total_s else None


def compare(w: Workload, *, policies: tuple[str, ...] = POLICIES, eta: int | None = None, seed: int = 0,
            release: str = "migrate", timeline: bool = False, progress: Progress | None = None) -> Comparison:
    eta = w.eta if eta is None else eta
    results: dict[str, SimResult] = {}
    splits: list[SimResult] = []
    for name in policies:
        if name == "async":
            splits = sweep_async(w, eta=eta, seed=seed, timeline=timeline, progress=progress)
            results[name] = fastest(splits)
            continue
        if progress:
            progress(f"{w.name}: {name}")
        results[name] = simulate(w, name, eta=eta, seed=seed, release=release, timeline=timeline)
    return Comparison(w, eta, results, splits)
