"""Elastic: the watermark rule of docs/algorithms.md §5.1.

Once a step may start (B groups ready; streaming: its first group, admission.may_open) or while a step runs,
cells move to TRAIN while the ROLLOUT cells left can still serve every queued and running run: (|R| − n)·k ≥ W,
the core first (it starts the step; the others join it as satellites), then the least loaded. One exception:
once B groups are ready and the staleness bound stops admission, W can only fall until a step trains; waiting for
it to fit only idles slots (the tail again), so the core goes at once and the runs it leaves wait in the queue.
As W falls during the step, more cells follow; when W needs them (runs wait for a slot) satellites come back.
The core holds the step's gradients while a step is open, so it leaves TRAIN only between steps, when the next
step would not pass the same test (with η ≥ 1 the next step's runs are admitted as a step ends, and a core kept
in TRAIN would leave them a cell short). With η = 0 no run is in flight when the step's groups are ready, so
every cell moves at once: colocate.
"""

from __future__ import annotations

import math

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import admissible_groups, end_of_run, may_open, may_train, train_and_admit
from gyre_slurm.scheduler.view import Decision, Switch, Train, View


def demand(v: View) -> int:
    """The runs that need a ROLLOUT slot: W less the runs finishing on draining cells (they never move)."""
    return v.watermark - sum(c.running for c in v.cells if c.role == Role.SWITCHING and c.target == Role.TRAIN)


def serving_slots(v: View) -> int:
    """The rollout slots of the cells serving or on their way back to serve."""
    return (len(v.with_role(Role.ROLLOUT)) + len(v.switching_to(Role.ROLLOUT))) * v.runs_per_cell


class ElasticPolicy:
    name = "elastic"

    def __init__(self, max_staleness: int, max_train_cells: int | None = None) -> None:
        self.max_staleness = max_staleness
        self.max_train_cells = max_train_cells

    def to_train(self, v: View, admitting: int = 0) -> list[int]:
        """The cells to move to TRAIN now: one at a time while (|R| − n)·k ≥ W, the core first. `admitting`: runs
        admitted by the same decision, counted with W (else a cell leaves just as they arrive)."""
        n_rollout = len(v.with_role(Role.ROLLOUT))
        in_train = len(v.with_role(Role.TRAIN)) + len(v.switching_to(Role.TRAIN))
        cap = self.max_train_cells if self.max_train_cells is not None else len(v.cells)
        core = v.core
        core_in = core is not None and (core.role == Role.TRAIN or core.target == Role.TRAIN)
        # satellites follow a core that holds no runs: while the core still finishes runs (drained, or about to
        # move them), the step cannot start, and a satellite leaving early only takes serving capacity away
        core_free = core is not None and (core.role == Role.TRAIN or core.running == 0)
        need = demand(v) + admitting
        blocked = self.blocked(v)
        out: list[int] = []
        for c in v.movable(Role.ROLLOUT):
            left = n_rollout - len(out) - 1  # rollout cells after this one leaves
            if in_train + len(out) >= cap:
                break
            if left * v.runs_per_cell < need and not (c.is_core and blocked and left >= 1):
                break
            if not c.is_core and not (core_in and core_free):
                break  # the step runs on the core: it goes first
            out.append(c.id)
            core_in = core_in or c.is_core
        return out

    def blocked(self, v: View) -> bool:
        """B groups are ready and the staleness bound stops admission: W can only fall until a step trains, so
        waiting for it to fit only idles slots; the core goes at once and the runs it leaves wait in the queue."""
        return admissible_groups(v, self.max_staleness) == 0 and may_train(v, self.max_staleness)

    def core_may_stay(self, v: View) -> bool:
        """Between steps, a core in TRAIN may open the next step: the other serving cells hold W and the runs this
        decision admits."""
        core = v.core
        if v.training or core is None or core.role != Role.TRAIN:
            return True
        admitting = admissible_groups(v, self.max_staleness) * v.runs_per_group
        return serving_slots(v) >= demand(v) + admitting or self.blocked(v)

    def to_rollout(self, v: View, step_wanted: bool) -> list[int]:
        """The cells to give back: satellites as W needs slots; after the step, all that the next does not use."""
        train = v.movable(Role.TRAIN)
        if not step_wanted:
            return [c.id for c in train]
        # runs without a slot, counting the cells already on their way back
        short = demand(v) - serving_slots(v)
        if short <= 0 or not v.training:
            return []
        satellites = [c.id for c in reversed(train) if not c.is_core]
        return satellites[:math.ceil(short / v.runs_per_cell)]

    def decide(self, v: View) -> list[Decision]:
        end = end_of_run(v)
        if end is not None:
            return end
        out: list[Decision] = []
        opens = may_open(v, self.max_staleness)
        step_wanted = v.training or (opens and self.core_may_stay(v))
        back = self.to_rollout(v, step_wanted)
        if back:
            capacity = len(v.with_role(Role.ROLLOUT)) * v.runs_per_cell
            if step_wanted:
                why = f"W={v.watermark} > rollout capacity {capacity}"
            elif opens:
                why = f"between steps W={v.watermark} > rollout capacity {capacity} without the core"
            else:
                why = "no step to train yet (too few groups ready, or the staleness gate closed)"
            out.append(Switch(tuple(back), Role.ROLLOUT, why))
        elif step_wanted:
            admitting = admissible_groups(v, self.max_staleness) * v.runs_per_group
            move = self.to_train(v, admitting)
            if move:
                left = (len(v.with_role(Role.ROLLOUT)) - len(move)) * v.runs_per_cell
                why = (f"W={v.watermark} fits the rollout cells left" if demand(v) + admitting <= left else
                       f"W={v.watermark} > {left} slots left, but B groups are ready and the staleness bound stops "
                       "admission: the core trains, the runs it leaves wait")
                out.append(Switch(tuple(move), Role.TRAIN, why))
        # a step does not open on a core on its way back
        return out + [d for d in train_and_admit(v, self.max_staleness) if step_wanted or not isinstance(d, Train)]
