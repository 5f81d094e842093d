"""Every status the ledger keeps, as an Enum with one table of allowed transitions beside it.

The daemon changes a status only through `StateMachine.check` (an illegal transition raises IllegalTransition
before anything is written; the daemon logs it as an `events` row and carries on), and the ledger's status
columns carry CHECK constraints made from the same Enums (`sql_check`), so a row with an unknown status cannot
exist even when written with plain sqlite3. Cell roles follow the same rules (roles.py holds their table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from gyre_slurm.errors import IllegalTransition
from gyre_slurm.roles import TRANSITIONS as ROLE_TRANSITIONS
from gyre_slurm.roles import Role

S = TypeVar("S", bound=Enum)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per machine
class StateMachine(Generic[S]):
    """`initial`: the statuses a new row may be written with; `transitions[s]`: where a row in s may go next
    (a status listed in its own set may be written again, e.g. a run resumed after a crash is RUNNING again)."""

    name: str
    states: type[S]
    initial: frozenset[S]
    transitions: Mapping[S, frozenset[S]]

    def __post_init__(self) -> None:
        missing = set(self.states) - set(self.transitions)
        if missing:  # a table that forgets a state would make every write from it illegal
            raise ValueError(f"{self.name}: no transitions listed for {sorted(s.value for s in missing)}")

    def allowed(self, src: S | None, dst: S) -> bool:
        return dst in (self.initial if src is None else self.transitions[src])

    def check(self, src: S | None, dst: S, subject: str) -> S:
        """Return dst if `subject` may go from src (None: a new row) to dst, else raise IllegalTransition."""
        if not isinstance(dst, self.states) or (src is not None and not isinstance(src, self.states)):
            raise IllegalTransition(self.name, subject, getattr(src, "value", src), getattr(dst, "value", dst))
        if not self.allowed(src, dst):
            raise IllegalTransition(self.name, subject, None if src is None else src.value, dst.value)
        return dst

    @property
    def terminal(self) -> frozenset[S]:
        return frozenset(s for s, nxt in self.transitions.items() if not nxt)

    def values(self) -> tuple[str, ...]:
        return tuple(s.value for s in self.states)

    def sql_check(self, column: str, nullable: bool = False) -> str:
        """A CHECK constraint body that admits exactly this machine's statuses."""
        body = f"{column} IN ({', '.join(repr(v) for v in self.values())})"
        return f"{column} IS NULL OR {body}" if nullable else body


class StatusEnum(str, Enum):
    """A status is its string in the ledger, in messages and in f-strings."""

    def __str__(self) -> str:
        return self.value


def _machine(name: str, states: type[S], initial: set[S], table: dict[S, set[S]]) -> StateMachine[S]:
    return StateMachine(name, states, frozenset(initial), {s: frozenset(table.get(s, ())) for s in states})


class RunStatus(StatusEnum):
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"  # the daemon stopped cleanly (steps done, wall-clock limit, scancel, gyre CLI)
    FAILED = "FAILED"  # the daemon gave up (e.g. a training step failed)
    DEGRADED = "DEGRADED"  # failing (scheduler/health.py): admits nothing but a probe group now and then


RUN = _machine("run", RunStatus, {RunStatus.RUNNING}, {
    # resumed from the ledger: after a clean stop, a failure, or a kill -9 that never wrote STOPPED
    RunStatus.RUNNING: {RunStatus.RUNNING, RunStatus.STOPPED, RunStatus.FAILED, RunStatus.DEGRADED},
    RunStatus.DEGRADED: {RunStatus.RUNNING, RunStatus.STOPPED, RunStatus.FAILED},
    RunStatus.STOPPED: {RunStatus.RUNNING},
    RunStatus.FAILED: {RunStatus.RUNNING},
})


class AgentStatus(StatusEnum):
    UP = "UP"
    LOST = "LOST"  # silent for control.heartbeat_timeout_s
    STOPPED = "STOPPED"  # the daemon stopped (it told the agent to stop)


