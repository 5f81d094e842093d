"""A rollout's trajectory tree in the ledger: one `tree_nodes` row per node, written when the rollout ends.

Rows carry the shape only (parent link, kind, token counts, how the call that ended there finished); the token
ids stay where they already are, in the model calls' records in segments/calls.seg, so nothing is stored twice.
Each of the rollout's `model_calls` rows gets the key of the node where its output ends (`tree_node_key`), so
calls join their nodes. `node_key` is RunTree's Node.key: stable for a given sequence of calls, so a daemon
restarted after a kill -9 rebuilds the same tree from the segment file and rewrites the same keys; the rows go
through INSERT OR IGNORE on (rollout_id, node_key), so finishing a rollout twice is harmless.

Reading: `read_tree` gives a rollout's rows from the ledger, or, while the rollout has none yet (still running,
or finished before trees were persisted), rebuilds them from its model calls' payloads.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from gyre_slurm.errors import GyreError
from gyre_slurm.ledger.readonly import query_dicts
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.trajectory.segments import insert_payload, read_record
from gyre_slurm.trajectory.tree import RunTree

SEGMENT_FILE = Path("segments") / "calls.seg"


def tree_rows(tree: RunTree, rollout_id: int | None) -> list[dict[str, Any]]:
    """One row per node of `tree` (the synthetic root is not a node: its children have parent_key None)."""
    rows = []
    for n in tree.nodes():
        parent = n.parent
        rows.append({
            "rollout_id": rollout_id,
            "node_key": n.key,
            "parent_key": None if parent is None or parent is tree.root else parent.key,
            "kind": n.kind,
            "n_tokens": len(n.tokens),
            "n_trainable": sum(n.trainable),
            "finish_reason": n.finish_reason,
            "commit_seq": n.commit_seq,
        })
    rows.sort(key=lambda r: r["node_key"])
    return rows


def persist_tree(ledger: LedgerWriter, rollout_id: int, tree: RunTree) -> int:
    """Queue the tree's rows (INSERT OR IGNORE). Call it just before queueing the rollout's terminal status:
    both then commit in the same transaction, because the batch is flushed first if the rows and the status
    would not fit in it together. Only a tree larger than a whole batch (`max_batch_rows` nodes) is split over
    several commits, rows first, so a terminal status in the ledger always has its tree; a crash after some rows
    leaves the rollout RUNNING, and finishing it again after the restart inserts the rest and ignores the others.
    Returns the number of rows queued."""
    rows = tree_rows(tree, rollout_id)
    ends = tree.call_ends()
    if rows and ledger.pending + len(rows) + len(ends) >= ledger.max_batch_rows:
        ledger.flush()
    for r in rows:
        ledger.insert_ignore("tree_nodes", **r)
    for call_index, key in sorted(ends.items()):
        ledger.update("model_calls", {"rollout_id": rollout_id, "call_index": call_index}, tree_node_key=key)
    return len(rows)


# --- reading (read-only: `gyre tree`) -----------------------------------------------------------------------------
def tree_from_calls(segment_file: Path, calls: list[dict[str, Any]]) -> RunTree:
    """Rebuild a rollout's tree from its model_calls rows (segment_offset, segment_length), in call order (a
    payload may name an earlier parent call), as the daemon does. Opens the segment file for reading only: a
    SegmentFile would open it for appending and cut a record the daemon is still writing."""
    tree = RunTree()
    if not calls:
        return tree
    if not segment_file.is_file():
        raise GyreError(f"no segment file at {segment_file}: cannot rebuild the tree from the model calls")
    with open(segment_file, "rb") as f:
        for c in calls:
            if c["segment_offset"] is None or c["segment_length"] is None:
                continue
            rec = read_record(f, c["segment_offset"], c["segment_length"])
            try:
                insert_payload(tree, rec)
            except (KeyError, ValueError) as e:
                raise GyreError(f"call {c.get('call_index')} of rollout {rec.get('rollout_id')}: payload at "
                                f"offset {c['segment_offset']} does not fit the tree: {e}") from None
    return tree


def read_tree(conn: sqlite3.Connection, run_dir: Path, rollout_id: int) -> tuple[dict[str, Any], list[dict], str]:
    """(the rollout's row, its tree rows, where they came from: 'ledger' or 'segments'). GyreError if unknown."""
    ro = query_dicts(conn, "SELECT id, status, reward, n_calls FROM rollouts WHERE id = ?", (rollout_id,))
    if not ro:
        span = query_dicts(conn, "SELECT min(id) AS lo, max(id) AS hi FROM rollouts")[0]
        known = "none yet" if span["lo"] is None else f"ids {span['lo']}–{span['hi']}"
        raise GyreError(f"run {Path(run_dir).name} has no rollout {rollout_id} (rollouts: {known})")
    rows = query_dicts(conn, "SELECT node_key, parent_key, kind, n_tokens, n_trainable, finish_reason, commit_seq "
                             "FROM tree_nodes WHERE rollout_id = ? ORDER BY node_key", (rollout_id,))
    if rows:
        return ro[0], rows, "ledger"
    calls = query_dicts(conn, "SELECT call_index, segment_offset, segment_length FROM model_calls "
                              "WHERE rollout_id = ? ORDER BY call_index", (rollout_id,))
    tree = tree_from_calls(Path(run_dir) / SEGMENT_FILE, calls)
    return ro[0], tree_rows(tree, rollout_id), "segments"
