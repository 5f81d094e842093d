"""Per-stream decode throughput against concurrent streams: the `slowdown(load)` hook of docs/algorithms.md §5.2, §8.

A curve is ((streams, tokens/s per stream relative to one stream), ...), rising in streams. Continuous batching
shares one forward pass among the streams of a server, so each stream's tokens/s falls as streams are added:
slowdown(n) = 1 / relative(n), with slowdown(1) = 1. Between points it is interpolated on log-log scale; beyond the
last point the last segment is extended (a cell may serve more runs than the curve was measured at).
"""

from __future__ import annotations

import math

Curve = tuple[tuple[float, float], ...]

# [measured] the embedded engine (built-in tiny model, one torch thread, CPU, a shared 2-core machine):
#   .venv/bin/python tools/bench_engine.py --curve --new-tokens 256 --repeats 5
# per-stream tokens/s 1: 878, 2: 676, 4: 553, 8: 359, 16: 301 (relative 1.000, 0.770, 0.630, 0.409, 0.342).
# The machine is shared: an earlier run of 3 rounds gave 828, 862, 605, 445, 373 (relative 0.450 at 16 streams).
EMBEDDED_CURVE: Curve = ((1, 1.0), (2, 0.770), (4, 0.630), (8, 0.409), (16, 0.342))

# [public] SGLang v0.5.7, DeepSeek-R1-0528 FP8, TP=8 on H200, random 1k in / 1k out, bench_serving mean TPOT
# 12.8 / 17.2 / 25.6 / 34.6 ms at 8 / 16 / 32 / 64 concurrent requests (SemiAnalysisAI/InferenceX issue #870, a
# concurrency sweep posted 2026-03-05). The sweep has no point below 8: TPOT at 1, 2, 4 streams (9.0, 9.55,
# 10.65 ms) is [assumed], the 8 → 16 slope (0.55 ms per added stream) extended down: decode is memory-bound at
# small batches, so TPOT grows about linearly with the batch there. relative(n) = TPOT(1) / TPOT(n).
SGLANG_TPOT_MS = {1: 9.0, 2: 9.55, 4: 10.65, 8: 12.8, 16: 17.2, 32: 25.6, 64: 34.6}
SGLANG_CURVE: Curve = tuple((n, SGLANG_TPOT_MS[1] / ms) for n, ms in SGLANG_TPOT_MS.items())


def slowdown(curve: Curve, streams: float) -> float:
    """How many times longer one stream's LLM time takes at `streams` concurrent streams than alone (≥ 1)."""
    if streams <= curve[0][0]:
        return 1.0 / curve[0][1]
    i = next((j for j in range(1, len(curve)) if streams <= curve[j][0]), len(curve) - 1)
    (n0, r0), (n1, r1) = curve[i - 1], curve[i]
    x = (math.log(streams) - math.log(n0)) / (math.log(n1) - math.log(n0))
    rel = math.exp(math.log(r0) + x * (math.log(r1) - math.log(r0)))
    return max(1.0, 1.0 / rel)
