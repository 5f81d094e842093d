"""What the daemon reads back from its own ledger: each coordinator book's state at start-up (a resumed run) and
the few facts it looks up while running. Typed rows, statuses as their Enums; the SQL stays here.

Every reader goes through LedgerWriter.rows/scalar, which flush first: the daemon reads its own writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.roles import Role
from gyre_slurm.statuses import (
    AgentStatus,
    EvalStatus,
    GroupStatus,
    RolloutStatus,
    RunStatus,
    ShardStatus,
    StepStatus,
    SwitchStatus,
)

# the events that say how the last daemon ended: suspended with its Slurm job, or not (it started or resumed since)
LIFECYCLE_EVENTS = ("daemon_suspended", "daemon_restarted", "run_started")


@dataclass(frozen=True)
class RunRow:
    created_at: float
    daemon_starts: int
    status: RunStatus


@dataclass(frozen=True)
class CellRow:
    id: int
    role: Role
    pinned: bool
    slurm_job_id: str | None
    slurm_state: str | None


@dataclass(frozen=True)
class AgentRow:
    node_index: int
    cell_id: int
    role: Role
    status: AgentStatus


@dataclass(frozen=True)
class SwitchRow:
    id: int
    cell_id: int
    from_role: Role
    to_role: Role
    requested_at: float


@dataclass(frozen=True)
class EvalRow:
    id: int
    version: int
    status: EvalStatus
    reason: str


@dataclass(frozen=True)
class VersionRow:
    version: int
    location: str | None
    handle: list[dict[str, Any]] | None  # mooncake: the version's parts (WeightsHandles) as JSON


@dataclass(frozen=True)
class ShardRow:
    id: int
    step: int
    shard: int
    path: str
    status: ShardStatus


@dataclass(frozen=True)
class GroupRow:
    id: int
    task_id: int
    status: GroupStatus
    admitted_version: int


@dataclass(frozen=True)
class RolloutRow:
    id: int
    status: RolloutStatus
    cell_id: int | None
    reward: float | None
    advantage: float | None
    started_at: float | None
    worker: str | None
    n_calls: int
    prompt_tokens: int
    completion_tokens: int
    task_id: int


@dataclass(frozen=True)
class UnheldRun:
    """A run a late model call belongs to, when the daemon no longer holds it: its counters, its group's status
    (None for an evaluation run) and whether that call is in the ledger already."""

    n_calls: int
    prompt_tokens: int
    completion_tokens: int
    group_status: GroupStatus | None
    seen: bool


_ROLLOUT_COLUMNS = ("id, status, cell_id, reward, advantage, started_at, worker, n_calls, prompt_tokens, "
                    "completion_tokens, task_id")


def _rollout(r: dict[str, Any]) -> RolloutRow:
    return RolloutRow(**{**r, "status": RolloutStatus(r["status"])})


class LedgerReads(LedgerWriter):
    """The readers; Ledger (records.py) adds the writes."""

    # --- run ------------------------------------------------------------------------------------------------
    def _last_id(self, table: str) -> int:
        """The highest id in one of our own tables (0 when empty): where a book's next id counts on from."""
        return self.scalar(f"SELECT max(id) FROM {table}") or 0

    def run(self, run_id: str) -> RunRow | None:
        rows = self.rows("SELECT created_at, daemon_starts, status FROM runs WHERE id = :id", id=run_id)
        return RunRow(rows[0]["created_at"], rows[0]["daemon_starts"], RunStatus(rows[0]["status"])) if rows else None

    def was_suspended(self) -> bool:
        """The last daemon was suspended with its Slurm job (it wrote daemon_suspended and nobody started since)."""
        marks = ", ".join(f"'{k}'" for k in LIFECYCLE_EVENTS)
        last = self.scalar(f"SELECT kind FROM events WHERE kind IN ({marks}) ORDER BY id DESC LIMIT 1")
        return last == "daemon_suspended"

    def daemon_starts(self) -> int:
        """How many times a daemon started this run (0 before its row exists)."""
        return self.scalar("SELECT max(daemon_starts) FROM runs") or 0

    # --- cells, agents, role switches -------------------------------------------------------------------------
    def cells(self) -> list[CellRow]:
        return [CellRow(r["id"], Role(r["role"]), bool(r["pinned"]), r["slurm_job_id"], r["slurm_state"])
                for r in self.rows("SELECT id, role, pinned, slurm_job_id, slurm_state FROM cells")]

    def agents(self) -> list[AgentRow]:
        return [AgentRow(r["node_index"], r["cell_id"], Role(r["role"]), AgentStatus(r["status"]))
                for r in self.rows("SELECT node_index, cell_id, role, status FROM agents")]

    def pending_switches(self) -> list[SwitchRow]:
        return [SwitchRow(r["id"], r["cell_id"], Role(r["from_role"]), Role(r["to_role"]), r["requested_at"])
                for r in self.rows("SELECT id, cell_id, from_role, to_role, requested_at FROM role_switches "
                                   "WHERE status = :s", s=SwitchStatus.PENDING.value)]

    def last_switch_id(self) -> int:
        return self._last_id("role_switches")

    # --- tasks, groups, rollouts, model calls ---------------------------------------------------------------
    def task_keys(self) -> dict[int, str]:
        return {r["id"]: r["key"] for r in self.rows("SELECT id, key FROM tasks")}

    def last_group_id(self) -> int:
        return self._last_id("groups")

    def last_rollout_id(self) -> int:
        return self._last_id("rollouts")

    def groups_trained(self) -> int:
        return self.scalar("SELECT count(*) FROM groups WHERE status = :s", s=GroupStatus.TRAINED.value) or 0

    def open_groups(self) -> list[GroupRow]:
        """The groups not done with: ADMITTED (runs going on) or READY (waiting for a step)."""
        return [GroupRow(g["id"], g["task_id"], GroupStatus(g["status"]), g["admitted_version"])
                for g in self.rows("SELECT id, task_id, status, admitted_version FROM groups WHERE status IN (:a, :r)",
                                   a=GroupStatus.ADMITTED.value, r=GroupStatus.READY.value)]

    def group_runs(self, group_id: int) -> list[RolloutRow]:
        return [_rollout(r) for r in self.rows(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE group_id = :g "
                                               "ORDER BY id", g=group_id)]

    def eval_runs(self, eval_id: int) -> list[RolloutRow]:
        return [_rollout(r) for r in self.rows(f"SELECT {_ROLLOUT_COLUMNS} FROM rollouts WHERE eval_id = :e "
                                               "ORDER BY id", e=eval_id)]

    def context_limited(self) -> list[int]:
        """Runs that asked for more prompt than the model's context (their context_limit events)."""
        return [r["rid"] for r in self.rows("SELECT json_extract(data, '$.rollout_id') AS rid FROM events "
                                            "WHERE kind = 'context_limit'")]

    def unheld_run(self, rollout_id: int, call_index: int) -> UnheldRun | None:
        rows = self.rows("SELECT r.n_calls, r.prompt_tokens, r.completion_tokens, g.status AS group_status, "
                         "(SELECT count(*) FROM model_calls m WHERE m.rollout_id = r.id AND m.call_index = :c) "
                         "AS seen FROM rollouts r LEFT JOIN groups g ON g.id = r.group_id WHERE r.id = :r",
                         r=rollout_id, c=call_index)
        if not rows:
            return None
        r = rows[0]
        status = GroupStatus(r["group_status"]) if r["group_status"] is not None else None
        return UnheldRun(r["n_calls"], r["prompt_tokens"], r["completion_tokens"], status, bool(r["seen"]))

    def runs_between(self, t0: float, now: float) -> list[tuple[float, float | None]]:
        """(started_at, ended_at) of the runs that were rolling out some time between t0 and now."""
        return [(r["started_at"], r["ended_at"]) for r in self.rows(
            "SELECT started_at, ended_at FROM rollouts WHERE started_at IS NOT NULL AND started_at < :now AND "
            "(ended_at IS NULL OR ended_at > :t0)", now=now, t0=t0)]

    # --- evaluations ------------------------------------------------------------------------------------------
    def last_eval_id(self) -> int:
        return self._last_id("evals")

    def evals(self) -> list[EvalRow]:
        return [EvalRow(r["id"], r["version"], EvalStatus(r["status"]), r["reason"])
                for r in self.rows("SELECT id, version, status, reason FROM evals")]

    def running_evals(self) -> list[int]:
        return [r["id"] for r in self.rows("SELECT id FROM evals WHERE status = :s", s=EvalStatus.RUNNING.value)]

    def runs_served_later(self, eval_id: int, version: int) -> set[int]:
        """The evaluation's runs with a model call served by a version after the one evaluated."""
        return {r["id"] for r in self.rows("SELECT DISTINCT rollout_id AS id FROM model_calls m JOIN rollouts r "
                                           "ON r.id = m.rollout_id WHERE r.eval_id = :e AND m.weight_version > :v",
                                           e=eval_id, v=version)}

    # --- training steps, shards, weight versions ------------------------------------------------------------
    def steps_done(self) -> int:
        return self.scalar("SELECT count(*) FROM train_steps WHERE status = :s", s=StepStatus.DONE.value) or 0

    def running_steps(self) -> list[int]:
        return [r["step"] for r in self.rows("SELECT step FROM train_steps WHERE status = :s",
                                             s=StepStatus.RUNNING.value)]

    def step_status(self, step: int) -> StepStatus | None:
        status = self.scalar("SELECT status FROM train_steps WHERE step = :s", s=step)
        return StepStatus(status) if status else None

    def last_shard_id(self) -> int:
        return self._last_id("shards")

    def open_shards(self) -> list[ShardRow]:
        """Shards QUEUED or TAKEN: a step was in flight when the daemon stopped."""
        return [ShardRow(r["id"], r["step"], r["shard"], r["path"], ShardStatus(r["status"]))
                for r in self.rows("SELECT id, step, shard, path, status FROM shards WHERE status IN (:q, :t)",
                                   q=ShardStatus.QUEUED.value, t=ShardStatus.TAKEN.value)]

    def weight_version(self, version: int | None = None) -> VersionRow | None:
        """A published version's row; None: the last one."""
        rows = self.rows("SELECT version, location, handle FROM weight_versions WHERE :v IS NULL OR version = :v "
                         "ORDER BY version DESC LIMIT 1", v=version)
        if not rows:
            return None
        handle = rows[0]["handle"]
        if isinstance(handle, str):  # raw SQL hands JSON columns back as text
            handle = json.loads(handle)
        return VersionRow(rows[0]["version"], rows[0]["location"], handle)
