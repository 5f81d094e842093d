"""The discrete-event simulator: the timed executor of the very policy objects the daemon runs.

Events (run done, switch done, training done, weights synced) come off a heap in time order. After each one the
policy's `decide(view)` is called and its decisions are carried out with the daemon's semantics, again until it
has nothing more to say (the daemon re-decides on a 0.25 s tick, so this is what it would do too):

- Admit(n): n groups of G runs at the current version, QUEUED until a ROLLOUT cell has a free slot (FIFO; the
  least loaded cell takes the next run, as the daemon places them).
- Switch(cells, role): the cells go SWITCHING for s_RT (to TRAIN) or s_TR (to ROLLOUT). A rollout cell's runs
  either migrate at once to free slots of other ROLLOUT cells (each pays a re-prefill; with no free slot a run goes
  back to the head of the queue with its progress), or, with release="drain", stay and finish there: the cell
  takes no new run and starts its s_RT once empty.
- Train(groups, cells): a step on the oldest-admitted ready groups. Every TRAIN cell works on it while it runs
  (satellites that finish their switch mid-step join it; cells pulled back leave it): the step is an amount of
  training work done at rate n·eff(n). Then t_sync for the weights, and v += 1.
  Streaming (docs/algorithms.md §8): Train opens the step; after every event, as the daemon does, the oldest ready group
  joins while the step has room and `admission.may_join` allows, bringing its work. With no work left and groups
  still missing, the step's cells wait (idle). It closes when its groups are in and their work is done.
- Finish: the run is over.

Runs on a cell slow down with its load when the workload has a throughput curve (workload.py): whenever a cell's
load changes, every run on it is re-timed (a new epoch, so its older RUN_DONE is stale).
"""

from __future__ import annotations

import heapq
from collections import deque

from gyre_slurm.roles import Role
from gyre_slurm.scheduler.admission import may_join
from gyre_slurm.scheduler.view import Admit, CellView, Decision, Finish, Switch, Train, View
from gyre_slurm.sim.metrics import WARMUP_STEPS, SimResult, Usage, histogram
from gyre_slurm.sim.state import (
    DONE,
    DROPPED,
    QUEUED,
    READY,
    RUNNING,
    TRAINED,
    TRAINING,
    SimCell,
    SimError,
    SimGroup,
    SimRun,
    SimStep,
)
from gyre_slurm.sim.workload import Workload

RUN_DONE, SWITCH_DONE, TRAIN_DONE, SYNC_DONE = range(4)
MAX_ROUNDS = 64  # decide() rounds after one event before it counts as a livelock
RELEASES = ("migrate", "drain")


def policy_label(policy) -> str:
    args = {a: getattr(policy, a) for a in ("train_cells", "max_staleness", "max_train_cells") if hasattr(policy, a)}
    return f"{policy.name}({', '.join(f'{k}={v}' for k, v in args.items())})"


