"""Group advantages with exclusions (docs/algorithms.md §4.3), on hand-computed answers."""

from __future__ import annotations

import math

import pytest

from gyre_slurm.scoring.advantages import group_advantages


def test_known_answer_unbiased_std():
    res = group_advantages([(1, "COMPLETED", 1.0), (2, "COMPLETED", 0.0), (3, "TIMEOUT_SCORED", 0.5),
                            (4, "COMPLETED", 0.5)])
    # μ = 0.5, unbiased σ = sqrt((0.25 + 0.25) / 3)
    sigma = math.sqrt(0.5 / 3)
    assert res.mean == pytest.approx(0.5) and res.std == pytest.approx(sigma)
    assert res.n_valid == 4 and res.drop_reason is None and not res.dropped
    assert res.advantages == pytest.approx({1: 0.5 / (sigma + 1e-6), 2: -0.5 / (sigma + 1e-6), 3: 0.0, 4: 0.0})


def test_excluded_runs_never_shift_the_baseline():
    base = [(1, "COMPLETED", 1.0), (2, "COMPLETED", 0.0), (3, "COMPLETED", 0.0)]
    clean = group_advantages(base)
    noisy = group_advantages([*base, (4, "EVAL_ERROR", 0.0), (5, "INFRA_ERROR", None), (6, "EVAL_ERROR", None)])
    assert noisy.advantages == clean.advantages
    assert noisy.mean == pytest.approx(1 / 3) and noisy.n_valid == 3
    assert noisy.excluded == {4: "EVAL_ERROR", 5: "INFRA_ERROR", 6: "EVAL_ERROR"}
    assert set(noisy.advantages) == {1, 2, 3}
    # Two valid runs, values hand-computed: μ = 0.5, σ = sqrt(0.5) (unbiased).
    two = group_advantages([(1, "COMPLETED", 1.0), (2, "COMPLETED", 0.0), (3, "INFRA_ERROR", None)])
    s = math.sqrt(0.5)
    assert two.advantages == pytest.approx({1: 0.5 / (s + 1e-6), 2: -0.5 / (s + 1e-6)})


def test_too_small_after_exclusion():
    res = group_advantages([(1, "COMPLETED", 1.0), (2, "EVAL_ERROR", None), (3, "INFRA_ERROR", None)])
    assert res.dropped and res.drop_reason == "too_small" and res.advantages == {}
    assert res.n_valid == 1 and res.mean == 1.0 and res.std is None
    empty = group_advantages([(1, "INFRA_ERROR", None)])
    assert empty.drop_reason == "too_small" and empty.mean is None and empty.n_valid == 0


def test_zero_variance_dropped():
    res = group_advantages([(i, "COMPLETED", 0.25) for i in range(16)])
    assert res.drop_reason == "zero_variance" and res.advantages == {} and res.std == 0.0
    tiny = group_advantages([(1, "COMPLETED", 0.25), (2, "COMPLETED", 0.25 + 1e-9)])
    assert tiny.drop_reason == "zero_variance"


def test_truncated_context_scored_by_default_or_excluded():
    runs = [(1, "COMPLETED", 1.0), (2, "TRUNCATED_CONTEXT", 0.0), (3, "COMPLETED", 0.5)]
    scored = group_advantages(runs)
    assert set(scored.advantages) == {1, 2, 3} and scored.mean == pytest.approx(0.5)
    assert scored.advantages[2] < 0
    excl = group_advantages(runs, exclude_truncated=True)
    assert set(excl.advantages) == {1, 3} and excl.excluded == {2: "TRUNCATED_CONTEXT"}
    assert excl.mean == pytest.approx(0.75)


def test_bad_input_rejected():
    with pytest.raises(ValueError, match="reward"):
        group_advantages([(1, "COMPLETED", None), (2, "COMPLETED", 1.0)])
    with pytest.raises(ValueError, match="reward"):
        group_advantages([(1, "COMPLETED", float("nan")), (2, "COMPLETED", 1.0)])
    with pytest.raises(ValueError, match="unknown status"):
        group_advantages([(1, "RUNNING", 1.0), (2, "COMPLETED", 1.0)])
    with pytest.raises(ValueError, match="twice"):
        group_advantages([(1, "COMPLETED", 1.0), (1, "COMPLETED", 0.0)])
