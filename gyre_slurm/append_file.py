"""A file appended to in whole records (the segment file, a proxy's journal).

A write that does not fit (a full disk) may leave part of its record in the file; a later write that fits would
then follow a torn record, and a reader stops at the tear, losing every whole record after it. So a failed write is
cut off again at once: the file is always whole records, and the writer gets DiskFull (or the OSError) with nothing
of the record kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gyre_slurm.errors import DiskFull, disk_full


class AppendFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "ab")  # noqa: SIM115 - held for the writer's lifetime

    def append(self, data: bytes) -> int:
        """Write one record and flush it to the OS; its offset."""
        offset = self._f.tell()
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as e:
            self.cut(offset)
            if disk_full(e):
                raise DiskFull(f"{self.path} cannot grow: {e.strerror}") from e
            raise
        return offset

    def cut(self, offset: int) -> None:
        """Cut the file back to `offset`, the start of the record just written. A new handle: the old one's buffer
        may still hold the bytes that did not fit, and would write them with its next flush."""
        with contextlib.suppress(OSError):
            self._f.close()  # its flush fails again on a full disk: the bytes it drops are the ones cut here
        os.truncate(self.path, offset)
        self._f = open(self.path, "ab")  # noqa: SIM115

    def tell(self) -> int:
        return self._f.tell()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
