"""Scheduling policies as pure objects: an immutable view of the run in, decisions out.

The daemon calls `decide` after every event (rollout done, group ready, switch done, training done) and
carries the decisions out; the simulator will call the same objects. A policy holds no state of its own:
everything it needs is in the view, so a restarted daemon decides exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.roles import Role


@dataclass(frozen=True)
class CellView:
    id: int
    role: Role
    is_core: bool
    running: int  # agent runs placed on this cell


@dataclass(frozen=True)
class View:
    cells: tuple[CellView, ...]
    groups_open: int  # admitted, some runs not terminal yet
    groups_ready: int  # all runs terminal, valid, not trained yet
    groups_per_step: int  # B
    queued: int  # rollouts waiting for a slot
    running: int  # rollouts running
    training: bool  # a training step is in flight
    steps_done: int
    max_steps: int

    @property
    def watermark(self) -> int:
        return self.queued + self.running

    def with_role(self, role: Role) -> list[int]:
        return [c.id for c in self.cells if c.role == role]


@dataclass(frozen=True)
class Admit:
    groups: int


@dataclass(frozen=True)
class Switch:
    cells: tuple[int, ...]
    role: Role


@dataclass(frozen=True)
class Train:
    groups: int
    cells: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    reason: str


Decision = Admit | Switch | Train | Finish


class ColocatePolicy:
    """All cells roll out B groups, wait for every run of them (the long tail), all switch to training, train,
    switch back with the new weights, repeat. No staleness: every run of a step is sampled by one version."""

    name = "colocate"

    def decide(self, v: View) -> list[Decision]:
        if v.training or v.with_role(Role.SWITCHING):
            return []  # wait for the step or the switches in flight
        rollout, train = v.with_role(Role.ROLLOUT), v.with_role(Role.TRAIN)
        if v.steps_done >= v.max_steps:
            if v.groups_open == 0 and v.running == 0:
                return [Finish(f"{v.max_steps} steps done")]
            return []
        if v.groups_ready >= v.groups_per_step and v.groups_open == 0 and v.running == 0:
            if rollout:
                return [Switch(tuple(rollout), Role.TRAIN)]
            if train and any(c.is_core and c.role == Role.TRAIN for c in v.cells):
                return [Train(v.groups_per_step, tuple(train))]
            return []
        if train:  # the step is over (or nothing to train): every cell back to rollout
            return [Switch(tuple(train), Role.ROLLOUT)]
        missing = v.groups_per_step - v.groups_open - v.groups_ready
        if rollout and missing > 0:
            return [Admit(missing)]  # also refills groups dropped for too few valid runs or zero variance
        return []


def make_policy(name: str) -> ColocatePolicy:
    if name == "colocate":
        return ColocatePolicy()
    raise ValueError(f"scheduling policy '{name}' is not implemented yet (available: colocate)")
