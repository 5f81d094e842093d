"""The shards of the training step in flight (docs/design.md §3 step 7): queued here, taken by training cells.

The daemon splits the groups of a step into run-aligned shards as they join it (train/shards.py; all at the
step's start, or one group at a time for a streaming step), writes one file each and queues them; their losses
are unnormalised and the seal, once the last group is in, says by how many runs the core divides their sum.
The core and every satellite that joined take one at a time; satellites send their gradients straight to the
core, and a shard is DONE only on the core's word (ShardDone), whoever computed it. A cell that dies, leaves
TRAIN or is pulled back gives its shards back to the queue; a gradient of a requeued shard that still reaches the
core first counts, and the core drops any later copy. No sockets here: the loop feeds messages in and sends what
these methods return.

Statuses change only through `_set`, which checks the SHARD machine before anything is written.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import NoShard, ShardAssignment, ShardRef, StepSeal
from gyre_slurm.statuses import SHARD, Severity, ShardStatus
from gyre_slurm.train.batch import UNNORMALISED, TrainBatch, write_batch
from gyre_slurm.train.shards import N_SHARDS_KEY, SHARD_KEY, shard_id, split_batch

log = logging.getLogger("gyre.shards")

OPEN = (ShardStatus.QUEUED, ShardStatus.TAKEN)
RETRY_S = 0.2  # a cell told "nothing queued now" asks again after this (a shard may be requeued meanwhile)


@dataclass
class QueuedShard:
    row: int  # shards.id
    step: int
    index: int  # within the step
    path: Path
    status: ShardStatus | None = None  # None: no row yet
    cell: int | None = None  # holds it (TAKEN) or held it last
    attempts: int = 0
    by: int | None = None  # the cell whose gradient the core added
    taken_at: float | None = None  # last taken
    done_at: float | None = None


class ShardQueue:
    def __init__(self, ledger: Ledger, run_dir: Path) -> None:
        self.ledger = ledger
        self.run_dir = run_dir
        self.step: int | None = None  # the step whose shards are queued (None: no step, or one without shards)
        self.attempt = 0
        self.endpoint: str | None = None  # the core's gradient receiver, once it said StepOpen
        self.shards: dict[int, QueuedShard] = {}
        self.seal: StepSeal | None = None  # set once the step's last group is in (a streaming step's come one by one)
        self.joined: set[int] = set()  # satellites told to join (JoinStep) or working on the step
        self.dropped: set[int] = set()  # satellites that could not do a shard of this step: no more for them
        self._next_row = ledger.last_shard_id() + 1

    # --- the step's life --------------------------------------------------------------------------------------
    def start(self, step: int, attempt: int) -> None:
        """A step opens with no shard yet: its groups' shards come with `add`, its end with `seal`."""
        self.step, self.attempt, self.endpoint, self.shards, self.seal = step, attempt, None, {}, None
        self.joined, self.dropped = set(), set()

    def add(self, part: TrainBatch, shard_runs: int, now: float) -> list[ShardRef]:
        """Split groups that joined the step (one TrainBatch) into shards of about `shard_runs` runs, numbered on
        from the step's earlier shards, write them and queue them. Their losses stay unnormalised (n_valid_runs =
        UNNORMALISED): the step's valid runs are counted at the seal, and the core divides by them (CoreStep)."""
        assert self.step == part.step and self.seal is None, "add goes to the open, unsealed step"
        n = max(1, math.ceil(len(part.runs()) / shard_runs))
        folder = self.run_dir / "batches" / f"step-{part.step:05d}"
        base = len(self.shards)
        refs = []
        for piece in split_batch(dataclasses.replace(part, n_valid_runs=UNNORMALISED), n_shards=n):
            k = base + shard_id(piece)
            piece.meta.update({SHARD_KEY: k, N_SHARDS_KEY: None})  # the step's count is the seal's
            sh = QueuedShard(self._next_row, part.step, k, folder / f"shard-{k:04d}.msgpack")
            self._next_row += 1
            write_batch(sh.path, piece)  # on disk before its row says QUEUED
            self._set(sh, ShardStatus.QUEUED, step=part.step, shard=k, path=str(sh.path),
                      n_runs=len(piece.runs()), tokens=sum(piece.targets_per_run.values()), cell_id=None,
                      attempts=0, queued_at=now, taken_at=None, done_at=None, done_by=None)
            self.shards[k] = sh
            refs.append(ShardRef(shard=k, path=str(sh.path)))
        return refs

    def open(self, batch: TrainBatch, attempt: int, shard_runs: int, now: float) -> list[ShardRef]:
        """A step whose data is all in at its start: started, its shards queued, sealed."""
        self.start(batch.step, attempt)
        refs = self.add(batch, shard_runs, now)
        self.seal_step(len(batch.runs()))
        return refs

    def seal_step(self, n_valid_runs: int) -> StepSeal:
        """The step's last group is in: no shard comes after these."""
        assert self.shards, "a sealed step has shards"
        self.seal = StepSeal(n_shards=len(self.shards), n_valid_runs=n_valid_runs)
        return self.seal

    def current(self, step: int, attempt: int) -> bool:
        return self.step is not None and (step, attempt) == (self.step, self.attempt)

    def close(self, ok: bool, now: float, reason: str = "") -> None:
        """The step ended: its open shards FAILED (ok=False), or none should be left (ok=True)."""
        left = [sh for sh in self.shards.values() if sh.status in OPEN]
        if ok and left:  # cannot happen while the core reports each shard before TrainDone on one socket
            log.warning("step %s done with shards %s not reported DONE", self.step, [sh.index for sh in left])
        for sh in left:
            self._set(sh, ShardStatus.FAILED, done_at=now)
        if left and not ok:
            self.ledger.event("shards_failed", f"step {self.step}: {len(left)} shard(s) FAILED: {reason}",
                              severity=Severity.WARNING, data={"step": self.step, "shards": [sh.index for sh in left]})
        self.step, self.endpoint, self.shards, self.joined, self.dropped = None, None, {}, set(), set()
        self.seal = None

    # --- cells ------------------------------------------------------------------------------------------------
    def take(self, cell: int, is_core: bool, now: float) -> ShardAssignment | NoShard:
        """The first queued shard for `cell`; else when to ask again, or that the step has nothing left for it
        (a satellite once every shard is DONE; anyone once the step is over)."""
        step = self.step
        assert step is not None
        if cell in self.dropped:
            return NoShard(step=step, step_over=True)
        seal = self.seal if is_core else None  # the core learns the step's end here
        queued = [sh for sh in self.shards.values() if sh.status == ShardStatus.QUEUED]
        if not queued:
            over = not is_core and self.seal is not None and \
                all(sh.status == ShardStatus.DONE for sh in self.shards.values())
            return NoShard(step=step, retry_after_s=RETRY_S, step_over=over, seal=seal)
        sh = min(queued, key=lambda s: s.index)
        sh.attempts += 1
        sh.cell = cell
        sh.taken_at = now
        self._set(sh, ShardStatus.TAKEN, cell_id=cell, attempts=sh.attempts, taken_at=now)
        if not is_core:
            self.joined.add(cell)
        return ShardAssignment(step=step, shard=sh.index, path=str(sh.path), seal=seal)

    def done(self, shard: int, by_cell: int, now: float) -> bool:
        """The core added the shard's gradient (computed by `by_cell`); False for a repeat or an unknown shard."""
        sh = self.shards.get(shard)
        if sh is None or sh.status not in OPEN:
            return False
        sh.by, sh.done_at = by_cell, now
        self._set(sh, ShardStatus.DONE, done_at=now, done_by=by_cell)
        return True

    def requeue(self, cell: int, reason: str) -> list[int]:
        """Give the shards `cell` holds back to the queue (it died, left TRAIN or is being pulled back), and
        forget that it joined: a cell that comes back is asked to join again."""
        self.joined.discard(cell)
        back = sorted(sh.index for sh in self.shards.values()
                      if sh.status == ShardStatus.TAKEN and sh.cell == cell)
        for k in back:
            self._set(self.shards[k], ShardStatus.QUEUED)
        if back:
            self.ledger.event("shards_requeued", f"step {self.step}: shard(s) {back} of cell {cell} queued "
                              f"again: {reason}", severity=Severity.WARNING, cell_id=cell,
                              data={"step": self.step, "shards": back})
        return back

    def give_back(self, shard: int, cell: int, error: str) -> bool:
        """A satellite could not do the shard it took: queued again, and that cell takes no more of this step."""
        self.dropped.add(cell)
        sh = self.shards.get(shard)
        if sh is None or sh.status != ShardStatus.TAKEN or sh.cell != cell:
            return False
        self._set(sh, ShardStatus.QUEUED)
        self.ledger.event("shard_given_back", f"step {self.step}: cell {cell} could not do shard {shard}: "
                          f"{error}", severity=Severity.WARNING, cell_id=cell, data={"step": self.step, "shard": shard})
        return True

    def holders(self) -> set[int]:
        return {sh.cell for sh in self.shards.values() if sh.status == ShardStatus.TAKEN and sh.cell is not None}

    def busy_intervals(self) -> list[tuple[float, float]]:
        """When the step's shards that are in were being computed (taken → reported done)."""
        return [(sh.taken_at, sh.done_at) for sh in self.shards.values()
                if sh.status == ShardStatus.DONE and sh.taken_at is not None and sh.done_at is not None]

    def done_by(self) -> set[int]:
        """The cells whose gradients are in the step so far."""
        return {sh.by for sh in self.shards.values() if sh.status == ShardStatus.DONE and sh.by is not None}

    # --- recovery ---------------------------------------------------------------------------------------------
    def recover(self, now: float) -> int:
        """A restarted daemon runs the step that was in flight again, with new shards: the old ones FAILED."""
        rows = self.ledger.open_shards()
        for r in rows:
            sh = QueuedShard(r.id, r.step, r.shard, Path(r.path), r.status)
            self._set(sh, ShardStatus.FAILED, done_at=now)
        if rows:
            self.ledger.event("shards_failed", f"{len(rows)} shard(s) of the step in flight FAILED: the daemon "
                              f"stopped during the step; it is run again", severity=Severity.WARNING)
        return len(rows)

    def _set(self, sh: QueuedShard, dst: ShardStatus, **values) -> None:
        """The one place a shard's status is checked and written (a new row when it has no status yet)."""
        self.ledger.transition(SHARD, {"id": sh.row}, sh.status, dst, f"step {sh.step} shard {sh.index}",
                               **values)
        sh.status = dst
