"""Prefix KV reuse: finished sequences' KV caches in an LRU bounded by bytes, and the KV of running requests.

A request whose input_ids start with a cached sequence prefills only the rest. An agent's next turn extends its
previous prompt + output, so it takes over the whole cached entry without copying; a request sharing only part of
an entry gets a copy of that part and leaves the entry in place. A running request's KV is a source too (copied,
never taken): the rollouts of a group start together with the same long system prompt, and every one after the
first copies the KV the first has just computed instead of computing it again.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from gyre_slurm.model.qwen3 import KVCache


@dataclass(eq=False)
class CacheEntry:
    tokens: torch.Tensor  # int64, the tokens whose KV the cache holds
    first: int  # tokens[0], to skip most entries without a tensor comparison
    cache: KVCache
    nbytes: int  # what its tensors hold (their capacity, which may exceed the valid tokens)


@dataclass(eq=False)
class Donor:
    """A running request's KV as a source: its first cache.length tokens of prompt + output."""

    prompt: torch.Tensor  # int64
    output: Sequence[int]
    cache: KVCache


def common_prefix(a: torch.Tensor, b: torch.Tensor, n: int) -> int:
    """How many of the first n tokens a and b share (both hold at least n)."""
    if n <= 0:
        return 0
    eq = a[:n] == b[:n]
    return n if bool(eq.all()) else int(torch.argmin(eq.to(torch.int8)))


def donor_match(ids: torch.Tensor, donor: Donor, n: int) -> int:
    """Common prefix of ids and the donor's prompt + output, over at most n tokens."""
    in_prompt = min(n, len(donor.prompt))
    m = common_prefix(ids, donor.prompt, in_prompt)
    if m < in_prompt or n == in_prompt:
        return m
    rest = torch.tensor(list(donor.output[: n - in_prompt]), dtype=torch.int64)
    return m + common_prefix(ids[m:], rest, len(rest))


class PrefixCache:
    """LRU of finished sequences' KV caches, bounded by the bytes of their tensors."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.bytes = 0
        self.tokens = 0  # valid tokens held
        self._ids = itertools.count()

    def put(self, tokens: list[int], cache: KVCache) -> None:
        n, nbytes = cache.length, cache.nbytes()
        if n == 0 or nbytes > self.max_bytes:
            return
        entry = CacheEntry(torch.tensor(tokens[:n], dtype=torch.int64), tokens[0], cache, nbytes)
        self.entries[next(self._ids)] = entry
        self.bytes += nbytes
        self.tokens += n
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self._forget(old)

    def _forget(self, entry: CacheEntry) -> None:
        self.bytes -= entry.nbytes
        self.tokens -= entry.cache.length

    def _best(self, input_ids: list[int], ids: torch.Tensor,
              running: Iterable[Donor]) -> tuple[int | None, Donor | None, int]:
        """(LRU key, running donor, tokens) of the longest prefix of input_ids held anywhere, at most len - 1."""
        limit = len(input_ids) - 1
        best_key, best = None, 0
        for key, e in self.entries.items():
            if e.first != input_ids[0]:
                continue
            n = min(e.cache.length, limit)
            if n > best:
                m = common_prefix(e.tokens, ids, n)
                if m > best:
                    best_key, best = key, m
        donor = None
        for d in running:
            n = min(d.cache.length, limit)
            if n > best and int(d.prompt[0]) == input_ids[0]:
                m = donor_match(ids, d, n)
                if m > best:
                    donor, best = d, m
        return (None, donor, best) if donor is not None else (best_key, None, best)

    def peek(self, input_ids: list[int], ids: torch.Tensor, running: Iterable[Donor] = ()) -> int:
        """How many tokens take() would reuse now."""
        return self._best(input_ids, ids, running)[2]

    def take(self, input_ids: list[int], ids: torch.Tensor, capacity: int = 0,
             running: Iterable[Donor] = ()) -> tuple[KVCache | None, int]:
        """The KV of the longest prefix of input_ids held by an entry or a running request (at most len - 1
        tokens: one must be computed), in a cache with room for `capacity` tokens; and how many tokens it holds."""
        best_key, donor, best = self._best(input_ids, ids, running)
        if donor is not None:
            return donor.cache.copy_prefix(best, capacity), best
        if best_key is None:
            return None, 0
        entry = self.entries[best_key]
        if best == entry.cache.length or (best == len(input_ids) - 1 and best == entry.cache.length - 1):
            # The request extends (nearly) the whole entry: take it over instead of copying.
            del self.entries[best_key]
            self._forget(entry)
            entry.cache.length = best
            entry.cache.reserve(capacity)
            return entry.cache, best
        self.entries.move_to_end(best_key)
        return entry.cache.copy_prefix(best, capacity), best

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        self.tokens = 0
