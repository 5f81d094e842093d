"""An evaluation's figures from its runs: pass@1, pass@k, mean score, timeout share (pure).

pass@k is the unbiased estimator of Chen et al. 2021 (docs/evaluation.md): per task with n scored runs of which
c passed, 1 − C(n−c, k) / C(n, k), averaged over tasks; pass@1 is then the mean pass share per task. A run passes
when its score reaches the pass score. Runs that ended in an evaluator or infrastructure error are excluded (as
from training), never counted as failures; a task none of whose runs was scored is left out of the means.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from gyre_slurm.statuses import RolloutStatus

SCORED = (RolloutStatus.COMPLETED, RolloutStatus.TIMEOUT_SCORED, RolloutStatus.TRUNCATED_CONTEXT)


@dataclass(frozen=True)
class EvalRun:
    task: int
    status: RolloutStatus
    reward: float | None
    mixed_versions: bool = False  # a call of the run was served by a later version than it started on


@dataclass(frozen=True)
class EvalFigures:
    n_runs: int  # scored
    n_excluded: int
    pass_at_1: float | None
    pass_at_k: float | None
    k: int
    score_mean: float | None
    timeout_share: float | None
    mixed_versions: int


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k runs drawn without replacement from n (c of them passing) passes."""
    if not 0 <= c <= n or n < 1 or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, n >= 1, k >= 1 (n={n}, c={c}, k={k})")
    k = min(k, n)
    return 1.0 - comb(n - c, k) / comb(n, k)


def figures(runs: list[EvalRun], k: int, pass_score: float) -> EvalFigures:
    scored = [r for r in runs if r.status in SCORED and r.reward is not None]
    by_task: dict[int, list[float]] = {}
    for r in scored:
        by_task.setdefault(r.task, []).append(r.reward)
    p1 = [sum(x >= pass_score for x in xs) / len(xs) for xs in by_task.values()]
    pk = [pass_at_k(len(xs), sum(x >= pass_score for x in xs), k) for xs in by_task.values()]
    return EvalFigures(
        n_runs=len(scored), n_excluded=len(runs) - len(scored),
        pass_at_1=sum(p1) / len(p1) if p1 else None, pass_at_k=sum(pk) / len(pk) if pk else None, k=k,
        score_mean=sum(r.reward for r in scored) / len(scored) if scored else None,
        timeout_share=(sum(r.status == RolloutStatus.TIMEOUT_SCORED for r in scored) / len(scored)
                       if scored else None),
        mixed_versions=sum(r.mixed_versions for r in runs))
