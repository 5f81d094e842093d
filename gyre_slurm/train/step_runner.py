"""One training step shared by the core and satellites (docs/design.md §2–3), with no knowledge of the daemon.

The daemon splits the step's batch into shards (`shards.split_batch`, global normaliser kept) and hands them
out. The core runs `CoreStep`: its own shards through `run_shard`, satellites' gradient messages through
`accept`, and once the step is sealed (a streaming step: its last group is in) and every shard is covered,
`finish` scales the gradient sum by the step's normaliser, clips, steps and saves v+1. A satellite runs
`SatelliteStep`: load the step's weights, accumulate shards, send one message per shard or per set of shards.

Exactly-once: a shard's gradient is added at most once. A satellite that dies loses only what it had not sent,
and since it sends complete shards only, its partial work is never counted: the missing shards stay in
`CoreStep.missing` until someone redoes them. A message that covers a shard already covered is refused as a
whole (a gradient cannot be split back into shards), so satellites should prefer one message per shard. A
model-parallel core decides on its leader's piece of a message, and then every rank adds its own piece or none
does (train/rank_grads.py): the shard is counted once or not at all.

A step with satellites is one optimizer step; the trainer's optimizer mini-batches (GSPOTrainer.minibatches)
apply to `train_step` only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from gyre_slurm.train.batch import TrainBatch
from gyre_slurm.train.grad_channel import GradMessage
from gyre_slurm.train.gspo_trainer import GSPOTrainer
from gyre_slurm.train.metrics import merge_metrics
from gyre_slurm.train.rank_grads import grad_key, why_not_fits
from gyre_slurm.train.shards import shard_id
from gyre_slurm.transfer.report import TransferReport

log = logging.getLogger(__name__)

ADDED = "added"


class MessageSource(Protocol):
    def poll(self, timeout: float) -> list[GradMessage]: ...


class MessageSink(Protocol):
    def send(self, msg: GradMessage) -> None: ...


class CoreStep:
    """The core's side of one step: gradients of every shard, each counted exactly once.

    Sealed at once (`shard_ids` given) when the step's shards are all known at its start; a streaming step starts
    unsealed (shard_ids None), takes shards as its groups become ready, and is sealed by `seal` once its last group
    is in. The step's gradient sum is divided by `normaliser` before the optimizer step: shards that carry
    unnormalised per-run losses (n_valid_runs = batch.UNNORMALISED, as a streaming step's must: its valid runs are
    counted only when it is sealed) need the step's valid-run count there; shards with the global normaliser, 1."""

    def __init__(self, trainer: GSPOTrainer, step: int, version_in: int, shard_ids: Iterable[int] | None = None,
                 *, normaliser: int = 1) -> None:
        self.trainer, self.step, self.version_in = trainer, step, version_in
        self.shard_ids: frozenset[int] | None = None  # every shard of the step, once sealed
        self.normaliser = 1
        if shard_ids is not None:
            self.seal(shard_ids, normaliser)
        self.covered: dict[int, str] = {}  # shard id -> who computed it ("core" or the sender's name)
        self.refused: list[str] = []  # reasons, in order
        self._parts: list[dict[str, float]] = []
        self._finished = False
        trainer.zero_grad()

    def seal(self, shard_ids: Iterable[int], normaliser: int = 1) -> None:
        """The step's shards are all known: these, and the gradient sum is divided by `normaliser` at the end."""
        ids = frozenset(shard_ids)
        if not ids:
            raise ValueError("a step needs at least one shard")
        if normaliser < 0:
            raise ValueError(f"normaliser must be >= 0, not {normaliser}")
        if self.shard_ids is not None and self.shard_ids != ids:
            raise ValueError(f"step {self.step} is sealed with shards {sorted(self.shard_ids)} already")
        self.shard_ids, self.normaliser = ids, normaliser

    @property
    def sealed(self) -> bool:
        return self.shard_ids is not None

    @property
    def version_out(self) -> int:
        return self.version_in + 1

    @property
    def missing(self) -> list[int]:
        """Shards not in yet (before the seal: none known to be missing)."""
        return sorted(self.shard_ids - self.covered.keys()) if self.shard_ids is not None else []

    @property
    def done(self) -> bool:
        return self.sealed and not self.missing

    def _belongs(self, sid: int) -> bool:
        return sid in self.shard_ids if self.shard_ids is not None else sid >= 0

    def run_shard(self, shard: TrainBatch) -> bool:
        """Compute a shard here. False (and no work) if its gradient is already in; raises on a shard that
        does not belong to this step (that is the caller's bug, not a peer's)."""
        sid = shard_id(shard)
        if (shard.step, shard.version_in) != (self.step, self.version_in) or not self._belongs(sid):
            known = sorted(self.shard_ids) if self.shard_ids is not None else "not sealed yet"
            raise ValueError(f"shard {sid} of step {shard.step} (v{shard.version_in}) is not part of step "
                             f"{self.step} (v{self.version_in}, shards {known})")
        if self._finished:
            raise RuntimeError("this step is finished")
        if sid in self.covered:
            return False
        self._parts.append(self.trainer.forward_backward(shard))
        self.covered[sid] = "core"
        return True

    def accept(self, msg: GradMessage) -> str:
        """Add a satellite's gradients unless they are for another step, overlap shards already in, or do not
        fit the model. Returns "added" or the reason for ignoring the message (also logged)."""
        why = self._why_not(msg)
        if why is None and not self._add(msg):
            why = "a core rank did not get its piece in time (none added it)"
        if why is None:
            for sid in msg.shard_ids:
                self.covered[sid] = msg.sender
            self._parts.append(dict(msg.metrics))
            return ADDED
        self.refused.append(why)
        log.info("gradients from %s for shards %s ignored: %s", msg.sender, list(msg.shard_ids), why)
        return why

    def _add(self, msg: GradMessage) -> bool:
        """Add the message's gradient: here, or on every rank of a model-parallel core that has its receivers open
        (each rank its own piece, all or none: train/rank_grads.py)."""
        if getattr(self.trainer, "grad_inbox", None) is not None:
            return bool(self.trainer.take_grads(grad_key(msg)))
        self.trainer.add_grads(msg.grads)
        return True

    def _why_not(self, msg: GradMessage) -> str | None:
        if self._finished:
            return "step already finished"
        if msg.step != self.step or msg.version_in != self.version_in:
            return f"other step: step {msg.step} v{msg.version_in}, this is step {self.step} v{self.version_in}"
        ids = set(msg.shard_ids)
        unknown = sorted(i for i in ids if not self._belongs(i))
        if not ids or unknown:
            return f"unknown shards {unknown}"
        if ids <= self.covered.keys():
            return "duplicate"
        if ids & self.covered.keys():
            return f"overlap: shards {sorted(ids & self.covered.keys())} already in"
        return why_not_fits(msg.grads, self.trainer.grad_shapes())  # the leader's piece (the others: each rank)

    def collect(self, source: MessageSource, timeout: float) -> bool:
        """Accept messages from `source` until every shard is covered or `timeout` seconds pass; returns done."""
        deadline = time.monotonic() + timeout
        while not self.done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for msg in source.poll(left):
                self.accept(msg)
        return self.done

    def finish(self, out_dir: Path) -> tuple[Path, dict[str, float]]:
        """Clip, step, save the new weights (version_in + 1) to out_dir; returns (path, merged metrics)."""
        if not self.done:
            raise RuntimeError(f"step {self.step}: shards {self.missing} are not covered yet")
        if self._finished:
            raise RuntimeError("this step is finished")
        t0 = time.perf_counter()
        metrics = merge_metrics(self._parts, shared_normaliser=True)
        if self.normaliser > 1:  # the per-run mean over the whole step's valid runs (docs/algorithms.md §1.5, §8)
            self.trainer.scale_grads(1.0 / self.normaliser)
            metrics["loss"] /= self.normaliser
        if self.normaliser != 1:
            metrics["n_valid_runs"] = float(self.normaliser)
        if metrics["runs"] > 0:
            metrics.update(self.trainer.optimizer_step())
        else:  # as train_step: nothing to learn from, no step
            self.trainer.zero_grad()
            metrics.update({"grad_norm": 0.0, "skipped": 1.0})
        self._finished = True
        path = self.trainer.save(Path(out_dir))
        metrics.update({
            "shards": float(len(self.shard_ids or ())),
            "shards_core": float(sum(1 for who in self.covered.values() if who == "core")),
            "satellites": float(len({who for who in self.covered.values() if who != "core"})),
            "messages_refused": float(len(self.refused)),
            "finish_seconds": time.perf_counter() - t0,
        })
        return path, metrics


