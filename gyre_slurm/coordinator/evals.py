"""The daemon's evaluations: the held-out tasks run with a published version, scored, never trained on.

An evaluation is due at the start (version 0), after every `eval.every_steps`-th step, before the run stops, and on
demand (`gyre eval`). Its runs go through the same workers, proxy, sandbox and evaluators as training runs, as
kind 'eval' in the ledger: they belong to no group (a CHECK constraint), are placed within `eval.slot_share` of the
rollout slots (RolloutBook.take), are sampled at `eval.temperature` (the proxy sets it), and are left out of the
scheduler's watermark. When its last run ends its figures go to its row (scoring/pass_at_k.py) and `on_done` runs
(the trackers). A run stopped during an evaluation resumes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.coordinator.rollouts import RolloutBook, RolloutState
from gyre_slurm.errors import ControlError, GyreError
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.scoring.pass_at_k import EvalRun, figures
from gyre_slurm.statuses import EVAL, ROLLOUT_TERMINAL, EvalStatus


@dataclass
class EvalState:
    id: int
    version: int
    runs: list[int]


class EvalBook:
    def __init__(self, cfg: RunConfig, ledger: Ledger, book: RolloutBook) -> None:
        self.cfg = cfg.eval
        self.ledger = ledger
        self.book = book
        self.open: dict[int, EvalState] = {}
        self.evaluated: set[int] = set()  # versions with a scheduled evaluation (start, every_steps, end)
        self._next = 1
        self.on_done: Callable[[int], None] = lambda eval_id: None
        book.on_eval_run_ended = self._run_ended

    def recover(self) -> None:
        self._next = self.ledger.last_eval_id() + 1
        for r in self.ledger.evals():
            if r.reason != "manual":
                self.evaluated.add(r.version)
            if r.status == EvalStatus.RUNNING:  # its runs: RolloutBook.recover read them back
                runs = sorted(st.id for st in self.book.rollouts.values() if st.eval_id == r.id)
                self.open[r.id] = EvalState(r.id, r.version, runs)
        for e in list(self.open.values()):  # every run of it ended before the daemon stopped
            self._maybe_done(e, time.time())

    def snapshot(self, version: int) -> tuple[int, Path]:
        """A published version (-1: the last) and its snapshot folder, for `gyre eval` after the run."""
        w = self.ledger.weight_version(None if version < 0 else version)
        if w is None or not w.location or not Path(w.location).exists():
            shown = w.version if w is not None else max(version, 0)
            raise GyreError(f"version {shown} is not among this run's weight versions (see v_step_times)")
        return w.version, Path(w.location)

    @property
    def enabled(self) -> bool:
        return bool(self.book.eval_tasks)

    def due(self, version: int, steps_done: int, finishing: bool) -> str | None:
        """Why the current version is due for a scheduled evaluation now, or None."""
        if not self.enabled or version in self.evaluated:
            return None
        if version == 0 and self.cfg.at_start:
            return "start"
        if finishing and self.cfg.at_end:
            return "end"
        if self.cfg.every_steps and steps_done and steps_done % self.cfg.every_steps == 0 and version == steps_done:
            return "every_steps"
        return None

    def start(self, version: int, reason: str, now: float) -> int:
        """Queue an evaluation of `version` (the one the rollout engines serve now); returns its id."""
        if not self.enabled:
            raise ControlError("this run has no evaluation tasks: set eval.suite, eval.holdout_tasks or "
                               "eval.holdout_share in its config")
        eid = self._next
        self._next += 1
        c = self.cfg
        self.ledger.transition(EVAL, {"id": eid}, None, EvalStatus.RUNNING, f"evaluation {eid}", version=version,
                               step=version - 1 if version else None, reason=reason, samples=c.samples,
                               temperature=c.temperature, pass_score=c.pass_score, n_tasks=len(self.book.eval_tasks),
                               created_at=now)
        runs = self.book.add_eval_runs(eid, c.samples, now)
        self.open[eid] = EvalState(eid, version, runs)
        if reason != "manual":
            self.evaluated.add(version)
        self.ledger.event("eval_started", f"evaluation {eid} of version {version} ({reason}): {len(runs)} runs of "
                          f"{len(self.book.eval_tasks)} held-out tasks", data={"eval": eid, "version": version})
        return eid

    def _run_ended(self, st: RolloutState, now: float) -> None:
        e = self.open.get(st.eval_id)
        if e is not None:
            self._maybe_done(e, now)

    def _maybe_done(self, e: EvalState, now: float) -> None:
        runs = [self.book.rollouts[r] for r in e.runs]
        if any(st.status not in ROLLOUT_TERMINAL for st in runs):
            return
        later = self.ledger.runs_served_later(e.id, e.version)
        f = figures([EvalRun(st.task_index, st.status, st.reward, st.id in later) for st in runs], self.cfg.samples,
                    self.cfg.pass_score)
        self.ledger.transition(EVAL, {"id": e.id}, EvalStatus.RUNNING, EvalStatus.DONE, f"evaluation {e.id}",
                               ended_at=now, n_runs=f.n_runs, n_excluded=f.n_excluded, pass_at_1=f.pass_at_1,
                               pass_at_k=f.pass_at_k, k=f.k, score_mean=f.score_mean, timeout_share=f.timeout_share,
                               mixed_versions=f.mixed_versions)
        p1 = "n/a" if f.pass_at_1 is None else f"{f.pass_at_1:.3f}"
        self.ledger.event("eval_done", f"evaluation {e.id} of version {e.version}: pass@1 {p1} over {f.n_runs} "
                          f"scored runs ({f.n_excluded} excluded)", data={"eval": e.id, "version": e.version})
        del self.open[e.id]
        for r in e.runs:
            self.book.rollouts.pop(r, None)
        self.on_done(e.id)

    def queued(self) -> int:
        return len(self.book.eval_queue)
