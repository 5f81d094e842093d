"""Synthetic run trees shaped like a compressing, sub-agent-spawning agent harness (Claude Code-like).

For benchmarks and tests of path selection (docs/algorithms.md §3.3): no model, no tokenizer, only the shape of the
calls a harness sends through the TITO proxy. Every call is inserted with `RunTree.insert_call`, and its prompt
ids are built exactly as the proxy builds them (§2.3): the previous call's prompt + its output + a new suffix.

What one synthetic run does (all lengths are drawn uniformly from the inclusive (lo, hi) ranges of
`SyntheticConfig`, with a `random.Random` seeded per run, so a seed always gives the same tree):

* **Main conversation.** The first prompt is a conversation header, the system prompt (`system_tokens`) and the
  task (`task_tokens`). Each of `main_turns` turns is one model call (kind ``main``) whose output has
  `output_tokens` tokens; the next turn's prompt is that prompt + output + a tool result (`tool_result_tokens`).
* **Compaction.** Every `compact_every` main turns (when more turns follow) the conversation is summarised: a
  **new root** whose prompt is a fresh header + a summary prompt (`summary_prompt_tokens`: the summarisation
  instruction and a re-tokenised digest of the history, all context) and whose output is the model's summary
  (`summary_output_tokens`, kind ``main_summary``). The main conversation then continues from that root: the
  next main prompt is summary prompt + summary output + a "continue" message (`tool_result_tokens`).
* **Sub-agents.** After each main turn but the last, with probability `subagent_prob`, the main agent spawns a
  sub-agent (as Claude Code's Task tool does). The sub-agent has its own system prompt, so its conversation is a
  **separate root**: header + `subagent_system_tokens` + a task written for it (`subagent_task_tokens`). It runs
  `subagent_turns` turns (kind ``subagent``), compacts every `subagent_compact_every` turns into a new root of
  kind ``subagent_summary`` (same rules as the main conversation), and its final output is copied, re-tokenised
  as context, into the main agent's next tool result. Sub-agents do not spawn sub-agents.
* **Retries.** Any call is re-sent with probability `retry_prob` (a bad generation, a client timeout): the
  abandoned attempt is inserted first with the same prompt and a different output (its first token differs
  from the kept attempt's), which makes a **sibling leaf**; the conversation continues from the kept attempt.

Shape guarantees (checked by tests/test_synthetic.py):

* Every conversation starts with a header whose first token no other conversation of the run uses, so the tree
  has exactly ``1 + n_compactions + n_subagents + n_subagent_compactions`` roots (children of `RunTree.root`).
  Real chat templates start every conversation with the same `<|im_start|>system` tokens; such a shared prefix
  is context only, so it changes the compute of a packed forward but not which targets exist.
* ``len(tree.leaves()) == n_roots + n_retries``, and ``tree.n_trainable()`` is the total number of output tokens
  (kept and abandoned attempts), each sampled once at its prefix.
* Behaviour log-probs are drawn uniformly from `logprob_range`; every call uses weight version `version`.

`all_paths_without_dedup` gives the naive flattening that §3.2 (S1) counts: one sequence per root-to-leaf path
with every trainable token on it a target, so a target shared by k paths is counted k times.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gyre_slurm.trajectory.tree import RunTree, Segment

Range = tuple[int, int]


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape parameters of a synthetic run. (lo, hi) ranges are inclusive and drawn uniformly per occurrence."""

    main_turns: Range = (24, 40)  # model calls of the main agent (retries and summaries not counted)
    header_tokens: int = 4  # conversation header (its first token is unique to the conversation)
    system_tokens: Range = (200, 400)  # main system prompt
    task_tokens: Range = (40, 160)  # the task, the first user message
    output_tokens: Range = (20, 200)  # one model output (main and sub-agent turns)
    tool_result_tokens: Range = (30, 400)  # one tool result / user message appended after an output
    compact_every: int | None = 12  # main turns between compactions; None: never
    summary_prompt_tokens: Range = (150, 400)  # a compaction root's prompt (context)
    summary_output_tokens: Range = (100, 300)  # the model's summary (trainable)
    subagent_prob: float = 0.15  # chance that a main turn spawns a sub-agent
    subagent_turns: Range = (3, 10)
    subagent_system_tokens: Range = (100, 250)
    subagent_task_tokens: Range = (30, 120)
    subagent_compact_every: int | None = 6  # sub-agent turns between its compactions; None: never
    retry_prob: float = 0.05  # chance that any call is re-sent (the abandoned attempt becomes a sibling leaf)
    vocab_size: int = 256  # token ids are drawn from range(vocab_size)
    logprob_range: tuple[float, float] = (-4.0, -0.01)
    version: int = 0  # weights version recorded on every sampled token

    def __post_init__(self) -> None:
        for name in ("main_turns", "system_tokens", "task_tokens", "output_tokens", "tool_result_tokens",
                     "summary_prompt_tokens", "summary_output_tokens", "subagent_turns", "subagent_system_tokens",
                     "subagent_task_tokens"):
            lo, hi = getattr(self, name)
            minimum = 1 if name in ("main_turns", "subagent_turns", "output_tokens", "summary_output_tokens") else 0
            if not minimum <= lo <= hi:
                raise ValueError(f"{name} = {(lo, hi)}: need {minimum} <= lo <= hi")
        for name in ("compact_every", "subagent_compact_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, not {v}")
        if not (0.0 <= self.subagent_prob <= 1.0 and 0.0 <= self.retry_prob < 1.0):
            raise ValueError("subagent_prob must be in [0, 1] and retry_prob in [0, 1)")
        if self.header_tokens < 1 or self.vocab_size < 2:
            raise ValueError("header_tokens must be >= 1 and vocab_size >= 2")
        lo, hi = self.logprob_range
        if not lo <= hi <= 0.0:
            raise ValueError(f"logprob_range = {self.logprob_range}: need lo <= hi <= 0")


