"""Async: a fixed split. `train_cells` cells (the core first) train while the rest roll out without pause; a step
starts whenever B groups are ready and no step runs; in-flight runs go on with the new weights once published.
Staleness is bounded by admission (η)."""

from __future__ import annotations

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import end_of_run, train_and_admit
from gyre_slurm.scheduler.view import Decision, Switch, View


class AsyncPolicy:
    name = "async"

    def __init__(self, train_cells: int, max_staleness: int) -> None:
        if train_cells < 1:
            raise ValueError("the async split needs at least one training cell (the core)")
        self.train_cells = train_cells
        self.max_staleness = max_staleness

    def decide(self, v: View) -> list[Decision]:
        end = end_of_run(v)
        if end is not None:
            return end
        out: list[Decision] = []
        training = v.with_role(Role.TRAIN) + v.switching_to(Role.TRAIN)
        have = len(training)
        rollout = v.movable(Role.ROLLOUT)  # the core first
        # keep rollout capacity: never switch the last rollout cell away
        movable = [c for c in rollout if c.is_core or len(v.with_role(Role.ROLLOUT)) > 1][:self.train_cells - have]
        core = {c.id for c in v.cells if c.is_core}
        if not core & set(training) and not any(c.is_core for c in movable):
            movable = []  # only the core can train a step: the split waits for it (e.g. its agent is not up yet)
        if movable and not v.training:
            out.append(Switch(tuple(c.id for c in movable), Role.TRAIN, f"the async split: {self.train_cells} train"))
        return out + train_and_admit(v, self.max_staleness)
