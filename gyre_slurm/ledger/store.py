"""Opening the ledger and writing it in batches (the daemon is the only writer).

SQLite in WAL mode: readers (`gyre status`, `gyre sql`, sqlite3) never block the writer, and a writer killed
with -9 mid-transaction leaves the last committed state intact. Writes are queued in memory and committed
together every `flush_interval_s` or `max_batch_rows`; a caller that must not answer before its write is
durable (e.g. a control reply) calls `flush()` first. A commit only appends to the WAL (synchronous=NORMAL): the
checkpoints that copy it into ledger.db and sync the disk run on a thread of their own (_Checkpointer).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Table, bindparam, create_engine, event, insert, text, update
from sqlalchemy.exc import OperationalError

from gyre_slurm.errors import DiskFull, GyreError, IllegalTransition, disk_full
from gyre_slurm.ledger.models import SCHEMA_VERSION, STATUS_COLUMNS, Base, Meta
from gyre_slurm.statuses import Severity, StateMachine

log = logging.getLogger("gyre.ledger")


def _set_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes, fast
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def open_engine(path: Path) -> Engine:
    eng = create_engine(f"sqlite:///{path}")
    event.listen(eng, "connect", _set_pragmas)
    return eng


def views_sql() -> str:
    return resources.files("gyre_slurm.ledger").joinpath("views.sql").read_text()


def _check_version(eng: Engine) -> None:
    """A ledger written by another schema is refused whole: writing it with this one could fail half-way."""
    with eng.connect() as conn:
        if not conn.execute(text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'")).first():
            return
        row = conn.execute(text("SELECT value FROM meta WHERE key = 'schema_version'")).first()
    if row is not None and row[0] != str(SCHEMA_VERSION):
        raise GyreError(f"{eng.url.database} has ledger schema {row[0]}; this gyre writes schema {SCHEMA_VERSION}: "
                        "resume that run with the gyre version that started it (reading it still works)")


def create_schema(eng: Engine) -> None:
    """Create tables (if missing) and (re)create the views; safe to call on an existing ledger of this schema."""
    _check_version(eng)
    Base.metadata.create_all(eng)
    with eng.begin() as conn:
        raw = conn.connection.driver_connection
        raw.executescript(views_sql())
        conn.execute(
            insert(Meta.__table__).prefix_with("OR IGNORE"), {"key": "schema_version", "value": str(SCHEMA_VERSION)}
        )


def table(name: str) -> Table:
    return Base.metadata.tables[name]


@dataclass
class _Op:
    kind: str  # insert, insert_ignore, update
    table: Table
    values: dict[str, Any]
    where: dict[str, Any] = field(default_factory=dict)


def _set_rows(conn: Any, ops: list[_Op]) -> None:
    """LedgerWriter.set's updates: one executemany per (table, key columns, value columns)."""
    shapes: dict[tuple, list[_Op]] = {}
    for op in ops:
        shapes.setdefault((op.table.name, tuple(op.where), tuple(op.values)), []).append(op)
    for (_name, where, cols), group in shapes.items():
        t = group[0].table
        stmt = update(t)
        for k in where:
            stmt = stmt.where(t.c[k] == bindparam(f"w_{k}"))
        stmt = stmt.values({c: bindparam(f"v_{c}") for c in cols})
        conn.execute(stmt, [{**{f"w_{k}": v for k, v in o.where.items()}, **{f"v_{c}": v for c, v in o.values.items()}}
                            for o in group])


def _write_ops(conn: Any, ops: list[_Op]) -> None:
    """A flush's inserts and updates in their order; consecutive inserts of one shape as one executemany."""
    i = 0
    while i < len(ops):
        op = ops[i]
        if op.kind == "update":
            stmt = update(op.table)
            for k, v in op.where.items():
                stmt = stmt.where(op.table.c[k] == v)
            conn.execute(stmt.values(**op.values))
            i += 1
            continue
        j = i
        keys = op.values.keys()
        while j < len(ops) and ops[j].kind == op.kind and ops[j].table is op.table and ops[j].values.keys() == keys:
            j += 1
        stmt = insert(op.table)
        if op.kind == "insert_ignore":
            stmt = stmt.prefix_with("OR IGNORE")
        conn.execute(stmt, [o.values for o in ops[i:j]])
        i = j


