"""Supervised warm-up on recorded harness demonstrations (train/demos.py) whose prompts are long.

A coding CLI's prompt is ~6–19k tokens of system prompt and tool schemas before the first reply; a full
forward and backward over that costs seconds per sequence on a CPU, while the replies are a few hundred tokens
at the end. The demonstrations of one harness share that context token for token (they are recorded in one
workspace path, so only the task and what follows differ). Each step therefore prefills the shared context
once, without gradient, with the step's weights, and runs forward and backward over each demonstration's own
tail (its task, the replies and the tool results between them) attending to that cache. The gradient is exact
for every weight through the tail's positions; what it leaves out is the path through the context's keys and
values, which are recomputed every step, so the policy always trains on what it will see at sampling time.
(Keys and values kept from earlier weights do not work: the model learns to read a context it never sees
again. Freezing every weight that shapes them, so one prefill serves all steps, learns the format too slowly.)

Runs on the project's pure-torch Qwen3 (model/qwen3.py: same weights and names as Hugging Face, autograd
through its KV cache), saved back through Hugging Face's Qwen3 so the folder loads everywhere.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gyre_slurm.model.qwen3 import KVCache, Qwen3ForCausalLM
from gyre_slurm.train.demos import Demo
from gyre_slurm.train.torch_trainer import load_policy, save_policy

MARGIN = 256  # tokens of context before the first target that get a gradient too


def shared_context(demos: Sequence[Demo]) -> int:
    """How many leading ids every demonstration has in common, ending MARGIN tokens before the first target."""
    first = min(d.mask.index(1) for d in demos)
    n, ref = 0, demos[0].ids
    while n < first and all(d.ids[n] == ref[n] for d in demos):
        n += 1
    return max(1, min(n, first - MARGIN))


def _context_cache(model: Qwen3ForCausalLM, ids: Sequence[int], chunk: int = 4096) -> KVCache:
    cache = model.new_cache(len(ids))
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            model(torch.tensor([list(ids[s:s + chunk])]), cache, last_only=True)
    return cache


def tail_loss(model: Qwen3ForCausalLM, context: KVCache, tail: Sequence[int], tail_mask: Sequence[int]) -> torch.Tensor:
    """Mean −log π over the tail's targets, the tail (the tokens right after the context) attending to a
    (detached) context cache; a target's prediction comes from the token before it, inside the tail."""
    cache = context.copy_prefix(context.length)  # the step writes its own keys and values after the context
    ids = torch.tensor([list(tail)])
    pred = torch.tensor(list(tail_mask[1:]), dtype=torch.bool)
    lp = torch.log_softmax(model(ids[:, :-1], cache, at=pred[None]), -1)
    return -lp.gather(-1, ids[0, 1:][pred][:, None]).mean()


def warm_up_on_demos(model_dir: Path, out_dir: Path, demos: Sequence[Demo], steps: int, seed: int, *,
                     lr: float = 3e-3, batch_size: int = 4,
                     echo: Callable[[str], None] = lambda _m: None) -> dict:
    """`steps` AdamW steps, each on `batch_size` demonstrations drawn in shuffled passes; save to out_dir."""
    if not demos:
        raise ValueError("no demonstrations to warm up on")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = Qwen3ForCausalLM.from_pretrained(model_dir)
    model.eval()  # no dropout in this model anyway; the same function as at sampling time
    params = list({id(p): p for p in model.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    # linear decay to a tenth: the last steps settle instead of bouncing around the format they have found
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - 0.9 * k / max(1, steps - 1))
    shared = shared_context(demos)
    order: list[int] = []
    losses: list[float] = []
    for step in range(steps):
        batch = []
        for _ in range(batch_size):
            if not order:
                order = list(range(len(demos)))
                rng.shuffle(order)
            batch.append(order.pop())
        context = _context_cache(model, demos[0].ids[:shared])  # with this step's weights
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in batch:
            d = demos[i]
            loss = tail_loss(model, context, d.ids[shared:], d.mask[shared:]) / len(batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(total)
        if (step + 1) % max(1, steps // 10) == 0:
            echo(f"warm-up step {step + 1}/{steps}: loss {total:.3f}")
    hf = load_policy(model_dir, "cpu")
    hf.load_state_dict(model.state_dict())
    save_policy(hf, model_dir, out_dir)
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "seed": seed, "lr": lr, "batch_size": batch_size, "demos": len(demos),
            "shared_context": shared, "tokens": [len(d.ids) for d in demos],
            "initial_loss": losses[0], "final_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - t0,
            "out_dir": str(out_dir)}
