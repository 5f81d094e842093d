"""Benchmark path selection for training on run trees: Jmax=5 with dedup vs no path limit vs naive flattening.

    .venv/bin/python tools/bench_paths.py [--runs 16] [--repeats 3] [--scale 0.2] [--jmax 5] [--threads 1]
                                          [--model-path DIR] [--micro-batch-tokens 8192] [--seed 0]

Synthetic runs (gyre_slurm.trajectory.synthetic: a compressing, sub-agent-spawning harness) are turned into one
training batch per setting, and each batch goes through the real torch trainer's forward_backward (GSPO loss,
bypass mode, the trainer's micro-batch packing and pre-pass):

  (a) Jmax=5 + dedup: RunTree.segments(max_paths=5), docs/algorithms.md §3.3
  (b) no limit + dedup: RunTree.segments(max_paths=None): every path that adds a target, each target once
  (c) naive: every root-to-leaf path, every trainable token on it a target (shared targets once per path)

Baseline: (b). For each setting: sequences, tokens forwarded (up to each sequence's last target, as the trainer
trims), targets trained, forward+backward seconds over --repeats (at least 5; median, min, max), with the settings
interleaved (rotated each repeat) so that machine noise hits all three alike, and the time per trained target.
Then the ratios with their spread over the paired repeats, and the fraction of (b)'s targets (a) keeps — Jmax
buys its time by not training some targets, and the report says how many. The last line is the main figure: the
forward+backward time Jmax=5 saves against no path limit, median of the paired repeats (target >= 15%; the
QwenGyre paper reports 25.2%); the script exits 1 when the target is missed.

Timings use one torch thread by default: on a machine that other jobs share, several OpenMP threads per process
slow down by large and erratic factors, which would swamp the differences measured here (--threads to change).
Without --model-path it creates the built-in tiny Qwen3 in a temporary folder, with a context length that fits
the longest generated path. Behaviour log-probs are synthetic, so most runs' ratios sit outside GSPO's clip
window; that changes the loss value, not the work of the forward and backward passes being timed.
--scale multiplies every token-length range of the default synthetic config (1.0: the generator's defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

from gyre_slurm.train.batch import TrainBatch, TrainSample  # noqa: E402
from gyre_slurm.trajectory.synthetic import SyntheticConfig, all_paths_without_dedup, generate_runs  # noqa: E402
from gyre_slurm.trajectory.tree import Segment  # noqa: E402

PAPER_REDUCTION = 25.2  # QwenGyre: Jmax=5 vs no limit, forward+backward time (%)
TOKEN_RANGES = ("system_tokens", "task_tokens", "output_tokens", "tool_result_tokens", "summary_prompt_tokens",
                "summary_output_tokens", "subagent_system_tokens", "subagent_task_tokens")


def scaled_config(scale: float, vocab_size: int) -> SyntheticConfig:
    base = SyntheticConfig()
    ranges = {name: (max(1, round(lo * scale)), max(1, round(hi * scale)))
              for name in TOKEN_RANGES for lo, hi in [getattr(base, name)]}
    return dataclasses.replace(base, vocab_size=vocab_size, **ranges)


def make_batch(per_run: list[list[Segment]], counts: list[int], advantages: list[float]) -> TrainBatch:
    samples = [TrainSample(r, s.tokens, s.loss_mask, s.behav_logp) for r, segs in enumerate(per_run) for s in segs]
    return TrainBatch(samples, dict(enumerate(advantages)), dict(enumerate(counts)), step=0, version_in=0)


def sizes(batch: TrainBatch) -> tuple[int, int, int]:
    """(sequences, tokens forwarded, targets) as the trainer sees them."""
    seqs = [s for s in batch.samples if any(s.loss_mask)]
    tokens = sum(max(j for j, m in enumerate(s.loss_mask) if m) + 1 for s in seqs)
    return len(seqs), tokens, sum(sum(s.loss_mask) for s in seqs)


def tiny_model(folder: Path, context: int) -> Path:
    from gyre_slurm.model.tiny import create_tiny_model

    d = create_tiny_model(folder / "tiny", seed=0)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg["max_position_embeddings"] < context:
        cfg["max_position_embeddings"] = -(-context // 1024) * 1024
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return d


TARGET_REDUCTION = 15.0  # % of forward+backward time Jmax must save against no path limit (median over repeats)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=16, help="synthetic runs in the batch")
    ap.add_argument("--repeats", type=int, default=5, help="timed forward+backward passes per setting (>= 5)")
    ap.add_argument("--scale", type=float, default=0.2, help="multiplies every token-length range of the generator")
    ap.add_argument("--jmax", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: several threads on a shared, busy machine make timings erratic)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192, help="trainer micro-batch budget (padded)")
    ap.add_argument("--model-path", type=Path, help="default: create the built-in tiny model")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats must be at least 5: the spread of the ratio is part of the report")
    return args


def build_settings(args: argparse.Namespace, vocab: int) -> tuple[list, list[float], dict[str, TrainBatch]]:
    runs = generate_runs(args.runs, scaled_config(args.scale, vocab), seed=args.seed)
    rng = random.Random(args.seed)
    adv = [rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5) for _ in runs]
    bounded = [r.tree.segments(max_paths=args.jmax) for r in runs]
    full = [r.tree.segments() for r in runs]
    naive = [all_paths_without_dedup(r.tree) for r in runs]
    settings = {
        f"(a) Jmax={args.jmax} + dedup": make_batch([s for s, _ in bounded], [n for _, n in bounded], adv),
        "(b) no limit + dedup": make_batch([s for s, _ in full], [n for _, n in full], adv),
        "(c) naive, no dedup": make_batch(naive, [sum(sum(s.loss_mask) for s in segs) for segs in naive], adv),
    }
    return runs, adv, settings


def describe_scale(args: argparse.Namespace, runs: list, settings: dict[str, TrainBatch], trainer: Any,
                   model: str) -> None:
    longest = max(len(s.tokens) for s in settings["(c) naive, no dedup"].samples)
    tree_tokens = sum(len(n.tokens) for r in runs for n in r.tree.nodes())
    print(f"synthetic scale: {args.runs} runs (seed {args.seed}, --scale {args.scale}): "
          f"{sum(r.n_main_turns for r in runs)} main turns, {sum(r.n_compactions for r in runs)} compactions, "
          f"{sum(r.n_subagents for r in runs)} sub-agents, {sum(r.n_retries for r in runs)} retries, "
          f"{sum(len(r.tree.leaves()) for r in runs)} leaves, {tree_tokens:,} tree tokens "
          f"({sum(r.tree.n_trainable() for r in runs):,} trainable); longest path {longest:,} tokens")
    print(f"model {model}, device {trainer.device}, torch threads {torch.get_num_threads()}, "
          f"micro-batch {args.micro_batch_tokens:,} tokens, GSPO bypass mode")


def warm_up(trainer: Any, batch: TrainBatch, adv: list[float]) -> None:
    """One untimed pass on a small slice (allocator, kernels)."""
    first = batch.samples[0].run_id
    trainer.zero_grad()
    trainer.forward_backward(TrainBatch([s for s in batch.samples if s.run_id == first], {first: adv[first]},
                                        {first: batch.targets_per_run[first]}, step=0, version_in=0))


def time_settings(trainer: Any, settings: dict[str, TrainBatch], repeats: int) -> tuple[dict, dict]:
    """forward+backward seconds per setting, interleaved and rotated each repeat so noise hits all alike."""
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    names = list(settings)
    times: dict[str, list[float]] = {k: [] for k in names}
    metrics: dict[str, dict[str, float]] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("forward+backward", total=repeats * len(names))
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                progress.update(task, description=f"repeat {rep + 1}/{repeats} {name}")
                trainer.zero_grad()
                sync()
                t = time.perf_counter()
                metrics[name] = trainer.forward_backward(settings[name])
                sync()
                times[name].append(time.perf_counter() - t)
                progress.advance(task)
    trainer.zero_grad()
    return times, metrics


def spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"median {statistics.median(xs):{fmt}} (min {min(xs):{fmt}}, max {max(xs):{fmt}})"


def report(settings: dict[str, TrainBatch], times: dict, metrics: dict) -> tuple[float, float]:
    """Print the table and the ratios; returns (median per-repeat saving of (a) against (b) in %, targets kept)."""
    names = list(settings)
    size = {n: sizes(settings[n]) for n in names}
    print()
    print(f"{'setting':<22}{'sequences':>10}{'tokens':>10}{'padded':>10}{'targets':>9}{'micro':>6}"
          f"{'median s':>9}{'min s':>7}{'max s':>7}{'ms/target':>10}")
    for n in names:
        seqs, tokens, targets = size[n]
        med = statistics.median(times[n])
        print(f"{n:<22}{seqs:>10,}{tokens:>10,}{int(metrics[n]['padded_tokens']):>10,}{targets:>9,}"
              f"{int(metrics[n]['micro_batches']):>6}{med:>9.2f}{min(times[n]):>7.2f}{max(times[n]):>7.2f}"
              f"{1000 * med / targets:>10.3f}")
    a, b, c = names
    ratio = [x / y for x, y in zip(times[a], times[b], strict=True)]
    (sa, ta, na), (sb, tb, nb), (sc, tc, nc) = size[a], size[b], size[c]
    per_target = [(x / na) / (y / nb) for x, y in zip(times[a], times[b], strict=True)]
    print()
    print("baseline: (b), every path that adds a target, each target trained once (no path limit)")
    print(f"(a) vs (b): {sa / sb:.1%} of the sequences, {ta / tb:.1%} of the tokens forwarded; forward+backward "
          f"time ratio per repeat {spread(ratio)} over {len(ratio)} repeats")
    print(f"(a) keeps {na:,} of (b)'s {nb:,} trainable targets ({na / nb:.1%}; the bounded-sampling cost: "
          f"{1 - na / nb:.1%} dropped); time per trained target (a)/(b): {spread(per_target)}")
    print(f"(c) vs (b): {sc / sb:.2f}x sequences, {tc / tb:.2f}x tokens, {nc / nb:.2f}x targets (each shared target "
          f"once per path), {statistics.median(times[c]) / statistics.median(times[b]):.2f}x the time (median)")
    return 100 * (1 - statistics.median(ratio)), na / nb


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-paths-") as tmp:
        t0 = time.perf_counter()
        vocab = 256
        if args.model_path is not None:
            vocab = min(vocab, json.loads((args.model_path / "config.json").read_text())["vocab_size"])
        runs, adv, settings = build_settings(args, vocab)
        longest = max(len(s.tokens) for s in settings["(c) naive, no dedup"].samples)
        model_dir = args.model_path or tiny_model(Path(tmp), longest)

        from gyre_slurm.train.torch_trainer import TorchTrainer

        trainer = TorchTrainer(model_dir, micro_batch_tokens=args.micro_batch_tokens, seed=0, device=args.device)
        describe_scale(args, runs, settings, trainer, "built-in tiny Qwen3" if args.model_path is None
                       else str(model_dir))
        warm_up(trainer, settings[next(iter(settings))], adv)
        times, metrics = time_settings(trainer, settings, args.repeats)
        reduction, kept = report(settings, times, metrics)
        print(f"timing: {args.repeats} interleaved repeats per setting; whole benchmark "
              f"{time.perf_counter() - t0:.0f} s")
    missed = reduction < TARGET_REDUCTION
    if missed:
        print(f"MISSED TARGET: Jmax={args.jmax} saves {reduction:.1f}% < {TARGET_REDUCTION:g}%", file=sys.stderr)
    print(f"Jmax={args.jmax} cuts forward+backward time by {reduction:.1f}% (median of {args.repeats} paired "
          f"repeats; target >= {TARGET_REDUCTION:g}%; QwenGyre paper: {PAPER_REDUCTION}%) against no path limit, "
          f"keeping {kept:.1%} of its trainable targets")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
