"""The proxy's append-only journal of call records: nothing the proxy recorded is lost before the daemon has it.

Every CallRecord is written (and flushed) to <run_dir>/proxy/journal-<proxy_id>.bin before it is sent; each
CallAck is appended when it arrives. Records without an ack are re-sent, also by the next proxy started with
the same id (the daemon ignores a replay of a (rollout_id, call_index) it already has). Entries are msgpack
maps, one after another:

  {"k": "rec", "rec": <CallRecord.wire_body(): ids packed>, "st": <TITO state of the call or None>, "acked": bool}
  {"k": "ack", "r": rollout_id, "c": call_index, "open": bool}
  {"k": "closed", "r": rollout_id}

Records carry only what each call added (CallRecord.parent_call); "st" is the call's delta to the rollout's
conversations (proxy/conversations.py). Replaying an open rollout's records in call order lets a restarted
proxy keep extending its conversations with the exact ids and keep its call_index counting up. Compaction (at
start and when the file has grown) rewrites the file with what is still needed: un-acked records, every record
of an open rollout, and the closed rollouts. A torn tail (a crash mid-write) is dropped on load.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from gyre_slurm.append_file import AppendFile
from gyre_slurm.errors import DiskFull, GyreError
from gyre_slurm.protocol import CallAck, CallRecord

log = logging.getLogger("gyre.proxy.journal")

Key = tuple[int, int]  # (rollout_id, call_index)


def journal_path(run_dir: Path, proxy_id: str) -> Path:
    return Path(run_dir) / "proxy" / f"journal-{proxy_id}.bin"


@dataclass
class Restored:
    """What a restarted proxy takes over for one open rollout."""

    next_call_index: int
    calls: list[tuple[CallRecord, dict[str, Any] | None]]  # in call order, with each call's conversation delta


def _scan(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """All whole entries with their offsets, and the offset where the valid data ends."""
    entries: list[tuple[int, dict[str, Any]]] = []
    end = 0
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=1 << 31)
        while True:
            try:
                obj = unpacker.unpack()
            except msgpack.OutOfData:
                break
            except Exception as e:  # garbage in the file: keep what came before it
                log.warning("journal %s is damaged at byte %d (%s): the rest is dropped", path, end,
                            type(e).__name__)
                break
            if isinstance(obj, dict) and obj.get("k") in ("rec", "ack", "closed"):
                entries.append((end, obj))
            end = unpacker.tell()
    return entries, end


class Journal:
    # compact once the file holds this much more than what was live after the last compaction
    COMPACT_SLACK_BYTES = 64 << 20

    def __init__(self, run_dir: Path, proxy_id: str) -> None:
        self.path = journal_path(run_dir, proxy_id)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # one owner per journal: a second proxy with the same id would resend and compact under the first
        self._lock_fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise GyreError(f"another proxy uses the journal {self.path}: give this one another --proxy-id") from None
        self._pending: dict[Key, CallRecord] = {}  # insertion order = journal order
        self._closed: set[int] = set()
        self.restored: dict[int, Restored] = {}
        self._load_and_compact()
        self._file = AppendFile(self.path)  # held for the proxy's lifetime
        self._compacted_size = self.path.stat().st_size

    # --- load / compact -----------------------------------------------------------------------------------------
    def _load_and_compact(self) -> None:
        entries, _ = _scan(self.path) if self.path.exists() else ([], 0)
        acked: set[Key] = set()
        for _, e in entries:
            if e["k"] == "ack":
                acked.add((e["r"], e["c"]))
                if not e.get("open", True):
                    self._closed.add(e["r"])
            elif e["k"] == "closed":
                self._closed.add(e["r"])
            elif e.get("acked"):
                acked.add((e["rec"]["rollout_id"], e["rec"]["call_index"]))
        latest: dict[Key, dict[str, Any]] = {}  # one entry per call (a re-written journal may repeat none)
        for _, e in entries:
            if e["k"] == "rec":
                latest[(e["rec"]["rollout_id"], e["rec"]["call_index"])] = e
        keep = [e for key, e in latest.items() if key not in acked or key[0] not in self._closed]
        keep.sort(key=lambda e: (e["rec"]["rollout_id"], e["rec"]["call_index"]))
        for e in keep:
            rec = CallRecord.model_validate(e["rec"])
            key = (rec.rollout_id, rec.call_index)
            e["acked"] = key in acked
            if not e["acked"]:
                self._pending[key] = rec
            if rec.rollout_id in self._closed:
                continue
            got = self.restored.setdefault(rec.rollout_id, Restored(0, []))
            got.calls.append((rec, e.get("st")))
            got.next_call_index = rec.call_index + 1
        self._rewrite(keep)
        if entries:
            log.info("journal %s: %d records to re-send, %d open rollouts taken over, %d closed", self.path,
                     len(self._pending), len(self.restored), len(self._closed))

    def _rewrite(self, keep: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            for r in sorted(self._closed):
                f.write(msgpack.packb({"k": "closed", "r": r}))
            for e in keep:
                f.write(msgpack.packb(e))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _maybe_compact(self) -> None:
        """Called with the lock held, after an append."""
        size = self._file.tell()
        if size < self._compacted_size + self.COMPACT_SLACK_BYTES:
            return
        self._file.close()
        self._pending.clear()
        self._closed.clear()
        self.restored = {}
        self._load_and_compact()  # the in-memory view is rebuilt from the file, as at start
        self.restored = {}
        self._file = AppendFile(self.path)
        self._compacted_size = self.path.stat().st_size
        log.info("journal compacted to %d bytes", self._compacted_size)

    # --- appends ------------------------------------------------------------------------------------------------
    def _append(self, entry: dict[str, Any]) -> None:
        # in the OS before anyone can ack it: a proxy crash loses nothing; a full disk raises DiskFull, the
        # file whole records still (append_file.py)
        self._file.append(msgpack.packb(entry))

    def _note(self, entry: dict[str, Any]) -> None:
        """An ack or a closed rollout: on a full disk only a warning, since a restarted proxy that misses it sends
        the record again and the daemon acks (or closes) it again."""
        try:
            self._append(entry)
        except DiskFull as e:
            log.warning("journal: %s (%s not written; harmless: re-sent after a restart)", e, entry["k"])

    def record(self, rec: CallRecord, state: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._append({"k": "rec", "rec": rec.wire_body(), "st": state, "acked": False})
            key = (rec.rollout_id, rec.call_index)
            self._pending[key] = rec
            self._maybe_compact()

    def ack(self, ack: CallAck) -> bool:
        """Note an ack; True if it was for a record still pending."""
        with self._lock:
            key = (ack.rollout_id, ack.call_index)
            was_pending = self._pending.pop(key, None) is not None
            if was_pending or not ack.rollout_open:
                self._note({"k": "ack", "r": ack.rollout_id, "c": ack.call_index, "open": ack.rollout_open})
            if not ack.rollout_open:
                self._closed.add(ack.rollout_id)
            self._maybe_compact()
            return was_pending

    def close_rollout(self, rollout_id: int) -> None:
        with self._lock:
            if rollout_id not in self._closed:
                self._closed.add(rollout_id)
                self._note({"k": "closed", "r": rollout_id})

    # --- queries ------------------------------------------------------------------------------------------------
    def is_closed(self, rollout_id: int) -> bool:
        with self._lock:
            return rollout_id in self._closed

    def pending(self) -> list[CallRecord]:
        with self._lock:
            return list(self._pending.values())

    def n_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            with contextlib.suppress(OSError):  # a full disk: what is in the OS is in the file already
                self._file.sync()
            self._file.close()
            os.close(self._lock_fd)  # releases the flock
