"""Draw a rollout's trajectory tree as text (`gyre tree RUN ROLLOUT`): pure functions, no I/O.

One line per node, `tree`-style connectors, columns aligned: kind and node key, tokens in the node, how many
of them are trainable (sampled by the policy at that prefix), how the call that ended at the node finished,
and `◆ path N` on leaves (each leaf ends one root-to-leaf path, a candidate training sequence). Runs of
single-child nodes (an agent's turns extending one another) fold into one `┊` line; depth, siblings and lines
are capped with `…` lines that say what they hide. A summary header counts nodes, paths, roots, tokens and
kinds. Works on the ledger's `tree_nodes` rows; a RunTree is drawn through the same rows (`persist.tree_rows`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gyre_slurm.trajectory.tree import KINDS, RunTree

LEGEND = ("kind #node_key · tokens in the node, of them trainable · how the call ending there finished · "
          "◆ leaf (a path's end) · ┊ folded chain")


@dataclass
class _Node:
    key: int
    parent: int | None
    kind: str
    n_tokens: int
    n_trainable: int
    finish: str | None
    seq: int
    children: list[_Node] = field(default_factory=list)
    # the subtree rooted here: nodes, leaves, tokens, trainable tokens
    size: int = 1
    leaves: int = 0
    tokens: int = 0
    trainable: int = 0


@dataclass
class _Line:
    tree: str  # connectors and label (node lines) or the whole text (notes)
    cols: tuple[str, str, str, str] | None = None  # tokens, trainable, call ended, path mark (node lines only)
    accounts: int = 0  # how many nodes this line stands for (1 for a node, more for a `…`/`┊` note)


def _n(x: int) -> str:
    return f"{x:,}"


def _build(rows: Iterable[Mapping[str, Any]]) -> list[_Node]:
    """Link rows into nodes; returns the roots (a row whose parent is missing counts as a root)."""
    nodes = {int(r["node_key"]): _Node(int(r["node_key"]), r["parent_key"], r["kind"], int(r["n_tokens"]),
                                       int(r["n_trainable"]), r["finish_reason"], int(r["commit_seq"] or 0))
             for r in rows}
    roots = []
    for n in nodes.values():
        p = nodes.get(n.parent) if n.parent is not None else None
        if p is None or p is n:
            roots.append(n)
        else:
            p.children.append(n)
    order = lambda n: (n.seq, n.key)  # noqa: E731 - oldest call first
    roots.sort(key=order)
    # post-order without recursion (a long agent run is a deep chain), guarding against a cycle in bad rows
    seen: set[int] = set()
    stack: list[tuple[_Node, bool]] = [(r, False) for r in roots]
    while stack:
        n, done = stack.pop()
        if done:
            n.children.sort(key=order)
            n.leaves = sum(c.leaves for c in n.children) or 1
            n.size = 1 + sum(c.size for c in n.children)
            n.tokens = n.n_tokens + sum(c.tokens for c in n.children)
            n.trainable = n.n_trainable + sum(c.trainable for c in n.children)
            continue
        if n.key in seen:
            continue
        seen.add(n.key)
        n.children = [c for c in n.children if c.key not in seen]
        stack.append((n, True))
        stack.extend((c, False) for c in n.children)
    return roots


def _plural(n: int, word: str) -> str:
    return f"{_n(n)} {word}{'s' * (n != 1)}"


def _hidden(nodes: list[_Node]) -> str:
    tokens, trainable = sum(n.tokens for n in nodes), sum(n.trainable for n in nodes)
    return (f"{_plural(sum(n.size for n in nodes), 'node')}, {_plural(sum(n.leaves for n in nodes), 'path')}, "
            f"{_n(tokens)} tokens ({_n(trainable)} trainable)")


def _counts(c: Counter) -> str:
    return ", ".join(f"{k}×{v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def _walk(roots: list[_Node]) -> list[_Node]:
    every, stack = [], list(roots)
    while stack:
        n = stack.pop()
        every.append(n)
        stack.extend(n.children)
    return every


def _header(roots: list[_Node], every: list[_Node]) -> list[str]:
    leaves = [n for n in every if not n.children]
    branch_points = sum(1 for n in every if len(n.children) > 1)
    kinds, path_kinds = Counter(n.kind for n in every), Counter(n.kind for n in leaves)
    by_priority = sorted(kinds, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    return [
        f"{_plural(len(every), 'node')} · {_plural(len(leaves), 'path')} (leaves) · {_plural(len(roots), 'root')} · "
        f"{_plural(branch_points, 'branch point')} · {_n(sum(n.n_tokens for n in every))} tokens, "
        f"{_n(sum(n.n_trainable for n in every))} trainable",
        "kinds (nodes/paths): " + " · ".join(f"{k} {kinds[k]}/{path_kinds[k]}" for k in by_priority),
        LEGEND,
        "",
    ]


@dataclass
class _Drawer:
    """Depth-first drawing of the nodes into lines, folding chains and cutting what the limits hide."""

    max_depth: int
    max_children: int
    fold_chain: int
    max_lines: int
    lines: list[_Line] = field(default_factory=list)
    path_no: int = 0

    def note(self, text: str, accounts: int) -> None:
        self.lines.append(_Line(text, None, accounts))

    def draw(self, n: _Node, lead: str, cont: str, depth: int) -> None:
        if len(self.lines) > self.max_lines:
            return  # cut below anyway
        mark = ""
        if not n.children:
            self.path_no += 1
            mark = f"◆ path {self.path_no}"
        self.lines.append(_Line(f"{lead}{n.kind} #{n.key}", (_n(n.n_tokens), _n(n.n_trainable), n.finish or "",
                                                             mark), 1))
        kids = n.children
        if not kids:
            return
        if depth >= self.max_depth:
            self.note(f"{cont}└┄ … {_hidden(kids)} below", sum(k.size for k in kids))
            return
        if len(kids) == 1 and self._fold(kids[0], cont, depth):
            return
        shown, hidden = kids[:self.max_children], kids[self.max_children:]
        for i, k in enumerate(shown):
            last = i == len(shown) - 1 and not hidden
            self.draw(k, cont + ("└── " if last else "├── "), cont + ("    " if last else "│   "), depth + 1)
        if hidden:
            self.note(f"{cont}└┄ … {len(hidden)} more branches: {_hidden(hidden)}", sum(k.size for k in hidden))

    def _fold(self, c: _Node, cont: str, depth: int) -> bool:
        """A run of single-child nodes as one line, keeping its last node; False when the run is too short."""
        chain = []
        while len(c.children) == 1:
            chain.append(c)
            c = c.children[0]
        if len(chain) < self.fold_chain:
            return False
        tok, tr = sum(x.n_tokens for x in chain), sum(x.n_trainable for x in chain)
        ended = Counter(x.finish for x in chain if x.finish)
        self.note(f"{cont}┊   {len(chain)} more nodes in a line ({_counts(Counter(x.kind for x in chain))}): "
                  f"{_n(tok)} tokens ({_n(tr)} trainable)" + (f", calls ended {_counts(ended)}" if ended else ""),
                  len(chain))
        self.draw(c, f"{cont}└── ", f"{cont}    ", depth + 1)
        return True

    def draw_roots(self, roots: list[_Node], n_nodes: int) -> list[_Line]:
        for r in roots[:self.max_children]:
            self.draw(r, "", "", 0)
        if len(roots) > self.max_children:
            rest = roots[self.max_children:]
            self.note(f"… {len(rest)} more roots: {_hidden(rest)}", sum(r.size for r in rest))
        if len(self.lines) <= self.max_lines:
            return self.lines
        kept = self.lines[:self.max_lines - 1]
        left = n_nodes - sum(x.accounts for x in kept)
        return [*kept, _Line(f"… drawing cut at {self.max_lines} lines: {_n(left)} more nodes not drawn")]


def _columns(lines: list[_Line]) -> list[str]:
    width = min(64, max((len(x.tree) for x in lines if x.cols), default=0))
    out = [f"{'':<{width}}  {'tokens':>8}  {'trainable':>9}  call ended"]
    for x in lines:
        if x.cols is None:
            out.append(x.tree)
        else:
            tok, tr, fin, mark = x.cols
            out.append(f"{x.tree:<{width}}  {tok:>8}  {tr:>9}  {fin:<12}  {mark}".rstrip())
    return out


def render(rows: Iterable[Mapping[str, Any]], title: str | None = None, *, max_depth: int = 16,
           max_children: int = 8, fold_chain: int = 3, max_lines: int = 400) -> list[str]:
    """The drawing of one tree, as lines. `rows`: dicts with node_key, parent_key (None under the root), kind,
    n_tokens, n_trainable, finish_reason, commit_seq (tree_nodes rows, or `persist.tree_rows`). A node's
    children beyond `max_children`, levels beyond `max_depth` and lines beyond `max_lines` become `…` lines;
    `fold_chain` or more single-child nodes in a row become one `┊` line."""
    roots = _build(list(rows))
    out = [title] if title else []
    if not roots:
        return [*out, "empty tree: no model call recorded"]
    every = _walk(roots)
    lines = _Drawer(max_depth, max_children, fold_chain, max_lines).draw_roots(roots, len(every))
    return [*out, *_header(roots, every), *_columns(lines)]


def render_tree(tree: RunTree, title: str | None = None, **opts: Any) -> list[str]:
    """Draw a RunTree in memory: the same drawing as from its ledger rows."""
    from gyre_slurm.trajectory.persist import tree_rows

    return render(tree_rows(tree, None), title, **opts)
