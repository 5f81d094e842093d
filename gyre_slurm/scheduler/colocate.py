"""Colocate: every cell rolls out the step's B groups, waits for the last run of them (the long tail), every cell
switches to training, trains, switches back with the new weights. No staleness: a step's runs share one version."""

from __future__ import annotations

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import admissible_groups
from gyre_slurm.scheduler.view import Admit, Decision, Finish, Switch, Train, View


class ColocatePolicy:
    name = "colocate"

    def decide(self, v: View) -> list[Decision]:
        if v.training or v.with_role(Role.SWITCHING):
            return []  # wait for the step or the switches in flight
        rollout = sorted(c.id for c in v.movable(Role.ROLLOUT))
        train = v.with_role(Role.TRAIN)
        if v.steps_done >= v.max_steps:
            return [Finish(f"{v.max_steps} steps done")] if v.groups_open == 0 and v.running == 0 else []
        # every cell goes: evaluation runs in flight end first (no other cell could serve their calls)
        if v.groups_ready >= v.groups_per_step and v.groups_open == 0 and v.running == 0 and v.eval_running == 0:
            if rollout:
                return [Switch(tuple(rollout), Role.TRAIN, "the step's runs are all done")]
            core = v.core
            if core is not None and core.role == Role.TRAIN:
                return [Train(v.groups_per_step, tuple(train))]
            return []
        movable_train = sorted(c.id for c in v.movable(Role.TRAIN))
        if movable_train:  # the step is over (or nothing to train): every cell back to rollout
            return [Switch(tuple(movable_train), Role.ROLLOUT, "the step is over")]
        missing = admissible_groups(v, 0)  # also refills groups dropped for too few valid runs or zero variance
        if v.with_role(Role.ROLLOUT) and missing > 0:
            return [Admit(missing)]
        return []
