"""The training step in flight, as the daemon keeps it (docs/algorithms.md §8), and the sums it reports. No I/O here.

A step opens at version v on a policy's Train decision. Its groups join it in one go (B ready groups) or, with
`train.streaming`, one by one as they become ready, each split into shards at once (coordinator/shard_queue.py);
once B groups are in it is *sealed*: its valid runs are counted, and the core divides the gradient sum by them
before its one optimizer step. What the step trained on (rewards, exclusions, staleness) is merged from the metas of
the groups' parts (`merge_meta`); how much of its training hid behind rollouts is `overlap_seconds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

DATA_METRIC_PREFIXES = ("frac_", "groups_dropped", "staleness")  # the step's data, logged with the trainer's metrics


@dataclass
class StepInFlight:
    step: int
    groups: list[int]  # the groups in the step so far
    sent_at: float  # the step opened (TrainStep sent)
    batch_path: Path
    data_metrics: dict[str, float]  # exclusions and drops of the step's data, logged with the trainer's metrics
    attempt: int  # what a training job of an earlier attempt (daemon, core process) sends is not for this step
    target: int = 0  # groups the step takes (B)
    metas: list[dict[str, Any]] = field(default_factory=list)  # one per part of groups that joined
    n_valid: int = 0  # runs with targets so far: the step's loss averages over them
    tokens: int = 0  # trained targets so far
    sealed_at: float | None = None

    @property
    def full(self) -> bool:
        return len(self.groups) >= self.target


def merge_meta(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The meta of the step from those of its parts (RolloutBook.build_batch): counts add up, means are weighted by
    what they are means over, the staleness histogram adds up."""
    n_runs = sum(m["n_runs"] for m in metas)
    n_rollouts = sum(m["n_rollouts"] for m in metas)
    hist: dict[str, int] = {}
    for m in metas:
        for k, n in m["staleness_hist"].items():
            hist[k] = hist.get(k, 0) + n
    n_stale = sum(hist.values())
    out: dict[str, Any] = {
        "groups": [g for m in metas for g in m["groups"]], "n_runs": n_runs, "n_rollouts": n_rollouts,
        "reward_mean": sum(m["reward_mean"] * m["n_runs"] for m in metas) / max(1, n_runs),
        "staleness_mean": sum(m["staleness_mean"] * sum(m["staleness_hist"].values()) for m in metas)
        / max(1, n_stale),
        "staleness_max": max((m["staleness_max"] for m in metas), default=0),
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
    }
    for key in {k for m in metas for k in m}:
        if key.startswith("frac_"):
            out[key] = sum(m.get(key, 0.0) * m["n_rollouts"] for m in metas) / max(1, n_rollouts)
        elif key.startswith("groups_dropped"):
            out[key] = sum(m.get(key, 0) for m in metas)
    return out


def data_metrics(meta: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in meta.items() if k.startswith(DATA_METRIC_PREFIXES)}


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap_seconds(training: Iterable[Interval], rollouts: Iterable[Interval]) -> tuple[float, float]:
    """(seconds some cell trained the step, of those the seconds during which some run was rolling out)."""
    train, roll = union(training), union(rollouts)
    busy = sum(b - a for a, b in train)
    both, j = 0.0, 0
    for a, b in train:
        while j < len(roll) and roll[j][1] <= a:
            j += 1
        k = j
        while k < len(roll) and roll[k][0] < b:
            both += min(b, roll[k][1]) - max(a, roll[k][0])
            k += 1
    return busy, both