@dataclass
class Call:
    """One model call as the proxy recorded it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    kind: str
    finish_reason: str  # "stop" for a kept call, "abandoned" for a retried attempt


@dataclass
class SyntheticRun:
    tree: RunTree
    calls: list[Call] = field(default_factory=list)  # in insertion order
    n_main_turns: int = 0
    n_compactions: int = 0  # main-conversation compactions (main_summary roots)
    n_subagents: int = 0  # sub-agent conversations started (subagent roots)
    n_subagent_compactions: int = 0  # subagent_summary roots
    n_retries: int = 0  # abandoned attempts (sibling leaves)

    @property
    def n_roots(self) -> int:
        return 1 + self.n_compactions + self.n_subagents + self.n_subagent_compactions


class _Builder:
    def __init__(self, cfg: SyntheticConfig, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        self.run = SyntheticRun(RunTree())
        self.free_first = list(range(cfg.vocab_size))  # first tokens no conversation has used yet
        rng.shuffle(self.free_first)

    def n(self, r: Range) -> int:
        return self.rng.randint(r[0], r[1])

    def tokens(self, r: Range | int) -> list[int]:
        k = r if isinstance(r, int) else self.n(r)
        return [self.rng.randrange(self.cfg.vocab_size) for _ in range(k)]

    def header(self) -> list[int]:
        if not self.free_first:
            raise ValueError(f"more conversations than vocab_size ({self.cfg.vocab_size}) distinct first tokens")
        return [self.free_first.pop(), *self.tokens(self.cfg.header_tokens - 1)]

    def call(self, prompt: list[int], kind: str, out_range: Range) -> list[int]:
        """One model call (and maybe an abandoned attempt before it); returns the kept output."""
        cfg, rng = self.cfg, self.rng
        out = self.tokens(out_range)
        lo, hi = cfg.logprob_range
        if rng.random() < cfg.retry_prob:
            bad = self.tokens(out_range)
            bad[0] = (out[0] + 1 + rng.randrange(cfg.vocab_size - 1)) % cfg.vocab_size  # differs from the kept one
            self._insert(Call(list(prompt), bad, [rng.uniform(lo, hi) for _ in bad], kind, "abandoned"))
            self.run.n_retries += 1
        self._insert(Call(list(prompt), out, [rng.uniform(lo, hi) for _ in out], kind, "stop"))
        return out

    def _insert(self, c: Call) -> None:
        self.run.tree.insert_call(c.prompt_ids, c.output_ids, c.logprobs, self.cfg.version, kind=c.kind,
                                  finish_reason=c.finish_reason)
        self.run.calls.append(c)

    def conversation(self, system: Range, task: list[int], turns: int, compact_every: int | None, kind: str,
                     spawn: bool) -> list[int]:
        """A main or sub-agent conversation with its compactions; returns its final output."""
        cfg = self.cfg
        prompt = [*self.header(), *self.tokens(system), *task]
        out: list[int] = []
        for t in range(1, turns + 1):
            out = self.call(prompt, kind, cfg.output_tokens)
            if kind == "main":
                self.run.n_main_turns += 1
            if t == turns:
                break
            suffix = self.tokens(cfg.tool_result_tokens)
            if spawn and self.rng.random() < cfg.subagent_prob:
                suffix += self.subagent()  # the sub-agent's report comes back in the tool result
            prompt = prompt + out + suffix
            if compact_every is not None and t % compact_every == 0:
                root = [*self.header(), *self.tokens(cfg.summary_prompt_tokens)]
                summary = self.call(root, f"{kind}_summary", cfg.summary_output_tokens)
                if kind == "main":
                    self.run.n_compactions += 1
                else:
                    self.run.n_subagent_compactions += 1
                prompt = root + summary + self.tokens(cfg.tool_result_tokens)
        return out

    def subagent(self) -> list[int]:
        cfg = self.cfg
        self.run.n_subagents += 1
        report = self.conversation(cfg.subagent_system_tokens, self.tokens(cfg.subagent_task_tokens),
                                   self.n(cfg.subagent_turns), cfg.subagent_compact_every, "subagent", spawn=False)
        return list(report)  # re-tokenised into the main agent's context (same ids, no longer trainable there)


def generate_run(cfg: SyntheticConfig | None = None, seed: int = 0) -> SyntheticRun:
    """One synthetic run; the same (cfg, seed) always gives the same calls and tree."""
    cfg = cfg or SyntheticConfig()
    b = _Builder(cfg, random.Random(seed))
    b.conversation(cfg.system_tokens, b.tokens(cfg.task_tokens), b.n(cfg.main_turns), cfg.compact_every, "main",
                   spawn=True)
    return b.run


def generate_runs(n: int, cfg: SyntheticConfig | None = None, seed: int = 0) -> list[SyntheticRun]:
    """n independent runs (a group, say); run i uses its own seed drawn from `seed`."""
    master = random.Random(seed)
    return [generate_run(cfg, master.randrange(2**63)) for _ in range(n)]


def all_paths_without_dedup(tree: RunTree) -> list[Segment]:
    """Naive flattening, no path limit and no dedup: one segment per root-to-leaf path that holds a target,
    every trainable token on it a target (a target shared by k paths appears k times)."""
    out = []
    for leaf in sorted(tree.leaves(), key=lambda lf: lf.commit_seq):
        seg = Segment([], [], [], leaf.kind)
        for node in tree.path(leaf):
            seg.tokens += node.tokens
            seg.loss_mask += [int(t) for t in node.trainable]
            seg.behav_logp += [lp if t else 0.0 for lp, t in zip(node.logp, node.trainable, strict=True)]
        if any(seg.loss_mask):
            out.append(seg)
    return out
