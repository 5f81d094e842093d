"""Benchmark the embedded rollout engine through HTTP (one engine process, one torch thread by default).

    .venv/bin/python tools/bench_engine.py [--model-path DIR] [--threads 1] [--new-tokens 512] [--streams 8]

Figures: tokens/s of one stream (batch 1, 512 new tokens, ignore_eos), aggregate tokens/s of 8 concurrent
streams, and the speed-up of prefix reuse (an agent's second turn on a 2,000-token context against a cold prefill
of the same length). Without --model-path it creates the built-in tiny model in a temporary folder. The last line
printed is the single-stream tokens/s alone, for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm.engines.client import EngineClient, SamplingParams  # noqa: E402


def start_engine(model: Path, threads: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / "engine.ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_slurm.engines.embedded", "--model-path", str(model), "--threads", str(threads),
         "--ready-file", str(ready), "--prefix-cache-tokens", "200000"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("error: the engine did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["url"]


async def bench(url: str, new_tokens: int, streams: int, repeats: int, vocab: int) -> float:
    client = EngineClient(url)
    rng = random.Random(0)
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompt = [rng.randrange(256) for _ in range(16)]

    await client.generate(prompt, SamplingParams(max_new_tokens=32, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = await client.generate(prompt, sampling)
        rates.append(len(res.output_ids) / (time.perf_counter() - t0))
    single = statistics.median(rates)
    print(f"single stream: {single:,.0f} tokens/s (median of {repeats} x {new_tokens} new tokens, batch 1)")

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate([rng.randrange(256) for _ in range(16)], sampling)
                                     for _ in range(streams)))
    wall = time.perf_counter() - t0
    total = sum(len(r.output_ids) for r in results)
    print(f"{streams} concurrent streams: {total / wall:,.0f} tokens/s aggregate "
          f"({total / wall / streams:,.0f} per stream)")

    # Prefix reuse: turn 2 of an agent extends turn 1's prompt + output; cold is a fresh prompt of that length.
    context = [rng.randrange(256) for _ in range(2000)]
    turn1 = await client.generate(context, SamplingParams(max_new_tokens=64, ignore_eos=True))
    turn2_prompt = context + turn1.output_ids + [rng.randrange(256) for _ in range(32)]
    cold_prompt = [rng.randrange(256) for _ in range(len(turn2_prompt))]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    cold = await client.generate(cold_prompt, one)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = await client.generate(turn2_prompt, one)
    warm_s = time.perf_counter() - t0
    print(f"prefix reuse: second turn of a {len(turn2_prompt):,}-token context {warm_s * 1e3:.1f} ms "
          f"(cached_tokens={warm.cached_tokens}) vs cold {cold_s * 1e3:.1f} ms (cached_tokens={cold.cached_tokens}): "
          f"{cold_s / warm_s:.1f}x faster")
    await client.aclose()
    return single


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", type=Path, help="default: create the built-in tiny model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        workdir = Path(tmp)
        model = args.model_path
        if model is None:
            from gyre_slurm.model.tiny import create_tiny_model

            model = create_tiny_model(workdir / "tiny", seed=0)
        proc, url = start_engine(model, args.threads, workdir)
        try:
            vocab = EngineClient(url).model_info()["vocab_size"]
            print(f"engine {url}, model {model}, torch threads {args.threads}")
            single = asyncio.run(bench(url, args.new_tokens, args.streams, args.repeats, vocab))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{single:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
