"""engines/sampling.py: top-k / top-p from a sorted head of the vocabulary give what the whole sort gives."""

from __future__ import annotations

import torch

from gyre_slurm.engines import sampling
from gyre_slurm.engines.validation import Sampling


def params(temperature=1.0, top_p=1.0, top_k=-1) -> Sampling:
    return Sampling(16, temperature, top_p, top_k, (), frozenset(), True, False, True, None)


def whole_sort(logits, ps, us):
    """The reference: the whole vocabulary sorted, the same inverse-CDF draw."""
    vocab = logits.shape[-1]
    out = []
    for row, p, u in zip(logits, ps, us, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        probs, order = torch.softmax(row / p.temperature, -1).sort(descending=True)
        k = p.top_k if p.top_k > 0 else vocab
        keep = (torch.arange(vocab) < k) & ((probs.cumsum(-1) - probs) <= p.top_p)
        probs = probs * keep
        cdf = probs.cumsum(-1)
        choice = min(int((cdf <= u * cdf[-1]).sum()), int(keep.sum()) - 1)
        out.append(int(order[choice]))
    return out


def test_head_and_whole_sort_agree():
    torch.manual_seed(0)
    vocab = 5000
    mixes = [[params(0.7, 0.9)], [params(1.0, 1.0, 40)], [params(0.8, 0.95, 200), params(0.0), params(1.0, 0.5)],
             [params(1.0, 0.999)]]  # the last one's nucleus is wider than the head: the whole sort
    for trial in range(30):
        logits = torch.randn(1, vocab) * 6 if trial % 2 else torch.randn(1, vocab) * 2.5
        for ps in mixes:
            rows = logits.expand(len(ps), vocab).contiguous()
            seeds = [1000 * trial + i for i in range(len(ps))]
            toks, lps = sampling.sample(rows, ps, [torch.Generator().manual_seed(s) for s in seeds])
            us = [float(torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                        .to(torch.float32)) for s in seeds]
            assert toks == whole_sort(rows, ps, us), (trial, ps)
            ref = torch.log_softmax(rows, -1)[torch.arange(len(ps)), toks]
            assert torch.allclose(torch.tensor(lps), ref)


def test_sorted_head_sizes():
    torch.manual_seed(1)
    peaked = torch.randn(1, 20000) * 8
    flat = torch.zeros(1, 20000)
    assert sampling._sorted_head(peaked, [20000], [0.9])[0].shape[-1] == sampling.HEAD
    assert sampling._sorted_head(peaked, [50], [1.0])[0].shape[-1] == 50
    assert sampling._sorted_head(flat, [20000], [0.9])[0].shape[-1] == 20000  # the nucleus is wider than the head
    assert sampling._sorted_head(torch.cat([peaked, flat]), [30, 20000], [1.0, 1.0])[0].shape[-1] == 20000