class _Checkpointer:
    """WAL checkpoints off the writer's thread. By default SQLite checkpoints inside whichever commit takes the WAL
    past 1,000 pages, and a checkpoint syncs the WAL and ledger.db: on a busy disk (the segment file beside it
    growing by tens of MB/s) that commit, and every model call's ack waiting on it, stalled for 100+ ms. Here the
    writer never checkpoints (wal_autocheckpoint=0) and this thread runs a PASSIVE checkpoint every `every_s` on
    a connection of its own, which blocks neither the writer nor readers; sqlite3 lets go of the GIL meanwhile."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s = path, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn = sqlite3.connect(self.path, timeout=10)
        try:
            said = None
            while not self._stop.wait(self.every_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    said = None
                except sqlite3.Error as e:  # the next one tries again; the WAL keeps every commit meanwhile
                    if str(e) != said:  # once, not every second of a full disk
                        log.warning("ledger checkpoint failed: %s", e)
                    said = str(e)
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class LedgerWriter:
    """Queues inserts/updates and commits them in one transaction per flush, in the order they were made."""

    def __init__(self, path: Path, flush_interval_s: float = 0.05, max_batch_rows: int = 20_000) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = open_engine(self.path)
        event.listen(self.engine, "connect", lambda conn, _r: conn.execute("PRAGMA wal_autocheckpoint=0"))
        create_schema(self.engine)
        self._checkpointer = _Checkpointer(self.path)
        self.flush_interval_s = flush_interval_s
        self.max_batch_rows = max_batch_rows
        self._ops: list[_Op] = []
        # set(): the last values of a row's columns, written at the end of the flush's transaction, many rows of
        # one shape in one executemany (a counter bumped per model call costs no statement of its own)
        self._latest: dict[tuple[str, tuple], _Op] = {}
        self._oldest: float | None = None
        self.rows_written = 0
        self.full: DiskFull | None = None  # the last flush found the disk full: its rows are still queued

    # --- queueing -----------------------------------------------------------------------------------------
    def _touch(self) -> None:
        """The first write since the last flush starts the flush timer."""
        if not self._ops and not self._latest:
            self._oldest = time.monotonic()

    def _queue(self, op: _Op) -> None:
        self._touch()
        self._ops.append(op)
        if len(self._ops) >= self.max_batch_rows:
            self.flush()

    def insert(self, name: str, /, **values: Any) -> None:
        self._queue(_Op("insert", table(name), values))

    def insert_ignore(self, name: str, /, **values: Any) -> None:
        """Insert unless a row with the same unique key exists: replays from peers are idempotent."""
        self._queue(_Op("insert_ignore", table(name), values))

    def update(self, name: str, where: dict[str, Any], /, **values: Any) -> None:
        self._queue(_Op("update", table(name), values, where))

    def set(self, name: str, where: dict[str, Any], /, **values: Any) -> None:
        """Like update, for columns whose last value is all that counts (counters): coalesced per row until the
        flush, and written after the flush's other statements, in the same transaction."""
        k = (name, tuple(sorted(where.items())))
        op = self._latest.get(k)
        if op is None:
            self._touch()
            self._latest[k] = _Op("update", table(name), dict(values), dict(where))
        else:
            op.values.update(values)

    def transition(self, machine: StateMachine, key: dict[str, Any], src: Any, dst: Any, subject: str,
                   /, **values: Any) -> Any:
        """The one way a status (or a cell's role) is written: checked against its state machine first, so an
        illegal change raises IllegalTransition with nothing queued. src None inserts a new row (key + values)."""
        machine.check(src, dst, subject)
        name, column = STATUS_COLUMNS[machine]
        if src is None:
            self.insert(name, **key, **{column: dst.value}, **values)
        else:
            self.update(name, key, **{column: dst.value}, **values)
        return dst

    def event(self, kind: str, message: str, *, severity: Severity = Severity.INFO, cell_id: int | None = None,
              node_index: int | None = None, data: dict | None = None) -> None:
        if not isinstance(severity, Severity):  # a Severity member, not its string: one spelling at every call
            raise TypeError(f"event {kind!r}: severity must be a Severity, not {severity!r}")
        self.insert("events", ts=time.time(), kind=kind, severity=severity.value, cell_id=cell_id,
                    node_index=node_index, message=message, data=data)

    def illegal_transition(self, exc: IllegalTransition) -> None:
        """The events row of a status change that was refused (and never written)."""
        self.event("illegal_transition", str(exc), severity=Severity.ERROR,
                   data={"machine": exc.machine, "subject": exc.subject, "from": exc.src, "to": exc.dst})

    # --- flushing -----------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._ops) + len(self._latest)

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() - (self._oldest or 0.0) >= self.flush_interval_s

    def seconds_until_due(self) -> float | None:
        if not self.pending:
            return None
        return max(0.0, self.flush_interval_s - (time.monotonic() - (self._oldest or 0.0)))

    def flush(self) -> int:
        """Commit everything queued in one transaction; consecutive inserts into one table go as executemany. On a
        full disk the transaction is rolled back whole, the rows stay queued in order, `full` says why and 0 is
        returned: the caller (the daemon) holds back whatever must wait for the commit and tries again later."""
        if not self.pending:
            self.full = None  # nothing waits for room
            return 0
        ops, self._ops, oldest = self._ops, [], self._oldest
        latest, self._latest = self._latest, {}
        try:
            with self.engine.begin() as conn:
                _write_ops(conn, ops)
                _set_rows(conn, list(latest.values()))
        except (OperationalError, OSError) as e:
            # back in the queue as it was: nothing queued meanwhile (the writer has one thread, the daemon's)
            self._ops, self._latest, self._oldest = ops, latest, oldest
            if not disk_full(e):
                raise
            self.full = DiskFull(f"the ledger {self.path} cannot grow: {getattr(e, 'orig', None) or e}")
            return 0
        self.full = None
        self.rows_written += len(ops) + len(latest)
        return len(ops) + len(latest)

    def scalar(self, sql: str, **params: Any) -> Any:
        """Read one value (flushes first so the daemon reads its own writes)."""
        self.flush()
        with self.engine.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        self.flush()
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql), params)]

    def close(self) -> None:
        self.flush()
        self._checkpointer.stop()
        self.engine.dispose()  # the last connection to close checkpoints what is left
