"""Scheduling policies as pure objects: an immutable view of the run in (view.py), decisions out.

The daemon calls `decide` after every event (rollout done, group ready, switch done, training done) and carries
the decisions out; the simulator calls the same objects. A policy holds no state of its own: everything it needs is
in the view, so a restarted daemon decides exactly as before.
"""

from __future__ import annotations

from typing import Protocol

from gyre_slurm.scheduler.async_split import AsyncPolicy
from gyre_slurm.scheduler.colocate import ColocatePolicy
from gyre_slurm.scheduler.elastic import ElasticPolicy
from gyre_slurm.scheduler.view import Admit, CellView, Decision, Finish, Switch, Train, View

__all__ = ["Admit", "AsyncPolicy", "CellView", "ColocatePolicy", "Decision", "ElasticPolicy", "Finish",
           "SchedulerPolicy", "Switch", "Train", "View", "make_policy"]


class SchedulerPolicy(Protocol):
    name: str

    def decide(self, v: View) -> list[Decision]: ...


def make_policy(name: str, *, max_staleness: int = 0, train_cells: int = 1,
                max_train_cells: int | None = None) -> SchedulerPolicy:
    if name == "colocate":
        return ColocatePolicy()
    if name == "async":
        return AsyncPolicy(train_cells, max_staleness)
    if name == "elastic":
        return ElasticPolicy(max_staleness, max_train_cells)
    raise ValueError(f"unknown scheduling policy {name!r} (colocate, async, elastic)")
