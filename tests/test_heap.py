"""model/heap.py: within freed_memory_kept() the pages of a training step's large tensors (logits over a
151,936-id vocabulary and their gradients) are reused by the next step instead of being unmapped and faulted in
again (a third of the long model's warm-up step); after it, the kept memory goes back to the system."""

from __future__ import annotations

import os
import resource

import torch

from gyre_slurm.model.heap import freed_memory_kept


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_steps_pages_are_reused_within_and_returned_after() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(151_936, 16)  # a tied head: logits [300, 151936] (182 MB) and their gradients
    ids = torch.randint(0, 151_936, (300,))

    def faults_per_step(n: int) -> float:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            emb.weight.grad = None
            torch.nn.functional.cross_entropy(emb(ids) @ emb.weight.T, ids).backward()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n

    default = faults_per_step(3)
    assert default > 100_000  # glibc's default: every large tensor an mmap of its own, faulted in page by page
    with freed_memory_kept() as kept:
        assert kept
        faults_per_step(3)  # the heap grows to hold a step
        assert faults_per_step(6) < 0.25 * default  # then its pages serve the later steps
        peak = _rss_mb()
    assert _rss_mb() < peak - 100  # given back on the way out
