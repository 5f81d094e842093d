"""Cell roles and the one table of allowed transitions, shared by the daemon and the node agents."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What a cell is doing. SWITCHING and DOWN are states, never the target of a switch."""

    ROLLOUT = "ROLLOUT"
    TRAIN = "TRAIN"
    SWITCHING = "SWITCHING"
    DOWN = "DOWN"

    def __str__(self) -> str:
        return self.value


TARGET_ROLES = frozenset({Role.ROLLOUT, Role.TRAIN})

# A role switch always passes through SWITCHING; DOWN is entered on lost heartbeats from any state and left
# when the cell's agents register again (with whatever role they report).
TRANSITIONS: dict[Role, frozenset[Role]] = {
    Role.ROLLOUT: frozenset({Role.SWITCHING, Role.DOWN}),
    Role.TRAIN: frozenset({Role.SWITCHING, Role.DOWN}),
    Role.SWITCHING: frozenset({Role.ROLLOUT, Role.TRAIN, Role.DOWN}),
    Role.DOWN: frozenset({Role.ROLLOUT, Role.TRAIN, Role.SWITCHING}),
}
