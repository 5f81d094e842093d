"""Errors a user can act on. The CLI prints these as one line (`error: ...`) and exits non-zero."""

from __future__ import annotations

import errno
import sqlite3


class GyreError(Exception):
    """Base class: the message is shown to the user as it is."""


class ConfigError(GyreError):
    """The run config is invalid (unknown key, wrong type, bad value, missing file)."""


class ProtocolError(GyreError):
    """A ZeroMQ message could not be decoded or validated."""


class ControlError(GyreError):
    """The daemon refused a request, or could not be reached."""


class TrainerRanksLost(GyreError):
    """A rank of a multi-rank cell's trainer exited: the cell starts its ranks again and the step is run again."""


class RunNotFound(GyreError):
    """No run with that id under the state folder."""


class ReadOnlyError(GyreError):
    """A write was attempted through a read-only ledger connection."""


class IllegalTransition(GyreError):
    """A status change that its state machine (statuses.py) does not allow; nothing was written."""

    def __init__(self, machine: str, subject: str, src: str | None, dst: str) -> None:
        self.machine, self.subject, self.src, self.dst = machine, subject, src, dst
        start = "a new row" if src is None else src
        super().__init__(f"illegal {machine} transition for {subject}: {start} → {dst}")


class DiskFull(GyreError):
    """A write found no space left on the device (ENOSPC, EDQUOT, SQLITE_FULL); nothing of it was kept: the
    ledger keeps the rows queued, a segment file is cut back to its last whole record."""


DISK_FULL = "disk full: "  # how a peer's report of a write that found no space begins (a training step's)


def disk_full(e: BaseException) -> bool:
    """Whether an error is the disk (or a quota) being full: SQLite's SQLITE_FULL, or ENOSPC/EDQUOT."""
    orig = getattr(e, "orig", e)  # SQLAlchemy wraps the driver's error
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(orig)
    return isinstance(orig, DiskFull) or (isinstance(orig, OSError) and orig.errno in (errno.ENOSPC, errno.EDQUOT))
