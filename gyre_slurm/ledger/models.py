"""SQLAlchemy 2 models of the run ledger (one SQLite file per run, written only by the daemon).

Times are REAL seconds since the Unix epoch (UTC), so durations are plain subtraction in SQL; the views in
views.sql add readable timestamps. Rows that peers may resend after a crash carry a natural unique key, so a
replay is an idempotent INSERT OR IGNORE, never a duplicate. Every status and role column has a CHECK constraint
made from its Enum in statuses.py, so a row with an unknown status cannot exist.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from gyre_slurm.roles import TARGET_ROLES
from gyre_slurm.statuses import (
    AGENT,
    EVAL,
    GROUP,
    ROLE,
    ROLLOUT,
    RUN,
    SHARD,
    STEP,
    SWITCH,
    Severity,
    StateMachine,
)


class Base(DeclarativeBase):
    pass


# 2: CHECK constraints on statuses; model_calls.tree_node_key; no microbatches table
# 3: cells.pinned; policy_decisions; microbatches (the shards of each step and who computed them)
# 4: weight_transfers, weight_versions.handle; cells.slurm_job_id / slurm_state (cells as Slurm jobs); runs DEGRADED
# 5: evals; rollouts.kind / eval_id (group_id null for evaluation runs); tasks.split
# 6: microbatches is shards (a step's shard; a micro-batch is the trainer's forward-pass pack), v_shards
# 7: weight_transfers.sender_rank (versions published slice by slice: one row per receiver and sending rank)
SCHEMA_VERSION = 7


def _check(machine: StateMachine, column: str, table: str, nullable: bool = False) -> CheckConstraint:
    return CheckConstraint(machine.sql_check(column, nullable), name=f"ck_{table}_{column}")


def _check_in(values: list[str], column: str, table: str, nullable: bool = False) -> CheckConstraint:
    body = f"{column} IN ({', '.join(repr(v) for v in values)})"
    return CheckConstraint(f"{column} IS NULL OR {body}" if nullable else body, name=f"ck_{table}_{column}")


class Meta(Base):
    """Key/value facts about the ledger itself (schema version, run token hash…)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String, primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String, primary_key=True)
    name: Mapped[str] = mapped_column(String)
    status: Mapped[str] = mapped_column(String)  # RunStatus: RUNNING, STOPPED, FAILED
    policy: Mapped[str] = mapped_column(String)
    config: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    daemon_starts: Mapped[int] = mapped_column(Integer, default=1)  # > 1 after restarts from the ledger
    slurm_job_id: Mapped[str | None] = mapped_column(String)
    degraded_reason: Mapped[str | None] = mapped_column(Text)  # while DEGRADED: why (scheduler/health.py)
    __table_args__ = (_check(RUN, "status", "runs"),)


class Cell(Base):
    __tablename__ = "cells"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # cell index, 0 = core
    is_core: Mapped[bool] = mapped_column(Boolean)
    role: Mapped[str] = mapped_column(String)  # ROLLOUT, TRAIN, SWITCHING, DOWN
    target_role: Mapped[str | None] = mapped_column(String)  # while SWITCHING
    n_nodes: Mapped[int] = mapped_column(Integer)
    last_heartbeat: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default="0")  # by hand: no policy moves it
    slurm_job_id: Mapped[str | None] = mapped_column(String)  # the cell's own Slurm job (gyre submit), if any
    slurm_state: Mapped[str | None] = mapped_column(String)  # that job's state as Slurm last said (PENDING, …)
    __table_args__ = (_check(ROLE, "role", "cells"),
                      _check_in(sorted(r.value for r in TARGET_ROLES), "target_role", "cells", nullable=True))


class CellSpan(Base):
    """One interval of one cell in one role (open while ended_at is null): time-per-role comes from here."""

    __tablename__ = "cell_spans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cell_id: Mapped[int] = mapped_column(ForeignKey("cells.id"), index=True)
    role: Mapped[str] = mapped_column(String)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    __table_args__ = (_check(ROLE, "role", "cell_spans"),)


