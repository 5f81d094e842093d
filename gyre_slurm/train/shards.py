"""Run-aligned splitting of a step's TrainBatch into shards (pure, no torch).

A shard is a TrainBatch that holds whole runs. Two uses:

- satellites (docs/design.md §2–3): the daemon splits one optimizer step's batch into shards that any training cell
  can take. Every shard keeps the step's global |R_valid| as `n_valid_runs`, so the per-shard GSPO losses share
  one normaliser and their gradients simply add up to the whole-batch gradient (docs/algorithms.md §1.5).
- optimizer mini-batches (§1.5 "4 mini-batches per rollout batch"): the trainer splits a rollout batch into
  parts that each get their own optimizer step; there `keep_normaliser=False` gives each part its own count.

A run is never cut: its ratio s_r needs all of its targets at one θ. Splitting is deterministic (same batch,
same arguments → same shards), so a redone shard is the same shard.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from gyre_slurm.train.batch import BatchError, TrainBatch

SHARD_KEY = "shard"  # meta key: this shard's index in its step
N_SHARDS_KEY = "n_shards"


def run_costs(batch: TrainBatch) -> dict[int, int]:
    """Tokens each run costs a trainer (per sample: up to its last target; samples without targets cost 0),
    for every run id that has samples, in first-appearance order."""
    costs: dict[int, int] = {}
    for s in batch.samples:
        last = max((j for j, m in enumerate(s.loss_mask) if m), default=-1)
        costs[s.run_id] = costs.get(s.run_id, 0) + last + 1
    return costs


def split_indices(batch: TrainBatch, *, n_shards: int | None = None, max_tokens: int | None = None) -> list[list[int]]:
    """Sample indices of each shard (each list ascending), whole runs only. Give exactly one of:

    n_shards: that many shards balanced by token cost (longest run first onto the lightest shard), clamped to
        the number of runs with targets (never an empty shard; a batch without targets gives one shard).
    max_tokens: runs in batch order, a new shard whenever the next run would take this one over max_tokens;
        a run larger than max_tokens gets a shard of its own.
    """
    if (n_shards is None) == (max_tokens is None):
        raise ValueError("give exactly one of n_shards and max_tokens")
    if n_shards is not None and n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, not {n_shards}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
    costs = run_costs(batch)
    order = list(costs)  # first appearance
    if n_shards is not None:
        n = max(1, min(n_shards, sum(1 for c in costs.values() if c > 0)))
        loads = [0] * n
        members: list[list[int]] = [[] for _ in range(n)]
        for pos in sorted(range(len(order)), key=lambda p: (-costs[order[p]], p)):
            k = min(range(n), key=lambda j: (loads[j], j))
            loads[k] += costs[order[pos]]
            members[k].append(order[pos])
        groups = [set(m) for m in members]
    else:
        groups, load = [], 0
        for r in order:
            if not groups or (load + costs[r] > max_tokens and load > 0):
                groups.append(set())
                load = 0
            groups[-1].add(r)
            load += costs[r]
    where = {r: k for k, g in enumerate(groups) for r in g}
    out: list[list[int]] = [[] for _ in groups]
    for i, s in enumerate(batch.samples):
        out[where[s.run_id]].append(i)
    return out or [[]]


def subset(batch: TrainBatch, indices: Sequence[int], *, n_valid_runs: int | None, meta: dict | None = None) \
        -> TrainBatch:
    """A TrainBatch of the given samples (which must hold whole runs), with their runs' advantages and |T_r|."""
    samples = [batch.samples[i] for i in indices]
    run_ids = {s.run_id for s in samples}
    return TrainBatch(
        samples=samples,
        advantages={r: a for r, a in batch.advantages.items() if r in run_ids},
        targets_per_run={r: t for r, t in batch.targets_per_run.items() if r in run_ids},
        step=batch.step, version_in=batch.version_in, n_valid_runs=n_valid_runs,
        meta=copy.deepcopy(batch.meta) if meta is None else meta,
    )


def split_batch(batch: TrainBatch, *, n_shards: int | None = None, max_tokens: int | None = None,
                keep_normaliser: bool = True) -> list[TrainBatch]:
    """Run-aligned shards of `batch` (see `split_indices` for n_shards / max_tokens).

    keep_normaliser=True (satellites): every shard's n_valid_runs is the whole batch's |R_valid|, so gradients
    of the shards add up to the batch's gradient. False (mini-batches): each shard counts its own runs.
    Each shard's meta is the batch's plus {"shard": index, "n_shards": count}.
    """
    n_valid = (len(batch.runs()) if batch.n_valid_runs is None else batch.n_valid_runs) if keep_normaliser else None
    parts = split_indices(batch, n_shards=n_shards, max_tokens=max_tokens)
    return [subset(batch, idx, n_valid_runs=n_valid,
                   meta={**copy.deepcopy(batch.meta), SHARD_KEY: k, N_SHARDS_KEY: len(parts)})
            for k, idx in enumerate(parts)]


def shard_id(shard: TrainBatch) -> int:
    """The shard's index within its step (set by split_batch)."""
    sid = shard.meta.get(SHARD_KEY)
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        raise BatchError(f"batch has no shard index in meta[{SHARD_KEY!r}] (got {sid!r}): not made by split_batch")
    return sid


def check_shards(batch: TrainBatch, shards: Sequence[TrainBatch]) -> None:
    """Raise BatchError unless the shards together hold exactly the batch's samples, every run in one shard,
    each with the batch's advantage and |T_r|, with consistent step/version and shard indices 0..n-1."""
    ids = sorted(shard_id(s) for s in shards)
    if ids != list(range(len(shards))):
        raise BatchError(f"shard indices {ids} are not 0..{len(shards) - 1}")
    owner: dict[int, int] = {}
    for sh in shards:
        sid = shard_id(sh)
        if (sh.step, sh.version_in) != (batch.step, batch.version_in):
            raise BatchError(f"shard {sid}: step/version {sh.step}/{sh.version_in} differ from the batch's")
        for s in sh.samples:
            if owner.setdefault(s.run_id, sid) != sid:
                raise BatchError(f"run {s.run_id} is split across shards {owner[s.run_id]} and {sid}")
    n_samples = 0
    for sh in shards:
        sid = shard_id(sh)
        for r in sh.runs():
            if sh.advantages.get(r) != batch.advantages.get(r) or \
                    sh.targets_per_run.get(r) != batch.targets_per_run.get(r):
                raise BatchError(f"shard {sid}: run {r}'s advantage or |T_r| differs from the batch's")
        n_samples += len(sh.samples)
    if n_samples != len(batch.samples) or set(owner) != {s.run_id for s in batch.samples}:
        raise BatchError(f"shards hold {n_samples} samples of runs {sorted(owner)}, the batch "
                         f"{len(batch.samples)} samples")


def merge_shards(shards: Sequence[TrainBatch]) -> TrainBatch:
    """The batch the shards came from (samples in shard order), with the shards' shared normaliser."""
    if not shards:
        raise BatchError("nothing to merge")
    first = shards[0]
    meta = {k: v for k, v in first.meta.items() if k not in (SHARD_KEY, N_SHARDS_KEY)}
    merged = TrainBatch([], {}, {}, step=first.step, version_in=first.version_in,
                        n_valid_runs=first.n_valid_runs, meta=copy.deepcopy(meta))
    for sh in sorted(shards, key=shard_id):
        merged.samples.extend(sh.samples)
        merged.advantages.update(sh.advantages)
        merged.targets_per_run.update(sh.targets_per_run)
    return merged
