"""The shards of the training step in flight (DESIGN.md §3 step 7): queued here, taken by training cells.

The daemon splits a step's batch into run-aligned shards (train/shards.py, the global normaliser kept so their
gradients add up), writes one file each and queues them. The core and every satellite that joined take one at
a time; satellites send their gradients straight to the core, and a shard is DONE only on the core's word
(MicrobatchDone), whoever computed it. A cell that dies, leaves TRAIN or is pulled back gives its shards back
to the queue; a gradient of a requeued shard that still reaches the core first counts, and the core drops any
later copy. No sockets here: the loop feeds messages in and sends what these methods return.

Statuses change only through `_set`, which checks the MICROBATCH machine before anything is written.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.protocol import MicrobatchAssignment, NoMicrobatch, ShardRef
from gyre_slurm.statuses import MICROBATCH, MicrobatchStatus
from gyre_slurm.train.batch import TrainBatch, write_batch
from gyre_slurm.train.shards import split_batch

log = logging.getLogger("gyre.microbatches")

OPEN = (MicrobatchStatus.QUEUED, MicrobatchStatus.TAKEN)
RETRY_S = 0.2  # a cell told "nothing queued now" asks again after this (a shard may be requeued meanwhile)


@dataclass
class Shard:
    row: int  # microbatches.id
    step: int
    index: int  # within the step
    path: Path
    status: MicrobatchStatus | None = None  # None: no row yet
    cell: int | None = None  # holds it (TAKEN) or held it last
    attempts: int = 0
    by: int | None = None  # the cell whose gradient the core added


class MicrobatchQueue:
    def __init__(self, ledger: LedgerWriter, run_dir: Path) -> None:
        self.ledger = ledger
        self.run_dir = run_dir
        self.step: int | None = None  # the step whose shards are queued (None: no step, or one without shards)
        self.attempt = 0
        self.endpoint: str | None = None  # the core's gradient receiver, once it said StepOpen
        self.shards: dict[int, Shard] = {}
        self.joined: set[int] = set()  # satellites told to join (JoinStep) or working on the step
        self.dropped: set[int] = set()  # satellites that could not do a shard of this step: no more for them
        self._next_row = (ledger.scalar("SELECT max(id) FROM microbatches") or 0) + 1

    # --- the step's life --------------------------------------------------------------------------------------
    def open(self, batch: TrainBatch, attempt: int, shard_runs: int, now: float) -> list[ShardRef]:
        """Split the step's batch into shards of about `shard_runs` runs, write them and queue them."""
        n = max(1, math.ceil(len(batch.runs()) / shard_runs))
        folder = self.run_dir / "batches" / f"step-{batch.step:05d}"
        self.step, self.attempt, self.endpoint, self.shards = batch.step, attempt, None, {}
        self.joined, self.dropped = set(), set()
        for part in split_batch(batch, n_shards=n):
            k = part.meta["shard"]
            sh = Shard(self._next_row, batch.step, k, folder / f"shard-{k:04d}.msgpack")
            self._next_row += 1
            write_batch(sh.path, part)  # on disk before its row says QUEUED
            self._set(sh, MicrobatchStatus.QUEUED, step=batch.step, shard=k, path=str(sh.path),
                      n_runs=len(part.runs()), tokens=sum(part.targets_per_run.values()), cell_id=None, attempts=0,
                      queued_at=now, taken_at=None, done_at=None, done_by=None)
            self.shards[k] = sh
        return [ShardRef(shard=k, path=str(sh.path)) for k, sh in sorted(self.shards.items())]

    def current(self, step: int, attempt: int) -> bool:
        return self.step is not None and (step, attempt) == (self.step, self.attempt)

    def close(self, ok: bool, now: float, reason: str = "") -> None:
        """The step ended: its open shards FAILED (ok=False), or none should be left (ok=True)."""
        left = [sh for sh in self.shards.values() if sh.status in OPEN]
        if ok and left:  # cannot happen while the core reports each shard before TrainDone on one socket
            log.warning("step %s done with shards %s not reported DONE", self.step, [sh.index for sh in left])
        for sh in left:
            self._set(sh, MicrobatchStatus.FAILED, done_at=now)
        if left and not ok:
            self.ledger.event("microbatches_failed", f"step {self.step}: {len(left)} shard(s) FAILED: {reason}",
                              severity="warning", data={"step": self.step, "shards": [sh.index for sh in left]})
        self.step, self.endpoint, self.shards, self.joined, self.dropped = None, None, {}, set(), set()

    # --- cells ------------------------------------------------------------------------------------------------
    def take(self, cell: int, is_core: bool, now: float) -> MicrobatchAssignment | NoMicrobatch:
        """The first queued shard for `cell`; else when to ask again, or that the step has nothing left for it
        (a satellite once every shard is DONE; anyone once the step is over)."""
        step = self.step
        assert step is not None
        if cell in self.dropped:
            return NoMicrobatch(step=step, step_over=True)
        queued = [sh for sh in self.shards.values() if sh.status == MicrobatchStatus.QUEUED]
        if not queued:
            over = not is_core and all(sh.status == MicrobatchStatus.DONE for sh in self.shards.values())
            return NoMicrobatch(step=step, retry_after_s=RETRY_S, step_over=over)
        sh = min(queued, key=lambda s: s.index)
        sh.attempts += 1
        sh.cell = cell
        self._set(sh, MicrobatchStatus.TAKEN, cell_id=cell, attempts=sh.attempts, taken_at=now)
        if not is_core:
            self.joined.add(cell)
        return MicrobatchAssignment(step=step, shard=sh.index, path=str(sh.path))

    def done(self, shard: int, by_cell: int, now: float) -> bool:
        """The core added the shard's gradient (computed by `by_cell`); False for a repeat or an unknown shard."""
        sh = self.shards.get(shard)
        if sh is None or sh.status not in OPEN:
            return False
        sh.by = by_cell
        self._set(sh, MicrobatchStatus.DONE, done_at=now, done_by=by_cell)
        return True

    def requeue(self, cell: int, reason: str) -> list[int]:
        """Give the shards `cell` holds back to the queue (it died, left TRAIN or is being pulled back), and
        forget that it joined: a cell that comes back is asked to join again."""
        self.joined.discard(cell)
        back = sorted(sh.index for sh in self.shards.values()
                      if sh.status == MicrobatchStatus.TAKEN and sh.cell == cell)
        for k in back:
            self._set(self.shards[k], MicrobatchStatus.QUEUED)
        if back:
            self.ledger.event("microbatches_requeued", f"step {self.step}: shard(s) {back} of cell {cell} queued "
                              f"again: {reason}", severity="warning", cell_id=cell,
                              data={"step": self.step, "shards": back})
        return back

    def give_back(self, shard: int, cell: int, error: str) -> bool:
        """A satellite could not do the shard it took: queued again, and that cell takes no more of this step."""
        self.dropped.add(cell)
        sh = self.shards.get(shard)
        if sh is None or sh.status != MicrobatchStatus.TAKEN or sh.cell != cell:
            return False
        self._set(sh, MicrobatchStatus.QUEUED)
        self.ledger.event("microbatch_given_back", f"step {self.step}: cell {cell} could not do shard {shard}: "
                          f"{error}", severity="warning", cell_id=cell, data={"step": self.step, "shard": shard})
        return True

    def holders(self) -> set[int]:
        return {sh.cell for sh in self.shards.values() if sh.status == MicrobatchStatus.TAKEN and sh.cell is not None}

    def done_by(self) -> set[int]:
        """The cells whose gradients are in the step so far."""
        return {sh.by for sh in self.shards.values() if sh.status == MicrobatchStatus.DONE and sh.by is not None}

    # --- recovery ---------------------------------------------------------------------------------------------
    def recover(self, now: float) -> int:
        """A restarted daemon runs the step that was in flight again, with new shards: the old ones FAILED."""
        rows = self.ledger.rows("SELECT id, step, shard, path, status FROM microbatches "
                                "WHERE status IN (:q, :t)", q=MicrobatchStatus.QUEUED.value,
                                t=MicrobatchStatus.TAKEN.value)
        for r in rows:
            sh = Shard(r["id"], r["step"], r["shard"], Path(r["path"]), MicrobatchStatus(r["status"]))
            self._set(sh, MicrobatchStatus.FAILED, done_at=now)
        if rows:
            self.ledger.event("microbatches_failed", f"{len(rows)} shard(s) of the step in flight FAILED: the daemon "
                              f"stopped during the step; it is run again", severity="warning")
        return len(rows)

    def _set(self, sh: Shard, dst: MicrobatchStatus, **values) -> None:
        """The one place a shard's status is checked and written (a new row when it has no status yet)."""
        self.ledger.transition(MICROBATCH, {"id": sh.row}, sh.status, dst, f"step {sh.step} shard {sh.index}",
                               **values)
        sh.status = dst
