"""Fitting a workload's free parameters on the two baselines, never on elastic (whose time is the prediction).

- `fit_rollout_share`: c_tok such that colocate spends a share ρ of its step rolling out (docs/algorithms.md §5.3:
  rollout is ~70 % (RollPacker) to > 90 % (APRIL) of RL time; we take ρ = 0.8). The colocate rollout phase does
  not depend on c_tok, so one colocate run with c_tok = 0 measures it.
- `fit_timeout`: T_max / m such that T_colocate / T_best-async matches the paper's implied ratio. The ratio grows
  with T_max / m (a longer tail hurts colocate more than async), so this is a bisection.
- `fit_train_share`: c_tok such that the baselines' ratio comes as close as it can to the target (for 2.4T, where
  both baselines' hours are published); the ratio is not monotone in c_tok, so a grid, then a bisection on a
  crossing or a golden-section search on the closest point.
- `fit_scale`: scales every duration (m, T_max) so colocate's total time hits the published hours.

All fits use one seed: every evaluation sees the same tasks (common random numbers), so the objective is a
deterministic function of the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre_slurm.sim.compare import Progress, fastest, simulate, sweep_async
from gyre_slurm.sim.workload import Workload

ROLLOUT_SHARE = 0.8  # docs/algorithms.md §5.3: rollout ≈ 70 % (RollPacker) … > 90 % (APRIL) of RL time
GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass
class Fit:
    workload: Workload  # with the fitted values in it
    params: dict[str, float]  # the fitted values, as stored in paper.py
    achieved: dict[str, float] = field(default_factory=dict)  # colocate_h, async_h, colocate_over_async, C_T
    evaluations: int = 0


def baselines(w: Workload, seed: int = 0, progress: Progress | None = None) -> dict[str, float]:
    """Colocate and best-tuned async over the whole run: hours, their ratio and the best split."""
    col = simulate(w, "colocate", seed=seed)
    best = fastest(sweep_async(w, seed=seed, progress=progress))
    return {"colocate_h": col.total_s / 3600, "async_h": best.total_s / 3600,
            "colocate_over_async": col.total_s / best.total_s, "C_T": best.train_cells}


def with_train_share(w: Workload, x: float) -> Workload:
    """c_tok (with c_fix = 0) such that T_train(C) of an average batch is x · m."""
    per_unit = w.mean_step_tokens() / 1e6 / w.train_rate(w.cells)  # seconds of T_train(C) per cell-s/Mtok
    return w.with_(train_fix_s=0.0, train_s_per_mtok=x * w.median_s / per_unit)


def fit_rollout_share(w: Workload, share: float = ROLLOUT_SHARE, seed: int = 0) -> Workload:
    free = w.with_(train_s_per_mtok=0.0, train_fix_s=0.0)
    col = simulate(free, "colocate", seed=seed)
    overhead = w.switch_rt_s + w.switch_tr_s + w.sync_s
    rollout = max(1.0, col.total_s / len(col.step_ends) - overhead)
    t_train = rollout * (1 - share) / share
    return with_train_share(w, t_train / w.median_s)


def bisect(f: Callable[[float], float], lo: float, hi: float, target: float, iters: int) -> float:
    """x in [lo, hi] (log scale) with f(x) ≈ target, for an increasing f; clamps at the ends."""
    f_lo, f_hi = f(lo), f(hi)
    if target <= f_lo:
        return lo
    if target >= f_hi:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def fit_timeout(w: Workload, target: float, *, seed: int = 0, lo: float = 0.5, hi: float = 8.0,
                iters: int = 7, progress: Progress | None = None) -> Workload:
    def ratio(r: float) -> float:
        if progress:
            progress(f"{w.name}: T_max/m = {r:.3f}")
        return baselines(w.with_(timeout_s=r * w.median_s), seed)["colocate_over_async"]

    r = bisect(ratio, lo, hi, target, iters)
    return w.with_(timeout_s=r * w.median_s)


def fit_train_share(w: Workload, target: float, *, seed: int = 0, grid: tuple[float, ...] = (0.1, 0.3, 1.0),
                    iters: int = 6, progress: Progress | None = None) -> Workload:
    cache: dict[float, float] = {}

    def err(x: float) -> float:
        if x not in cache:
            if progress:
                progress(f"{w.name}: T_train(C)/m = {x:.3f}")
            cache[x] = math.log(baselines(with_train_share(w, x), seed)["colocate_over_async"] / target)
        return cache[x]

    errs = [err(x) for x in grid]
    for a, b, ea, eb in zip(grid, grid[1:], errs, errs[1:], strict=False):
        if ea == 0 or ea * eb < 0:  # a crossing: bisect it
            for _ in range(iters):
                mid = math.sqrt(a * b)
                if err(mid) * ea > 0:
                    a = mid
                else:
                    b = mid
            return with_train_share(w, math.sqrt(a * b))
    # no crossing: the target is out of reach; take the closest point (golden section around the best grid point)
    i = min(range(len(grid)), key=lambda j: abs(errs[j]))
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for _ in range(iters):
        c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
        if abs(err(c)) < abs(err(d)):
            b = d
        else:
            a = c
    return with_train_share(w, min(cache, key=lambda x: abs(cache[x])))


def fit_scale(w: Workload, colocate_h: float, *, seed: int = 0, rounds: int = 3) -> Workload:
    """Scale m and T_max (and with them the tokens and the training time) until colocate takes colocate_h."""
    for _ in range(rounds):
        got = simulate(w, "colocate", seed=seed).total_s / 3600
        f = colocate_h / got
        w = w.with_(median_s=w.median_s * f, timeout_s=w.timeout_s * f)
    return w


GRID = (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0)  # T_train(C)/m tried by fit_train_share


def calibrate(w: Workload, *, seed: int = 0, rounds: int = 2, grid: tuple[float, ...] = GRID,
              progress: Progress | None = None) -> Fit:
    """Fit a paper workload on its baselines (the method above depends on what the paper published for it)."""
    if w.paper is None:
        raise ValueError(f"{w.name} has no published results to calibrate on")
    target = w.paper.colocate_over_async
    col_h, async_h = w.paper.hours.get("colocate"), w.paper.hours.get("async")
    if col_h and async_h:  # both baselines' hours: the training share and the time scale
        target = col_h / async_h
        w = fit_train_share(w, target, seed=seed, grid=grid, progress=progress)
        w = fit_scale(w, col_h, seed=seed)
        params = {"median_s": w.median_s, "timeout_s": w.timeout_s, "train_s_per_mtok": w.train_s_per_mtok}
    else:  # only ratios: the rollout share fixes c_tok, the tail (T_max/m) the ratio
        for _ in range(rounds):
            w = fit_rollout_share(w, seed=seed)
            w = fit_timeout(w, target, seed=seed, progress=progress)
        w = fit_rollout_share(w, seed=seed)  # c_tok for the final T_max (the two agree at the fixed point)
        params = {"timeout_s": w.timeout_s, "train_s_per_mtok": w.train_s_per_mtok}
    got = baselines(w, seed)
    return Fit(w, {k: round(v, 4) for k, v in params.items()}, got)
