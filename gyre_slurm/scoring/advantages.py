"""Group advantages with exclusions (docs/algorithms.md §4.3).

Excluded runs (evaluator or infrastructure errors) are removed *before* the group statistics, so an aborted run
never shifts its siblings' baseline (the slime pitfall of §4.1). Pure logic, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from gyre_slurm.statuses import ROLLOUT_TERMINAL, RolloutStatus

STATUSES = frozenset(s.value for s in ROLLOUT_TERMINAL)
ALWAYS_EXCLUDED = frozenset({RolloutStatus.EVAL_ERROR.value, RolloutStatus.INFRA_ERROR.value})
SIGMA_MIN = 1e-6
STD_EPS = 1e-6

DropReason = Literal["too_small", "zero_variance"]


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: dict[int, float]  # run_id -> Â; empty when the group is dropped
    mean: float | None  # over valid runs (None when there are none)
    std: float | None  # unbiased, over valid runs (None with fewer than 2)
    n_valid: int
    drop_reason: DropReason | None = None
    excluded: dict[int, str] = field(default_factory=dict)  # run_id -> status, for the per-step exclusion counts

    @property
    def dropped(self) -> bool:
        return self.drop_reason is not None


def group_advantages(
    runs: Iterable[tuple[int, str, float | None]],
    *,
    exclude_truncated: bool = False,
    sigma_min: float = SIGMA_MIN,
) -> GroupAdvantages:
    """Â_i = (r_i − μ)/(σ + 1e-6) over the group's valid runs, given (run_id, status, reward or None) per run.

    TRUNCATED_CONTEXT is scored like a timeout unless `exclude_truncated` (DeepSWE-style masking).
    """
    excluded_statuses = ALWAYS_EXCLUDED | ({RolloutStatus.TRUNCATED_CONTEXT.value} if exclude_truncated else set())
    valid: dict[int, float] = {}
    excluded: dict[int, str] = {}
    for run_id, status, reward in runs:
        if status not in STATUSES:
            raise ValueError(f"run {run_id}: unknown status {status!r} (expected one of {sorted(STATUSES)})")
        if run_id in valid or run_id in excluded:
            raise ValueError(f"run {run_id} appears twice in the group")
        if status in excluded_statuses:
            excluded[run_id] = status
            continue
        if reward is None or not math.isfinite(reward):
            raise ValueError(f"run {run_id} has status {status} but reward {reward!r}: a scored run needs a finite "
                             "reward (mark evaluator failures EVAL_ERROR instead)")
        valid[run_id] = float(reward)

    n = len(valid)
    mean = sum(valid.values()) / n if n else None
    if n < 2:
        return GroupAdvantages({}, mean, None, n, "too_small", excluded)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid.values()) / (n - 1))
    if std < sigma_min:
        return GroupAdvantages({}, mean, std, n, "zero_variance", excluded)
    adv = {run_id: (r - mean) / (std + STD_EPS) for run_id, r in valid.items()}
    return GroupAdvantages(adv, mean, std, n, None, excluded)