class Simulation:
    def __init__(self, workload: Workload, policy, *, seed: int = 0, release: str = "migrate", eta: int = 0,
                 streaming: bool = False, max_events: int = 20_000_000, keep_timeline: bool = True) -> None:
        if release not in RELEASES:
            raise SimError(f"release must be migrate or drain, not {release!r}")
        self.w, self.policy, self.seed, self.release, self.eta = workload, policy, seed, release, eta
        self.streaming = streaming
        # the join gate uses the policy's own η (colocate has none: 0)
        self.join_eta = getattr(policy, "max_staleness", eta)
        # run speed by cell load (None: load-free, every RUN_DONE pushed once at its start, as before)
        self.speed = ([workload.run_speed(n) for n in range(workload.runs_per_cell + 1)]
                      if workload.slowdown_curve is not None else None)
        self.loaded: set[int] = set()  # cells whose load changed since their runs were last timed
        self.max_events, self.keep_timeline = max_events, keep_timeline
        self.t = 0.0
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.cells = [SimCell(i, i == 0) for i in range(workload.cells)]
        self.runs: list[SimRun] = []
        self.groups: list[SimGroup] = []
        self.queue: deque[int] = deque()
        self.open: dict[int, None] = {}  # an ordered set of open group ids
        self.ready: list[int] = []
        self.trained_groups = self.running = self.version = self.steps_done = 0
        self.step: SimStep | None = None
        self.finished = False
        self.usage, self.warm = Usage(), Usage()
        self.step_ends: list[float] = []
        self.step_cells: list[float] = []
        self.train_s: list[float] = []
        self.busy_s: list[float] = []
        self.overlap_s: list[float] = []
        self.stale: list[int] = []
        self.switches = self.migrations = self.requeued = self.dropped = self.terminal = 0
        self.timeline: list[tuple[int, float, float, str]] = []
        self.last_progress = 0.0
        self.stall_s = 50 * (workload.timeout_s + workload.train_time(1, workload.mean_step_tokens())) + 1e4

    # --- the loop -------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        self.schedule()
        self.retime_runs()
        events = 0
        while not self.finished:
            if not self.heap:
                raise SimError(f"policy {policy_label(self.policy)} stalled at t={self.t:.0f} s: no event pending "
                               f"and decide() changes nothing; {self.describe()}")
            t, _, kind, a, b = heapq.heappop(self.heap)
            self.advance(t)
            if self.handle(kind, a, b):
                self.schedule()
            self.retime_runs()
            events += 1
            if events > self.max_events or self.t - self.last_progress > self.stall_s:
                raise SimError(f"policy {policy_label(self.policy)} makes no progress: {events} events, no step "
                               f"done since t={self.last_progress:.0f} s; {self.describe()}")
        return self.result()

    def push(self, delay: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.t + delay, self.seq, kind, a, b))

    def schedule(self) -> None:
        self.join_ready()
        for _ in range(MAX_ROUNDS):
            decisions = self.policy.decide(self.view())
            if not decisions:
                return
            for d in decisions:
                self.execute(d)
            if self.finished:
                return
        raise SimError(f"policy {policy_label(self.policy)} livelocks at t={self.t:.0f} s: it keeps deciding "
                       f"{decisions} without time passing; {self.describe()}")

    def describe(self) -> str:
        roles = ",".join(f"{c.id}:{c.role.value}" + (f">{c.target.value}" if c.target else "") for c in self.cells)
        return (f"v={self.version} steps={self.steps_done}/{self.w.steps} open={len(self.open)} "
                f"ready={len(self.ready)} queued={len(self.queue)} running={self.running} "
                f"training={self.step is not None} cells [{roles}]")

    def view(self) -> View:
        s = self.step
        return View(
            tuple(CellView(c.id, c.role, c.is_core, len(c.runs), target=c.target) for c in self.cells),
            groups_per_step=self.w.groups_per_step, groups_open=len(self.open), groups_ready=len(self.ready),
            groups_training=len(s.groups) if s else 0, groups_trained=self.trained_groups,
            queued=len(self.queue), running=self.running, runs_per_cell=self.w.runs_per_cell,
            runs_per_group=self.w.group_size,
            training=s is not None, step_cells=tuple(sorted(s.cells)) if s else (), steps_done=self.steps_done,
            max_steps=self.w.steps, version=self.version,
            open_versions=tuple(sorted(self.groups[g].version for g in self.open)),
            ready_versions=tuple(sorted(self.groups[g].version for g in self.ready)), streaming=self.streaming)

    # --- events ---------------------------------------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Integrate the idle metrics up to t (docs/algorithms.md §5.2)."""
        dt = t - self.t
        if dt > 0:
            u, k = self.usage, self.w.runs_per_cell
            in_step = self.step.cells if self.step else ()
            busy = self.step_busy(t)
            for c in self.cells:
                n = len(c.runs)
                u.cell_time += dt
                if c.role == Role.ROLLOUT:
                    u.rollout_time += dt
                    u.slots_busy += dt * min(n, k) / k
                    u.cell_idle += dt if n == 0 else 0.0
                elif c.role == Role.TRAIN:
                    u.cell_idle += dt - busy if c.id in in_step else dt
                elif n == 0:  # switching (a draining cell still serving runs is busy)
                    u.cell_idle += dt
        self.t = t

    def step_busy(self, t: float) -> float:
        """Seconds of [now, t] the step's cells work (all of it while syncing); books its training and overlap."""
        s = self.step
        if s is None or s.syncing:
            return t - self.t
        busy = max(0.0, min(t, s.work_until) - self.t)
        s.busy += busy
        if self.running:  # some run still rolls out while the step trains: the overlap of docs/algorithms.md §8
            s.overlap += busy
        return busy

    def handle(self, kind: int, a: int, b: int) -> bool:
        """Apply one event; False for a stale one (its run, cell or step moved on since it was pushed)."""
        if kind == RUN_DONE:
            r = self.runs[a]
            if r.epoch != b or r.status != RUNNING:
                return False
            self.run_done(r)
        elif kind == SWITCH_DONE:
            c = self.cells[a]
            if c.epoch != b or c.role != Role.SWITCHING:
                return False
            self.switch_done(c)
        elif kind == TRAIN_DONE:
            s = self.step
            if s is None or s.epoch != a or s.syncing:
                return False
            self.update_work()
            if len(s.groups) < s.need:
                s.work_left = 0.0  # streaming: the work so far is done; the cells wait for the next group
                return False
            s.syncing = True
            self.push(self.w.sync_s, SYNC_DONE)
        else:
            self.step_done()
        return True

    def run_done(self, r: SimRun) -> None:
        c = self.cells[r.cell]
        if self.speed is not None:
            self.progress(r)
            if r.left > 1e-6 and r.total > 0:  # killed at T_max: it trains what it generated
                r.tokens *= max(0.0, 1.0 - r.left / r.total)
            self.loaded.add(c.id)
        c.runs.discard(r.id)
        r.status, r.cell = DONE, None
        self.running -= 1
        self.terminal += 1
        g = self.groups[r.group]
        g.left -= 1
        if r.ok:
            g.valid += 1
            g.tokens += r.tokens
        if g.left == 0:
            del self.open[g.id]
            if g.valid >= self.w.min_valid:
                g.status, g.ready_at = READY, self.t
                self.ready.append(g.id)
            else:
                g.status = DROPPED
                self.dropped += 1
        if c.draining and not c.runs:
            self.push(self.w.switch_rt_s, SWITCH_DONE, c.id, c.epoch)
        self.place_queued()

    def switch_done(self, c: SimCell) -> None:
        self.span(c)
        c.role, c.target, c.draining = c.target, None, False
        s = self.step
        if c.role == Role.TRAIN and s is not None and not s.syncing:
            self.update_work()
            s.cells.add(c.id)  # a satellite joins the batch in flight
            self.retime()
        elif c.role == Role.ROLLOUT:
            self.place_queued()

    def step_done(self) -> None:
        s = self.step
        for gid in s.groups:
            g = self.groups[gid]
            g.status = TRAINED
            self.stale += [s.version - g.version] * g.valid
        self.trained_groups += len(s.groups)
        self.version += 1
        self.steps_done += 1
        self.step_ends.append(self.t)
        self.step_cells.append(s.cell_seconds / max(1e-9, s.last - s.started))
        self.train_s.append(s.last - s.started)
        self.busy_s.append(s.busy)
        self.overlap_s.append(s.overlap)
        self.step = None
        self.last_progress = self.t
        if self.steps_done == WARMUP_STEPS:
            self.warm = Usage(**vars(self.usage))

    # --- decisions ------------------------------------------------------------------------------------------
    def execute(self, d: Decision) -> None:
        if isinstance(d, Admit):
            self.admit(d.groups)
        elif isinstance(d, Switch):
            # every cell of the decision leaves first, so no run migrates onto a cell that is leaving too
            leaving = [self.switch(cid, d.role) for cid in d.cells]
            for c in leaving:
                self.release_cell(c)
        elif isinstance(d, Train):
            self.train(d)
        elif isinstance(d, Finish):
            self.finished = True
        else:
            raise SimError(f"policy {policy_label(self.policy)} returned {d!r}, not a decision")

    def admit(self, n: int) -> None:
        if n <= 0:
            raise SimError(f"policy {policy_label(self.policy)} admitted {n} groups")
        for _ in range(n):
            gid = len(self.groups)
            samples = self.w.sample_group(self.seed, gid)
            self.groups.append(SimGroup(gid, self.version, len(samples)))
            self.open[gid] = None
            for s in samples:
                self.queue.append(len(self.runs))
                self.runs.append(SimRun(len(self.runs), gid, s.duration_s, s.ok, s.tokens, s.duration_s))
        self.place_queued()

    def switch(self, cid: int, role: Role) -> SimCell:
        c = self.cells[cid]
        if c.role not in (Role.ROLLOUT, Role.TRAIN) or role == c.role or role not in (Role.ROLLOUT, Role.TRAIN):
            raise SimError(f"policy {policy_label(self.policy)} switched cell {cid} ({c.role.value}) to {role.value} "
                           f"at t={self.t:.0f} s; {self.describe()}")
        s = self.step
        if c.role == Role.TRAIN and s is not None and cid in s.cells:
            if c.is_core:
                raise SimError(f"policy {policy_label(self.policy)} moved the core cell off the step in flight "
                               f"at t={self.t:.0f} s")
            if not s.syncing:
                self.update_work()
                s.cells.discard(cid)  # the rest of the step slows down
                self.retime()
            else:
                s.cells.discard(cid)
        self.switches += 1
        self.span(c)
        c.role, c.target = Role.SWITCHING, role
        c.epoch += 1
        return c

    def release_cell(self, c: SimCell) -> None:
        """Start a switch decided just now: to ROLLOUT after s_TR; to TRAIN after migrating or draining its runs."""
        if c.target == Role.ROLLOUT:
            self.push(self.w.switch_tr_s, SWITCH_DONE, c.id, c.epoch)
        elif self.release == "drain" and c.runs:
            c.draining = True  # no new run is placed here; the last one to end starts the switch
        else:
            self.evict(c)
            self.push(self.w.switch_rt_s, SWITCH_DONE, c.id, c.epoch)

    def evict(self, c: SimCell) -> None:
        """Migrate a leaving cell's runs to free slots of the other ROLLOUT cells, the rest back to the queue."""
        back: list[int] = []
        k = self.w.runs_per_cell
        for rid in sorted(c.runs):
            r = self.runs[rid]
            self.progress(r)
            free = [x for x in self.cells if x.role == Role.ROLLOUT and len(x.runs) < k]
            r.epoch += 1
            if free:
                dst = min(free, key=lambda x: (len(x.runs), x.id))
                r.left += self.w.migrate_s
                self.migrations += 1
                self.start(r, dst)
            else:
                r.status, r.cell = QUEUED, None
                self.running -= 1
                self.requeued += 1
                back.append(rid)
        c.runs.clear()
        self.queue.extendleft(reversed(back))

    def train(self, d: Train) -> None:
        core = self.cells[0]
        train_cells = {c.id for c in self.cells if c.role == Role.TRAIN}
        enough = d.groups > 0 and (bool(self.ready) if self.streaming else d.groups <= len(self.ready))
        problem = ("a step is already running" if self.step is not None else
                   "the core cell is not in TRAIN" if core.role != Role.TRAIN else
                   f"only {len(self.ready)} groups are ready" if not enough else
                   f"cells {sorted(set(d.cells) - train_cells)} are not in TRAIN" if set(d.cells) - train_cells
                   else "")
        if problem:
            raise SimError(f"policy {policy_label(self.policy)} decided {d} but {problem}; {self.describe()}")
        self.sort_ready()
        if self.streaming:  # open the step; its groups join as they may (join_ready), the first one now
            self.step = SimStep(self.steps_done, self.version, [], train_cells, 0.0, self.t, self.t, need=d.groups)
            if not self.join_ready():
                raise SimError(f"policy {policy_label(self.policy)} opened a step at v={self.version} that no ready "
                               f"group may join (admission.may_join); {self.describe()}")
            return
        batch, self.ready = self.ready[:d.groups], self.ready[d.groups:]
        for gid in batch:
            self.groups[gid].status = TRAINING
        work = self.w.train_work(sum(self.groups[gid].tokens for gid in batch))
        self.step = SimStep(self.steps_done, self.version, batch, train_cells, work, self.t, self.t, need=d.groups)
        self.retime()

    def join_ready(self) -> int:
        """Streaming: the oldest ready groups join the open step while it has room and may_join allows."""
        s = self.step
        if not self.streaming or s is None or s.syncing:
            return 0
        self.sort_ready()
        joined = 0
        while len(s.groups) < s.need and self.ready:
            g = self.groups[self.ready[0]]
            waiting = [self.groups[x].version for x in self.open] + [self.groups[x].version for x in self.ready[1:]]
            if not may_join(s.version, self.w.groups_per_step, len(s.groups), g.version, waiting, self.join_eta):
                break
            self.update_work()
            self.ready.pop(0)
            g.status = TRAINING
            s.groups.append(g.id)
            s.work_left += self.w.token_work(g.tokens)
            if len(s.groups) == s.need:
                s.work_left += self.w.train_fix_s  # the per-step part, once, at the close
            joined += 1
        if joined:
            self.retime()
        return joined

    # --- helpers --------------------------------------------------------------------------------------------
    def sort_ready(self) -> None:
        """Oldest admitted first (the staleness gate's order), then first ready."""
        self.ready.sort(key=lambda gid: (self.groups[gid].version, self.groups[gid].ready_at, gid))

    def start(self, r: SimRun, c: SimCell) -> None:
        if r.status == QUEUED:
            self.running += 1
        r.status, r.cell, r.since = RUNNING, c.id, self.t
        c.runs.add(r.id)
        if self.speed is None:
            self.push(r.left, RUN_DONE, r.id, r.epoch)
            return
        r.deadline = min(r.deadline, self.t + self.w.timeout_s)  # the harness's limit runs from its first start
        self.loaded.add(c.id)  # timed by retime_runs with the cell's new load

    def progress(self, r: SimRun) -> None:
        """Bring a running run's remaining alone-time up to now."""
        r.left -= (self.t - r.since) * r.rate
        r.since = self.t

    def retime_runs(self) -> None:
        """Re-time every run on the cells whose load changed: each at the speed of its cell's load now. The hot
        loop of a simulation: progress() and push() inlined, the same arithmetic in the same order."""
        if not self.loaded:
            return
        t, runs, heap = self.t, self.runs, self.heap
        for cid in sorted(self.loaded):
            c = self.cells[cid]
            speed = self.speed[len(c.runs)]
            for rid in sorted(c.runs):
                r = runs[rid]
                r.left -= (t - r.since) * r.rate
                r.since = t
                r.rate = speed
                r.epoch += 1
                self.seq += 1
                heapq.heappush(heap, (t + min(max(0.0, r.left) / speed, r.deadline - t), self.seq, RUN_DONE, rid,
                                      r.epoch))
        self.loaded.clear()

    def place_queued(self) -> None:
        k = self.w.runs_per_cell
        free = [c for c in self.cells if c.role == Role.ROLLOUT and len(c.runs) < k]
        while self.queue and free:
            c = min(free, key=lambda x: (len(x.runs), x.id))
            self.start(self.runs[self.queue.popleft()], c)
            if len(c.runs) >= k:
                free.remove(c)

    def update_work(self) -> None:
        s = self.step
        dt = self.t - s.last
        s.work_left = max(0.0, s.work_left - self.w.train_rate(len(s.cells)) * dt)
        s.cell_seconds += len(s.cells) * dt
        s.last = self.t

    def retime(self) -> None:
        s = self.step
        s.epoch += 1
        delay = max(0.0, s.work_left) / self.w.train_rate(len(s.cells))
        s.work_until = self.t + delay
        self.push(delay, TRAIN_DONE, s.epoch)

    def span(self, c: SimCell) -> None:
        if self.keep_timeline and self.t > c.since:
            self.timeline.append((c.id, c.since, self.t, c.role.value))
        c.since = self.t

    def result(self) -> SimResult:
        for c in self.cells:
            self.span(c)
        usage = self.usage.minus(self.warm) if self.steps_done > WARMUP_STEPS + 1 else self.usage
        return SimResult(
            workload=self.w.name, policy=self.policy.name, label=policy_label(self.policy), eta=self.eta,
            cells=self.w.cells, seed=self.seed, step_ends=self.step_ends, usage=usage,
            staleness=histogram(self.stale), switches=self.switches, migrations=self.migrations,
            requeued=self.requeued, runs_admitted=len(self.runs), runs_terminal=self.terminal,
            runs_trained=len(self.stale), groups_dropped=self.dropped, step_cells=self.step_cells,
            train_s=self.train_s, timeline=sorted(self.timeline), train_cells=getattr(self.policy, "train_cells", 0),
            streaming=self.streaming, busy_s=self.busy_s, overlap_s=self.overlap_s)
