"""Sampling one token per row of a batch, with the logprob the engine reports for it."""

from __future__ import annotations

import torch

from gyre_slurm.engines.validation import Sampling


def sample(logits: torch.Tensor, params: list[Sampling], generators: list[torch.Generator],
           temp_scaled_logprobs: bool = False) -> tuple[list[int], list[float]]:
    """One token per row by inverse-CDF sampling with one uniform draw from the row's own generator, so a seeded
    request samples the same way whatever else shares its batch. Returns the tokens and their logprobs: at
    temperature 1 (log_softmax(logits), before temperature, top-k and top-p), or SGLang's default
    log_softmax(logits / temperature) with temp_scaled_logprobs."""
    vocab = logits.shape[-1]
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    logp = torch.log_softmax(scaled if temp_scaled_logprobs else logits, dim=-1)
    if all(p.greedy for p in params):
        tok = logits.argmax(dim=-1, keepdim=True)
    else:
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(logits.dtype)
        top_k = [1 if p.greedy else (p.top_k if p.top_k > 0 else vocab) for p in params]
        top_p = [p.top_p for p in params]
        if max(top_k) >= vocab and min(top_p) >= 1.0:
            probs = torch.softmax(scaled, dim=-1)
            cdf = probs.cumsum(dim=-1)
            tok = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
        else:
            probs, order = _sorted_head(scaled, top_k, top_p)
            rank = torch.arange(probs.shape[-1])
            drop = rank[None, :] >= torch.tensor(top_k)[:, None]
            # top-p keeps the smallest head of the sorted distribution whose mass reaches p (the first always stays)
            drop |= (probs.cumsum(dim=-1) - probs) > torch.tensor(top_p, dtype=probs.dtype)[:, None]
            probs = probs.masked_fill(drop, 0.0)
            cdf = probs.cumsum(dim=-1)
            kept = (~drop).sum(dim=-1, keepdim=True)
            choice = (cdf <= (u * cdf[:, -1])[:, None]).sum(dim=-1, keepdim=True)
            tok = order.gather(1, torch.minimum(choice, kept - 1))
    lp = logp.gather(1, tok).clamp(min=torch.finfo(logp.dtype).min)
    return tok[:, 0].tolist(), lp[:, 0].tolist()


HEAD = 1024  # the sorted head tried first for top-p: a trained model's nucleus almost always ends inside it


def _sorted_head(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities (normalised over the whole vocabulary) in descending order and their token ids, as far
    as any row's top-k / top-p can keep: its top_k, or for top-p the first HEAD when their mass exceeds p (every
    later token is then dropped). Sorting Qwen3's 151,936 logits costs 10-40 ms a step on CPU; topk of a head,
    well under a millisecond. The whole sort when some row needs it."""
    vocab = scaled.shape[-1]
    head = min(HEAD, vocab)
    need = max(k if k < vocab else (head if p < 1.0 else vocab) for k, p in zip(top_k, top_p, strict=True))
    if need < vocab:
        probs, order = torch.softmax(scaled, dim=-1).topk(need, dim=-1)
        mass = probs.cumsum(dim=-1)[:, -1].tolist()
        if all(k <= need or m > p for k, p, m in zip(top_k, top_p, mass, strict=True)):
            return probs, order
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    return torch.softmax(sorted_logits, dim=-1), order
