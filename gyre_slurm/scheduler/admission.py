"""Bounded staleness (ALGORITHMS.md §5.1, §6): admission counted in groups (AReaL's capacity rule), and a gate on
starting a step, so that no run is trained more than η versions after the version it started on.

- Admission: a group may be admitted only while   trained + training + ready + open < (v + η + 1)·B,   v the
  version runs are admitted at. "Accepted" counts a group when it becomes ready, not when a step consumes it
  (counting at consumption over-admits). Dropped groups are not accepted: they are refilled. Admission also stops
  once the groups admitted cover the run's remaining steps, so the last step leaves no run behind.
- The gate: admission alone bounds how far the *newest* runs are ahead (AReaL's head off-policyness); a long-tail
  run can still fall arbitrarily far behind. A step at version v trains the oldest ready groups; every group left
  waiting (open, or ready beyond the batch) will be trained later, B per step, oldest first: the i-th of them at
  v + 1 + ⌊i/B⌋ at the earliest, so the step may start only if it started at that version − η or later. (Checking
  only the oldest is not enough: B + 1 old groups left waiting cannot all be trained in one step.)
  With η = 0 that is: every run of the step is done (colocate).
"""

from __future__ import annotations

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.view import Admit, Decision, Finish, Train, View


def admissible_groups(v: View, max_staleness: int) -> int:
    in_flight = v.groups_trained + v.groups_training + v.groups_ready + v.groups_open
    bound = min((v.version + max_staleness + 1) * v.groups_per_step, v.max_steps * v.groups_per_step)
    return max(0, bound - in_flight)


def may_train(v: View, max_staleness: int) -> bool:
    """B groups are ready and starting a step now leaves no waiting group more than η versions behind."""
    if v.groups_ready < v.groups_per_step:
        return False
    # trained oldest first, B per step: the i-th waiting group goes into the step at v + 1 + i // B at the earliest
    left = sorted(v.open_versions + v.ready_versions[v.groups_per_step:])
    return all(a >= v.version + 1 + i // v.groups_per_step - max_staleness for i, a in enumerate(left))


def end_of_run(v: View) -> list[Decision] | None:
    """After the last step: Finish once nothing is left in flight; None while steps remain."""
    if v.steps_done < v.max_steps:
        return None
    done = not v.training and v.groups_open == 0 and v.running == 0
    return [Finish(f"{v.max_steps} steps done")] if done else []


def train_and_admit(v: View, max_staleness: int) -> list[Decision]:
    """What the overlapping policies (async, elastic) do once their cells are placed: start a step on the core when
    the gate allows, and admit as many groups as the bound allows while some cell can roll them out."""
    out: list[Decision] = []
    core = v.core
    if not v.training and may_train(v, max_staleness) and core is not None and core.role == Role.TRAIN:
        out.append(Train(v.groups_per_step, tuple(v.with_role(Role.TRAIN))))
    n = admissible_groups(v, max_staleness)
    if n > 0 and (v.with_role(Role.ROLLOUT) or v.switching_to(Role.ROLLOUT)):
        out.append(Admit(n))
    return out
