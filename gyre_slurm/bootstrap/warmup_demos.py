"""Supervised warm-up on recorded harness demonstrations (bootstrap/demos.py) whose prompts are long.

A coding CLI's prompt is ~6–19k tokens of system prompt and tool schemas before the first reply; a full
forward and backward over that costs seconds per sequence on a CPU, while the replies are a few hundred tokens
at the end. Demonstrations recorded at one workspace path share that context token for token (only the task
and what follows differ); a few paths are used, and each step draws from one. Each step prefills the shared
context once, without gradient, with the step's weights, then each demonstration's own context (its task and what the
CLI writes after it) the same way, and runs forward and backward over its tail only (MARGIN tokens before the
first reply, the replies and the tool results between them) attending to that cache. The gradient is exact
for every weight through the tail's positions; what it leaves out is the path through the context's keys and
values, which are recomputed every step, so the policy always trains on what it will see at sampling time.
(Keys and values kept from earlier weights do not work: the model learns to read a context it never sees
again. Freezing every weight that shapes them, so one prefill serves all steps, learns the format too slowly.)

A curriculum comes first: `short_steps` steps on the tails alone, without the context. From a random start,
attention spread over ~10k context keys hardly learns to look at the previous few tokens, and without that a
reply is a bigram guess (after "\n": `<tool_call>` or `{"`? after `": "`: the tool's name or its command?). On
short sequences the local patterns are learned in a few dozen cheap steps (no prefill); the steps with the
context then teach the model to keep them there.

Runs on the project's pure-torch Qwen3 (model/qwen3.py: same weights and names as Hugging Face, autograd
through its KV cache), saved back through Hugging Face's Qwen3 so the folder loads everywhere.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gyre_slurm.bootstrap.demos import Demo
from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import KVCache, Qwen3ForCausalLM
from gyre_slurm.train.torch_trainer import load_policy, save_policy

MARGIN = 256  # tokens of context before the first target that get a gradient too
FORMAT_P, EXTRA_ROUNDS = 0.5, 3  # the first reply token's probability a warm-up must reach; extra rounds to reach it
# The share of replies, sampled at temperature 1 at each turn of a held-out demonstration (after its whole context up
# to that turn), that must be well-formed for the CLI at every turn (SHARE_MIN, else more rounds), and below which
# the build is refused (SHARE_REFUSE); SAMPLES replies per turn and held-out context. A token check alone passed builds
# whose sampled replies all broke (every token of `{"name": "exec_command", ...}` at p >= 0.5 still leaves a ~30-token
# reply a coin toss), and a check of first replies alone passed a build whose second replies were nearly all "Done.".
SHARE_MIN, SHARE_REFUSE, SAMPLES = 0.8, 0.5, 16


def shared_context(demos: Sequence[Demo]) -> int:
    """How many leading ids every demonstration has in common (at most up to the first one's tail)."""
    end = min(_tail_start(d) for d in demos)
    n, ref = 0, demos[0].ids
    while n < end and all(d.ids[n] == ref[n] for d in demos):
        n += 1
    return n


def _tail_start(d: Demo) -> int:
    """Where a demonstration's tail (the part trained with gradient) starts: MARGIN tokens before its first target."""
    return max(1, d.mask.index(1) - MARGIN)


def _extend(model: Qwen3ForCausalLM, cache: KVCache, ids: Sequence[int], chunk: int = 4096) -> KVCache:
    """Prefill ids into cache without gradient (the context: its keys and values are inputs to the step)."""
    cache.reserve(cache.length + len(ids))
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            model.hidden_states(torch.tensor([list(ids[s:s + chunk])]), cache, keep="none")
    return cache


def reply_format_p(model: Qwen3ForCausalLM, demos: Sequence[Demo], which: Sequence[int],
                   is_free: Callable[[int], bool] = lambda _t: False) -> float:
    """The lowest probability the model gives, after the whole context of each of the `which` demonstrations, to a
    token of its first reply that the CLI's format fixes (`<tool_call>`, the tool's name, the JSON around the
    command): every token but the free ones (`is_free`: the answer's digits) and the token right after them."""
    worst = 1.0
    with torch.no_grad():
        for i in which:
            d = demos[i]
            f = d.mask.index(1)
            e = d.mask.index(0, f) if 0 in d.mask[f:] else len(d.ids)
            cache = _extend(model, model.new_cache(e), d.ids[:f - 1])
            logits = model(torch.tensor([d.ids[f - 1:e - 1]]), cache)[0]
            p = torch.softmax(logits.float(), -1).gather(-1, torch.tensor([d.ids[f:e]]).T)[:, 0]
            for k in range(e - f):
                if not is_free(d.ids[f + k]) and not (k and is_free(d.ids[f + k - 1])):
                    worst = min(worst, float(p[k]))
    return worst


def _reply_spans(d: Demo) -> list[tuple[int, int]]:
    """[start, end) of each reply of a demonstration's main line in its ids (its runs of targets)."""
    spans, k = [], 0
    while 1 in d.mask[k:]:
        f = d.mask.index(1, k)
        k = d.mask.index(0, f) if 0 in d.mask[f:] else len(d.ids)
        spans.append((f, k))
    return spans


def reply_shares(model: Qwen3ForCausalLM, demos: Sequence[Demo], which: Sequence[int],
                 well_formed: Callable[[list[int], list[int]], bool], samples: int = SAMPLES,
                 seed: int = 0) -> list[float]:
    """For each reply of the main line (first, second, …), the share of `samples` replies sampled at temperature 1
    after the whole context before it in each of the `which` demonstrations (its own earlier replies and the tool
    results the CLI gave them) that `well_formed(sampled ids, the demonstration's own reply)` accepts. A reply is
    sampled up to the end token its demonstration's reply ends with, at most twice that reply's length plus 8."""
    gen = torch.Generator().manual_seed(seed)
    good: dict[int, list[bool]] = {}
    with torch.no_grad():
        for i in which:
            d = demos[i]
            ctx, done = model.new_cache(len(d.ids)), 0
            for k, (f, e) in enumerate(_reply_spans(d)):
                _extend(model, ctx, d.ids[done:f - 1])
                done = f - 1
                ref = d.ids[f:e]
                for row in _sample_replies(model, ctx, d.ids[f - 1], ref[-1], 2 * (e - f) + 8, samples, gen):
                    good.setdefault(k, []).append(bool(well_formed(row, ref)))
    return [sum(v) / len(v) for _k, v in sorted(good.items())]


def _sample_replies(model: Qwen3ForCausalLM, ctx, prev: int, stop: int, limit: int, samples: int,
                    gen: torch.Generator) -> list[list[int]]:
    """`samples` replies sampled at temperature 1 after the context in `ctx` (whose last token, `prev`, is still to
    be fed), each cut after its first `stop` token, at most `limit` tokens long."""
    caches = [ctx.copy_prefix(ctx.length, ctx.length + 1 + limit) for _ in range(samples)]
    last = torch.full((samples, 1), prev)
    rows = torch.empty((samples, 0), dtype=torch.long)
    for _ in range(limit):
        probs = torch.softmax(model(last, caches, last_only=True)[:, -1].float(), -1)
        last = torch.multinomial(probs, 1, generator=gen)
        rows = torch.cat([rows, last], 1)
        if bool((rows == stop).any(1).all()):
            break
    return [row[:row.index(stop) + 1] if stop in row else row for row in rows.tolist()]


def reply_checker(model_dir: Path) -> Callable[[list[int], list[int]], bool]:
    """Whether a sampled reply is what the CLI takes as the demonstration's: it ends as that reply ends, and where
    that reply is a tool call (the proxy's parser, proxy/toolcalls.py), it parses as calls of the same tools."""
    from gyre_slurm.proxy.toolcalls import parse_qwen3

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        tok = None

    def names(ids: list[int]) -> list[str] | None:
        if tok is None:
            return None
        parsed = parse_qwen3(tok.decode(ids[:-1]))
        return None if parsed.malformed else [c["function"]["name"] for c in parsed.tool_calls] or None

    def well_formed(sampled: list[int], ref: list[int]) -> bool:
        if not sampled or sampled[-1] != ref[-1]:
            return False
        want = names(ref)
        return want is None or names(sampled) == want

    return well_formed


def mend_format(model: Qwen3ForCausalLM, demos: Sequence[Demo], firsts: Sequence[int], held_out: Sequence[int],
                free: set[int], well_formed: Callable[[list[int], list[int]], bool], n: int,
                step: Callable[[], float], echo: Callable[[str], None]) -> tuple[float, float, int]:
    """The mean loss hides the few tokens the CLI's format fixes (`<tool_call>` after "assistant\n", the tool's
    name): some builds end with one of them at p ~0.001-0.05 after the trained contexts (`firsts`), or with replies
    sampled at some turn after an unseen context (`held_out`, a new workspace path as every real run has) well-formed
    in fewer than SHARE_MIN cases, and every run of the CLI then breaks at that turn. `n` more steps with the
    context at the schedule's last rate mend it (measured: 0.001 → 0.996 for `<tool_call>`, 0.05 → 0.36+ for the
    tool's name), up to EXTRA_ROUNDS times; below SHARE_REFUSE after them the build is refused (GyreError).
    Returns (the lowest p, the lowest turn's share of well-formed sampled replies, steps added)."""
    extra = 0

    def measure() -> tuple[float, list[float]]:
        p = reply_format_p(model, demos, firsts, free.__contains__)
        return p, reply_shares(model, demos, held_out or firsts, well_formed, seed=extra)

    def said(shares: list[float]) -> str:
        return " / ".join(f"{x:.0%}" for x in shares)

    format_p, shares = measure()
    for _round in range(EXTRA_ROUNDS):
        if format_p >= FORMAT_P and min(shares) >= SHARE_MIN:
            break
        echo(f"warm-up: a token of the reply format has p {format_p:.3f} after the context (want {FORMAT_P}), "
             f"{said(shares)} of sampled replies parse (want {SHARE_MIN:.0%} each): {n} more steps with the context")
        for _ in range(n):
            step()
            extra += 1
        format_p, shares = measure()
    share = min(shares)
    echo(f"warm-up: of the replies sampled after {'unseen' if held_out else 'the trained'} contexts "
         f"({SAMPLES * len(held_out or firsts)} each: 1st / 2nd / …), {said(shares)} are well-formed for the CLI")
    if share < SHARE_REFUSE:
        raise GyreError(f"the warm-up left {share:.0%} of sampled replies well-formed at one turn of the "
                        f"conversation (below {SHARE_REFUSE:.0%}): a policy whose runs break there cannot learn; try "
                        "more model.warmup_steps or model.warmup_demos, or another model.seed")
    return format_p, share, extra


def _digit_ids(model_dir: Path) -> set[int]:
    """The ids whose text holds a digit (the answers' own tokens), from the model folder's tokenizer; none without
    one."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return set()
    return {i for i in range(len(tok)) if any(c.isdigit() for c in tok.decode([i]))}


def tail_loss(model: Qwen3ForCausalLM, cache: KVCache, tail: Sequence[int], tail_mask: Sequence[int]) -> torch.Tensor:
    """Mean −log π over the tail's targets, the tail (the tokens right after what `cache` holds, which it extends)
    attending to that detached context; a target's prediction comes from the token before it, inside the tail."""
    ids = torch.tensor([list(tail)])
    pred = torch.tensor(list(tail_mask[1:]), dtype=torch.bool)
    lp = torch.log_softmax(model(ids[:, :-1], cache, at=pred[None]), -1)
    return -lp.gather(-1, ids[0, 1:][pred][:, None]).mean()


def tails_loss(model: Qwen3ForCausalLM, demos: Sequence[Demo]) -> torch.Tensor:
    """The mean over demonstrations of tail_loss without the context: all tails in one batch (right-padded: causal
    attention keeps the padding out of sight), one head call and one embedding gradient instead of one per tail
    (a fifth less per curriculum step)."""
    starts = [_tail_start(d) for d in demos]
    tails = [(d.ids[t:], d.mask[t:]) for d, t in zip(demos, starts, strict=True)]
    width = max(len(ids) for ids, _ in tails)
    ids = torch.zeros((len(tails), width), dtype=torch.long)
    pred = torch.zeros((len(tails), width - 1), dtype=torch.bool)
    for r, (tail, mask) in enumerate(tails):
        ids[r, :len(tail)] = torch.tensor(list(tail))
        pred[r, :len(mask) - 1] = torch.tensor(list(mask[1:]), dtype=torch.bool)
    lp = torch.log_softmax(model(ids[:, :-1], at=pred), -1).gather(-1, ids[:, 1:][pred][:, None])[:, 0]
    per_demo = torch.zeros(len(tails)).index_add(0, pred.nonzero()[:, 0], lp) / pred.sum(1)
    return -per_demo.mean()


def context_backward(model: Qwen3ForCausalLM, batch: Sequence[Demo], n: int) -> float:
    """Backward of the batch's mean tail_loss after their whole context: the shared context (n tokens) prefilled
    once with the step's weights, then each demonstration's own (its task, what the CLI says after it; once per
    task: demonstrations of one task have the same), all without gradient, and each tail with. The loss."""
    shared_cache = _extend(model, model.new_cache(n), batch[0].ids[:n])
    own: dict[tuple[int, ...], KVCache] = {}
    total = 0.0
    for d in batch:
        t = _tail_start(d)
        key = tuple(d.ids[n:t])
        if key not in own:
            own[key] = _extend(model, shared_cache.copy_prefix(n, t), key)
        loss = tail_loss(model, own[key].copy_prefix(t, len(d.ids)), d.ids[t:], d.mask[t:]) / len(batch)
        loss.backward()
        total += float(loss.detach())
    return total


def warm_up_on_demos(model_dir: Path, out_dir: Path, demos: Sequence[Demo], steps: int, seed: int, *,
                     held_out: Sequence[Demo] = (), short_steps: int = 0, lr: float = 3e-3, batch_size: int = 4,
                     echo: Callable[[str], None] = lambda _m: None) -> dict:
    """`short_steps` then `steps` AdamW steps (tails alone, then with the context), each on `batch_size`
    demonstrations drawn in shuffled passes; save to out_dir. The `held_out` demonstrations (recorded at workspace
    paths of their own) are never trained on: replies sampled at each of their turns say whether the policy
    writes the CLI's tool calls where it has not been (mend_format); under SHARE_REFUSE the build is refused."""
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
    total_steps = short_steps + steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - 0.9 * k / max(1, total_steps - 1))
    groups = sorted({d.context for d in demos})  # one shared context each; a step draws from one group
    members = {g: [i for i, d in enumerate(demos) if d.context == g] for g in groups}
    shared = {g: shared_context([demos[i] for i in members[g]]) for g in groups}
    orders: dict[int, list[int]] = {g: [] for g in groups}
    losses: list[float] = []

    def train_step(step: int, with_context: bool) -> float:
        g = groups[step % len(groups)]
        batch = []
        for _ in range(batch_size):
            if not orders[g]:
                orders[g] = list(members[g])
                rng.shuffle(orders[g])
            batch.append(orders[g].pop())
        opt.zero_grad(set_to_none=True)
        chosen = [demos[i] for i in batch]
        if with_context:
            total = context_backward(model, chosen, shared[g])
        else:
            loss = tails_loss(model, chosen)
            loss.backward()
            total = float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(total)
        return total

    for step in range(total_steps):
        total = train_step(step, step >= short_steps)
        sched.step()
        if (step + 1) % max(1, total_steps // 10) == 0:
            n = shared[groups[step % len(groups)]]
            where = "tails alone" if step < short_steps else f"with the {n}-token context"
            echo(f"warm-up step {step + 1}/{total_steps} ({where}): loss {total:.3f}")
    for pg in opt.param_groups:  # the schedule's last rate, for any steps mend_format adds
        pg["lr"] = lr * 0.1
    every = [*demos, *held_out]
    format_p, share, extra = mend_format(model, every, [members[g][0] for g in groups],
                                         range(len(demos), len(every)), _digit_ids(model_dir),
                                         reply_checker(model_dir), max(1, steps // 4),
                                         lambda: train_step(len(losses), True), echo)
    hf = load_policy(model_dir, "cpu")
    hf.load_state_dict(model.state_dict())
    save_policy(hf, model_dir, out_dir)
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "short_steps": short_steps, "seed": seed, "lr": lr, "batch_size": batch_size,
            "demos": len(demos),
            "shared_context": [shared[g] for g in groups], "tokens": [len(d.ids) for d in demos],
            "initial_loss": losses[0], "final_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - t0,
            "reply_format_p": format_p, "reply_share": share, "extra_steps": extra, "out_dir": str(out_dir)}
