"""A node's work in one training step with shards (docs/design.md §3 step 7): the core's loop and a satellite's.

Core: open a gradient receiver and tell the daemon (StepOpen, so satellites can join), then take shards one at
a time and compute them, and between shards add what satellites sent; report every shard that is in
(ShardDone, with the cell that computed it) so the daemon hands it to nobody again. While no shard is
queued it keeps collecting and asks again (a shard of a cell that left is queued again; a streaming step's next
group may join). Once the step is sealed (its seal comes with the TrainStep, or with a later answer when its
groups join as they become ready) and every shard is in, divide by the step's valid runs, clip, step and save
version_in + 1.

Satellite: take a shard, compute it at the step's weights, send its gradient straight to the core, and again,
until the step has nothing left for it or its job is told to stop (it finishes the shard in hand first). The
step's weights are loaded with its first shard, so a JoinStep that comes after the step costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from gyre_slurm.agent.train_link import StepStopped, TrainLink
from gyre_slurm.protocol import (
    JoinStep,
    NoShard,
    ShardAssignment,
    ShardDone,
    ShardFailed,
    StepOpen,
    StepSeal,
    TrainDone,
    TrainStep,
    WeightsRef,
)
from gyre_slurm.train.batch import read_batch
from gyre_slurm.train.grad_channel import GradMessage, GradReceiver, GradSender
from gyre_slurm.train.gspo_trainer import GSPOTrainer
from gyre_slurm.train.rank_grads import GradLink, RankGrads, RankSink
from gyre_slurm.train.step_runner import ADDED, CoreStep, SatelliteStep
from gyre_slurm.transfer.engine import TransferAgent
from gyre_slurm.transfer.report import TransferReport

log = logging.getLogger("gyre.agent")

SENDER_LINGER_S = 10.0  # a satellite told to stop: time for its last gradient to reach the core


def sender_cell(msg: GradMessage) -> int | None:
    """The cell a gradient message comes from (satellites name themselves by their cell index)."""
    return int(msg.sender) if msg.sender.isdecimal() else None


def core_step(trainer: GSPOTrainer, cmd: TrainStep, link: TrainLink, cell: int, receiver: GradReceiver | RankGrads,
              weights_in: WeightsRef | None = None, endpoints: list[str] | None = None) -> TrainDone:
    """Run the step's shards here and with satellites; returns the TrainDone of the published version.
    `weights_in`: version_in as the core published it (StepOpen tells the daemon, for satellites to pull);
    `endpoints`: every core rank's gradient receiver, by rank (a model-parallel core; `receiver` is rank 0's)."""
    t0 = time.perf_counter()
    step = CoreStep(trainer, cmd.step, cmd.version_in)

    def seal(s: StepSeal | None) -> None:  # a streaming step's seal comes with a later answer
        if s is not None and not step.sealed:
            step.seal(range(s.n_shards), s.n_valid_runs)

    seal(cmd.seal)
    receiver.expect(cmd.step)
    link.send(StepOpen(step=cmd.step, attempt=cmd.attempt, grad_endpoint=receiver.endpoint, weights=weights_in,
                       grad_endpoints=endpoints or []))

    def collect(wait_s: float) -> None:
        for msg in receiver.poll(wait_s):
            by = sender_cell(msg)
            if by is None:
                log.warning("gradients from %r ignored: not a cell's name", msg.sender)
            elif step.accept(msg) == ADDED:
                for sid in msg.shard_ids:
                    link.send(ShardDone(step=cmd.step, attempt=cmd.attempt, shard=sid, by_cell=by))

    while not step.done:
        collect(0)
        if step.done:
            break
        answer = link.take(cmd.step, cmd.attempt, collect)
        if answer is None:
            raise StepStopped(f"step {cmd.step} stopped: a newer command replaced it")
        seal(answer.seal)
        if isinstance(answer, ShardAssignment):
            if step.run_shard(read_batch(Path(answer.path))):
                link.send(ShardDone(step=cmd.step, attempt=cmd.attempt, shard=answer.shard, by_cell=cell))
        elif answer.step_over:
            raise StepStopped(f"the daemon closed step {cmd.step} (attempt {cmd.attempt}) before it was done")
        else:
            collect(answer.retry_after_s)
    path, metrics = step.finish(Path(cmd.out_dir))
    metrics["shards_by_satellites"] = metrics["shards"] - metrics["shards_core"]
    metrics["seconds"] = time.perf_counter() - t0
    return TrainDone(step=cmd.step, ok=True, weights=WeightsRef(version=cmd.version_in + 1, path=str(path)),
                     metrics={k: float(v) for k, v in metrics.items()}, attempt=cmd.attempt)


def satellite_step(sat: SatelliteStep, cmd: JoinStep, link: TrainLink, cell: int,
                   pull: Callable[[GSPOTrainer], TransferReport] | None = None,
                   grad_agent: TransferAgent | None = None, rank_link: GradLink | None = None) -> int:
    """Do shards of the step until it has none left for this cell or the job is told to stop; returns how many
    gradients were sent. `pull` loads the step's weights (weight_link.py); `grad_agent` sends the gradients'
    bytes over the Transfer Engine (None: inline). A model-parallel trainer's ranks send their own slices to the
    core's ranks (train/rank_grads.py; `rank_link`: how each rank reaches them). A shard that fails here is handed
    back (ShardFailed), then the error raised."""
    sender: GradSender | RankSink | None = None
    sent, over, holding = 0, False, None
    try:
        while not link.stop.is_set():
            answer = link.take(cmd.step, cmd.attempt, link.stop.wait)
            if isinstance(answer, NoShard):
                over = answer.step_over
                if over:
                    break
                link.stop.wait(answer.retry_after_s)
                continue
            if answer is None:
                break
            holding = answer.shard
            if sender is None:  # the first shard: the step's weights, and the way to the core
                sat.load(Path(cmd.weights.path), cmd.step, cmd.version_in, pull)
                if hasattr(sat.trainer, "send_grads"):  # rank r to the core's rank r
                    sender = RankSink(sat.trainer, cmd.grad_endpoints or [cmd.grad_endpoint], link.token, rank_link)
                else:
                    sender = GradSender(cmd.grad_endpoint, link.token, name=str(cell), agent=grad_agent)
                sat.sink = sender
            sat.run_shard(read_batch(Path(answer.path)))
            sent, holding = sent + 1, None
    except Exception as e:
        if holding is not None:
            link.send(ShardFailed(step=cmd.step, attempt=cmd.attempt, shard=holding, node_index=link.node_index,
                                       error=f"{type(e).__name__}: {e}"))
        raise
    finally:
        if sender is not None:  # once the step is over nobody reads what is still queued
            sender.close(linger_s=0.0 if over else SENDER_LINGER_S)
    return sent
