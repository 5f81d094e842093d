"""How far does ONE optimizer step move the policy? A diagnostic for choosing `train.lr` (not a benchmark).

For a finished step of a run (its batch is kept in state/RUN/batches/step-N/), this loads the weights that step
started from, takes one GSPO step with a fresh AdamW at each learning rate given, and measures on the batch's own
trained tokens:
- improvement: Σ_r Â_r · Δ(mean log π of run r's tokens) / Σ_r |Â_r|: how much the step moved the runs the way their
  advantages ask (positive: better runs made likelier, worse ones less likely);
- KL: the mean over runs of the mean k3 = exp(old − new) − (old − new) − 1, the policy's KL to where it started.
The same two figures on a held-out batch (the next step's, or --held-out STEP) say how much of the step carries over
to runs it was not taken on (`--embedding-lr` as train.embedding_lr; `--freeze layers --freeze model.norm` steps the
token embeddings alone). A policy whose KL grows much faster than its improvement as lr rises is fragile there:
AdamW's first steps move every weight by about lr, whatever the gradient. `--freeze NAME` keeps parameters whose name
contains NAME fixed.

    .venv/bin/python tools/probe_lr.py state/RUN --step 0 --lr 1e-4 2e-4 3e-4 [--freeze self_attn]
    .venv/bin/python tools/probe_lr.py state/RUN --step 0 --lr 5e-5 --embedding-lr 1e-3

Last line: the largest lr whose KL stays at or below --max-kl (default 0.1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm.train.batch import TrainBatch, read_batch  # noqa: E402
from gyre_slurm.train.shards import merge_shards  # noqa: E402
from gyre_slurm.train.torch_trainer import TorchTrainer  # noqa: E402


def step_batch(run: Path, step: int) -> TrainBatch:
    files = sorted((run / "batches" / f"step-{step:05d}").glob("*.msgpack"))
    if not files:
        sys.exit(f"no batch of step {step} in {run}/batches (a step's batch is kept once it has been trained)")
    parts = [read_batch(f) for f in files]
    return parts[0] if len(parts) == 1 else merge_shards(parts)


def start_weights(run: Path, step: int) -> Path:
    """The weights step N started from (its version_in, as the ledger records where each version lives)."""
    import sqlite3

    con = sqlite3.connect(f"file:{run / 'ledger.db'}?mode=ro", uri=True)
    row = con.execute("SELECT w.location FROM train_steps t JOIN weight_versions w ON w.version = t.version_in "
                      "WHERE t.step = ?", (step,)).fetchone()
    if row is None:
        sys.exit(f"step {step} of {run} is not in its ledger")
    path = Path(row[0]) if Path(row[0]).is_absolute() else REPO / row[0]
    if not (path / "config.json").is_file():
        sys.exit(f"the weights step {step} started from are gone ({path})")
    return path


def moved_by(batch: TrainBatch, before: list[torch.Tensor], after: list[torch.Tensor]) -> tuple[float, float]:
    """(improvement, KL) of the move from `before` to `after` (each sample's targets' log-probs) on batch."""
    moved: dict[int, list[torch.Tensor]] = {}
    for s, x, y in zip(batch.samples, before, after, strict=True):
        if len(x):
            moved.setdefault(s.run_id, []).append(y - x)
    gain = weight = kl = 0.0
    for run_id, parts in moved.items():
        d = torch.cat(parts)
        a = batch.advantages[run_id]
        gain, weight = gain + a * float(d.mean()), weight + abs(a)
        kl += float((torch.exp(-d) + d - 1).mean())
    return gain / max(weight, 1e-12), kl / max(len(moved), 1)


def probe(weights: Path, batches: list[TrainBatch], lr: float, embedding_lr: float | None, freeze: list[str],
          micro_batch_tokens: int) -> list[tuple[float, float]]:
    """One step on batches[0]; (improvement, KL) on each batch: the step's own, then the held-out one if given."""
    tr = TorchTrainer(weights, device="cpu", lr=lr, embedding_lr=embedding_lr, micro_batch_tokens=micro_batch_tokens)
    for name, p in tr.model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    for group in tr.optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    before = [tr.proximal_logprobs(b) for b in batches]  # per sample, its targets' log-probs at the current weights
    tr.train_step(batches[0])
    return [moved_by(b, x, tr.proximal_logprobs(b)) for b, x in zip(batches, before, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run's folder (state/RUN)")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 2e-4, 3e-4])
    ap.add_argument("--embedding-lr", type=float, default=None, help="as train.embedding_lr (default: each lr)")
    ap.add_argument("--held-out", type=int, default=None, metavar="STEP",
                    help="also measure the step on this step's batch (default: the next step's, when kept)")
    ap.add_argument("--freeze", action="append", default=[], help="keep parameters whose name contains this fixed")
    ap.add_argument("--max-kl", type=float, default=0.1)
    args = ap.parse_args()
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    mbt = int(cfg.get("train", {}).get("micro_batch_tokens", 8192))
    batches, weights = [step_batch(args.run, args.step)], start_weights(args.run, args.step)
    held = args.held_out if args.held_out is not None else args.step + 1
    if (args.run / "batches" / f"step-{held:05d}").is_dir():
        batches.append(step_batch(args.run, held))
    print(f"step {args.step} of {args.run.name}: {len(batches[0].advantages)} runs, from {weights}"
          + (f"; held out: step {held}" if len(batches) > 1 else "")
          + (f"; embedding lr {args.embedding_lr:.1e}" if args.embedding_lr else "")
          + (f"; frozen: {', '.join(args.freeze)}" if args.freeze else ""))
    ok = []
    for lr in sorted(args.lr):
        res = probe(weights, batches, lr, args.embedding_lr, args.freeze, mbt)
        print(f"lr {lr:.1e}: improvement {res[0][0]:+.4f}  KL {res[0][1]:.4f}"
              + (f"  | held out: improvement {res[1][0]:+.4f}  KL {res[1][1]:.4f}" if len(res) > 1 else ""), flush=True)
        if res[0][1] <= args.max_kl:
            ok.append(lr)
    print(f"largest lr with KL <= {args.max_kl}: {max(ok):.1e}" if ok else f"no lr given keeps KL <= {args.max_kl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
