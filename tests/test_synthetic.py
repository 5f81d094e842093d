"""The synthetic harness trees (gyre_slurm.trajectory.synthetic) and what each path setting claims on them."""

from __future__ import annotations

import pytest

from gyre_slurm.trajectory.synthetic import SyntheticConfig, all_paths_without_dedup, generate_run, generate_runs
from gyre_slurm.trajectory.tree import KINDS, RunTree, Segment

SMALL = SyntheticConfig(main_turns=(9, 14), system_tokens=(5, 20), task_tokens=(2, 8), output_tokens=(1, 12),
                        tool_result_tokens=(0, 10), compact_every=4, summary_prompt_tokens=(3, 10),
                        summary_output_tokens=(2, 10), subagent_prob=0.4, subagent_turns=(2, 6),
                        subagent_system_tokens=(3, 10), subagent_task_tokens=(1, 5), subagent_compact_every=2,
                        retry_prob=0.2)


class TargetIds:
    """Exact identity of a (prefix, token) position: interned trie ids over token sequences."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], int] = {}

    def walk(self, tokens: list[int]) -> list[int]:
        cur, out = 0, []
        for tok in tokens:
            cur = self.ids.setdefault((cur, tok), len(self.ids) + 1)
            out.append(cur)
        return out

    def targets(self, segs: list[Segment]) -> list[int]:
        return [i for s in segs for i, m in zip(self.walk(s.tokens), s.loss_mask, strict=True) if m]

    def trainable(self, tree: RunTree) -> set[int]:
        out = set()
        for leaf in tree.leaves():
            path = tree.path(leaf)
            ids = self.walk([t for n in path for t in n.tokens])
            out |= {i for i, tr in zip(ids, [x for n in path for x in n.trainable], strict=True) if tr}
        return out


@pytest.mark.parametrize("seed", range(8))
def test_documented_shape(seed):
    run = generate_run(SMALL, seed)
    tree = run.tree
    assert SMALL.main_turns[0] <= run.n_main_turns <= SMALL.main_turns[1]
    assert run.n_compactions == (run.n_main_turns - 1) // SMALL.compact_every
    assert len(tree.root.children) == run.n_roots == 1 + run.n_compactions + run.n_subagents \
        + run.n_subagent_compactions
    assert len(tree.leaves()) == run.n_roots + run.n_retries
    assert tree.n_trainable() == sum(len(c.output_ids) for c in run.calls)
    assert sum(c.finish_reason == "abandoned" for c in run.calls) == run.n_retries
    assert {c.kind for c in run.calls} <= set(KINDS)
    assert sum(c.kind == "main" and c.finish_reason == "stop" for c in run.calls) == run.n_main_turns
    assert sum(c.kind == "main_summary" and c.finish_reason == "stop" for c in run.calls) == run.n_compactions
    # Token-in/token-out: a call either starts a conversation (a first token no earlier call used), re-sends an
    # earlier prompt (a retry), or extends an earlier kept call's prompt + output.
    firsts: set[int] = set()
    for i, c in enumerate(run.calls):
        earlier = run.calls[:i]
        if c.prompt_ids[0] not in firsts:
            firsts.add(c.prompt_ids[0])
            continue
        extends = any(e.finish_reason == "stop" and c.prompt_ids[:len(e.prompt_ids) + len(e.output_ids)]
                      == e.prompt_ids + e.output_ids for e in earlier)
        retried = c.finish_reason == "stop" and any(e.prompt_ids == c.prompt_ids and e.finish_reason == "abandoned"
                                                    for e in earlier)
        assert extends or retried, i
    assert len(firsts) == run.n_roots


def test_all_kinds_occur_and_generation_is_deterministic():
    runs = generate_runs(6, SMALL, seed=1)
    kinds = {c.kind for r in runs for c in r.calls}
    assert kinds == set(KINDS)
    assert {n.kind for r in runs for n in r.tree.nodes()} == set(KINDS)
    assert sum(r.n_retries for r in runs) > 0 and sum(r.n_subagents for r in runs) > 0
    again = generate_runs(6, SMALL, seed=1)
    assert [[(c.prompt_ids, c.output_ids, c.logprobs, c.kind) for c in r.calls] for r in runs] == \
        [[(c.prompt_ids, c.output_ids, c.logprobs, c.kind) for c in r.calls] for r in again]
    assert [c.output_ids for c in generate_run(SMALL, 5).calls] != [c.output_ids for c in generate_run(SMALL, 6).calls]
    assert generate_run(seed=0).n_main_turns >= SyntheticConfig().main_turns[0]  # the defaults work


def test_bad_config_rejected():
    with pytest.raises(ValueError, match="output_tokens"):
        SyntheticConfig(output_tokens=(0, 5))
    with pytest.raises(ValueError, match="compact_every"):
        SyntheticConfig(compact_every=0)


@pytest.mark.parametrize("seed", range(6))
def test_bounded_unbounded_and_naive_claims(seed):
    tree = generate_run(SMALL, 100 + seed).tree
    ids = TargetIds()
    everything = ids.trainable(tree)
    assert len(everything) == tree.n_trainable()

    a_segs, a_n = tree.segments(max_paths=5)
    b_segs, b_n = tree.segments()
    naive = all_paths_without_dedup(tree)
    a, b, c = ids.targets(a_segs), ids.targets(b_segs), ids.targets(naive)

    # (b) no limit + dedup: every target of the tree, each exactly once
    assert len(b) == len(set(b)) == b_n and set(b) == everything
    # (a) Jmax=5 + dedup: each once, a subset of (b); here strictly smaller (the bounded-sampling cost)
    assert len(a_segs) == 5 and len(b_segs) > 5
    assert len(a) == len(set(a)) == a_n and set(a) < set(b)
    # (c) naive: the same targets, but those shared by several paths counted once per path
    assert len(naive) == len(tree.leaves()) and set(c) == everything
    assert len(c) > len(set(c))
    paths_through = {t: c.count(t) for t in set(c)}
    assert max(paths_through.values()) > 1
    assert len(c) == sum(paths_through.values())
