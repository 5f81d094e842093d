"""The colocate policy, as a pure function of the run's view."""

from __future__ import annotations

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.policy import Admit, CellView, ColocatePolicy, Finish, Switch, Train, View


def view(roles, open_=0, ready=0, queued=0, running=0, training=False, done=0, max_steps=10) -> View:
    cells = tuple(CellView(i, Role(r), i == 0, 0) for i, r in enumerate(roles))
    return View(cells, open_, ready, 2, queued, running, training, done, max_steps)


def test_colocate_cycle() -> None:
    p = ColocatePolicy()
    assert p.decide(view(["ROLLOUT", "ROLLOUT"])) == [Admit(2)]
    assert p.decide(view(["ROLLOUT", "ROLLOUT"], open_=2, queued=5, running=27)) == []
    # one group ready, one still running its long tail: keep rolling out
    assert p.decide(view(["ROLLOUT", "ROLLOUT"], open_=1, ready=1, running=1)) == []
    # a dropped group (zero variance) leaves a hole: refill it
    assert p.decide(view(["ROLLOUT", "ROLLOUT"], ready=1)) == [Admit(1)]
    assert p.decide(view(["ROLLOUT", "ROLLOUT"], ready=2)) == [Switch((0, 1), Role.TRAIN)]
    assert p.decide(view(["SWITCHING", "TRAIN"], ready=2)) == []
    assert p.decide(view(["TRAIN", "TRAIN"], ready=2)) == [Train(2, (0, 1))]
    assert p.decide(view(["TRAIN", "TRAIN"], ready=2, training=True)) == []
    assert p.decide(view(["TRAIN", "TRAIN"], done=1)) == [Switch((0, 1), Role.ROLLOUT)]
    assert p.decide(view(["TRAIN", "TRAIN"], done=10)) == [Finish("10 steps done")]
    assert p.decide(view(["ROLLOUT", "DOWN"], ready=2)) == [Switch((0,), Role.TRAIN)]
