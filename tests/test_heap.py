"""model/heap.py: within freed_memory_kept() the pages of a training step's large tensors (logits over a
151,936-id vocabulary and their gradients) are reused by the next step instead of being unmapped and faulted in
again (a third of the long model's warm-up step); after it, the kept memory goes back to the system. Measured in
a process of its own, as a model build is: pytest's own heap, after hundreds of tests, is no model of one."""

from __future__ import annotations

import json
import subprocess
import sys

STEPS = """
import json, os, resource, torch
from gyre_slurm.model.heap import freed_memory_kept
torch.manual_seed(0)
emb = torch.nn.Embedding(151_936, 16)  # a tied head: logits [300, 151936] (182 MB) and their gradients
ids = torch.randint(0, 151_936, (300,))
def faults_per_step(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        emb.weight.grad = None
        torch.nn.functional.cross_entropy(emb(ids) @ emb.weight.T, ids).backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
out = {"default": faults_per_step(3)}
with freed_memory_kept() as kept:
    faults_per_step(4)  # the heap grows to hold a step
    out.update(kept=kept, kept_faults=faults_per_step(6), peak_mb=rss_mb())
out["after_mb"] = rss_mb()
print(json.dumps(out))
"""


def test_a_steps_pages_are_reused_within_and_returned_after() -> None:
    r = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=300,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kept"]
    assert got["default"] > 100_000, got  # glibc's default: every large tensor an mmap of its own, faulted in
    assert got["kept_faults"] < 0.5 * got["default"], got  # the heap's pages serve the later steps
    assert got["after_mb"] < got["peak_mb"] - 100, got  # given back on the way out
