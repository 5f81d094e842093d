"""Benchmark the embedded rollout engine through HTTP (one `gyre engine` process, one torch thread by default).

    .venv/bin/python tools/bench_engine.py [--model-path DIR] [--threads 1] [--new-tokens 512] [--streams 8]
                                           [--repeats 5] [--pairs 9] [--context 2000]
    .venv/bin/python tools/bench_engine.py --curve [--new-tokens 256] [--repeats 3]

Figures, each with its baseline and spread:
- 8 concurrent streams: aggregate tokens/s against the single stream's.
- prefix reuse: --pairs (cold, warm) pairs. Each pair draws a fresh random context, runs a first turn on it
  (64 new tokens, untimed), then times the second turn (context + output + 32 new tokens, served from the
  cached KV) and a cold prefill of a fresh random prompt of exactly the same length (nothing cached); the two
  run in alternating order. Reported: median and min-max of cold ms, warm ms and the per-pair speed-up
  (target: median >= 3x).
- last, the single-stream tokens/s alone (batch 1, --new-tokens new tokens, median of --repeats; target >= 1,000).
Exits 1, naming the target, when a target is missed.

--curve prints only the per-stream throughput curve that `gyre simulate` uses as its load slowdown (sim/paper.py,
docs/algorithms.md §8): tokens/s per stream at 1, 2, 4, 8, 16 concurrent streams (each the median of --repeats rounds
of that many requests of --new-tokens new tokens), and each relative to one stream; no target.

Without --model-path it creates the built-in tiny model in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm.engines.client import EngineClient, GenerateResult, SamplingParams  # noqa: E402
from gyre_slurm.spawn import gyre_argv, spawn, wait_ready_file  # noqa: E402

SINGLE_STREAM_TARGET = 1000.0  # tokens/s, batch 1, one torch thread
PREFIX_SPEEDUP_TARGET = 3.0  # median cold / warm time of the same-length prompt
TURN1_NEW, TURN2_NEW = 64, 32  # tokens the first turn generates, and the next user message's tokens
VOCAB_USED = 256  # random prompts draw from the byte tokens: every model here has them
CURVE_STREAMS = (1, 2, 4, 8, 16)  # the loads of --curve (a rollout cell serves up to k runs)


@dataclass
class Spread:
    """Median and range of repeated samples, as printed: "12.3 (11.0-14.1)"."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def show(self, fmt: str = ".1f") -> str:
        return f"{self.median:{fmt}} ({min(self.values):{fmt}}-{max(self.values):{fmt}})"


def start_engine(model: Path, threads: int, workdir: Path, *extra: str, prefix_cache_tokens: int = 200_000,
                 timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """The real embedded engine as a process (also tools/bench_long_context.py's); `extra`: more engine options."""
    ready, log = workdir / "engine.ready.json", workdir / "engine.log"
    argv = gyre_argv("engine", "--model-path", str(model), "--threads", str(threads), "--ready-file", str(ready),
                     "--prefix-cache-tokens", str(prefix_cache_tokens), *extra)
    proc = spawn(argv, log, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, cwd=REPO)
    return proc, wait_ready_file(ready, proc, what="the engine", timeout_s=timeout_s, log=log)["url"]


async def timed(client: EngineClient, ids: list[int],
                sampling: SamplingParams = SamplingParams(max_new_tokens=1, ignore_eos=True)
                ) -> tuple[GenerateResult, float]:
    t0 = time.perf_counter()
    res = await client.generate(ids, sampling)
    return res, time.perf_counter() - t0


async def single_stream(client: EngineClient, prompt: list[int], new_tokens: int, repeats: int) -> Spread:
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    await client.generate(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(repeats):
        res, s = await timed(client, prompt, sampling)
        rates.append(len(res.output_ids) / s)
    return Spread(rates)


async def concurrent(client: EngineClient, rng: random.Random, new_tokens: int, streams: int) -> float:
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(random_ids(rng, 16), sampling) for _ in range(streams)))
    return sum(len(r.output_ids) for r in results) / (time.perf_counter() - t0)


async def per_stream_curve(client: EngineClient, rng: random.Random, new_tokens: int,
                           repeats: int) -> list[tuple[int, float]]:
    """(streams, median tokens/s per stream) at each load of CURVE_STREAMS, after one warm-up round."""
    await concurrent(client, rng, 32, max(CURVE_STREAMS))  # warm-up: allocations, the largest batch once
    out = []
    for n in CURVE_STREAMS:
        rates = [await concurrent(client, rng, new_tokens, n) / n for _ in range(repeats)]
        out.append((n, statistics.median(rates)))
    return out


