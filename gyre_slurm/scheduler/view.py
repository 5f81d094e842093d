"""What a scheduling policy sees (an immutable view of the run) and what it may decide.

The daemon builds a View from its state after every event; the simulator builds one from its own. Policies are
pure functions of it, so the daemon and the simulator run the very same rules, and a restarted daemon decides as
before.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.roles import Role


@dataclass(frozen=True)
class CellView:
    id: int
    role: Role  # ROLLOUT, TRAIN, SWITCHING, DOWN
    is_core: bool  # keeps the reference weights and the optimizer state: the step runs there
    running: int = 0  # agent runs placed on this cell
    target: Role | None = None  # where a SWITCHING cell is going
    pinned: bool = False  # set by hand (`gyre cells reassign`): no policy moves it


@dataclass(frozen=True)
class View:
    cells: tuple[CellView, ...]
    groups_per_step: int  # B
    groups_open: int = 0  # admitted, some runs not terminal yet
    groups_ready: int = 0  # all runs terminal, valid, waiting for a step
    groups_training: int = 0  # in the step in flight
    groups_trained: int = 0  # consumed by finished steps (with ready and training: the "accepted" of §5.1)
    queued: int = 0  # rollouts waiting for a slot
    running: int = 0  # rollouts running (training runs: the watermark)
    eval_running: int = 0  # evaluation runs queued or running (outside the watermark; coordinator/evals.py)
    runs_per_cell: int = 1  # k: concurrent runs one ROLLOUT cell serves
    runs_per_group: int = 1  # G: an admitted group adds this many runs to W
    training: bool = False  # a training step is in flight
    step_cells: tuple[int, ...] = ()  # the cells working on the step in flight
    steps_done: int = 0
    max_steps: int = 1
    version: int = 0  # v: the policy version rollouts are admitted at
    # the versions open and ready groups were admitted at, oldest first (the staleness gate on training)
    open_versions: tuple[int, ...] = ()
    ready_versions: tuple[int, ...] = ()  # ready and not in the step in flight
    # train.streaming: a step opens with its first ready group and takes the others as they become ready (up to B)
    streaming: bool = False

    @property
    def watermark(self) -> int:
        """W = queued + running rollouts (docs/algorithms.md §5.1)."""
        return self.queued + self.running

    def with_role(self, role: Role) -> list[int]:
        return [c.id for c in self.cells if c.role == role]

    def switching_to(self, role: Role) -> list[int]:
        return [c.id for c in self.cells if c.role == Role.SWITCHING and c.target == role]

    def movable(self, role: Role) -> list[CellView]:
        """Cells in `role` a policy may move: not pinned; the core first, then the least loaded."""
        return sorted((c for c in self.cells if c.role == role and not c.pinned),
                      key=lambda c: (not c.is_core, c.running, c.id))

    @property
    def core(self) -> CellView | None:
        return next((c for c in self.cells if c.is_core), None)


@dataclass(frozen=True)
class Admit:
    groups: int


@dataclass(frozen=True)
class Switch:
    cells: tuple[int, ...]
    role: Role
    reason: str = ""


@dataclass(frozen=True)
class Train:
    groups: int
    cells: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    reason: str


Decision = Admit | Switch | Train | Finish
