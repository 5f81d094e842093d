"""A run's trajectory tree: a radix tree over token ids (docs/algorithms.md §2.5), and its training paths (§3.3).

Every model call inserts prompt ids (context) and output ids (trainable, with behaviour log-probs and the
weight version that sampled them). Invariants: each (prefix, token) position exists once; `trainable` is
monotone (a token the policy sampled at exactly this prefix stays a target even when later calls replay it
as context); every trainable token carries a log-prob and a version. Pure data structure: no I/O.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

KINDS = ("main", "main_summary", "subagent", "subagent_summary")  # priority order for path selection


def _ids(seq: Iterable[int] = ()) -> array:
    return array("i", seq)


def _as(code: str, seq: Iterable) -> array:
    """seq as an array of `code`, not copied when it is one already (a decoded CallRecord's ids)."""
    return seq if isinstance(seq, array) and seq.typecode == code else array(code, seq)


@dataclass(eq=False)
class Node:
    """A run of tokens with one parent. Per-token data lives in typed arrays, not lists: 4 bytes an id and 1 a
    target flag, plus 8 for a log-prob and 4 for a version only in nodes that hold targets (context alone has
    neither), so a 700k-token tree costs ~5 bytes a token and the garbage collector never walks its tokens."""

    tokens: array = field(default_factory=_ids)  # array('i')
    trainable: bytearray = field(default_factory=bytearray)  # 1: a target (the policy sampled it here)
    _logp: array | None = None  # array('d') behaviour log-probs (NaN where not a target); None: no target yet
    _version: array | None = None  # array('i') weight version of each target (-1 elsewhere); None: no target yet
    children: dict[int, Node] = field(default_factory=dict)
    parent: Node | None = None
    kind: str = "main"
    finish_reason: str | None = None  # set on the node where a call's output ended
    commit_seq: int = 0  # insertion order of the call that created the node
    key: int = 0  # stable id within the tree (for the ledger's tree_nodes)
    marks: list[int] = field(default_factory=list)  # call boundaries at this node's end (RunTree._mark)

    @property
    def logp(self) -> array:
        return self._logp if self._logp is not None else array("d", [math.nan]) * len(self.tokens)

    @property
    def version(self) -> array:
        return self._version if self._version is not None else array("i", [-1]) * len(self.tokens)

    def set_target(self, j: int, logp: float, version: int) -> None:
        if self._logp is None or self._version is None:
            self._logp, self._version = self.logp, self.version
        self.trainable[j] = 1
        self._logp[j] = logp
        self._version[j] = version

    def _split(self, at: int, key: int) -> Node:
        """Keep tokens[:at] here; move the rest (and the children) into a new child. Returns the child."""
        lp, ver = self._logp, self._version
        tail = Node(self.tokens[at:], self.trainable[at:], lp[at:] if lp is not None else None,
                    ver[at:] if ver is not None else None, self.children, self, self.kind, self.finish_reason,
                    self.commit_seq, key, self.marks)
        for c in tail.children.values():
            c.parent = tail
        del self.tokens[at:], self.trainable[at:]
        if lp is not None and ver is not None:
            del lp[at:], ver[at:]
        self.children = {tail.tokens[0]: tail}
        self.finish_reason = None
        self.marks = []
        return tail


@dataclass
class Segment:
    """One training sequence: a root-to-leaf path, with loss only on the targets this path claimed."""

    tokens: list[int]
    loss_mask: list[int]
    behav_logp: list[float]  # 0.0 where loss_mask is 0
    kind: str


class RunTree:
    def __init__(self) -> None:
        self.root = Node()
        self._keys = 0
        self._seq = 0
        self.n_calls = 0
        self.duplicate_targets = 0  # sampled again at the same prefix: kept once (metrics)
        # call boundaries: mark 2c = end of call c's output, 2c+1 = end of its prompt -> (node ending there, depth)
        self._marks: dict[int, tuple[Node, int]] = {}

    def _new_key(self) -> int:
        self._keys += 1
        return self._keys

    def _split(self, node: Node, at: int) -> Node:
        tail = node._split(at, self._new_key())
        for m in tail.marks:
            self._marks[m] = (tail, self._marks[m][1])
        return tail

    def _mark(self, node: Node, mark: int, depth: int) -> None:
        node.marks.append(mark)
        self._marks[mark] = (node, depth)

    def _descend(self, node: Node, seq: array, logprobs: array | None, version: int, kind: str) -> Node:
        """Walk/insert seq below the end of `node`; returns the node ending exactly where seq ends. With logprobs
        seq is policy output (targets), else context."""
        i = 0
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            j, n_child = 0, len(child.tokens)
            if logprobs is None and child.tokens == seq[i:i + n_child]:
                j = n_child  # context that this node holds whole: compared in C, not token by token
            while j < n_child and i + j < len(seq) and child.tokens[j] == seq[i + j]:
                if logprobs is not None:
                    if not child.trainable[j]:  # (I2): now sampled here: becomes a target
                        child.set_target(j, logprobs[i + j], version)
                    else:
                        self.duplicate_targets += 1
                j += 1
            if j < n_child:
                self._split(child, j)  # seq ends or diverges inside this node: cut it at that point
            node, i = child, i + j
        if i < len(seq):
            rest = seq[i:]
            n = len(rest)
            out = logprobs is not None
            new = Node(tokens=rest, trainable=bytearray([out]) * n,
                       _logp=logprobs[i:] if out else None,
                       _version=array("i", [version]) * n if out else None,
                       parent=node, kind=kind, commit_seq=self._seq, key=self._new_key())
            node.children[rest[0]] = new
            node = new
        return node

    def insert_call(self, prompt_ids: list[int], output_ids: list[int], logprobs: list[float], version: int,
                    kind: str = "main", finish_reason: str | None = None, call_index: int | None = None,
                    parent_call: int | None = None, reused: int = 0) -> Node:
        """Insert one model call. With parent_call, the prompt is the first `reused` ids of that call (its
        prompt ∥ output, or its prompt) followed by prompt_ids: the walk starts at that boundary, so a call
        costs what it adds, not its history (I4). Returns the node where the output ends."""
        if len(logprobs) != len(output_ids):
            raise ValueError("one log-prob per output id is required")
        node, depth = self.root, 0
        if parent_call is not None:
            for mark in (2 * parent_call, 2 * parent_call + 1):
                got = self._marks.get(mark)
                if got is not None and got[1] == reused:
                    node, depth = got
                    break
            else:
                raise ValueError(f"call {call_index}: its parent call {parent_call} has no boundary at {reused} ids")
        self._seq += 1
        self.n_calls += 1
        node = self._descend(node, _as("i", prompt_ids), None, version, kind)
        depth += len(prompt_ids)
        if call_index is not None:
            self._mark(node, 2 * call_index + 1, depth)
        node = self._descend(node, _as("i", output_ids), _as("d", logprobs), version, kind)
        if call_index is not None:
            self._mark(node, 2 * call_index, depth + len(output_ids))
        node.finish_reason = finish_reason or node.finish_reason
        return node

    # --- reading ----------------------------------------------------------------------------------------------
    def call_ends(self) -> dict[int, int]:
        """call_index → key of the node where that call's output ends (keys are final once the run is over)."""
        return {mark // 2: node.key for mark, (node, _depth) in self._marks.items() if mark % 2 == 0}

    def nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes() if not n.children]

    @staticmethod
    def path(leaf: Node) -> list[Node]:
        out = []
        n: Node | None = leaf
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def n_trainable(self) -> int:
        return sum(sum(n.trainable) for n in self.nodes())

    def segments(self, max_paths: int | None = None, max_targets: int | None = None) -> tuple[list[Segment], int]:
        """The run's training paths (docs/algorithms.md §3.3): at most `max_paths` root-to-leaf paths (Jmax), picked
        one at a time by branch kind (main > main_summary > subagent > subagent_summary), then by how many
        targets they add that no chosen path has claimed yet, then by age; a path that adds nothing is skipped.
        Each target is claimed by the first chosen path that holds it, and at most `max_targets` are claimed
        (the rest stay context). Returns (segments, |T_r|)."""
        leaves = self.leaves()
        paths = {id(lf): self.path(lf) for lf in leaves}
        claimed: set[tuple[int, int]] = set()

        def new_targets(leaf: Node) -> int:
            return sum(1 for n in paths[id(leaf)] for j, t in enumerate(n.trainable)
                       if t and (n.key, j) not in claimed)

        out: list[Segment] = []
        left = list(leaves)
        budget = max_targets
        while left and (max_paths is None or len(out) < max_paths) and (budget is None or budget > 0):
            gains = {id(lf): new_targets(lf) for lf in left}
            left = [lf for lf in left if gains[id(lf)] > 0]  # a path that adds no new target is never worth it
            if not left:
                break
            leaf = min(left, key=lambda lf: (KINDS.index(lf.kind) if lf.kind in KINDS else len(KINDS),
                                             -gains[id(lf)], lf.commit_seq))
            left.remove(leaf)
            seg = Segment([], [], [], leaf.kind)
            for node in paths[id(leaf)]:
                for j, tok in enumerate(node.tokens):
                    target = node.trainable[j] and (node.key, j) not in claimed and (budget is None or budget > 0)
                    if target:
                        claimed.add((node.key, j))
                        budget = None if budget is None else budget - 1
                    seg.tokens.append(tok)
                    seg.loss_mask.append(int(target))
                    seg.behav_logp.append(node.logp[j] if target else 0.0)
            out.append(seg)
        return out, len(claimed)
