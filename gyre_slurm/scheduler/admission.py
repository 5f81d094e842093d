"""Bounded staleness (docs/algorithms.md §5.1, §6): admission counted in groups (AReaL's capacity rule), and a gate on
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
- Streaming (View.streaming, docs/algorithms.md §8): a step opens with its first ready group and takes the others as
  they become ready, up to B. Whichever groups arrive first, the step's open slots may have to take the oldest
  waiting groups, so a group joins only if afterwards the slots left, given to the oldest waiting groups, and the
  steps after, B per step, still train every waiting group within η (`feasible`). That holds when the step opens,
  each join keeps it, a new admission (the newest version, within the admission bound) and a dropped group never
  break it: no arrival order can push a group past η. With η = 0 a streaming step opens only once its B groups are
  ready: η = 0 stays the synchronous reference (every run of a step done before its gradient is taken), which
  makes elastic colocate.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.view import Admit, Decision, Finish, Train, View


def admissible_groups(v: View, max_staleness: int) -> int:
    in_flight = v.groups_trained + v.groups_training + v.groups_ready + v.groups_open
    bound = min((v.version + max_staleness + 1) * v.groups_per_step, v.max_steps * v.groups_per_step)
    return max(0, bound - in_flight)


def feasible(version: int, per_step: int, slots_left: int, waiting: Sequence[int], max_staleness: int) -> bool:
    """Every waiting group (admission versions) can still be trained within η: the `slots_left` oldest in the step
    open at `version`, the rest oldest first, `per_step` a step, the i-th of them at version + 1 + i // per_step."""
    w = sorted(waiting)
    inside, later = w[:slots_left], w[slots_left:]
    return all(a >= version - max_staleness for a in inside) and \
        all(a >= version + 1 + i // per_step - max_staleness for i, a in enumerate(later))


def may_train(v: View, max_staleness: int) -> bool:
    """B groups are ready and starting a step now leaves no waiting group more than η versions behind."""
    if v.groups_ready < v.groups_per_step:
        return False
    # trained oldest first, B per step: the i-th waiting group goes into the step at v + 1 + i // B at the earliest
    return feasible(v.version, v.groups_per_step, 0, v.open_versions + v.ready_versions[v.groups_per_step:],
                    max_staleness)


def may_join(version: int, per_step: int, taken: int, candidate: int, waiting: Sequence[int],
             max_staleness: int) -> bool:
    """A streaming step at `version` holding `taken` groups may take a ready group admitted at `candidate`:
    the other `waiting` groups (open, or ready and not in the step) stay feasible with the slots left after it."""
    if taken >= per_step or candidate < version - max_staleness:
        return False
    return feasible(version, per_step, per_step - taken - 1, waiting, max_staleness)


def may_open(v: View, max_staleness: int) -> bool:
    """A step may start now: streaming, its first group (the oldest ready) may join an empty step (η = 0: all B
    ready, see above); otherwise B groups are ready and the gate allows."""
    if not v.streaming or max_staleness == 0:
        return may_train(v, max_staleness)
    if v.groups_ready == 0:
        return False
    ready = sorted(v.ready_versions)
    return may_join(v.version, v.groups_per_step, 0, ready[0], v.open_versions + tuple(ready[1:]), max_staleness)


def end_of_run(v: View) -> list[Decision] | None:
    """After the last step: Finish once nothing is left in flight, a role switch included (a policy may move a cell
    in a run's last moments: the run stops with it settled, not PENDING); None while steps remain."""
    if v.steps_done < v.max_steps:
        return None
    done = not v.training and v.groups_open == 0 and v.running == 0 and not v.with_role(Role.SWITCHING)
    return [Finish(f"{v.max_steps} steps done")] if done else []


def train_and_admit(v: View, max_staleness: int) -> list[Decision]:
    """What the overlapping policies (async, elastic) do once their cells are placed: start a step on the core when
    the gate allows, and admit as many groups as the bound allows while some cell can roll them out."""
    out: list[Decision] = []
    core = v.core
    if not v.training and may_open(v, max_staleness) and core is not None and core.role == Role.TRAIN:
        out.append(Train(v.groups_per_step, tuple(v.with_role(Role.TRAIN))))
    n = admissible_groups(v, max_staleness)
    if n > 0 and (v.with_role(Role.ROLLOUT) or v.switching_to(Role.ROLLOUT)):
        out.append(Admit(n))
    return out
