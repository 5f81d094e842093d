"""The GPU check (run by tools/gpu_check.sh on a lent GPU machine; `--device cpu` runs the same steps here).

A Qwen3-shaped model with random weights (--hidden, --layers) is written as a Hugging Face folder; then:
  1. the embedded engine serves it on the device (`gyre engine --device`): 8 concurrent requests of --new-tokens
     tokens with log-probs, through its HTTP routes and the engine client the rollout cells use;
  2. one GSPO step of the Megatron trainer (train.backend: megatron) on the device, on rollouts the engine made;
  3. the trained weights are saved and the engine loads them (/update_weights_from_disk): log-probs change;
  4. release_memory_occupation / resume_memory_occupation, then a request again: the same tokens as before it.
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
                         "num_key_value_heads": max(1, heads // 2), "head_dim": 128})
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


def train_step(model: Path, device: str, prompts, outs, results: dict, out_dir: Path) -> dict:
    from gyre_slurm.train.batch import TrainBatch, TrainSample
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    tr = timed("megatron trainer built on the device", lambda: MegatronTrainer(model, device=device, lr=1e-4),
               results)
    pairs = enumerate(zip(prompts, outs, strict=True))
    samples = [TrainSample(i, p + o.output_ids, [0] * len(p) + [1] * len(o.output_ids),
                           [0.0] * len(p) + o.output_logprobs) for i, (p, o) in pairs]
    adv = {i: (1.0 if i % 2 else -0.5) for i in range(len(samples))}  # not summing to 0: a visible loss
    batch = TrainBatch(samples, adv, {i: len(o.output_ids) for i, o in enumerate(outs)}, step=0, version_in=0)
    metrics = timed("megatron GSPO step", lambda: tr.train_step(batch), results)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        results["trainer peak GiB"] = torch.cuda.max_memory_allocated() / 2**30
    timed("trained weights saved (HF layout)", lambda: tr.save(out_dir), results)
    return metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=420.0)
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
        metrics = train_step(model, args.device, prompts, outs, results, work / "v1")
        timed("weight update from disk", lambda: client.update_weights_from_disk(str(work / "v1"), 1), results)
        after = asyncio.run(generate(client, prompts[:1], args.new_tokens))[0]
        moved = max(abs(a - b) for a, b in zip(after.output_logprobs, outs[0].output_logprobs, strict=True))
        timed("release memory", lambda: client.release_memory(), results)
        timed("resume memory", lambda: client.resume_memory(), results)
        again = asyncio.run(generate(client, prompts[:1], args.new_tokens))[0]
    finally:
        proc.terminate()
        proc.wait()
    total = time.perf_counter() - t0
    ok = (again.output_ids == after.output_ids and after.weight_version == 1 and moved > 0
          and all(v == v for v in metrics.values()))
    print(f"gpu check on {args.device} ({torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}):"
          f" {'OK' if ok else 'FAILED'} in {total:.1f} s; step loss {metrics.get('loss', float('nan')):.4g}, "
          f"log-probs moved by {moved:.3g} after the update, same tokens after release/resume: "
          f"{again.output_ids == after.output_ids}")
    return 0 if ok and total <= args.budget_s else 1


if __name__ == "__main__":
    raise SystemExit(main())