class SatelliteStep:
    """A satellite's side: load the step's weights, accumulate shards, send their gradients to the core."""

    def __init__(self, trainer: GSPOTrainer, sink: MessageSink | None = None, *, name: str = "satellite") -> None:
        self.trainer, self.sink, self.name = trainer, sink, name
        self.step: int | None = None
        self.version_in: int | None = None
        self._loaded: tuple[str, int] | None = None
        self._pending: list[int] = []
        self._parts: list[dict[str, float]] = []

    def load(self, weights_dir: Path, step: int, version_in: int,
             pull: Callable[[GSPOTrainer], TransferReport] | None = None) -> TransferReport | None:
        """Take the weights the step starts from (skipped when this version is already loaded): from the snapshot
        folder, or through `pull(trainer)` (the Transfer Engine), whose report it returns. Drops any unsent work of
        an earlier step."""
        key = (str(Path(weights_dir).resolve()), version_in)
        report = None
        if key != self._loaded:
            if pull is None:
                self.trainer.load_weights(Path(weights_dir))
            else:
                report = pull(self.trainer)
            self._loaded = key
        self.step, self.version_in = step, version_in
        self._reset()
        return report

    def accumulate(self, shard: TrainBatch) -> dict[str, float]:
        """Add one shard's gradient to what this satellite holds (not sent until `flush`)."""
        if self.step is None:
            raise RuntimeError("load the step's weights first")
        sid = shard_id(shard)
        if (shard.step, shard.version_in) != (self.step, self.version_in):
            raise ValueError(f"shard {sid} is for step {shard.step} v{shard.version_in}, loaded step {self.step} "
                             f"v{self.version_in}")
        if sid in self._pending:
            raise ValueError(f"shard {sid} is already accumulated")
        m = self.trainer.forward_backward(shard)
        self._pending.append(sid)
        self._parts.append(m)
        return m

    def flush(self) -> GradMessage | None:
        """One message covering every shard accumulated since the last flush, sent if there is a sink;
        None when nothing is pending."""
        if not self._pending:
            return None
        # a sink that `exports` has the trainer's ranks export and send their own slices (train/rank_grads.py)
        grads = {} if getattr(self.sink, "exports", False) else self.trainer.export_grads()
        msg = GradMessage(step=self.step, version_in=self.version_in, shard_ids=tuple(self._pending),
                          sender=self.name, grads=grads, metrics=merge_metrics(self._parts, shared_normaliser=True))
        try:
            if self.sink is not None:
                self.sink.send(msg)  # before the reset: an exporting sink reads the gradient then
        finally:
            self._reset()
        return msg

    def run_shards(self, shards: Sequence[TrainBatch]) -> GradMessage | None:
        for shard in shards:
            self.accumulate(shard)
        return self.flush()

    def run_shard(self, shard: TrainBatch) -> GradMessage:
        msg = self.run_shards([shard])
        assert msg is not None
        return msg

    def _reset(self) -> None:
        self.trainer.zero_grad()
        self._pending, self._parts = [], []