class Agent(Base):
    __tablename__ = "agents"
    node_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    cell_id: Mapped[int] = mapped_column(ForeignKey("cells.id"), index=True)
    node_name: Mapped[str] = mapped_column(String)
    host: Mapped[str] = mapped_column(String)
    pid: Mapped[int] = mapped_column(Integer)
    slurm_job_id: Mapped[str | None] = mapped_column(String)
    status: Mapped[str] = mapped_column(String)  # AgentStatus: UP, LOST, STOPPED
    role: Mapped[str] = mapped_column(String)
    registered_at: Mapped[float] = mapped_column(Float)
    registrations: Mapped[int] = mapped_column(Integer, default=1)
    last_heartbeat: Mapped[float | None] = mapped_column(Float)
    rss_mb: Mapped[float | None] = mapped_column(Float)
    __table_args__ = (_check(AGENT, "status", "agents"), _check(ROLE, "role", "agents"))


class RoleSwitch(Base):
    __tablename__ = "role_switches"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    cell_id: Mapped[int] = mapped_column(ForeignKey("cells.id"), index=True)
    from_role: Mapped[str] = mapped_column(String)
    to_role: Mapped[str] = mapped_column(String)
    reason: Mapped[str] = mapped_column(String)  # manual, scheduler, ...
    status: Mapped[str] = mapped_column(String)  # SwitchStatus: PENDING, DONE, FAILED
    requested_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)  # first node began switching
    ended_at: Mapped[float | None] = mapped_column(Float)  # last node finished
    duration_s: Mapped[float | None] = mapped_column(Float)  # requested_at → ended_at
    error: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (_check(SWITCH, "status", "role_switches"), _check(ROLE, "from_role", "role_switches"),
                      _check_in(sorted(r.value for r in TARGET_ROLES), "to_role", "role_switches"))


class Task(Base):
    __tablename__ = "tasks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    suite: Mapped[str] = mapped_column(String)
    key: Mapped[str] = mapped_column(String)
    spec: Mapped[dict] = mapped_column(JSON)
    split: Mapped[str] = mapped_column(String, default="train", server_default="train")  # train, eval
    __table_args__ = (UniqueConstraint("suite", "key"), _check_in(["train", "eval"], "split", "tasks"))


class Group(Base):
    __tablename__ = "groups"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"), index=True)
    status: Mapped[str] = mapped_column(String)  # GroupStatus: ADMITTED → READY | DROPPED; READY → TRAINED
    size: Mapped[int] = mapped_column(Integer)
    admitted_version: Mapped[int] = mapped_column(Integer)
    train_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    ready_at: Mapped[float | None] = mapped_column(Float)
    n_valid: Mapped[int | None] = mapped_column(Integer)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    drop_reason: Mapped[str | None] = mapped_column(String)
    __table_args__ = (_check(GROUP, "status", "groups"),)


class Eval(Base):
    """One evaluation of one policy version on the held-out tasks: `samples` runs per task, never trained on.
    The figures are written when its last run ends (scoring/pass_at_k.py); runs that ended in an error are
    excluded from them, as from training."""

    __tablename__ = "evals"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, index=True)
    step: Mapped[int | None] = mapped_column(Integer)  # the step that published the version (null: version 0)
    reason: Mapped[str] = mapped_column(String)  # start, every_steps, end, manual
    status: Mapped[str] = mapped_column(String)  # EvalStatus: RUNNING → DONE
    samples: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float | None] = mapped_column(Float)
    pass_score: Mapped[float] = mapped_column(Float)
    n_tasks: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    n_runs: Mapped[int | None] = mapped_column(Integer)  # runs that were scored
    n_excluded: Mapped[int | None] = mapped_column(Integer)  # evaluator or infrastructure errors
    pass_at_1: Mapped[float | None] = mapped_column(Float)
    pass_at_k: Mapped[float | None] = mapped_column(Float)
    k: Mapped[int | None] = mapped_column(Integer)
    score_mean: Mapped[float | None] = mapped_column(Float)
    timeout_share: Mapped[float | None] = mapped_column(Float)  # scored runs that hit the harness time limit
    mixed_versions: Mapped[int | None] = mapped_column(Integer)  # runs with a call served by a later version
    __table_args__ = (_check(EVAL, "status", "evals"),
                      _check_in(["start", "every_steps", "end", "manual"], "reason", "evals"))


