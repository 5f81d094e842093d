"""The run ledger as the coordinator writes it: one named method per kind of fact, the tables and columns here.

Statuses (and a cell's role) change only through LedgerWriter.transition, checked against their state machines:
the methods below that write one (a new cell, a role change, an agent's registration) go through it too. Every
method only queues its rows; they are committed with the writer's next flush, as before, so a caller's commit
points are its own (`flush()`).
"""

from __future__ import annotations

from typing import Any

from gyre_slurm.ledger.reads import LedgerReads
from gyre_slurm.ledger.store import table
from gyre_slurm.roles import Role
from gyre_slurm.statuses import AGENT, ROLE, AgentStatus


def _transport(handle: list[dict[str, Any]] | None) -> dict[str, Any]:
    """weight_versions columns for how receivers get a version."""
    if handle is None:
        return {"transport": "file"}  # handle stays SQL NULL (a JSON column would store None as 'null')
    return {"transport": "mooncake", "handle": handle}


class Ledger(LedgerReads):
    """The daemon's ledger: LedgerWriter's batching, the readers of reads.py, and the writes below."""

    # --- run ------------------------------------------------------------------------------------------------
    def degraded_reason(self, run_id: str, reason: str | None) -> None:
        """Why a run that stays DEGRADED is (a status change writes it with the transition)."""
        self.update("runs", {"id": run_id}, degraded_reason=reason)

    # --- cells and agents -----------------------------------------------------------------------------------
    def cell_created(self, cell_id: int, is_core: bool, n_nodes: int, now: float) -> None:
        """A new cell, DOWN until its agents register, and its first span."""
        self.transition(ROLE, {"id": cell_id}, None, Role.DOWN, f"cell {cell_id}", is_core=is_core,
                        target_role=None, n_nodes=n_nodes, last_heartbeat=None, updated_at=now, pinned=False,
                        slurm_job_id=None, slurm_state=None)
        self._open_span(cell_id, Role.DOWN, now)

    def role_changed(self, cell_id: int, src: Role, dst: Role, now: float, target: Role | None = None) -> None:
        """A cell's new role (`target`: where a SWITCHING cell goes): its open span ends, one in `dst` begins."""
        self.transition(ROLE, {"id": cell_id}, src, dst, f"cell {cell_id}",
                        target_role=target.value if target else None, updated_at=now)
        self.spans_ended(cell_id, now)
        self._open_span(cell_id, dst, now)

    def _open_span(self, cell_id: int, role: Role, now: float) -> None:
        self.insert("cell_spans", cell_id=cell_id, role=role.value, started_at=now, ended_at=None)

    def spans_ended(self, cell_id: int, now: float) -> None:
        """The cell's open span ends (a role change, or the run stopping)."""
        self.update("cell_spans", {"cell_id": cell_id, "ended_at": None}, ended_at=now)

    def cell_job(self, cell_id: int, state: str, now: float, job: str | None = None) -> None:
        """The state of the cell's Slurm job as Slurm last said (with `job`: a new job of the cell)."""
        values: dict[str, Any] = {"slurm_job_id": job} if job is not None else {}
        self.update("cells", {"id": cell_id}, **values, slurm_state=state, updated_at=now)

    def cell_pinned(self, cell_id: int, pinned: bool, now: float) -> None:
        self.update("cells", {"id": cell_id}, pinned=pinned, updated_at=now)

    def agent_registered(self, node_index: int, prev: AgentStatus | None, *, cell_id: int, node_name: str, host: str,
                         pid: int, slurm_job_id: str | None, role: Role, now: float) -> None:
        """An agent UP (again: `prev` is its status in the ledger, None for a new one), counting registrations."""
        values: dict[str, Any] = dict(cell_id=cell_id, node_name=node_name, host=host, pid=pid,
                                      slurm_job_id=slurm_job_id, role=role.value, last_heartbeat=now)
        if prev is None:
            values.update(registered_at=now, registrations=1)
        else:
            values.update(registrations=table("agents").c.registrations + 1)
        self.transition(AGENT, {"node_index": node_index}, prev, AgentStatus.UP, f"agent of node {node_index}",
                        **values)

    def heartbeat(self, node_index: int, cell_id: int, now: float, rss_mb: float | None) -> None:
        self.update("agents", {"node_index": node_index}, last_heartbeat=now, rss_mb=rss_mb)
        self.update("cells", {"id": cell_id}, last_heartbeat=now)

    def agent_role(self, node_index: int, role: Role) -> None:
        """The role a node reported after a switch (the cell's follows once all its nodes did)."""
        self.update("agents", {"node_index": node_index}, role=role.value)

    # --- tasks, rollouts, model calls -----------------------------------------------------------------------
    def task(self, task_id: int, suite: str, key: str, spec: dict[str, Any], split: str) -> None:
        """A task of the run's suites (once: a resumed run adds only those not there yet)."""
        self.insert_ignore("tasks", id=task_id, suite=suite, key=key, spec=spec, split=split)

    def rollout_cell(self, rollout_id: int, cell: int | None) -> None:
        """A running rollout continues on another cell."""
        self.update("rollouts", {"id": rollout_id}, cell_id=cell)

    def advantage(self, rollout_id: int, advantage: float) -> None:
        self.update("rollouts", {"id": rollout_id}, advantage=advantage)

    def call_recorded(self, rollout_id: int, call_index: int, *, cell: int | None, weight_version: int | None,
                      api: str, branch_reason: str | None, prompt_tokens: int, reused_tokens: int,
                      completion_tokens: int, finish_reason: str | None, started_at: float, latency_s: float,
                      segment: tuple[int, int], counters: tuple[int, int, int]) -> None:
        """A model call's row (once: a replay is ignored), its payload at `segment` (offset, length) in the segment
        file, and its run's counters after it (n_calls, prompt and completion tokens: the last value counts)."""
        self.insert_ignore(
            "model_calls", rollout_id=rollout_id, call_index=call_index, cell_id=cell, weight_version=weight_version,
            tree_node_key=None, api=api, branch_reason=branch_reason, prompt_tokens=prompt_tokens,
            reused_tokens=reused_tokens, completion_tokens=completion_tokens, finish_reason=finish_reason,
            started_at=started_at, latency_s=latency_s, segment_offset=segment[0], segment_length=segment[1])
        self.set("rollouts", {"id": rollout_id}, n_calls=counters[0], prompt_tokens=counters[1],
                 completion_tokens=counters[2], version_end=weight_version)

    # --- training steps and weights -------------------------------------------------------------------------
    def step_sealed(self, step: int, n_groups: int, n_runs: int, tokens: int, reward_mean: float) -> None:
        """The figures of a step's data, once its last group is in."""
        self.update("train_steps", {"step": step}, n_groups=n_groups, n_runs=n_runs, tokens_trained=tokens,
                    reward_mean=reward_mean)

    def version_published(self, version: int, step: int | None, location: str, now: float,
                          handle: list[dict[str, Any]] | None = None) -> None:
        self.insert("weight_versions", version=version, step=step, created_at=now, published_at=now,
                    location=location, **_transport(handle))

    def version_handle(self, version: int, handle: list[dict[str, Any]] | None) -> None:
        """How receivers get a version, once the core has published it (the base model, after a restart)."""
        self.update("weight_versions", {"version": version}, **_transport(handle))

    def weight_transfer(self, now: float, version: int, cell: int, receiver: str, transport: str, nbytes: int,
                        seconds: float, ok: bool, error: str | None, sender_rank: int | None = None) -> None:
        self.insert("weight_transfers", ts=now, version=version, cell=cell, receiver=receiver, transport=transport,
                    bytes=nbytes, seconds=seconds, gib_s=nbytes / seconds / 2**30 if seconds > 0 else 0.0, ok=ok,
                    error=error, sender_rank=sender_rank)

    # --- the scheduler --------------------------------------------------------------------------------------
    def policy_decision(self, now: float, *, policy: str, kind: str, cells: list[int] | None, role: Role | None,
                        groups: int | None, reason: str, watermark: int, capacity: int, queued: int, running: int,
                        groups_ready: int, groups_open: int, version: int, roles: str) -> None:
        """A decision of the scheduling policy with the numbers it was made on (v_policy_decisions)."""
        self.insert("policy_decisions", ts=now, policy=policy, kind=kind, cells=cells,
                    role=role.value if role is not None else None, groups=groups, reason=reason, watermark=watermark,
                    capacity=capacity, queued=queued, running=running, groups_ready=groups_ready,
                    groups_open=groups_open, version=version, roles=roles)