AGENT = _machine("agent", AgentStatus, {AgentStatus.UP}, {
    AgentStatus.UP: {AgentStatus.UP, AgentStatus.LOST, AgentStatus.STOPPED},  # UP again: a restarted agent
    AgentStatus.LOST: {AgentStatus.UP},
    AgentStatus.STOPPED: {AgentStatus.UP},  # the run was resumed
})


class SwitchStatus(StatusEnum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


SWITCH = _machine("role switch", SwitchStatus, {SwitchStatus.PENDING}, {
    SwitchStatus.PENDING: {SwitchStatus.DONE, SwitchStatus.FAILED},
})


class GroupStatus(StatusEnum):
    ADMITTED = "ADMITTED"  # some of its runs are not terminal yet
    READY = "READY"  # every run terminal, advantages computed, waiting for a training step
    DROPPED = "DROPPED"  # too few valid runs or zero variance: refilled by another group
    TRAINED = "TRAINED"


GROUP = _machine("group", GroupStatus, {GroupStatus.ADMITTED}, {
    GroupStatus.ADMITTED: {GroupStatus.READY, GroupStatus.DROPPED},
    GroupStatus.READY: {GroupStatus.TRAINED},
})


class RolloutStatus(StatusEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # the harness exited 0; scored from its workspace
    TIMEOUT_SCORED = "TIMEOUT_SCORED"  # killed at its time limit; scored from its workspace
    TRUNCATED_CONTEXT = "TRUNCATED_CONTEXT"  # a reply hit a length limit (context, CLI output cap); scored or excluded
    EVAL_ERROR = "EVAL_ERROR"  # the evaluator failed: excluded, never scored 0
    INFRA_ERROR = "INFRA_ERROR"  # the harness crashed, a key was refused, or its worker vanished: excluded


ROLLOUT_TERMINAL = frozenset(RolloutStatus) - {RolloutStatus.QUEUED, RolloutStatus.RUNNING}
ROLLOUT = _machine("rollout", RolloutStatus, {RolloutStatus.QUEUED}, {
    RolloutStatus.QUEUED: {RolloutStatus.RUNNING},
    RolloutStatus.RUNNING: set(ROLLOUT_TERMINAL),
})


class StepStatus(StatusEnum):
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"  # the trainer failed, or the daemon died during the step (it is run again)


STEP = _machine("training step", StepStatus, {StepStatus.RUNNING}, {
    StepStatus.RUNNING: {StepStatus.DONE, StepStatus.FAILED},
    StepStatus.FAILED: {StepStatus.RUNNING},  # retried from its groups after a daemon restart
})


class ShardStatus(StatusEnum):
    QUEUED = "QUEUED"  # waiting for a training cell
    TAKEN = "TAKEN"  # a training cell (cell_id) computes its gradient
    DONE = "DONE"  # the core added its gradient (done_by: the cell that computed it)
    FAILED = "FAILED"  # its step failed, or the daemon died during it (the step is run again with new shards)


SHARD = _machine("shard", ShardStatus, {ShardStatus.QUEUED}, {
    # QUEUED → DONE: a requeued shard whose first gradient reaches the core late, before anyone took it again
    ShardStatus.QUEUED: {ShardStatus.TAKEN, ShardStatus.DONE, ShardStatus.FAILED},
    # TAKEN → QUEUED: its cell died, left TRAIN or is being pulled back
    ShardStatus.TAKEN: {ShardStatus.QUEUED, ShardStatus.DONE, ShardStatus.FAILED},
})


class EvalStatus(StatusEnum):
    RUNNING = "RUNNING"  # its runs are queued or running
    DONE = "DONE"  # every run ended: the figures are in its row


# a run stopped during an evaluation leaves it RUNNING: the resumed daemon goes on with it
EVAL = _machine("evaluation", EvalStatus, {EvalStatus.RUNNING}, {
    EvalStatus.RUNNING: {EvalStatus.DONE},
    EvalStatus.DONE: set(),
})


class Severity(StatusEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


ROLE = _machine("cell role", Role, {Role.DOWN}, {r: set(nxt) for r, nxt in ROLE_TRANSITIONS.items()})

MACHINES: tuple[StateMachine, ...] = (RUN, AGENT, SWITCH, GROUP, ROLLOUT, STEP, SHARD, EVAL, ROLE)
