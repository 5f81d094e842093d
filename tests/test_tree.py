"""The trajectory radix tree and its training paths, on hand-built calls with known answers."""

from __future__ import annotations

import math

from gyre_slurm.trajectory.tree import RunTree


def lp(n: int, base: float = -0.5) -> list[float]:
    return [base - 0.01 * i for i in range(n)]


def test_a_linear_agent_run_is_one_path_with_every_output_a_target() -> None:
    t = RunTree()
    p1, o1 = [1, 2, 3], [10, 11, 99]
    t.insert_call(p1, o1, lp(3), version=0)
    p2 = p1 + o1 + [5, 6]  # previous prompt + output + the tool result suffix
    o2 = [12, 99]
    t.insert_call(p2, o2, lp(2, -1.0), version=1)
    assert len(t.leaves()) == 1
    segs, n = t.segments()
    assert n == 5 and len(segs) == 1
    s = segs[0]
    assert s.tokens == p2 + o2
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert s.behav_logp[3:6] == lp(3) and s.behav_logp[8:] == lp(2, -1.0)
    versions = [v for node in t.path(t.leaves()[0]) for v in node.version]
    assert versions == [-1, -1, -1, 0, 0, 0, -1, -1, 1, 1]


def test_branches_share_targets_once_and_trainable_is_monotone() -> None:
    t = RunTree()
    t.insert_call([1, 2], [10, 11], lp(2), 0)  # main call
    # a sub-agent sees the main output as context, then samples its own tokens
    t.insert_call([1, 2, 10, 11, 7], [20, 21], lp(2), 0, kind="subagent")
    # a retry of the first call sampled the same first token, then diverged
    t.insert_call([1, 2], [10, 30], lp(2, -2.0), 0)
    assert t.duplicate_targets == 1
    segs, n = t.segments()
    assert n == 5  # 10, 11, 20, 21, 30: each target once
    assert sum(sum(s.loss_mask) for s in segs) == 5
    # replayed as context in the sub-agent's prompt, 10 and 11 stay targets (claimed by one path only)
    owners = [s for s in segs if s.loss_mask[2]]
    assert len(owners) == 1 and owners[0].behav_logp[2] == lp(2)[0]
    assert {s.kind for s in segs} == {"main", "subagent"}
    assert segs[0].kind == "main" and segs[-1].kind == "subagent"  # main first


def test_a_prompt_that_rewrites_history_starts_a_new_root_and_max_paths_bounds() -> None:
    t = RunTree()
    t.insert_call([1, 2, 3], [10], lp(1), 0)
    t.insert_call([4, 5], [11], lp(1), 0, kind="main_summary")  # compaction: a new root
    t.insert_call([1, 2, 3, 10, 6], [12], lp(1), 0)
    assert len(t.root.children) == 2
    segs, n = t.segments(max_paths=1)
    assert len(segs) == 1 and n == 2 and segs[0].kind == "main"
    segs, n = t.segments()
    assert n == 3 and [s.kind for s in segs] == ["main", "main_summary"]


def test_context_is_never_a_target_and_splits_keep_the_data() -> None:
    t = RunTree()
    t.insert_call([1, 2, 3, 4], [9], [-0.1], 0)
    t.insert_call([1, 2], [7], [-0.2], 0)  # splits the first node inside its prompt
    t.insert_call([1, 2, 3], [], [], 0)  # a call that ends inside a node
    nodes = t.nodes()
    assert all(math.isnan(lpv) for n in nodes for lpv, tr in zip(n.logp, n.trainable, strict=True) if not tr)
    segs, n = t.segments()
    assert n == 2 and sorted(tuple(s.tokens) for s in segs) == [(1, 2, 3, 4, 9), (1, 2, 7)]


def branchy_tree() -> RunTree:
    """A compressing, sub-agent-spawning run: main (2 calls), a sub-agent reading main's first output, the
    sub-agent's summary, a main summary after compaction, and a call that only re-reads history."""
    t = RunTree()
    t.insert_call([1, 2], [10, 11, 12], lp(3), 0, kind="main")
    t.insert_call([1, 2, 10, 11, 12, 3], [13, 14], lp(2), 0, kind="main")
    t.insert_call([1, 2, 10, 11, 12, 7], [20, 21, 22, 23, 24, 25], lp(6), 0, kind="subagent")
    t.insert_call([8, 9], [30, 31, 32, 33, 34, 35, 36, 37], lp(8), 0, kind="subagent_summary")
    t.insert_call([5, 6], [40, 41], lp(2), 1, kind="main_summary")
    t.insert_call([1, 2, 10, 11, 12, 6], [50, 51], lp(2), 1, kind="subagent")  # a second sub-agent
    t.insert_call([1, 2, 10, 11, 12, 3, 9], [], [], 1, kind="main")  # re-reads history: no target of its own
    return t


def test_paths_are_chosen_by_kind_then_new_targets_and_bounded_by_jmax() -> None:
    t = branchy_tree()
    segs, n = t.segments(max_paths=3)
    # main first even though the sub-agent summary has more tokens; then main_summary, then subagent
    assert [s.kind for s in segs] == ["main", "main_summary", "subagent"]
    assert n == 5 + 2 + 6  # the sub-agent summary's 8 targets are the cost of the bound
    segs, n = t.segments()
    assert [s.kind for s in segs] == ["main", "main_summary", "subagent", "subagent", "subagent_summary"]
    assert n == t.n_trainable() == 23
    # the history-only call added no target: its path is never chosen
    assert len(segs) == 5 and len(t.leaves()) == 6


def test_a_target_shared_by_three_chosen_paths_is_trained_once() -> None:
    t = branchy_tree()
    segs, _ = t.segments()
    # token 10 (main's first output) sits on the main path and both sub-agents' paths: all three chosen
    holders = [s for s in segs if 10 in s.tokens]
    assert len(holders) == 3
    assert sum(s.loss_mask[s.tokens.index(10)] for s in holders) == 1
    total = sum(sum(s.loss_mask) for s in segs)
    assert total == 23 == len({(k, tok) for s in segs for k, (tok, m) in enumerate(zip(s.tokens, s.loss_mask,
                                                                                      strict=True)) if m})


def test_a_per_run_target_budget_keeps_the_rest_as_context() -> None:
    segs, n = branchy_tree().segments(max_targets=6)
    assert n == 6 and sum(sum(s.loss_mask) for s in segs) == 6
    assert [s.kind for s in segs] == ["main", "main_summary"]  # the budget ran out inside the second path
