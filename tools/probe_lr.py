"""How far does ONE optimizer step move the policy? A diagnostic for choosing `train.lr` (not a benchmark).

For a finished step of a run (its batch is kept in state/RUN/batches/step-N/), this loads the weights that step
started from, takes one GSPO step with a fresh AdamW at each learning rate given, and measures on the batch's own
trained tokens:
- improvement: Σ_r Â_r · Δ(mean log π of run r's tokens) / Σ_r |Â_r|: how much the step moved the runs the way their
  advantages ask (positive: better runs made likelier, worse ones less likely);
- KL: the mean over runs of the mean k3 = exp(old − new) − (old − new) − 1, the policy's KL to where it started.
A policy whose KL grows much faster than its improvement as lr rises is fragile there: AdamW's first steps move
every weight by about lr, whatever the gradient. `--freeze NAME` keeps parameters whose name contains NAME fixed.

    .venv/bin/python tools/probe_lr.py state/RUN --step 0 --lr 1e-4 2e-4 3e-4 [--freeze self_attn]

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


def probe(weights: Path, batch: TrainBatch, lr: float, freeze: list[str], micro_batch_tokens: int,
          ) -> tuple[float, float]:
    tr = TorchTrainer(weights, device="cpu", lr=lr, micro_batch_tokens=micro_batch_tokens)
    for name, p in tr.model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    tr.params = [p for p in tr.model.parameters() if p.requires_grad]
    tr.optimizer = torch.optim.AdamW(tr.params, lr=lr, weight_decay=0.0)
    before = tr.proximal_logprobs(batch)  # per sample, its targets' log-probs at the current weights
    tr.train_step(batch)
    after = tr.proximal_logprobs(batch)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run's folder (state/RUN)")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 2e-4, 3e-4])
    ap.add_argument("--freeze", action="append", default=[], help="keep parameters whose name contains this fixed")
    ap.add_argument("--max-kl", type=float, default=0.1)
    args = ap.parse_args()
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    mbt = int(cfg.get("train", {}).get("micro_batch_tokens", 8192))
    batch, weights = step_batch(args.run, args.step), start_weights(args.run, args.step)
    print(f"step {args.step} of {args.run.name}: {len(batch.advantages)} runs, from {weights}"
          + (f", frozen: {', '.join(args.freeze)}" if args.freeze else ""))
    ok = []
    for lr in sorted(args.lr):
        gain, kl = probe(weights, batch, lr, args.freeze, mbt)
        print(f"lr {lr:.1e}: improvement {gain:+.4f}  KL {kl:.4f}", flush=True)
        if kl <= args.max_kl:
            ok.append(lr)
    print(f"largest lr with KL <= {args.max_kl}: {max(ok):.1e}" if ok else f"no lr given keeps KL <= {args.max_kl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
