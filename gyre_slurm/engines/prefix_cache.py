"""Prefix KV reuse: finished sequences' KV caches in an LRU bounded by tokens.

A request whose input_ids start with a cached sequence prefills only the rest. An agent's next turn extends its
previous prompt + output, so it takes over the whole cached entry without copying; a request sharing only part of
an entry gets a copy of that part and leaves the entry in place.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from gyre_slurm.model.qwen3 import KVCache


@dataclass(eq=False)
class CacheEntry:
    tokens: torch.Tensor  # int64, the tokens whose KV the cache holds
    first: int  # tokens[0], to skip most entries without a tensor comparison
    cache: KVCache


class PrefixCache:
    """LRU of finished sequences' KV caches, bounded by the total number of cached tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.tokens = 0
        self._ids = itertools.count()

    def put(self, tokens: list[int], cache: KVCache) -> None:
        n = cache.length
        if n == 0 or n > self.max_tokens:
            return
        self.entries[next(self._ids)] = CacheEntry(torch.tensor(tokens[:n], dtype=torch.int64), tokens[0], cache)
        self.tokens += n
        while self.tokens > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= old.cache.length

    def take(self, input_ids: list[int], ids: torch.Tensor) -> tuple[KVCache | None, int]:
        """The KV of the longest cached prefix of input_ids (at most len - 1 tokens: one must be computed)."""
        limit = len(input_ids) - 1
        best_key, best = None, 0
        for key, e in self.entries.items():
            if e.first != input_ids[0]:
                continue
            n = min(e.cache.length, limit)
            if n <= best:
                continue
            eq = e.tokens[:n] == ids[:n]
            m = n if bool(eq.all()) else int(torch.argmin(eq.to(torch.int8)))
            if m > best:
                best_key, best = key, m
        if best_key is None:
            return None, 0
        entry = self.entries[best_key]
        if best == entry.cache.length or (best == limit and best == entry.cache.length - 1):
            # The request extends (nearly) the whole entry: take it over instead of copying.
            del self.entries[best_key]
            self.tokens -= entry.cache.length
            entry.cache.length = best
            return entry.cache, best
        self.entries.move_to_end(best_key)
        return entry.cache.copy_prefix(best), best

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
