"""Benchmark the stage path's node-local part (weights.engine_update: stage, agent/engine_stage.py): writing a
version as a Hugging Face safetensors folder into a RAM disk, and reading it back as a loader does.

    .venv/bin/python tools/bench_stage.py [--size-mib 1024] [--rounds 3] [--dir /dev/shm] [--shards 4]

The state: bf16 matrices of a transformer's shapes (4096 x 4096 and 4096 x 12288), views into one contiguous buffer
as the agent's Transfer Engine staging buffer holds them. Each round: `write_hf_folder` (the agent's code: the
tensors written from that buffer, config copied, an index when sharded, then the folder renamed) into --dir, then
`read_safetensors` (the embedded engine's loader; the files are memory-mapped, as SGLang's DefaultModelLoader maps
them with safetensors) with every tensor copied into a model's parameters (host memory here), and a check that the
bytes read back are the bytes written. Then the folder goes.

MEASURED here: the write and read rates (median over the rounds, GB = 1e9 bytes). EXTRAPOLATED at those rates
(linear in bytes, one process): the seconds per version for 8B (16.4 GB of bf16) and 122B (244 GB; read in full by
one process, and the 1/8 a TP-8 rank keeps, the lower bound when every rank reads only its slice); and the RAM the
stage needs (staging buffer + at most two versions on the RAM disk). READ (not measured here): the published
figures printed at the end, with their sources. The Transfer Engine pull into the agent is bench_weights.py's.
The figure, last: the write (staging) rate; target >= 1 GB/s here. Exits 1 when it is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from gyre_slurm.agent.engine_stage import SHARD_BYTES, WRITERS, shards, write_hf_folder  # noqa: E402
from gyre_slurm.model.qwen3 import read_safetensors  # noqa: E402

TARGET_GB_S = 1.0  # staging (writing a version into the RAM disk) at least this fast here
MODELS = [("8B", 16.4e9, 1), ("122B", 244e9, 1), ("122B, one TP-8 rank's 1/8", 244e9, 8)]
READ = [  # published figures, not measured here (docs/cells.md cites them)
    "checkpoint-engine (MoonshotAI/checkpoint-engine README, 0.1.3, 'Benchmark', vLLM): Qwen3-235B-A22B bf16 "
    "on 8xH800 TP8 updated in 6.75 s by NCCL broadcast, 16.47 s by P2P over the Transfer Engine",
    "/dev/shm is a tmpfs of half the node's RAM by default (Linux tmpfs: size defaults to 50% of RAM)",
]


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """bf16 matrices as views into one buffer (the staging buffer's layout), filled with random bits."""
    shapes = [(4096, 4096), (4096, 12288), (12288, 4096)]
    nbytes = size_mib << 20
    buf = torch.randint(-128, 127, (nbytes,), dtype=torch.int8).view(torch.uint8)
    out, off, i = {}, 0, 0
    while True:
        rows, cols = shapes[i % len(shapes)]
        n = rows * cols * 2
        if off + n > nbytes:
            break
        out[f"model.layers.{i // 3}.w{i % 3}.weight"] = buf[off:off + n].view(torch.bfloat16).view(rows, cols)
        off, i = off + n, i + 1
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="the RAM disk (weights.stage_dir's)")
    ap.add_argument("--shards", type=int, default=4, help="files the state is cut into (a real version: its GB / "
                    f"{SHARD_BYTES >> 30} GiB, written {WRITERS} at a time here)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    state = make_state(args.size_mib)
    nbytes = sum(t.numel() * 2 for t in state.values())
    shard = -(-nbytes // args.shards)
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-stage-", dir=args.dir))
    source = work / "source"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "qwen3"}')
    writes, reads = [], []
    params = {n: torch.empty_like(t) for n, t in state.items()}  # the model the loader copies into
    try:
        for r in range(args.rounds):
            dest = work / f"v{r:05d}"
            t0 = time.perf_counter()
            write_hf_folder(state, source, dest, shard)
            t1 = time.perf_counter()
            for name, t in read_safetensors(dest).items():  # mapped: the bytes are read by the copy
                params[name].copy_(t)
            t2 = time.perf_counter()
            bad = [n for n, t in state.items() if not torch.equal(params[n].view(torch.int16), t.view(torch.int16))]
            if bad:
                print(f"read back differs: {bad[:3]}")
                return 1
            writes.append(t1 - t0)
            reads.append(t2 - t1)
            shutil.rmtree(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w_s, r_s = statistics.median(writes), statistics.median(reads)
    w_rate, r_rate = nbytes / w_s / 1e9, nbytes / r_s / 1e9
    files = len(list(shards(state, shard)))
    print(f"state: {len(state)} bf16 tensors, {nbytes / 1e9:.2f} GB in {files} file(s), {args.rounds} rounds, "
          f"{args.dir} ({os.cpu_count()} CPUs)")
    print(f"MEASURED write (stage) {w_s:.3f} s median ({min(writes):.3f}-{max(writes):.3f}): {w_rate:.2f} GB/s; "
          f"read back (load) {r_s:.3f} s ({min(reads):.3f}-{max(reads):.3f}): {r_rate:.2f} GB/s")
    print("EXTRAPOLATED per version at these rates (write + read; the pull and the GPU copy not included):")
    for name, size, share in MODELS:
        write, read = size / w_rate / 1e9, size / share / r_rate / 1e9
        print(f"  {name:28s} write {write:6.1f} s + read {read:6.1f} s = {write + read:6.1f} s")
    for name, size, _ in MODELS[:2]:
        print(f"  RAM for {name}: {size / 1e9:.0f} GB staging buffer + up to {2 * size / 1e9:.0f} GB on the RAM disk "
              f"(the served and the new version) = {3 * size / 1e9:.0f} GB; a default /dev/shm of "
              f"{2 * size / 1e9:.0f} GB needs {4 * size / 1e9:.0f} GB of node RAM")
    for line in READ:
        print(f"READ {line}")
    ok = w_rate >= TARGET_GB_S
    print(f"staging write: {w_rate:.2f} GB/s (target >= {TARGET_GB_S} GB/s) {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
