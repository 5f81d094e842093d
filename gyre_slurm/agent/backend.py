"""What a node runs in each role. A role switch is `leave(old)` then `enter(new)` on the node's backend.

Backends: the control-plane backend below (the cell holds no engine or trainer: used until the engine and
trainer backends are attached, and by tests of the control plane), later the SGLang / embedded engine for
ROLLOUT and the torch / Megatron trainer for TRAIN.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from gyre_slurm.roles import Role


class RoleBackend(Protocol):
    def enter(self, role: Role) -> None: ...

    def leave(self, role: Role) -> None: ...


class ControlPlaneBackend:
    """Holds no engine or trainer; keeps the history of roles so a node can say what it did and when."""

    def __init__(self) -> None:
        self.history: list[tuple[float, str, Role]] = []

    def enter(self, role: Role) -> None:
        self.history.append((time.time(), "enter", role))

    def leave(self, role: Role) -> None:
        self.history.append((time.time(), "leave", role))


def backend_for(run_dir: Path) -> RoleBackend:
    return ControlPlaneBackend()
