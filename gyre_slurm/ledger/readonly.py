"""Read-only access to a ledger, for `gyre sql`, `gyre status` and plots.

Two locks: `PRAGMA query_only` and an authorizer that lets a statement read and nothing else (no writes,
ATTACH, schema changes or writing pragmas). A refused statement raises ReadOnlyError before anything runs.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from gyre_slurm.errors import GyreError, ReadOnlyError

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)
_ALLOWED.add(_RECURSIVE)
# pragmas whose argument names what to read, and pragmas that read a setting only when given no value
_NAME_PRAGMAS = {"table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list",
                 "integrity_check", "quick_check", "table_list"}
_SETTING_PRAGMAS = {"database_list", "journal_mode", "page_count", "page_size", "user_version", "schema_version",
                    "compile_options", "function_list", "pragma_list", "foreign_keys", "query_only"}

class _Refusal:
    def __init__(self) -> None:
        self.what: str | None = None

    def __call__(self, action: int, arg1: str | None, arg2: str | None, _db: str | None, _trig: str | None) -> int:
        if action in _ALLOWED:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA:
            name = (arg1 or "").lower()
            if name in _NAME_PRAGMAS or (name in _SETTING_PRAGMAS and arg2 is None):
                return sqlite3.SQLITE_OK
        names = {v: k for k, v in vars(sqlite3).items() if k.startswith("SQLITE_") and isinstance(v, int)
                 and k not in ("SQLITE_OK", "SQLITE_DENY", "SQLITE_IGNORE")}
        self.what = self.what or names.get(action, f"action {action}").removeprefix("SQLITE_").lower()
        return sqlite3.SQLITE_DENY


def connect_readonly(path: Path) -> sqlite3.Connection:
    path = Path(path)
    if not path.is_file():
        raise GyreError(f"no ledger at {path}")
    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10.0, check_same_thread=False)
    conn.execute("PRAGMA query_only=ON")
    conn.row_factory = sqlite3.Row
    return conn


def run_query(conn: sqlite3.Connection, sql: str, params: tuple | dict = ()) -> tuple[list[str], list[tuple]]:
    """Run one read-only statement; returns (column names, rows). Raises ReadOnlyError / GyreError."""
    refusal = _Refusal()
    conn.set_authorizer(refusal)
    try:
        cur = conn.execute(sql, params)
        rows = [tuple(r) for r in cur.fetchall()]
        cols = [d[0] for d in cur.description or []]
        return cols, rows
    except sqlite3.DatabaseError as e:
        if refusal.what or "not authorized" in str(e) or "readonly" in str(e).lower():
            raise ReadOnlyError(
                f"gyre sql is read-only: a statement that does '{refusal.what or 'write'}' was refused; "
                "the ledger is unchanged"
            ) from None
        raise GyreError(f"SQL error: {e}") from None
    except sqlite3.ProgrammingError as e:
        raise GyreError(f"SQL error: {e}") from None
    finally:
        conn.set_authorizer(None)


def query_dicts(conn: sqlite3.Connection, sql: str, params: tuple | dict = ()) -> list[dict[str, Any]]:
    cols, rows = run_query(conn, sql, params)
    return [dict(zip(cols, r, strict=True)) for r in rows]