class Rollout(Base):
    __tablename__ = "rollouts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String, default="train", server_default="train")  # train, eval
    group_id: Mapped[int | None] = mapped_column(ForeignKey("groups.id"), index=True)  # training runs only
    eval_id: Mapped[int | None] = mapped_column(ForeignKey("evals.id"), index=True)  # evaluation runs only
    task_id: Mapped[int] = mapped_column(ForeignKey("tasks.id"))
    # RolloutStatus: QUEUED, RUNNING, then terminal: COMPLETED, TIMEOUT_SCORED, TRUNCATED_CONTEXT, EVAL_ERROR,
    # INFRA_ERROR
    status: Mapped[str] = mapped_column(String, index=True)
    cell_id: Mapped[int | None] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String)
    queued_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    version_start: Mapped[int | None] = mapped_column(Integer)
    version_end: Mapped[int | None] = mapped_column(Integer)
    n_calls: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reward: Mapped[float | None] = mapped_column(Float)
    advantage: Mapped[float | None] = mapped_column(Float)
    workspace: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    # an evaluation run never belongs to a group, so it can never be trained
    __table_args__ = (_check(ROLLOUT, "status", "rollouts"),
                      CheckConstraint("(kind = 'train' AND group_id IS NOT NULL AND eval_id IS NULL) OR "
                                      "(kind = 'eval' AND group_id IS NULL AND eval_id IS NOT NULL "
                                      "AND advantage IS NULL)", name="ck_rollouts_kind"))


class ModelCall(Base):
    __tablename__ = "model_calls"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"))
    call_index: Mapped[int] = mapped_column(Integer)  # per rollout, assigned by the proxy: the replay key
    cell_id: Mapped[int | None] = mapped_column(Integer)
    weight_version: Mapped[int | None] = mapped_column(Integer)
    # the tree node (tree_nodes.node_key of this rollout) where the call's output ends; set when the rollout ends
    tree_node_key: Mapped[int | None] = mapped_column(Integer)
    api: Mapped[str] = mapped_column(String)  # openai-chat, openai-completions, anthropic-messages
    branch_reason: Mapped[str | None] = mapped_column(String)  # why this call started a new branch, if it did
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    reused_tokens: Mapped[int] = mapped_column(Integer, default=0)  # prompt ids taken from earlier calls
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String)
    started_at: Mapped[float] = mapped_column(Float)
    latency_s: Mapped[float] = mapped_column(Float)
    segment_offset: Mapped[int | None] = mapped_column(Integer)  # payload (ids, log-probs) in segments/calls.seg
    segment_length: Mapped[int | None] = mapped_column(Integer)
    __table_args__ = (
        UniqueConstraint("rollout_id", "call_index"),
        Index("ix_model_calls_started_at", "started_at"),
    )


class TreeNode(Base):
    __tablename__ = "tree_nodes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id"), index=True)
    node_key: Mapped[int] = mapped_column(Integer)  # per rollout, assigned by the proxy: the replay key
    parent_key: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String)  # main, main_summary, subagent, subagent_summary
    n_tokens: Mapped[int] = mapped_column(Integer)
    n_trainable: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String)
    commit_seq: Mapped[int] = mapped_column(Integer)  # the ids stay in the calls' records in segments/calls.seg
    __table_args__ = (UniqueConstraint("rollout_id", "node_key"),)


class TrainStep(Base):
    __tablename__ = "train_steps"
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    policy: Mapped[str] = mapped_column(String)
    version_in: Mapped[int] = mapped_column(Integer)
    version_out: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String)  # StepStatus: RUNNING, DONE, FAILED
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    n_groups: Mapped[int] = mapped_column(Integer, default=0)
    n_runs: Mapped[int] = mapped_column(Integer, default=0)
    n_cells: Mapped[int] = mapped_column(Integer, default=0)
    tokens_trained: Mapped[int] = mapped_column(Integer, default=0)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    rollout_s: Mapped[float | None] = mapped_column(Float)  # first admission of its groups → last run terminal
    train_s: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict | None] = mapped_column(JSON)
    __table_args__ = (_check(STEP, "status", "train_steps"),)


