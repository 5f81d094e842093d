"""The scheduling policies as pure functions of the run's view: colocate, async, elastic, admission and the
staleness gate, and a property test of all three over random event sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import admissible_groups, may_train
from gyre_slurm.scheduler.policy import (
    Admit,
    AsyncPolicy,
    CellView,
    ColocatePolicy,
    ElasticPolicy,
    Finish,
    Switch,
    Train,
    View,
    make_policy,
)


def cells(*roles: str, running: tuple[int, ...] = (), pinned: tuple[int, ...] = ()) -> tuple[CellView, ...]:
    run = running or (0,) * len(roles)
    return tuple(CellView(i, Role(r.split(">")[0]), i == 0, run[i],
                          target=Role(r.split(">")[1]) if ">" in r else None, pinned=i in pinned)
                 for i, r in enumerate(roles))


def view(roles, **kw) -> View:
    c = kw.pop("cells", None) or cells(*roles)
    return View(c, **{"groups_per_step": 2, "max_steps": 10, "runs_per_cell": 4, **kw})


# --- colocate ----------------------------------------------------------------------------------------------------
def test_colocate_cycle() -> None:
    p = ColocatePolicy()
    r2 = ["ROLLOUT", "ROLLOUT"]
    assert p.decide(view(r2)) == [Admit(2)]
    assert p.decide(view(r2, groups_open=2, queued=5, running=27)) == []
    # one group ready, one still running its long tail: keep rolling out
    assert p.decide(view(r2, groups_open=1, groups_ready=1, running=1)) == []
    # a dropped group (zero variance) leaves a hole: refill it
    assert p.decide(view(r2, groups_ready=1)) == [Admit(1)]
    assert p.decide(view(r2, groups_ready=2))[0].cells == (0, 1)
    assert p.decide(view(["SWITCHING>TRAIN", "TRAIN"], groups_ready=2)) == []
    assert p.decide(view(["TRAIN", "TRAIN"], groups_ready=2)) == [Train(2, (0, 1))]
    assert p.decide(view(["TRAIN", "TRAIN"], groups_ready=2, training=True)) == []
    assert p.decide(view(["TRAIN", "TRAIN"], steps_done=1, version=1, groups_trained=2))[0] == \
        Switch((0, 1), Role.ROLLOUT, "the step is over")
    assert p.decide(view(r2, steps_done=1, version=1, groups_trained=2)) == [Admit(2)]
    assert p.decide(view(["TRAIN", "TRAIN"], steps_done=10)) == [Finish("10 steps done")]
    assert p.decide(view(["ROLLOUT", "DOWN"], groups_ready=2))[0].cells == (0,)


# --- admission and the staleness gate ----------------------------------------------------------------------------
def test_admission_counts_groups_up_to_the_bound_and_the_run_end() -> None:
    v = view(["ROLLOUT"], version=3, groups_trained=6, groups_ready=1, groups_open=2)
    assert admissible_groups(v, 0) == 8 - 9 + 1 == 0
    assert admissible_groups(v, 1) == 10 - 9
    assert admissible_groups(v, 2) == 12 - 9
    assert admissible_groups(view(["ROLLOUT"], version=9, groups_trained=18, groups_open=2), 5) == 0  # run's end


def test_the_gate_keeps_every_waiting_group_within_eta() -> None:
    ready2 = dict(groups_ready=2, ready_versions=(4, 5), version=5)
    assert may_train(view(["TRAIN"], **ready2, groups_open=1, open_versions=(5,)), 1)
    assert not may_train(view(["TRAIN"], **ready2, groups_open=1, open_versions=(4,)), 1)  # 4 < 5 + 1 - 1
    assert may_train(view(["TRAIN"], **ready2, groups_open=1, open_versions=(4,)), 2)
    # a third ready group waits for the next step too
    assert may_train(view(["TRAIN"], groups_ready=3, ready_versions=(4, 4, 5), version=5), 1)
    assert not may_train(view(["TRAIN"], groups_ready=3, ready_versions=(3, 4, 4), version=5), 1)
    assert not may_train(view(["TRAIN"], groups_ready=1, ready_versions=(5,), version=5), 3)  # not B ready
    assert may_train(view(["TRAIN"], groups_ready=2, ready_versions=(5, 5), version=5), 0)  # nothing waits


# --- elastic -----------------------------------------------------------------------------------------------------
def test_the_watermark_boundary() -> None:
    """4 rollout cells of k=4: n cells move while (4 − n)·4 ≥ W. W = 8 → 2 cells; W = 9 → 1."""
    p = ElasticPolicy(max_staleness=1)
    at = {"groups_ready": 2, "ready_versions": (0, 0), "version": 1, "groups_open": 1, "open_versions": (1,)}
    assert p.to_train(view(["ROLLOUT"] * 4, running=8, **at)) == [0, 1]
    assert p.to_train(view(["ROLLOUT"] * 4, running=9, **at)) == [0]
    assert p.to_train(view(["ROLLOUT"] * 4, running=12, **at)) == [0]
    assert p.to_train(view(["ROLLOUT"] * 4, running=13, **at)) == []
    assert p.to_train(view(["ROLLOUT"] * 4, running=0, **at)) == [0, 1, 2, 3]  # W = 0: all (η = 0: colocate)


def test_the_core_goes_first_then_the_least_loaded_and_pins_hold() -> None:
    p = ElasticPolicy(max_staleness=1)
    at = {"groups_ready": 2, "version": 1}
    free_core = cells("ROLLOUT", "ROLLOUT", "ROLLOUT", running=(0, 0, 1))
    assert p.to_train(view([], cells=free_core, running=1, **at)) == [0, 1]
    # a core still holding runs goes alone: satellites follow once its runs have moved (or drained)
    busy_core = cells("ROLLOUT", "ROLLOUT", "ROLLOUT", running=(3, 0, 1))
    assert p.to_train(view([], cells=busy_core, running=4, **at)) == [0]
    pinned = cells("ROLLOUT", "ROLLOUT", "ROLLOUT", pinned=(1,))
    assert p.to_train(view([], cells=pinned, **at)) == [0, 2]
    # the core pinned in ROLLOUT: no step can run, so no satellite moves
    assert p.to_train(view([], cells=cells("ROLLOUT", "ROLLOUT", pinned=(0,)), **at)) == []
    # during a step the core trains: satellites join as W allows
    full = {"groups_trained": 2, "groups_training": 2, "groups_open": 2, "open_versions": (1, 1)}  # 6 = (1+1+1)·2
    mid = view(["TRAIN", "ROLLOUT", "ROLLOUT", "ROLLOUT"], training=True, running=7, version=1, runs_per_group=4,
               **full)
    assert p.decide(mid) == [Switch((1,), Role.TRAIN, "W=7 fits the rollout cells left")]
    # runs admitted by the same decision count with W: one more group of 4 and no cell can leave (7 + 4 > 2·4)
    room = view(["TRAIN", "ROLLOUT", "ROLLOUT", "ROLLOUT"], training=True, running=7, version=1, runs_per_group=4,
                **{**full, "groups_open": 1, "open_versions": (1,)})
    assert p.decide(room) == [Admit(1)]


def test_satellites_come_back_when_runs_wait_and_all_return_after_the_step() -> None:
    p = ElasticPolicy(max_staleness=2)
    short = view(["TRAIN", "TRAIN", "TRAIN", "ROLLOUT"], training=True, running=4, queued=5, version=1)
    assert p.to_rollout(short, step_wanted=True) == [2, 1]  # 5 runs without a slot: 2 cells of k=4
    assert p.to_rollout(view(["TRAIN", "TRAIN"], training=False), step_wanted=False) == [0, 1]
    assert p.to_rollout(view(["TRAIN", "TRAIN"], cells=cells("TRAIN", "TRAIN", pinned=(1,))),
                        step_wanted=False) == [0]


def test_cells_on_their_way_count_draining_runs_need_no_slot() -> None:
    p = ElasticPolicy(max_staleness=1)
    # one cell already coming back covers the 5 waiting runs with the one serving: give back one more, not two
    back = cells("TRAIN", "TRAIN", "TRAIN", "TRAIN", "SWITCHING>ROLLOUT", "ROLLOUT", running=(0, 0, 0, 0, 0, 4))
    assert p.to_rollout(view([], cells=back, training=True, running=4, queued=5), step_wanted=True) == [3]
    # the core drains its 3 runs: no satellite leaves before it can train (the step waits for the core anyway) …
    drain = cells("SWITCHING>TRAIN", "ROLLOUT", "ROLLOUT", running=(3, 2, 0))
    at = {"groups_ready": 2, "ready_versions": (1, 1), "groups_open": 1, "open_versions": (1,), "version": 1,
          "groups_trained": 3}
    assert p.to_train(view([], cells=drain, running=5, **at)) == []
    # … and once it trains, its runs ended, the empty cell 2 may follow while 2 runs fit 1·4 slots
    trained = cells("TRAIN", "ROLLOUT", "ROLLOUT", running=(0, 2, 0))
    assert p.to_train(view([], cells=trained, running=2, **at)) == [2]
    # runs draining on a cell on its way to TRAIN need no rollout slot: 8 − 3 = 5 runs > 1·4 slots, 7 − 3 fit
    going = cells("TRAIN", "SWITCHING>TRAIN", "ROLLOUT", "ROLLOUT", running=(0, 3, 2, 0))
    assert p.to_train(view([], cells=going, running=7, queued=1, **at)) == []
    assert p.to_train(view([], cells=going, running=7, **at)) == [3]


def test_elastic_starts_the_step_on_the_core_and_admits_within_eta() -> None:
    p = ElasticPolicy(max_staleness=1)
    d = p.decide(view(["TRAIN", "ROLLOUT"], groups_ready=2, ready_versions=(0, 0), version=0, groups_open=0))
    assert Train(2, (0,)) in d and Admit(2) in d  # (0 + 1 + 1)·2 − 2 ready



def test_between_steps_the_core_opens_the_next_step_only_while_the_other_cells_hold_w() -> None:
    p = ElasticPolicy(max_staleness=1)
    ready = {"groups_ready": 1, "ready_versions": (1,), "groups_open": 2, "open_versions": (1, 1), "version": 1,
             "groups_trained": 2, "streaming": True}
    # the last step just ended, its successor's runs were admitted: 6 runs (and 1 more admitted now) for the one
    # rollout cell of k = 4
    crowded = view(["TRAIN", "ROLLOUT"], cells=cells("TRAIN", "ROLLOUT", running=(0, 4)), running=4, queued=2,
                   **ready)
    d = p.decide(crowded)
    assert [(x.cells, x.role) for x in d if isinstance(x, Switch)] == [((0,), Role.ROLLOUT)]
    assert not any(isinstance(x, Train) for x in d)  # no step opens on a core on its way back
    # 3 runs and the 1 this decision admits fit the other cell: the next step opens on the core at once
    fits = view(["TRAIN", "ROLLOUT"], cells=cells("TRAIN", "ROLLOUT", running=(0, 3)), running=3, **ready)
    assert Train(2, (0,)) in p.decide(fits)
    # during a step the core stays whatever W is: it holds the step's gradients
    open_step = view(["TRAIN", "ROLLOUT"], cells=cells("TRAIN", "ROLLOUT", running=(0, 4)), running=4, queued=2,
                     training=True, **ready)
    assert not any(isinstance(x, Switch) for x in p.decide(open_step))


def test_the_core_trains_at_once_when_b_groups_wait_and_the_staleness_bound_stops_admission() -> None:
    p = ElasticPolicy(max_staleness=1)
    # version 1, B = 2: 2 trained, 2 ready, 2 open = (1 + 1 + 1)·2, nothing more may be admitted; 6 runs > 4 slots
    at = {"groups_ready": 2, "ready_versions": (1, 1), "groups_open": 2, "open_versions": (2, 2), "version": 1,
          "groups_trained": 2}
    both = cells("ROLLOUT", "ROLLOUT", running=(3, 3))
    d = p.decide(view([], cells=both, running=6, **at))
    sw = [x for x in d if isinstance(x, Switch)]
    assert [(x.cells, x.role) for x in sw] == [((0,), Role.TRAIN)] and "staleness bound stops admission" in sw[0].reason
    # a satellite never leaves on that ground: with the core training, the 6 runs need the other cell
    assert p.to_train(view([], cells=cells("TRAIN", "ROLLOUT", running=(0, 4)), running=6, **at)) == []
    # while admission is still open, the plain rule holds: 6 runs do not fit one cell, the core stays
    opened = {**at, "groups_trained": 1}
    assert p.to_train(view([], cells=both, running=6, **opened), admitting=2) == []
    # and the last rollout cell never goes on that ground
    assert p.to_train(view([], cells=cells("ROLLOUT", running=(6,)), running=6, **at)) == []

# --- async ---------------------------------------------------------------------------------------------------------
def test_async_keeps_its_split_and_trains_whenever_b_groups_are_ready() -> None:
    p = AsyncPolicy(train_cells=2, max_staleness=1)
    assert p.decide(view(["ROLLOUT"] * 4)) == [Switch((0, 1), Role.TRAIN, "the async split: 2 train"), Admit(4)]
    tail = view(["TRAIN", "TRAIN", "ROLLOUT", "ROLLOUT"], groups_ready=2, ready_versions=(1, 1), groups_open=2,
                open_versions=(0, 0), version=1, groups_trained=2)
    assert p.decide(tail) == []  # the open groups started at v0 would be 2 versions behind when trained: wait
    ok = view(["TRAIN", "TRAIN", "ROLLOUT", "ROLLOUT"], groups_ready=2, ready_versions=(0, 0), groups_open=2,
              open_versions=(1, 1), version=1, groups_trained=2)
    assert p.decide(ok) == [Train(2, (0, 1))]  # (1 + 1 + 1)·2 − (2 + 2 + 2): nothing more to admit yet
    # the core's agent not up yet (DOWN): the split waits for it rather than send two satellites to train a step
    # that only the core can run (it then hung with the core rolling out)
    late_core = view(["DOWN", "ROLLOUT", "ROLLOUT"])
    assert not [d for d in p.decide(late_core) if isinstance(d, Switch)]
    with pytest.raises(ValueError):
        AsyncPolicy(train_cells=0, max_staleness=1)


def test_make_policy() -> None:
    assert make_policy("colocate").name == "colocate"
    assert make_policy("async", train_cells=2, max_staleness=1).name == "async"
    assert make_policy("elastic", max_staleness=1).name == "elastic"
    with pytest.raises(ValueError):
        make_policy("fifo")


# --- a property over random event sequences ----------------------------------------------------------------------
@dataclass
class Sim:
    """A minimal executor of decisions: groups of G runs, cells that switch when told, one step at a time."""

    n_cells: int
    k: int = 4
    B: int = 2
    G: int = 3
    max_steps: int = 6
    roles: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    open_: list = field(default_factory=list)  # [admitted version, runs left]
    ready: list = field(default_factory=list)  # admitted versions
    trained: int = 0
    version: int = 0
    steps: int = 0
    training: list | None = None  # versions of the groups in the step
    finished: bool = False
    staleness: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.roles = [Role.ROLLOUT] * self.n_cells
        self.targets = [None] * self.n_cells

    def view(self) -> View:
        w = sum(r for _, r in self.open_)
        slots = self.roles.count(Role.ROLLOUT) * self.k
        running = min(w, slots)
        cs = tuple(CellView(i, r, i == 0, 0, target=self.targets[i]) for i, r in enumerate(self.roles))
        return View(cs, groups_per_step=self.B, groups_open=len(self.open_), groups_ready=len(self.ready),
                    groups_training=len(self.training or ()), groups_trained=self.trained,
                    queued=w - running, running=running, runs_per_cell=self.k,
                    training=self.training is not None, steps_done=self.steps, max_steps=self.max_steps,
                    version=self.version, open_versions=tuple(sorted(a for a, _ in self.open_)),
                    ready_versions=tuple(sorted(self.ready)))

    def apply(self, policy) -> None:
        for d in policy.decide(self.view()):
            if isinstance(d, Admit):
                self.open_ += [[self.version, self.G] for _ in range(d.groups)]
            elif isinstance(d, Switch):
                for c in d.cells:
                    assert self.roles[c] in (Role.ROLLOUT, Role.TRAIN) and self.roles[c] != d.role
                    self.roles[c], self.targets[c] = Role.SWITCHING, d.role
            elif isinstance(d, Train):
                assert self.training is None and self.roles[0] == Role.TRAIN
                self.ready.sort()
                self.training, self.ready = self.ready[:d.groups], self.ready[d.groups:]
            elif isinstance(d, Finish):
                self.finished = True
        b = self.view()
        in_flight = b.groups_trained + b.groups_training + b.groups_ready + b.groups_open
        assert in_flight <= (self.version + self.eta + 1) * self.B

    def event(self, pick: int) -> None:
        events = []
        slots = self.roles.count(Role.ROLLOUT) * self.k
        if slots and self.open_:
            events.append("run")
        events += [f"switch{i}" for i, r in enumerate(self.roles) if r == Role.SWITCHING]
        if self.training is not None:
            events.append("train")
        if not events:
            return
        e = events[pick % len(events)]
        if e == "run":
            g = self.open_[pick % len(self.open_)]
            g[1] -= 1
            if g[1] == 0:
                self.open_.remove(g)
                self.ready.append(g[0])
        elif e == "train":
            self.staleness += [self.version - a for a in self.training]
            self.trained += len(self.training)
            self.training, self.version, self.steps = None, self.version + 1, self.steps + 1
        else:
            i = int(e[6:])
            self.roles[i], self.targets[i] = self.targets[i], None


POLICIES = {"colocate": lambda eta: ColocatePolicy(), "async": lambda eta: AsyncPolicy(1, eta),
            "elastic": lambda eta: ElasticPolicy(eta)}


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=150, deadline=None)
@given(eta=st.integers(0, 3), n_cells=st.integers(2, 5), picks=st.lists(st.integers(0, 1000), min_size=400,
                                                                        max_size=400))
def test_every_policy_respects_eta_and_finishes(name: str, eta: int, n_cells: int, picks: list[int]) -> None:
    sim = Sim(n_cells)
    sim.eta = 0 if name == "colocate" else eta
    policy = POLICIES[name](eta)
    sim.apply(policy)
    for p in picks:
        if sim.finished:
            break
        sim.event(p)
        sim.apply(policy)
    assert all(s <= sim.eta for s in sim.staleness), (sim.staleness, sim.eta)
    assert sim.steps <= sim.max_steps
    for _ in range(5000):  # then let it run to the end: no policy stalls
        if sim.finished:
            break
        sim.event(0)
        sim.apply(policy)
    assert sim.finished and sim.steps == sim.max_steps and not sim.open_


def test_a_run_finishes_only_once_its_last_switch_is_settled() -> None:
    """A policy may move a cell in a run's last moments (elastic: W=0 fits the cells left): the run stops with that
    switch done, never PENDING in the ledger."""
    p = ElasticPolicy(max_staleness=1)
    assert p.decide(view(["TRAIN", "SWITCHING>TRAIN"], steps_done=10)) == []
    assert p.decide(view(["TRAIN", "TRAIN"], steps_done=10)) == [Finish("10 steps done")]
