"""The training batch file: written by the daemon, read by a trainer (msgpack, one file per step or shard).

Token alignment: `loss_mask[i]` and `behav_logp[i]` describe token i as a *target*, i.e. predicted from
tokens[:i]. Token 0 therefore can never be a target. A batch holds whole runs (every claimed target of a run,
docs/algorithms.md §1.5 step 1), so `targets_per_run[r]` equals the run's masked-token count here.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

FORMAT = 1
UNNORMALISED = 0  # n_valid_runs of a shard whose step's valid runs are not known yet (a streaming step)


class BatchError(ValueError):
    """A batch that a trainer must not train on; the message names the sample or run."""


@dataclass
class TrainSample:
    run_id: int
    tokens: list[int]
    loss_mask: list[int]  # 1 = trainable target (claimed once per run, §3.3)
    behav_logp: list[float]  # behaviour log-prob per token, 0 where loss_mask is 0


@dataclass
class TrainBatch:
    samples: list[TrainSample]
    advantages: dict[int, float]  # run_id -> Â_r
    targets_per_run: dict[int, int]  # run_id -> |T_r|
    step: int
    version_in: int  # weights version the step starts from
    # Global |R_valid| when this file is one data-parallel shard of a step; None: the runs in this file;
    # UNNORMALISED (0): per-run losses summed, the step's |R_valid| applied where the shards' gradients are added up
    n_valid_runs: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def normaliser(self) -> int:
        """What the summed per-run losses are divided by (docs/algorithms.md §1.5's |R_valid|)."""
        if self.n_valid_runs is None:
            return len(self.runs())
        return self.n_valid_runs or 1

    def runs(self) -> list[int]:
        """Run ids with at least one target, in first-appearance order."""
        seen: dict[int, None] = {}
        for s in self.samples:
            if any(s.loss_mask):
                seen.setdefault(s.run_id, None)
        return list(seen)

    def validate(self) -> None:
        if not isinstance(self.step, int) or self.step < 0 or not isinstance(self.version_in, int) \
                or self.version_in < 0:
            raise BatchError(f"step ({self.step!r}) and version_in ({self.version_in!r}) must be ints >= 0")
        counted: dict[int, int] = {}
        for i, s in enumerate(self.samples):
            where = f"sample {i} (run {s.run_id})"
            n = len(s.tokens)
            if n == 0:
                raise BatchError(f"{where}: no tokens")
            if len(s.loss_mask) != n or len(s.behav_logp) != n:
                raise BatchError(f"{where}: tokens ({n}), loss_mask ({len(s.loss_mask)}) and behav_logp "
                                 f"({len(s.behav_logp)}) lengths differ")
            if any(m not in (0, 1) for m in s.loss_mask):
                raise BatchError(f"{where}: loss_mask values must be 0 or 1")
            if s.loss_mask[0]:
                raise BatchError(f"{where}: token 0 is masked as a target but nothing precedes it to predict it")
            if any(t < 0 for t in s.tokens):
                raise BatchError(f"{where}: negative token id")
            bad = next((j for j, (m, lp) in enumerate(zip(s.loss_mask, s.behav_logp, strict=True))
                        if m and not (math.isfinite(lp) and lp <= 1e-4)), None)
            if bad is not None:
                raise BatchError(f"{where}: behav_logp[{bad}] = {s.behav_logp[bad]!r} is not a log-probability")
            counted[s.run_id] = counted.get(s.run_id, 0) + sum(s.loss_mask)
        for run_id, n_targets in counted.items():
            if n_targets == 0:
                continue
            adv = self.advantages.get(run_id)
            if adv is None or not math.isfinite(adv):
                raise BatchError(f"run {run_id} has {n_targets} targets but no finite advantage ({adv!r})")
            if self.targets_per_run.get(run_id) != n_targets:
                raise BatchError(f"run {run_id}: targets_per_run says {self.targets_per_run.get(run_id)!r} but its "
                                 f"samples mask {n_targets} targets (a batch must hold whole runs)")
        n_runs = sum(1 for c in counted.values() if c)
        if self.n_valid_runs is not None and self.n_valid_runs != UNNORMALISED and self.n_valid_runs < n_runs:
            raise BatchError(f"n_valid_runs = {self.n_valid_runs} but this batch alone has {n_runs} runs with targets")

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "step": self.step, "version_in": self.version_in, "n_valid_runs": self.n_valid_runs,
            "advantages": {int(k): float(v) for k, v in self.advantages.items()},
            "targets_per_run": {int(k): int(v) for k, v in self.targets_per_run.items()},
            "samples": [[s.run_id, s.tokens, s.loss_mask, s.behav_logp] for s in self.samples],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainBatch:
        if d.get("format") != FORMAT:
            raise BatchError(f"batch format {d.get('format')!r} is not {FORMAT}")
        return cls(
            samples=[TrainSample(int(r), list(t), list(m), [float(x) for x in lp]) for r, t, m, lp in d["samples"]],
            advantages={int(k): float(v) for k, v in d["advantages"].items()},
            targets_per_run={int(k): int(v) for k, v in d["targets_per_run"].items()},
            step=d["step"], version_in=d["version_in"], n_valid_runs=d.get("n_valid_runs"), meta=d.get("meta") or {},
        )


def write_batch(path: Path, batch: TrainBatch) -> None:
    """Validate, then write atomically (temp file in the same folder, rename): readers never see half. No fsync: the
    daemon writes these on its one thread, and on a slow disk a sync of megabytes stalled it past its hang timeout;
    like the ledger's commits (WAL, synchronous=NORMAL) a batch outlives any crash of a process, not of the OS."""
    batch.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgpack.packb(batch.to_dict(), use_bin_type=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_batch(path: Path) -> TrainBatch:
    raw = Path(path).read_bytes()
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise BatchError(f"{path}: not a msgpack batch file ({e})") from e
    if not isinstance(d, dict):
        raise BatchError(f"{path}: not a batch file (top level is {type(d).__name__})")
    try:
        batch = TrainBatch.from_dict(d)
    except (KeyError, TypeError) as e:
        raise BatchError(f"{path}: malformed batch ({e!r})") from e
    batch.validate()
    return batch
