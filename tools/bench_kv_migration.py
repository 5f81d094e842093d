"""Benchmark KV-cache migration (transfer/kv.py): a call aborted on engine A continues on engine B from its KV.

    .venv/bin/python tools/bench_kv_migration.py [--model-path DIR] [--threads 1] [--contexts 8192 32768]
                                                 [--repeats 3]

Two `gyre engine` processes (A and B, --threads torch threads each) serve the long-context model's shape
(gyre_slurm/model/long.py: Qwen3 architecture, 151,936 ids, 2 layers, 2 KV heads of 32; random weights, created
in a temporary folder unless --model-path names one). For each context, a greedy call on a random prompt of that
many tokens decodes on A (its prompt served from A's prefix cache after a first, untimed prefill) and is aborted
once it has sampled a few tokens; then it continues on B for one token, timed from the abort request to B's
answer:
- migrated: A aborts with export_kv (its KV packed into Transfer Engine memory, the handle in the answer), B
  imports it (/import_kv: the Transfer Engine read over TCP on loopback, checks, into B's prefix cache), then B's
  /generate of prompt + kept ids prefills only the last kept id;
- re-prefill, the baseline (what the proxy did before migration, and still does when one fails): A aborts without
  export, B's /generate of prompt + kept ids computes the whole prefill (B's cache flushed first).
Both include the abort's round trip; B's cache is flushed before each; the two alternate in order. Printed per
context: the median (min-max) of --repeats of each, the migrated one's parts, and the ratio of the medians; last,
the figure at the longest context (target: migrated >= 5x faster). Exits 1 when it misses.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_engine import Spread, start_engine, timed  # noqa: E402  (the engine benchmarks' shared pieces)

from gyre_slurm.engines.client import EngineClient, GenerateResult, SamplingParams  # noqa: E402
from gyre_slurm.model.long import EOS_IDS, create_long_model  # noqa: E402

TARGET = 5.0  # re-prefill time / migrated time, at the longest context
KEPT = 4  # tokens A samples before it is aborted
ONE = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)


def generated(client: EngineClient) -> int:
    return httpx.get(client.base_url + "/get_server_info", timeout=30).json()["internal_states"][0][
        "generated_tokens"]


async def aborted_call(a: EngineClient, prompt: list[int], export: bool, rid: str) -> tuple[GenerateResult, float]:
    """A greedy call decoding on A, aborted after KEPT tokens; the answer and the abort's round trip (s)."""
    start = generated(a)
    running = asyncio.create_task(a.generate(prompt, SamplingParams(max_new_tokens=4096, ignore_eos=True,
                                                                    temperature=0.0), rid=rid))
    while generated(a) < start + KEPT:
        await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    await asyncio.to_thread(a.abort, rid, False, export)
    res = await running
    return res, time.perf_counter() - t0


async def migrated(a: EngineClient, b: EngineClient, prompt: list[int], rid: str) -> dict[str, float]:
    res, abort_s = await aborted_call(a, prompt, True, rid)
    if "kv_handle" not in res.meta_info:
        raise SystemExit(f"error: A exported no KV: {res.meta_info.get('kv_export_error')}")
    ids = prompt + res.output_ids
    t0 = time.perf_counter()
    await b.import_kv(res.meta_info["kv_handle"], ids)
    import_s = time.perf_counter() - t0
    first, first_s = await timed(b, ids, ONE)
    if first.cached_tokens != len(ids) - 1:
        raise SystemExit(f"error: the continuation reused {first.cached_tokens} of {len(ids)} tokens")
    return {"total": abort_s + import_s + first_s, "abort": abort_s, "import": import_s, "first": first_s}


async def reprefill(a: EngineClient, b: EngineClient, prompt: list[int], rid: str) -> float:
    res, abort_s = await aborted_call(a, prompt, False, rid)
    first, first_s = await timed(b, prompt + res.output_ids, ONE)
    if first.cached_tokens > 1:
        raise SystemExit(f"error: the baseline reused {first.cached_tokens} cached tokens")
    return abort_s + first_s


async def bench(urls: tuple[str, str], args: argparse.Namespace) -> list[str]:
    a, b = EngineClient(urls[0]), EngineClient(urls[1])
    rng = random.Random(0)
    flush = lambda: httpx.post(b.base_url + "/flush_cache", timeout=30)  # noqa: E731
    warm = [rng.randrange(min(EOS_IDS)) for _ in range(256)]
    await a.generate(warm, ONE)
    await migrated(a, b, warm, "warm-up")  # starts both Transfer Engines
    missed, last = [], ""
    for ctx in args.contexts:
        prompt = [rng.randrange(min(EOS_IDS)) for _ in range(ctx)]
        await a.generate(prompt, ONE)  # A's prefill, untimed: its calls below decode at once
        mig, base = [], []
        for i in range(args.repeats):
            for kind in ("mig", "base") if i % 2 == 0 else ("base", "mig"):
                flush()
                if kind == "mig":
                    mig.append(await migrated(a, b, prompt, f"m{ctx}-{i}"))
                else:
                    base.append(await reprefill(a, b, prompt, f"b{ctx}-{i}"))
        total, baseline = Spread([m["total"] for m in mig]), Spread(base)
        ratio = baseline.median / total.median
        parts = ", ".join(f"{k} {Spread([m[k] for m in mig]).median * 1e3:.0f} ms"
                          for k in ("abort", "import", "first"))
        print(f"{ctx:,} tokens of context: next token on B with migrated KV {total.show('.3f')} s ({parts}: abort "
              f"with export, transfer + import, first token) vs re-prefill {baseline.show('.3f')} s: {ratio:.1f}x "
              f"faster")
        last = (f"KV migration at {ctx:,} tokens: {ratio:.1f}x faster than re-prefill to the continuation's next "
                f"token (median of {args.repeats}; target >= {TARGET:g}x)")
        if ctx == max(args.contexts) and ratio < TARGET:
            missed.append(f"KV migration {ratio:.1f}x < {TARGET:g}x at {ctx:,} tokens")
    print(last)
    await a.aclose()
    await b.aclose()
    return missed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", type=Path, help="default: create the long-context model (random weights)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    return ap.parse_args()


def run(workdir: Path, args: argparse.Namespace) -> list[str]:
    """Start A and B, benchmark, stop them; the targets missed."""
    model = args.model_path or create_long_model(workdir / "model")
    procs, urls = [], []
    try:
        for name in ("a", "b"):
            (workdir / name).mkdir()
            proc, url = start_engine(model, args.threads, workdir / name, prefix_cache_tokens=200_000, timeout_s=180)
            procs.append(proc)
            urls.append(url)
        print(f"engines A {urls[0]}, B {urls[1]}, model {model}, torch threads {args.threads} each")
        return asyncio.run(bench((urls[0], urls[1]), args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-kv-") as tmp:
        missed = run(Path(tmp), args)
    sys.stderr.write("".join(f"missed target: {m}\n" for m in missed))
    return int(bool(missed))


if __name__ == "__main__":
    sys.exit(main())