class Shard(Base):
    """One shard of a training step (whole runs): queued by the daemon, taken by a training cell, DONE once the
    core added its gradient. A step re-run after a daemon restart gets new rows (the old ones are FAILED)."""

    __tablename__ = "shards"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, index=True)
    shard: Mapped[int] = mapped_column(Integer)  # index within the step (train/shards.py)
    path: Mapped[str] = mapped_column(Text)  # the shard's batch file
    n_runs: Mapped[int] = mapped_column(Integer)  # runs with targets
    tokens: Mapped[int] = mapped_column(Integer)  # targets (trained tokens)
    status: Mapped[str] = mapped_column(String)  # ShardStatus: QUEUED → TAKEN → DONE | FAILED
    cell_id: Mapped[int | None] = mapped_column(Integer)  # the cell that holds it (TAKEN) or held it last
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # times taken (> 1: redone after a cell left)
    queued_at: Mapped[float] = mapped_column(Float)
    taken_at: Mapped[float | None] = mapped_column(Float)  # the last take
    done_at: Mapped[float | None] = mapped_column(Float)
    done_by: Mapped[int | None] = mapped_column(Integer)  # the cell whose gradient the core added
    __table_args__ = (_check(SHARD, "status", "shards"),)


class WeightVersion(Base):
    __tablename__ = "weight_versions"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    published_at: Mapped[float | None] = mapped_column(Float)
    location: Mapped[str | None] = mapped_column(Text)  # the snapshot folder (always written)
    transport: Mapped[str | None] = mapped_column(String)  # how receivers get it: file, mooncake
    handle: Mapped[list | None] = mapped_column(JSON)  # mooncake: the version's parts (WeightsHandles: peer, layout)


class WeightTransfer(Base):
    """One receiver's transfer of one version: a rollout engine loading it, a satellite joining a step."""

    __tablename__ = "weight_transfers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    version: Mapped[int] = mapped_column(Integer, index=True)
    cell: Mapped[int] = mapped_column(Integer)
    receiver: Mapped[str] = mapped_column(String)  # engine:<cell>, satellite:<cell>
    transport: Mapped[str] = mapped_column(String)  # mooncake, file, nccl, remote_instance
    bytes: Mapped[int] = mapped_column(Integer)
    seconds: Mapped[float] = mapped_column(Float)
    gib_s: Mapped[float] = mapped_column(Float)
    ok: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)
    sender_rank: Mapped[int | None] = mapped_column(Integer)  # the core's rank whose part this was (sliced versions)


class PolicyDecision(Base):
    """Every decision of the scheduling policy that changed something, with the numbers it was made on."""

    __tablename__ = "policy_decisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    policy: Mapped[str] = mapped_column(String)
    kind: Mapped[str] = mapped_column(String)  # admit, switch, train, finish
    cells: Mapped[list | None] = mapped_column(JSON)  # the cells moved or training
    role: Mapped[str | None] = mapped_column(String)  # a switch's target
    groups: Mapped[int | None] = mapped_column(Integer)  # admitted or trained
    reason: Mapped[str] = mapped_column(Text)
    watermark: Mapped[int] = mapped_column(Integer)  # W = queued + running rollouts
    capacity: Mapped[int] = mapped_column(Integer)  # runs the ROLLOUT cells can serve at once: |R|·k
    queued: Mapped[int] = mapped_column(Integer)
    running: Mapped[int] = mapped_column(Integer)
    groups_ready: Mapped[int] = mapped_column(Integer)
    groups_open: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)
    roles: Mapped[str] = mapped_column(String)  # every cell's role when it was decided, e.g. "R T S>T R"
    __table_args__ = (_check_in(["admit", "switch", "train", "finish"], "kind", "policy_decisions"),
                      _check_in(sorted(r.value for r in TARGET_ROLES), "role", "policy_decisions", nullable=True))


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    kind: Mapped[str] = mapped_column(String, index=True)
    severity: Mapped[str] = mapped_column(String)  # Severity: info, warning, error
    cell_id: Mapped[int | None] = mapped_column(Integer)
    node_index: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)
    __table_args__ = (_check_in([s.value for s in Severity], "severity", "events"),)


# The column each state machine governs: LedgerWriter.transition writes these, and nothing else does.
STATUS_COLUMNS: dict[StateMachine, tuple[str, str]] = {
    RUN: ("runs", "status"), AGENT: ("agents", "status"), SWITCH: ("role_switches", "status"),
    GROUP: ("groups", "status"), ROLLOUT: ("rollouts", "status"), STEP: ("train_steps", "status"),
    SHARD: ("shards", "status"), EVAL: ("evals", "status"), ROLE: ("cells", "role"),
}
