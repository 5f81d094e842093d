"""The simulator's entities (docs/algorithms.md §5.2): runs, groups, cells and the training step in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_slurm.errors import GyreError
from gyre_slurm.roles import Role


class SimError(GyreError):
    """A policy asked for something impossible, or stopped making progress (the message names it)."""


QUEUED, RUNNING, DONE = "QUEUED", "RUNNING", "DONE"
OPEN, READY, TRAINING, TRAINED, DROPPED = "OPEN", "READY", "TRAINING", "TRAINED", "DROPPED"


@dataclass(slots=True)
class SimRun:
    id: int
    group: int
    left: float  # agent time still to run (a migration adds the re-prefill)
    ok: bool  # a valid sample once terminal
    tokens: float
    total: float = 0.0  # its duration alone on a cell, as sampled (a run cut at T_max trains that share)
    status: str = QUEUED
    cell: int | None = None
    since: float = 0.0  # when it last started on its cell
    epoch: int = 0  # bumped on every move and re-timing: a RUN_DONE of an older epoch is stale
    rate: float = 1.0  # seconds of `left` done per second on its cell now (load slowdown)
    deadline: float = float("inf")  # the harness kills it at its first start + T_max (with a load curve)


@dataclass(slots=True)
class SimGroup:
    id: int
    version: int  # admitted at
    left: int  # runs not terminal yet
    valid: int = 0
    tokens: float = 0.0
    status: str = OPEN
    ready_at: float = 0.0


@dataclass(slots=True)
class SimCell:
    id: int
    is_core: bool
    role: Role = Role.ROLLOUT
    target: Role | None = None
    runs: set[int] = field(default_factory=set)
    draining: bool = False  # drain release: SWITCHING to TRAIN once its last run ends
    epoch: int = 0  # bumped on every switch: a SWITCH_DONE of an older epoch is stale
    since: float = 0.0  # when its current role (timeline span) began


@dataclass(slots=True)
class SimStep:
    index: int
    version: int  # the weights it trains from
    groups: list[int]
    cells: set[int]  # cells working on it now
    work_left: float  # cell-seconds at full efficiency
    last: float  # when work_left was last brought up to date
    started: float
    cell_seconds: float = 0.0  # ∫ n dt over the training phase (mean cells per step)
    epoch: int = 0  # bumped whenever its cells change: a TRAIN_DONE of an older epoch is stale
    syncing: bool = False  # work done; weights on their way to the rollout cells
    need: int = 0  # the groups it takes (streaming: they join one by one; it closes when all are in)
    work_until: float = 0.0  # when its cells run out of work at the current rate (≤ now: waiting for groups)
    busy: float = 0.0  # training seconds: some step cell working off work
    overlap: float = 0.0  # of those, seconds while some run was still running
