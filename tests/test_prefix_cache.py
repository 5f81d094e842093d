"""The engine's prefix KV reuse (engines/prefix_cache.py): longest prefix, take-over or copy, running requests as
sources, and the bound in bytes."""

from __future__ import annotations

import torch

from gyre_slurm.engines.prefix_cache import Donor, PrefixCache, common_prefix
from gyre_slurm.model.qwen3 import KVCache, Qwen3Config

CONFIG = Qwen3Config(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=4, max_position_embeddings=256)


def filled(tokens: list[int], capacity: int | None = None) -> KVCache:
    """A cache whose key and value at position i are the token there (so copies can be checked)."""
    cache = KVCache(CONFIG, capacity or len(tokens))
    for store in (cache.keys, cache.values):
        for t in store:
            t[:, :, : len(tokens)] = torch.tensor(tokens, dtype=t.dtype)[None, None, :, None]
    cache.length = len(tokens)
    return cache


def take(pc: PrefixCache, ids: list[int], capacity: int = 0, running=()):
    return pc.take(ids, torch.tensor(ids), capacity, running)


def test_common_prefix():
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9, 4])
    assert common_prefix(a, b, 4) == 2 and common_prefix(a, a, 3) == 3 and common_prefix(a, b, 0) == 0


def test_longest_prefix_is_taken_over_or_copied():
    pc = PrefixCache(1 << 30)
    pc.put(list(range(1, 11)), filled(list(range(1, 11))))
    pc.put([1, 2, 3, 50, 51], filled([1, 2, 3, 50, 51]))
    # a branch of the first entry: a copy of its 5-token prefix, with room for what the request needs
    cache, n = take(pc, [1, 2, 3, 4, 5, 99, 98], capacity=40)
    assert n == 5 and cache.length == 5 and cache.capacity == 40 and len(pc.entries) == 2
    assert cache.keys[0][0, 0, :5, 0].tolist() == [1, 2, 3, 4, 5]
    # the next turn of the first entry takes it over (no copy) and the entry leaves the LRU
    cache, n = take(pc, list(range(1, 11)) + [7, 7], capacity=30)
    assert n == 10 and cache.capacity >= 30 and len(pc.entries) == 1 and pc.tokens == 5
    assert take(pc, [9, 9, 9]) == (None, 0)


def test_running_requests_are_copied_never_taken():
    pc = PrefixCache(1 << 30)
    pc.put([1, 2, 3], filled([1, 2, 3]))
    prompt, output = [1, 2, 3, 4, 5, 6], [7, 8, 9]  # KV for the prompt and the first two output tokens
    running = filled(prompt + output[:2], capacity=64)
    donor = Donor(torch.tensor(prompt), output, running)
    cache, n = take(pc, prompt + [7, 8, 100], capacity=20, running=[donor])
    assert n == 8 and cache is not running and cache.capacity == 20 and running.length == 8
    assert cache.values[1][0, 1, :8, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    cache, n = take(pc, [1, 2, 3, 4, 0], running=[donor])  # shares only part of the prompt
    assert n == 4
    assert len(pc.entries) == 1  # the LRU entry (shorter) was left alone


def test_bound_in_bytes_counts_capacity():
    per_token = filled([1]).nbytes()
    pc = PrefixCache(100 * per_token)
    pc.put(list(range(60)), filled(list(range(60)), capacity=80))  # 80 tokens' worth of memory
    assert pc.bytes == 80 * per_token and pc.tokens == 60
    pc.put([5] * 30, filled([5] * 30))  # 110 > 100: the oldest goes
    assert len(pc.entries) == 1 and pc.bytes == 30 * per_token and pc.tokens == 30
    pc.put(list(range(200)), filled(list(range(200))))  # larger than the whole budget: not kept
    assert len(pc.entries) == 1
    pc.clear()
    assert pc.bytes == pc.tokens == 0 and not pc.entries


def test_prefill_order(tmp_path):
    """The scheduler's choice of the prompt that gets a step's chunk: in turn the one closest to done and the
    oldest; a prompt that shares more than a chunk with one under way waits for it (then copies its KV)."""
    from types import SimpleNamespace as NS

    from gyre_slurm.engines.model_thread import EmbeddedEngine, EngineOptions
    from gyre_slurm.model.tiny import create_tiny_model

    engine = EmbeddedEngine(EngineOptions(str(create_tiny_model(tmp_path / "m", seed=0)), chunked_prefill_size=64))

    def req(ids, fed=0, started=False, hint=0):
        return NS(inp=NS(input_ids=ids), ids=torch.tensor(ids), fed=fed, cache=object() if started else None,
                  reuse_hint=hint)

    cold = req(list(range(1000)), fed=128, started=True)
    later = req([7] * 900 + [8] * 20, hint=900)  # its history is cached: 20 tokens to compute
    assert [engine._next_prefill([cold, later]) for _ in range(4)] == [later, cold, later, cold]
    sibling = req(list(range(990)) + [5, 5])  # the same system prompt as `cold`, which has computed 128 of it
    assert {id(engine._next_prefill([cold, sibling])) for _ in range(4)} == {id(cold)}
    cold.fed = 990  # the shared part is computed: the sibling may start (and copy it)
    assert not engine._awaits_shared_prefix(sibling, [cold, sibling])
    other = req(list(range(1000)), started=True)
    brief = req(list(range(40)) + [1])  # shares less than a chunk with it: no reason to wait
    assert [engine._next_prefill([other, brief]) for _ in range(2)] == [brief, other]
