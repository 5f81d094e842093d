"""Running the three policies on one workload: colocate, async tuned over its split C_T and over streaming on/off
(the fastest is the baseline, docs/algorithms.md §5.4 lesson 2), and elastic with streaming on and off."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gyre_slurm.scheduler.policy import make_policy
from gyre_slurm.sim.engine import Simulation
from gyre_slurm.sim.metrics import SimResult
from gyre_slurm.sim.workload import Workload

POLICIES = ("colocate", "async", "elastic")
MODES = (True, False)  # streaming on, off: what `gyre simulate` compares by default
Progress = Callable[[str], None]


def result_key(policy: str, streaming: bool) -> str:
    """How a Comparison names an elastic result: "elastic" streams, "elastic-batch" does not."""
    return f"{policy}-batch" if policy == "elastic" and not streaming else policy


def simulate(w: Workload, policy: str, *, eta: int | None = None, seed: int = 0, train_cells: int = 1,
             release: str = "migrate", max_train_cells: int | None = None, streaming: bool = False,
             timeline: bool = False) -> SimResult:
    """One run of one policy. η defaults to the workload's; colocate is always η = 0 (one version per step) and
    never streams."""
    eta = w.eta if eta is None else eta
    eta = 0 if policy == "colocate" else eta
    p = make_policy(policy, max_staleness=eta, train_cells=train_cells, max_train_cells=max_train_cells)
    return Simulation(w, p, seed=seed, release=release, eta=eta, streaming=streaming and policy != "colocate",
                      keep_timeline=timeline).run()


def sweep_async(w: Workload, *, eta: int | None = None, seed: int = 0, timeline: bool = False,
                modes: tuple[bool, ...] = MODES, progress: Progress | None = None) -> list[SimResult]:
    """Async at every split C_T = 1 .. C − 1 (one cell always rolls out), with each streaming mode."""
    out = []
    for c in range(1, max(2, w.cells)):
        for streaming in modes:
            if progress:
                progress(f"{w.name}: async C_T={c}{' streaming' if streaming else ''}")
            out.append(simulate(w, "async", eta=eta, seed=seed, train_cells=c, streaming=streaming,
                                timeline=timeline))
    return out


def fastest(results: list[SimResult]) -> SimResult:
    return min(results, key=lambda r: r.total_s)


@dataclass
class Comparison:
    workload: Workload
    eta: int
    results: dict[str, SimResult]  # "colocate", "async" (the fastest split and mode), "elastic", "elastic-batch"
    async_splits: list[SimResult]

    def speedup(self, baseline: str, elastic: str = "elastic") -> float | None:
        """T_baseline / T_elastic over the whole run (the paper's end-to-end speedup)."""
        el, base = self.results.get(elastic), self.results.get(baseline)
        return base.total_s / el.total_s if el and base and el.total_s else None

    @property
    def elastic_keys(self) -> list[str]:
        return [k for k in ("elastic", "elastic-batch") if k in self.results]


def compare(w: Workload, *, policies: tuple[str, ...] = POLICIES, eta: int | None = None, seed: int = 0,
            release: str = "migrate", modes: tuple[bool, ...] = MODES, timeline: bool = False,
            progress: Progress | None = None) -> Comparison:
    """Each policy once; async at every split and mode (the fastest is kept); elastic once per streaming mode."""
    eta = w.eta if eta is None else eta
    results: dict[str, SimResult] = {}
    splits: list[SimResult] = []
    for name in policies:
        if name == "async":
            splits = sweep_async(w, eta=eta, seed=seed, timeline=timeline, modes=modes, progress=progress)
            results[name] = fastest(splits)
            continue
        for streaming in modes if name == "elastic" else (False,):
            if progress:
                progress(f"{w.name}: {result_key(name, streaming)}")
            results[result_key(name, streaming)] = simulate(w, name, eta=eta, seed=seed, release=release,
                                                            streaming=streaming, timeline=timeline)
    return Comparison(w, eta, results, splits)
