"""Merging the metrics of several `forward_backward` calls (shards of one step, or mini-batches of one step).

Each call reports fractions and means over its own runs or targets; merging weights them by those counts so
the result is what one call over everything would report. The median `mismatch` cannot be merged exactly:
it becomes the runs-weighted mean of the parts' medians.
"""

from __future__ import annotations

from collections.abc import Sequence

SUMMED = ("tokens_trained", "runs", "micro_batches", "prepass_micro_batches", "padded_tokens")
TOKEN_WEIGHTED = ("clip_frac",)
RUN_WEIGHTED = ("clip_frac_runs", "mean_abs_log_s", "mismatch", "frac_runs_outside_window",
                "frac_runs_s_outside_window", "mean_log_w", "w_trunc_frac", "kl")


def weighted(parts: Sequence[dict[str, float]], key: str, weight: str) -> float:
    """Mean of `key` over parts weighted by `weight` (0 when no part has weight)."""
    total = sum(p.get(weight, 0.0) for p in parts if key in p)
    return sum(p[key] * p.get(weight, 0.0) for p in parts if key in p) / total if total else 0.0


def merge_metrics(parts: Sequence[dict[str, float]], *, shared_normaliser: bool) -> dict[str, float]:
    """Merge per-part metrics.

    shared_normaliser=True: the parts are shards of one loss (same |R_valid|), so losses add up.
    False: each part normalised by its own runs (mini-batches), so the loss is the runs-weighted mean and
    n_valid_runs adds up.
    """
    out: dict[str, float] = {k: sum(p.get(k, 0.0) for p in parts) for k in SUMMED}
    for k in TOKEN_WEIGHTED:
        out[k] = weighted(parts, k, "tokens_trained")
    for k in RUN_WEIGHTED:
        if any(k in p for p in parts):
            out[k] = weighted(parts, k, "runs")
    if shared_normaliser:
        out["loss"] = sum(p.get("loss", 0.0) for p in parts)
        out["n_valid_runs"] = max((p.get("n_valid_runs", 0.0) for p in parts), default=0.0)
    else:
        out["loss"] = weighted(parts, "loss", "n_valid_runs")
        out["n_valid_runs"] = sum(p.get("n_valid_runs", 0.0) for p in parts)
    return out
