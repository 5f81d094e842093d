"""Trajectory trees in the ledger (tree_nodes rows, idempotent, committed with the terminal status), their
drawing, and `gyre tree RUN ROLLOUT` (from the ledger, or rebuilt from the segment file while a run goes on)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from gyre_slurm.errors import GyreError
from gyre_slurm.ledger.readonly import connect_readonly
from gyre_slurm.ledger.store import LedgerWriter
from gyre_slurm.trajectory.draw import render, render_tree
from gyre_slurm.trajectory.persist import persist_tree, read_tree, tree_rows
from gyre_slurm.trajectory.segments import SegmentFile
from gyre_slurm.trajectory.tree import RunTree

from .conftest import gyre


def lp(n: int) -> list[float]:
    return [-0.5] * n


# (prompt, output, kind, finish_reason): the calls of one small branchy run
SMALL = [
    ([1, 2, 3], [10, 11], "main", "stop"),  # node #1
    ([1, 2, 3, 10, 11, 5], [12], "main", "stop"),  # extends it: #2 under #1
    ([1, 2, 3], [20, 21], "main", "length"),  # a retry diverging after the prompt: #1 splits, tail #3, new #4
    ([1, 2, 3, 10, 11, 7], [30], "subagent", "stop"),  # a sub-agent branching off after the first answer: #5
    ([9], [8], "subagent", "stop"),  # another root: #6
]


def build(calls) -> RunTree:
    t = RunTree()
    for p, o, kind, fin in calls:
        t.insert_call(p, o, lp(len(o)), 0, kind=kind, finish_reason=fin)
    return t


def branchy() -> RunTree:
    """An agent run of about 40 nodes: a long main line, retries, sub-agents and a summary, two roots."""
    t = RunTree()
    ctx = list(range(100, 140))
    for turn in range(8):
        o = [200 + 10 * turn + i for i in range(6)]
        t.insert_call(ctx, o, lp(6), 0, finish_reason="tool_calls")
        if turn == 3:  # a retry of turn 3 that sampled something else
            t.insert_call(ctx, [900, 901], lp(2), 0, finish_reason="length")
        ctx = ctx + o + [50 + turn] * 3
    for s in range(3):  # sub-agents start from the main context, each two calls long
        sp = ctx + [70 + s]
        t.insert_call(sp, [300 + s, 301], lp(2), 0, kind="subagent", finish_reason="tool_calls")
        t.insert_call(sp + [300 + s, 301, 79], [310, 311], lp(2), 0, kind="subagent", finish_reason="stop")
    t.insert_call(ctx + [66], [400] * 10, lp(10), 0, kind="main_summary", finish_reason="stop")
    for i in range(12):  # many samples of the last turn
        t.insert_call(ctx, [1000 + i, 3], lp(2), 0, finish_reason="stop")
    t.insert_call([7, 7, 7], [8, 8], lp(2), 0, kind="subagent_summary", finish_reason="stop")
    return t


# --- rows ------------------------------------------------------------------------------------------------------
def test_rows_link_parents_and_sum_to_the_tree() -> None:
    for t in (build(SMALL), branchy()):
        rows = tree_rows(t, 7)
        nodes = {n.key: n for n in t.nodes()}
        assert sorted(r["node_key"] for r in rows) == sorted(nodes) and all(r["rollout_id"] == 7 for r in rows)
        keys = {r["node_key"] for r in rows}
        assert {r["node_key"] for r in rows if r["parent_key"] is None} == {n.key for n in t.root.children.values()}
        assert all(r["parent_key"] is None or r["parent_key"] in keys for r in rows)
        assert sum(r["n_tokens"] for r in rows) == sum(len(n.tokens) for n in t.nodes())
        assert sum(r["n_trainable"] for r in rows) == t.n_trainable()
        parents = {r["parent_key"] for r in rows}
        assert {r["node_key"] for r in rows if r["node_key"] not in parents} == {lf.key for lf in t.leaves()}
        by = {r["node_key"]: r for r in rows}
        for leaf in t.leaves():  # walking parent_key up from a leaf gives the tree's path
            walk, k = [], leaf.key
            while k is not None:
                walk.append(k)
                k = by[k]["parent_key"]
            assert walk[::-1] == [n.key for n in t.path(leaf)]
        for n in t.nodes():
            r = by[n.key]
            assert (r["kind"], r["finish_reason"], r["commit_seq"]) == (n.kind, n.finish_reason, n.commit_seq)


def _ledger_with_rollouts(path: Path, *ids: int, status: str = "RUNNING") -> LedgerWriter:
    w = LedgerWriter(path, flush_interval_s=60)
    w.insert("tasks", id=1, suite="s", key="k", spec={})
    w.insert("groups", id=1, task_id=1, status="ADMITTED", size=len(ids), admitted_version=0, created_at=1.0)
    for rid in ids:
        w.insert("rollouts", id=rid, group_id=1, task_id=1, status=status, queued_at=1.0)
    w.flush()
    return w


def test_persisting_is_idempotent_and_a_restart_rewrites_the_same_rows(tmp_path: Path) -> None:
    w = _ledger_with_rollouts(tmp_path / "ledger.db", 1)
    t = branchy()
    n = persist_tree(w, 1, t)
    w.update("rollouts", {"id": 1}, status="COMPLETED")
    persist_tree(w, 1, t)  # finished twice (a replayed report)
    w.flush()
    # a daemon killed after committing: it rebuilds the tree from the same calls in the same order, finishes again
    again = branchy()
    assert tree_rows(again, 1) == tree_rows(t, 1)
    persist_tree(w, 1, again)
    w.flush()
    cols = "node_key, parent_key, kind, n_tokens, n_trainable, finish_reason, commit_seq"
    got = w.rows(f"SELECT {cols} FROM tree_nodes WHERE rollout_id = 1 ORDER BY node_key")
    assert n == len(t.nodes()) == len(got)
    assert got == [{k: r[k] for k in cols.split(", ")} for r in tree_rows(t, 1)]
    v = w.rows("SELECT * FROM v_rollout_trees")
    assert len(v) == 1 and v[0] | {"kinds": None} == {
        "rollout": 1, "status": "COMPLETED", "reward": None, "calls": 0, "nodes": len(t.nodes()),
        "paths": len(t.leaves()), "roots": 2, "branch_points": sum(len(x.children) > 1 for x in t.nodes()),
        "tokens": sum(len(x.tokens) for x in t.nodes()), "trainable": t.n_trainable(), "kinds": None}
    assert set(v[0]["kinds"].split(",")) == {"main", "subagent", "main_summary", "subagent_summary"}
    w.close()


def test_each_model_call_gets_the_node_its_output_ends_in(tmp_path: Path) -> None:
    """model_calls.tree_node_key joins a call to its tree_nodes row, even after later calls split its node."""
    w = _ledger_with_rollouts(tmp_path / "ledger.db", 1)
    t = RunTree()
    for i, (p, o, kind, fin) in enumerate(SMALL):
        t.insert_call(p, o, lp(len(o)), 0, kind=kind, finish_reason=fin, call_index=i)
        w.insert("model_calls", rollout_id=1, call_index=i, api="openai-chat", prompt_tokens=len(p),
                 completion_tokens=len(o), started_at=1.0, latency_s=0.1)
    persist_tree(w, 1, t)
    w.flush()
    got = w.rows("SELECT m.call_index, m.tree_node_key, n.kind, n.finish_reason FROM model_calls m "
                 "JOIN tree_nodes n ON n.rollout_id = m.rollout_id AND n.node_key = m.tree_node_key "
                 "ORDER BY m.call_index")
    assert [r["call_index"] for r in got] == list(range(len(SMALL)))
    by_key = {n.key: n for n in t.nodes()}
    for r, (p, o, kind, fin) in zip(got, SMALL, strict=True):
        node = by_key[r["tree_node_key"]]
        path = [tok for n in t.path(node) for tok in n.tokens]
        assert path == p + o, f"call {r['call_index']}: its output does not end at node {node.key}"
        assert (r["kind"], r["finish_reason"]) == (kind, fin)
    assert got[0]["tree_node_key"] != 1  # call 0 ended in node #1, which call 2 split: its end moved to the tail
    w.close()


def test_tree_rows_commit_in_the_same_transaction_as_the_status(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    w = _ledger_with_rollouts(db, 1)
    t = build(SMALL)
    n = len(t.nodes())
    w.max_batch_rows = n + 3
    for i in range(4):
        w.event("x", f"e{i}")
    persist_tree(w, 1, t)  # 4 queued + n rows would cross the batch bound: the 4 events are committed first
    w.update("rollouts", {"id": 1}, status="COMPLETED")

    def committed() -> tuple[int, str]:
        conn = sqlite3.connect(db)
        try:
            return (conn.execute("SELECT count(*) FROM tree_nodes").fetchone()[0],
                    conn.execute("SELECT status FROM rollouts WHERE id = 1").fetchone()[0])
        finally:
            conn.close()

    assert w.pending == n + 1 and committed() == (0, "RUNNING")  # nothing of the tree without its status
    w.flush()
    assert committed() == (n, "COMPLETED")
    w.close()


# --- drawing ---------------------------------------------------------------------------------------------------
def _tree_part(lines: list[str]) -> list[str]:
    """The connector-and-label part of the drawing (after the blank line that ends the header)."""
    body = lines[lines.index("") + 2:]
    return [_label(ln) for ln in body]


def _label(line: str) -> str:
    m = re.match(r"^(.*?#\d+)", line)
    return m.group(1) if m else line


def _row(key: int, parent: int | None, kind: str, n: int, tr: int, fin: str | None, seq: int) -> dict:
    return {"node_key": key, "parent_key": parent, "kind": kind, "n_tokens": n, "n_trainable": tr,
            "finish_reason": fin, "commit_seq": seq}


HAND = [  # a prompt, its answer extended by a second turn and by a sub-agent, a retry, and a second root
    _row(1, None, "main", 30, 0, None, 1), _row(2, 1, "main", 5, 5, "tool_calls", 1),
    _row(3, 2, "main", 7, 4, "stop", 2), _row(5, 2, "subagent", 9, 6, "stop", 4),
    _row(4, 1, "main", 2, 2, "length", 3), _row(6, None, "subagent_summary", 12, 3, "stop", 5),
]


def test_drawing_shows_structure_kinds_counts_and_path_ends() -> None:
    lines = render(list(reversed(HAND)), "rollout 1")  # row order does not matter: siblings go oldest first
    assert lines[:3] == [
        "rollout 1",
        "6 nodes · 4 paths (leaves) · 2 roots · 2 branch points · 65 tokens, 20 trainable",
        "kinds (nodes/paths): main 4/2 · subagent 1/1 · subagent_summary 1/1",
    ]
    body = lines[lines.index("") + 2:]
    assert [_label(x) for x in body] == [
        "main #1",
        "├── main #2",
        "│   ├── main #3",
        "│   └── subagent #5",
        "└── main #4",
        "subagent_summary #6",
    ]
    cols = {_label(x): x[len(_label(x)):].split() for x in body}
    assert cols == {
        "main #1": ["30", "0"],  # the prompt: nothing trainable, no call ended there
        "├── main #2": ["5", "5", "tool_calls"],  # not a leaf: no path ends there
        "│   ├── main #3": ["7", "4", "stop", "◆", "path", "1"],
        "│   └── subagent #5": ["9", "6", "stop", "◆", "path", "2"],
        "└── main #4": ["2", "2", "length", "◆", "path", "3"],
        "subagent_summary #6": ["12", "3", "stop", "◆", "path", "4"],
    }
    assert len({x.index(" stop") for x in body if " stop" in x}) == 1  # the columns line up
    # a RunTree draws the same way: connectors follow its parent links, siblings oldest call first
    t = build(SMALL)
    kids = lambda n: sorted(n.children.values(), key=lambda c: (c.commit_seq, c.key))  # noqa: E731
    want: list[str] = []

    def walk(n, lead: str, cont: str) -> None:
        want.append(f"{lead}{n.kind} #{n.key}")
        for i, c in enumerate(kids(n)):
            last = i == len(kids(n)) - 1
            walk(c, cont + ("└── " if last else "├── "), cont + ("    " if last else "│   "))

    for r in kids(t.root):
        walk(r, "", "")
    assert _tree_part(render_tree(t, fold_chain=1000)) == want
    assert "kinds (nodes/paths): main " in render_tree(t)[1] and " subagent " in render_tree(t)[1]


def test_drawing_folds_chains_and_caps_width_depth_and_lines() -> None:
    t = branchy()
    lines = render_tree(t)
    n = len(t.nodes())
    assert 35 <= n <= 60 and lines[0].startswith(f"{n} nodes · {len(t.leaves())} paths (leaves) · 2 roots")
    tree = _tree_part(lines)
    # runs of single-child nodes (the agent's turns) fold into '┊' lines between their first and last node
    fold = [ln for ln in lines[4:] if "┊" in ln]
    assert fold and all("more nodes in a line (" in x and "calls ended tool_calls×" in x for x in fold)
    # 12 samples of the last turn + 3 sub-agents + a summary under one node: 8 drawn, the rest on a '…' line
    more = [ln for ln in lines if "more branches" in ln]
    assert len(more) == 1 and "… 8 more branches: " in more[0]
    assert any("subagent #" in x for x in tree) and any("main_summary #" in x for x in tree)
    assert "subagent_summary #" in tree[-1]
    assert all(len(ln) < 120 for ln in lines[4:])
    # every node is accounted for exactly once: drawn, folded or counted in a '…' line
    drawn = sum(1 for x in tree if "#" in x)
    folded = sum(int(x.split("┊")[1].split()[0]) for x in fold)
    hidden = int(more[0].split(": ")[1].split()[0])
    assert drawn + folded + hidden == n
    shallow = render_tree(t, max_depth=2)
    assert any("nodes, " in ln and "below" in ln for ln in shallow)
    short = render_tree(t, max_lines=10)
    assert short[-1].startswith("… drawing cut at 10 lines: ") and len(_tree_part(short)) == 10
    assert render_tree(RunTree(), "r")[1] == "empty tree: no model call recorded"


def test_the_ledger_rows_draw_like_the_tree(tmp_path: Path) -> None:
    t = branchy()
    w = _ledger_with_rollouts(tmp_path / "ledger.db", 1)
    persist_tree(w, 1, t)
    w.flush()
    rows = w.rows("SELECT node_key, parent_key, kind, n_tokens, n_trainable, finish_reason, commit_seq "
                  "FROM tree_nodes ORDER BY id DESC")  # any order
    assert render(rows, "x") == render_tree(t, "x")
    w.close()


# --- gyre tree ---------------------------------------------------------------------------------------------------
def _run_on_disk(state: Path) -> tuple[Path, RunTree]:
    """A run folder: rollout 1 finished (tree in the ledger), 2 still running (calls in the segment file only),
    3 finished without a model call."""
    run_dir = state / "r1"
    w = _ledger_with_rollouts(run_dir / "ledger.db", 1, 2, 3)
    seg = SegmentFile(run_dir / "segments" / "calls.seg")
    lineage = {1: (0, 5), 2: (0, 3), 3: (0, 5)}  # call -> (parent call, ids reused from it): records carry the rest
    for i, (p, o, kind, fin) in enumerate(SMALL):
        parent, reused = lineage.get(i, (None, 0))
        off, n = seg.append({"rollout_id": 2, "call_index": i, "prompt_ids": p[reused:], "output_ids": o,
                             "output_logprobs": lp(len(o)), "weight_version": 0, "finish_reason": fin, "kind": kind,
                             "parent_call": parent, "reused_tokens": reused})
        w.insert("model_calls", rollout_id=2, call_index=i, api="openai-chat", prompt_tokens=len(p),
                 completion_tokens=len(o), started_at=1.0, latency_s=0.1, segment_offset=off, segment_length=n)
    seg.close()
    t = branchy()
    persist_tree(w, 1, t)
    w.update("rollouts", {"id": 1}, status="COMPLETED", reward=1.0)
    w.update("rollouts", {"id": 3}, status="INFRA_ERROR")
    w.close()
    return run_dir, t


def test_gyre_tree_draws_from_the_ledger_or_the_segment_file(tmp_path: Path) -> None:
    state = tmp_path / "state"
    run_dir, t = _run_on_disk(state)
    seg = run_dir / "segments" / "calls.seg"
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # a record the daemon is still writing: `gyre tree` must not cut it off
    before = seg.read_bytes()

    r = gyre("tree", "r1", "1", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "rollout 1 of r1 · COMPLETED · reward 1 · 0 model calls · from the ledger (tree_nodes)"
    assert lines == render_tree(t, lines[0])

    r = gyre("tree", "r1", "2", "--state-dir", state)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "rebuilt from segments/calls.seg (no tree_nodes rows: the rollout is still running)" in lines[0]
    assert lines[1:] == render_tree(build(SMALL))  # the calls' kinds come from their payloads
    assert seg.read_bytes() == before

    r = gyre("tree", "r1", "3", "--state-dir", state)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "empty tree: no model call recorded"

    r = gyre("tree", "r1", "99", "--state-dir", state)
    assert r.returncode == 1 and r.stderr.strip() == "error: run r1 has no rollout 99 (rollouts: ids 1–3)"
    r = gyre("tree", "nope", "1", "--state-dir", state)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "no run 'nope'" in r.stderr


def test_read_tree_falls_back_to_the_segments_in_call_order(tmp_path: Path) -> None:
    run_dir, _ = _run_on_disk(tmp_path / "state")
    conn = connect_readonly(run_dir / "ledger.db")
    try:
        ro, rows, source = read_tree(conn, run_dir, 2)
        assert (ro["status"], source) == ("RUNNING", "segments") and rows == tree_rows(build(SMALL), 2)
        assert read_tree(conn, run_dir, 1)[2] == "ledger"
        with pytest.raises(GyreError, match="no rollout 4"):
            read_tree(conn, run_dir, 4)
    finally:
        conn.close()
