"""The GPU check (run by tools/gpu_check.sh on a lent GPU machine; `--device cpu` runs the same steps here).

A Qwen3-shaped model with random weights (--hidden, --layers) is written as a Hugging Face folder; then:
  1. the embedded engine serves it on the device (`gyre engine --device`): 8 concurrent requests of --new-tokens
     tokens with log-probs, through its HTTP routes and the engine client the rollout cells use;
  2. one GSPO step of the Megatron trainer (train.backend: megatron) on the device, on rollouts the engine made;
  3. the trained weights are saved and the engine loads them (/update_weights_from_disk): log-probs change;
  4. release_memory_occupation / resume_memory_occupation, then a request again: the same tokens as before it;
  5. with two GPUs visible (or --ranks 2), the same first step on a 2-rank tensor-parallel cell: loss and gradient
     norm equal TP=1's within 1e-4 (relative);
  6. one GSPO step of the tiny Qwen3-MoE (Megatron's MoE layer, 4 experts top 2) on the device.
A machine with one GPU runs no multi-rank cell (NCCL takes one rank per GPU): tests/test_megatron_parallel.py runs
those over gloo on the CPU.
Prints each timing; the last line is the summary. Exits non-zero when a step fails or the check overruns --budget-s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_slurm.engines.client import EngineClient, SamplingParams  # noqa: E402
from gyre_slurm.spawn import gyre_argv, spawn, wait_until  # noqa: E402


def make_model(out: Path, hidden: int, layers: int) -> Path:
    """The built-in tokenizer and chat template (as the tiny model has them), with a larger random Qwen3 body."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre_slurm.model.tiny import create_tiny_model

    create_tiny_model(out, seed=0)
    cfg = Qwen3Config.from_pretrained(out)
    heads = max(2, hidden // 128)
    big = Qwen3Config(**{**cfg.to_dict(), "hidden_size": hidden, "intermediate_size": 3 * hidden,
                         "num_hidden_layers": layers, "num_attention_heads": heads,
                         "num_key_value_heads": heads // 2 if heads >= 4 else heads, "head_dim": 128})  # TP=2 fits
    torch.manual_seed(0)
    Qwen3ForCausalLM(big).save_pretrained(out)
    return out


def timed(what: str, fn, results: dict):
    t = time.perf_counter()
    out = fn()
    results[what] = time.perf_counter() - t
    print(f"{what}: {results[what]:.3f} s", flush=True)
    return out


async def generate(client: EngineClient, prompts: list[list[int]], new_tokens: int):
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=7)
    return await asyncio.gather(*(client.generate(p, sp) for p in prompts))


def start_engine(model: Path, device: str, work: Path) -> tuple[object, EngineClient]:
    ready = work / "engine.json"
    proc = spawn(gyre_argv("engine", "--model-path", str(model), "--device", device, "--ready-file", str(ready),
                           "--threads", "4"), work / "engine.log")
    wait_until(ready.is_file, what="the engine", timeout_s=300, procs=proc, log=work / "engine.log")
    return proc, EngineClient(json.loads(ready.read_text())["url"])


def make_batch(prompts, outputs: list[tuple[list[int], list[float]]]):
    """One run per prompt: its output tokens the target, behaviour log-probs as given."""
    from gyre_slurm.train.batch import TrainBatch, TrainSample

    samples = [TrainSample(i, p + ids, [0] * len(p) + [1] * len(ids), [0.0] * len(p) + lps)
               for i, (p, (ids, lps)) in enumerate(zip(prompts, outputs, strict=True))]
    adv = {i: (1.0 if i % 2 else -0.5) for i in range(len(samples))}  # not summing to 0: a visible loss
    return TrainBatch(samples, adv, {i: len(ids) for i, (ids, _) in enumerate(outputs)}, step=0, version_in=0)


def train_step(model: Path, device: str, batch, results: dict, out_dir: Path) -> dict:
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    tr = timed("megatron trainer built on the device", lambda: MegatronTrainer(model, device=device, lr=1e-4),
               results)
    metrics = timed("megatron GSPO step", lambda: tr.train_step(batch), results)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        results["trainer peak GiB"] = torch.cuda.max_memory_allocated() / 2**30
    timed("trained weights saved (HF layout)", lambda: tr.save(out_dir), results)
    return metrics


def parallel_step(model: Path, device: str, batch, work: Path, results: dict) -> dict:
    """The same first step on a 2-rank tensor-parallel cell (train/rank_group.py: rank 0 here, rank 1 a `gyre
    trainer-rank` process on the next GPU; NCCL on GPUs, gloo on the CPU)."""
    from gyre_slurm.config import TrainSection
    from gyre_slurm.train.megatron_parallel import teardown_parallel
    from gyre_slurm.train.rank_group import RankGroup

    teardown_parallel()  # this process's world-1 groups: the cell's world replaces them
    train = TrainSection(backend="megatron", tensor_parallel=2, lr=1e-4)
    group = timed("megatron TP=2 cell up (2 ranks)", lambda: RankGroup(
        model, train, seed=0, resume_optimizer=False, log_dir=work / "ranks", world=2, device=device), results)
    try:
        return timed("megatron TP=2 GSPO step", lambda: group.train_step(batch), results)
    finally:
        group.close()
        teardown_parallel()


def moe_step(device: str, work: Path, results: dict) -> dict:
    """A GSPO step of the tiny Qwen3-MoE (4 experts, top 2: Megatron's MoE layer and router) on the device."""
    from gyre_slurm.model.tiny import build_tiny_moe
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(build_tiny_moe(work / "moe"), device=device, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (16,), generator=g).tolist() for _ in range(4)]
    outputs = [(torch.randint(3, 250, (32,), generator=g).tolist(), [-1.5] * 32) for _ in range(4)]
    return timed("megatron MoE GSPO step", lambda: tr.train_step(make_batch(prompts, outputs)), results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=1,
                    help="2: the TP=2 cell even without two GPUs (on the CPU: over gloo); cuda runs it when 2 GPUs "
                         "are visible")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    t0, results = time.perf_counter(), {}
    work = Path(tempfile.mkdtemp(prefix="gyre-gpu-check-"))
    model = timed("random Qwen3 written", lambda: make_model(work / "model", args.hidden, args.layers), results)
    proc, client = timed("engine up", lambda: start_engine(model, args.device, work), results)
    try:
        prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * 8 for i in range(8)]
        outs = timed("8 requests generated", lambda: asyncio.run(generate(client, prompts, args.new_tokens)),
                     results)
        tokens = sum(len(o.output_ids) for o in outs)
        print(f"decode: {tokens / results['8 requests generated']:,.0f} tokens/s over 8 streams", flush=True)
        batch = make_batch(prompts, [(o.output_ids, o.output_logprobs) for o in outs])
        metrics = train_step(model, args.device, batch, results, work / "v1")
        timed("weight update from disk", lambda: client.update_weights_from_disk(str(work / "v1"), 1), results)
        after = asyncio.run(generate(client, prompts[:1], args.new_tokens))[0]
        moved = max(abs(a - b) for a, b in zip(after.output_logprobs, outs[0].output_logprobs, strict=True))
        timed("release memory", lambda: client.release_memory(), results)
        timed("resume memory", lambda: client.resume_memory(), results)
        again = asyncio.run(generate(client, prompts[:1], args.new_tokens))[0]
        gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
        if gpus >= 2 or args.ranks == 2:
            tp2 = parallel_step(model, args.device, batch, work, results)
            tp_diff = max(abs(tp2[k] - metrics[k]) / max(1.0, abs(metrics[k])) for k in ("loss", "grad_norm"))
            print(f"megatron TP=2 vs TP=1, first step: loss {tp2['loss']:.6g} vs {metrics['loss']:.6g}, grad norm "
                  f"{tp2['grad_norm']:.6g} vs {metrics['grad_norm']:.6g} (relative difference {tp_diff:.2e})")
        else:
            tp_diff = 0.0
            print("megatron TP=2: not run (one GPU visible; NCCL takes one rank per GPU)")
        moe = moe_step(args.device, work, results)
    finally:
        proc.terminate()
        proc.wait()
    total = time.perf_counter() - t0
    ok = (again.output_ids == after.output_ids and after.weight_version == 1 and moved > 0
          and all(v == v for v in [*metrics.values(), *moe.values()]) and moe["grad_norm"] > 0 and tp_diff <= 1e-4)
    print(f"gpu check on {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}):"
          f" {'OK' if ok else 'FAILED'} in {total:.1f} s; step loss {metrics.get('loss', float('nan')):.4g}, "
          f"MoE step loss {moe['loss']:.4g}, log-probs moved by {moved:.3g} after the update, same tokens after "
          f"release/resume: "
          f"{again.output_ids == after.output_ids}")
    return 0 if ok and total <= args.budget_s else 1


if __name__ == "__main__":
    raise SystemExit(main())
