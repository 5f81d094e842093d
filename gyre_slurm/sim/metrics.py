"""What a simulation measures (docs/algorithms.md §5.2): time per step, cell-idle and slot-idle fractions, staleness of
trained runs, switches and migrations, and every cell's role timeline for plotting."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

WARMUP_STEPS = 3  # steps left out of the per-step time and the idle fractions: the pipeline fills first


@dataclass
class Usage:
    """Integrals over time, all in cell-seconds (a slot-second is counted as 1/k of a cell-second)."""

    cell_time: float = 0.0  # C·T
    cell_idle: float = 0.0  # SWITCHING, TRAIN outside a step, ROLLOUT with no run
    rollout_time: float = 0.0  # ∫ |R| dt
    slots_busy: float = 0.0  # ∫ Σ_c min(runs_c, k)/k dt over ROLLOUT cells

    def minus(self, other: Usage) -> Usage:
        return Usage(self.cell_time - other.cell_time, self.cell_idle - other.cell_idle,
                     self.rollout_time - other.rollout_time, self.slots_busy - other.slots_busy)


@dataclass
class SimResult:
    workload: str
    policy: str  # colocate, async, elastic
    label: str  # e.g. "async C_T=2"
    eta: int
    cells: int
    seed: int
    step_ends: list[float]  # when each step's weights were published (s since the start)
    usage: Usage  # after the warm-up (the whole run if it is shorter)
    staleness: dict[int, int]  # versions behind at training → runs trained
    switches: int
    migrations: int  # runs moved to another cell's free slot (each paid a re-prefill)
    requeued: int  # runs sent back to the queue (no free slot), progress kept
    runs_admitted: int
    runs_terminal: int
    runs_trained: int
    groups_dropped: int
    step_cells: list[float] = field(default_factory=list)  # mean cells working on each step
    train_s: list[float] = field(default_factory=list)  # each step's training phase (Train → work done)
    timeline: list[tuple[int, float, float, str]] = field(default_factory=list)  # (cell, t0, t1, role)
    train_cells: int = 0  # the async split (C_T), 0 otherwise
    streaming: bool = False  # steps took their groups as they became ready (docs/algorithms.md §8)
    busy_s: list[float] = field(default_factory=list)  # each step's training seconds (its cells working off work)
    overlap_s: list[float] = field(default_factory=list)  # of those, the seconds while some run still ran

    @property
    def total_s(self) -> float:
        return self.step_ends[-1] if self.step_ends else 0.0

    @property
    def per_step_s(self) -> float:
        """Mean time per step after the warm-up (over all steps when there are too few)."""
        n = len(self.step_ends)
        if n > WARMUP_STEPS + 1:
            return (self.step_ends[-1] - self.step_ends[WARMUP_STEPS - 1]) / (n - WARMUP_STEPS)
        return self.total_s / max(1, n)

    @property
    def cell_idle(self) -> float:
        return self.usage.cell_idle / self.usage.cell_time if self.usage.cell_time else 0.0

    @property
    def slot_idle(self) -> float:
        return 1.0 - self.usage.slots_busy / self.usage.rollout_time if self.usage.rollout_time else 0.0

    @property
    def overlap_share(self) -> float:
        """Training seconds during which some run still ran, over all training seconds (docs/algorithms.md §8)."""
        busy = sum(self.busy_s)
        return sum(self.overlap_s) / busy if busy else 0.0

    @property
    def overlap_shares(self) -> list[float]:
        """The overlap share of each step."""
        return [o / b if b else 0.0 for o, b in zip(self.overlap_s, self.busy_s, strict=True)]

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)


def histogram(values: list[int]) -> dict[int, int]:
    return dict(sorted(Counter(values).items()))


def format_histogram(h: dict[int, int]) -> str:
    """'0:60% 1:40%': the share of trained runs at each staleness."""
    total = sum(h.values())
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in h.items()) if total else "-"
