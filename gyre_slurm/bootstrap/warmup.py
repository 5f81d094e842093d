"""Supervised warm-up of a fresh policy on reference-harness demonstrations (the built-in `digits` suite).

A random tiny model cannot produce a tool call, so RL would have no reward signal. A short, deterministic
supervised pass on demonstrations (noisy answers, right with probability `p_right` per character) teaches the
conversation format and leaves room for RL to improve the answers. The loss covers only what the model
generates: after each '<|im_start|>assistant\\n', up to and including '<|im_end|>'.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from gyre_slurm.harness import agent_spec, builtin_suite
from gyre_slurm.train.torch_trainer import default_device, load_policy, save_policy, target_logprobs

ASSISTANT_START = "<|im_start|>assistant\n"
END = "<|im_end|>"


def assistant_target_mask(ids: Sequence[int], start: Sequence[int], end_id: int) -> list[int]:
    """1 on every token after an occurrence of `start` up to and including the next `end_id`, else 0."""
    mask = [0] * len(ids)
    start, k, i = list(start), len(start), 0
    while i + k <= len(ids):
        if list(ids[i:i + k]) != start:
            i += 1
            continue
        j = i + k
        while j < len(ids):
            mask[j] = 1
            if ids[j] == end_id:
                break
            j += 1
        i = j + 1
    return mask


def encode_demo(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of one rendered conversation and its assistant-target mask."""
    ids = tokenizer.apply_chat_template(messages, tools=agent_spec.TOOLS, tokenize=True, return_dict=False)
    ids = list(ids)
    start = tokenizer.encode(ASSISTANT_START, add_special_tokens=False)
    end_id = tokenizer.convert_tokens_to_ids(END)
    mask = assistant_target_mask(ids, start, end_id)
    n_turns = sum(1 for m in messages if m["role"] == "assistant")
    if sum(1 for i, t in enumerate(ids) if t == end_id and mask[i]) != n_turns:
        # The marker tokenised differently inside the conversation (BPE merges): training would be silently wrong.
        raise ValueError(f"found assistant spans for fewer than {n_turns} turns: {ASSISTANT_START!r} does not "
                         "tokenise the same inside the rendered conversation")
    return ids, mask


def _demo(rng: random.Random, digits: Sequence[int], counts: Sequence[int], phrasings: Sequence[str],
          p_right: float) -> list[dict]:
    d, n = rng.choice(digits), rng.choice(counts)
    # one phrasing: no draw, so the suites asked one way keep the demonstrations (and models) they always had
    ph = rng.choice(phrasings) if len(phrasings) > 1 else phrasings[0]
    return builtin_suite.demo_conversation(d, n, rng, p_right, ph)


def warm_up(
    model_dir: Path,
    out_dir: Path,
    steps: int,
    seed: int,
    p_right: float = 0.35,
    *,
    digits: Sequence[int] = tuple(range(10)),
    phrasings: Sequence[str] = ("",),
    lr: float = 3e-3,
    batch_size: int = 8,
    device: torch.device | str | None = None,
) -> dict:
    """Train `steps` AdamW steps on fresh demonstrations (token-mean cross-entropy), save to out_dir.

    Deterministic for a given seed (demonstrations come from random.Random(seed)). Returns metrics.
    """
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dev = torch.device(device) if device is not None else default_device()
    model = load_policy(model_dir, dev)
    model.eval()  # no dropout: same function as at sampling time
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    counts = sorted(builtin_suite.WORDS)
    losses: list[float] = []
    n_tokens = 0
    for _ in range(steps):
        rows = [encode_demo(tokenizer, _demo(rng, digits, counts, phrasings, p_right)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in rows)
        ids_t = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask_t = torch.zeros((len(rows), width), dtype=torch.bool)
        for r, (ids, mask) in enumerate(rows):
            ids_t[r, :len(ids)] = torch.tensor(ids)
            mask_t[r, :len(mask)] = torch.tensor(mask, dtype=torch.bool)
        logp = target_logprobs(model, ids_t.to(dev), mask_t.to(dev))
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        n_tokens += int(mask_t.sum())
    save_policy(model, model_dir, out_dir)
    tail = losses[-max(1, len(losses) // 10):]
    return {
        "steps": steps, "seed": seed, "p_right": p_right, "lr": lr, "batch_size": batch_size,
        "initial_loss": losses[0] if losses else None, "final_loss": sum(tail) / len(tail) if tail else None,
        "target_tokens": n_tokens, "seconds": time.perf_counter() - t0, "out_dir": str(out_dir),
    }