async def curve(url: str, args: argparse.Namespace) -> list[str]:
    """--curve: the per-stream throughput at each load, and relative to one stream (printed last)."""
    client = EngineClient(url)
    points = await per_stream_curve(client, random.Random(0), args.new_tokens, args.repeats)
    await client.aclose()
    base = points[0][1]
    print(f"per-stream tokens/s by concurrent streams, median of {args.repeats} rounds of {args.new_tokens} new "
          f"tokens after a 16-token prompt, torch threads {args.threads}:")
    print("curve: " + ", ".join(f"{n}: {r:,.0f} tok/s ({r / base:.3f})" for n, r in points))
    return []


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_USED) for _ in range(n)]


async def prefix_pairs(client: EngineClient, rng: random.Random, context: int,
                       pairs: int) -> list[tuple[float, float, int, int]]:
    """(cold s, warm s, prompt length, warm cached tokens) per pair; see the module docstring."""
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    out = []
    for i in range(pairs):
        ctx = random_ids(rng, context)
        turn1 = await client.generate(ctx, SamplingParams(max_new_tokens=TURN1_NEW, ignore_eos=True))
        turn2 = ctx + turn1.output_ids + random_ids(rng, TURN2_NEW)
        cold_prompt = random_ids(rng, len(turn2))
        if i % 2 == 0:  # alternate the order: drift in machine speed falls on both sides alike
            (cold, cold_s), (warm, warm_s) = await timed(client, cold_prompt, one), await timed(client, turn2, one)
        else:
            (warm, warm_s), (cold, cold_s) = await timed(client, turn2, one), await timed(client, cold_prompt, one)
        if cold.cached_tokens > 1 or warm.cached_tokens < len(ctx):  # a random prompt may share its first token
            raise SystemExit(f"error: the prefix cache did not behave: cold reused {cold.cached_tokens} tokens, "
                             f"warm {warm.cached_tokens} of {len(turn2)}")
        out.append((cold_s, warm_s, len(turn2), warm.cached_tokens))
    return out


async def bench(url: str, args: argparse.Namespace) -> list[str]:
    """Prints every figure; returns the targets missed."""
    client = EngineClient(url)
    rng = random.Random(0)
    missed = []
    single = await single_stream(client, random_ids(rng, 16), args.new_tokens, args.repeats)
    agg = await concurrent(client, rng, args.new_tokens, args.streams)
    print(f"{args.streams} concurrent streams: {agg:,.0f} tokens/s aggregate ({agg / args.streams:,.0f} per stream) "
          f"vs {single.median:,.0f} tokens/s for one stream alone: {agg / single.median:.1f}x from batching")

    pairs = await prefix_pairs(client, rng, args.context, args.pairs)
    cold, warm = Spread([p[0] * 1e3 for p in pairs]), Spread([p[1] * 1e3 for p in pairs])
    speedup = Spread([p[0] / p[1] for p in pairs])
    length, cached = pairs[0][2], min(p[3] for p in pairs)
    print(f"prefix reuse: warm second turn (>= {cached:,} of {length:,} tokens cached) vs cold prefill of a fresh "
          f"{length:,}-token context, median (min-max) of {len(pairs)} pairs, 1 new token each: cold "
          f"{cold.show()} ms, warm {warm.show()} ms, per-pair speed-up {speedup.show()}x "
          f"(target: median >= {PREFIX_SPEEDUP_TARGET:g}x)")
    if speedup.median < PREFIX_SPEEDUP_TARGET:
        missed.append(f"prefix-reuse speed-up {speedup.median:.1f}x < {PREFIX_SPEEDUP_TARGET:g}x")

    print(f"single stream: {single.show(',.0f')} tokens/s, median (min-max) of {args.repeats} requests of "
          f"{args.new_tokens} new tokens after a 16-token prompt, batch 1, wall time through HTTP "
          f"(target >= {SINGLE_STREAM_TARGET:,.0f})")
    if single.median < SINGLE_STREAM_TARGET:
        missed.append(f"single-stream {single.median:,.0f} tokens/s < {SINGLE_STREAM_TARGET:,.0f}")
    await client.aclose()
    return missed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", type=Path, help="default: create the built-in tiny model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="single-stream requests")
    ap.add_argument("--pairs", type=int, default=9, help="(cold, warm) prefix-reuse pairs (at least 7)")
    ap.add_argument("--context", type=int, default=2000, help="first-turn context of each prefix-reuse pair")
    ap.add_argument("--curve", action="store_true", help="only the per-stream tokens/s at 1-16 streams")
    args = ap.parse_args()
    if args.pairs < 7:
        ap.error("--pairs must be at least 7: a median of fewer says little on a shared machine")
    return args


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        workdir = Path(tmp)
        model = args.model_path
        if model is None:
            from gyre_slurm.model.tiny import create_tiny_model

            model = create_tiny_model(workdir / "tiny", seed=0)
        proc, url = start_engine(model, args.threads, workdir)
        try:
            print(f"engine {url}, model {model}, torch threads {args.threads}")
            missed = asyncio.run((curve if args.curve else bench)(url, args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    for m in missed:
        print(f"missed target: {m}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
