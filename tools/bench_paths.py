"""Benchmark path selection for training on run trees: Jmax=5 with dedup vs no path limit vs naive flattening.

    .venv/bin/python tools/bench_paths.py [--runs 16] [--repeats 3] [--scale 0.2] [--jmax 5] [--threads 1]
                                          [--model-path DIR] [--micro-batch-tokens 8192] [--seed 0]

Synthetic runs (gyre_slurm.trajectory.synthetic: a compressing, sub-agent-spawning harness) are turned into one
training batch per setting, and each batch goes through the real torch trainer's forward_backward (GSPO loss,
bypass mode, the trainer's micro-batch packing and pre-pass):

  (a) Jmax=5 + dedup: RunTree.segments(max_paths=5), ALGORITHMS.md §3.3
  (b) no limit + dedup: RunTree.segments(max_paths=None): every path that adds a target, each target once
  (c) naive: every root-to-leaf path, every trainable token on it a target (shared targets once per path)

For each: sequences, tokens forwarded (up to each sequence's last target, as the trainer trims), targets trained,
and forward+backward seconds averaged over --repeats, with the settings interleaved (rotated each repeat) so
that machine noise hits all three alike. Then the ratios; the last line is the main figure alone: the
forward+backward time Jmax=5 saves against no path limit (the QwenGyre paper reports 25.2%).

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=16, help="synthetic runs in the batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes per setting")
    ap.add_argument("--scale", type=float, default=0.2, help="multiplies every token-length range of the generator")
    ap.add_argument("--jmax", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: several threads on a shared, busy machine make timings erratic)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192, help="trainer micro-batch budget (padded)")
    ap.add_argument("--model-path", type=Path, help="default: create the built-in tiny model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    err = Console(stderr=True)

    with tempfile.TemporaryDirectory(prefix="gyre-bench-paths-") as tmp:
        t0 = time.perf_counter()
        vocab = 256
        if args.model_path is not None:
            vocab = min(vocab, json.loads((args.model_path / "config.json").read_text())["vocab_size"])
        cfg = scaled_config(args.scale, vocab)
        runs = generate_runs(args.runs, cfg, seed=args.seed)
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
        longest = max(len(s.tokens) for segs in naive for s in segs)
        model_dir = args.model_path or tiny_model(Path(tmp), longest)

        from gyre_slurm.train.torch_trainer import TorchTrainer

        trainer = TorchTrainer(model_dir, micro_batch_tokens=args.micro_batch_tokens, seed=0, device=args.device)
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        n_leaves = sum(len(r.tree.leaves()) for r in runs)
        print(f"{args.runs} synthetic runs (seed {args.seed}, scale {args.scale}): "
              f"{sum(r.n_main_turns for r in runs)} main turns, {sum(r.n_compactions for r in runs)} compactions, "
              f"{sum(r.n_subagents for r in runs)} sub-agents, {sum(r.n_retries for r in runs)} retries, "
              f"{n_leaves} leaves; longest path {longest:,} tokens")
        print(f"model {'built-in tiny Qwen3' if args.model_path is None else model_dir}, device {trainer.device}, "
              f"torch threads {torch.get_num_threads()}, micro-batch {args.micro_batch_tokens:,} tokens, "
              f"GSPO bypass mode")

        # Warm-up (allocator, kernels): one untimed pass on a small slice.
        warm = settings[next(iter(settings))]
        first = warm.samples[0].run_id
        trainer.zero_grad()
        trainer.forward_backward(TrainBatch([s for s in warm.samples if s.run_id == first], {first: adv[first]},
                                            {first: warm.targets_per_run[first]}, step=0, version_in=0))

        names = list(settings)
        times: dict[str, list[float]] = {k: [] for k in names}
        metrics: dict[str, dict[str, float]] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("forward+backward", total=args.repeats * len(names))
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    progress.update(task, description=f"repeat {rep + 1}/{args.repeats} {name}")
                    trainer.zero_grad()
                    sync()
                    t = time.perf_counter()
                    metrics[name] = trainer.forward_backward(settings[name])
                    sync()
                    times[name].append(time.perf_counter() - t)
                    progress.advance(task)
        trainer.zero_grad()

        rows = []
        for name in names:
            seqs, tokens, targets = sizes(settings[name])
            m = metrics[name]
            rows.append((name, seqs, tokens, int(m["padded_tokens"]), targets, int(m["micro_batches"]),
                         int(m["prepass_micro_batches"]), statistics.fmean(times[name]),
                         statistics.median(times[name]),
                         statistics.stdev(times[name]) if len(times[name]) > 1 else 0.0))
        print()
        print(f"{'setting':<22}{'sequences':>10}{'tokens':>10}{'padded':>10}{'targets':>9}{'micro':>6}{'prepass':>8}"
              f"{'mean s':>8}{'median s':>9}{'sd s':>7}")
        for name, seqs, tokens, padded, targets, micro, pre, mean, med, sd in rows:
            print(f"{name:<22}{seqs:>10,}{tokens:>10,}{padded:>10,}{targets:>9,}{micro:>6}{pre:>8}{mean:>8.2f}"
                  f"{med:>9.2f}{sd:>7.2f}")
        (a, b, c) = rows
        _, sa, ta, _, na, _, _, time_a, med_a, _ = a
        _, sb, tb, _, nb, _, _, time_b, med_b, _ = b
        _, sc, tc, _, nc, _, _, time_c, _, _ = c
        paired = [x / y for x, y in zip(times[names[0]], times[names[1]], strict=True)]
        print()
        print(f"(a) vs (b): {sa / sb:.1%} of the sequences, {ta / tb:.1%} of the tokens forwarded, "
              f"{time_a / time_b:.1%} of the forward+backward time (mean; median {med_a / med_b:.1%}; "
              f"per-repeat ratios {', '.join(f'{r:.2f}' for r in paired)})")
        print(f"(a) keeps {na:,} of (b)'s {nb:,} trainable targets: {na / nb:.1%} "
              f"(the bounded-sampling cost: {1 - na / nb:.1%} of the targets dropped)")
        print(f"(c) vs (b): {sc / sb:.2f}x sequences, {tc / tb:.2f}x tokens, {nc / nb:.2f}x targets "
              f"(each shared target counted once per path), {time_c / time_b:.2f}x the time")
        print(f"timing: {args.repeats} interleaved repeats per setting; "
              f"whole benchmark {time.perf_counter() - t0:.0f} s")
        reduction = 100 * (1 - time_a / time_b)
    print(f"Jmax={args.jmax} cuts forward+backward time by {reduction:.1f}% against no path limit "
          f"({time_a:.2f} s vs {time_b:.2f} s; QwenGyre paper: {PAPER_REDUCTION}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
