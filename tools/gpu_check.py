"""The GPU check (tools/gpu_check.sh runs it on a lent GPU machine; `--device cpu` walks the same steps here).

A Qwen3-shaped model with random weights (--hidden, --layers) is written as a Hugging Face folder; then, one printed
line per step (`<name>: ok|FAIL <figures>`, "skipped on cpu: <why>" for what only a GPU can show):
  versions   torch, CUDA, NCCL, Transformer Engine present?, megatron-core; free GPU memory.
  moe        one GSPO step of the tiny Qwen3-MoE on Megatron's MoE layer, without Transformer Engine.
  dense      Megatron's log-probs against Hugging Face's on the device (fp32: <= 1e-4; bf16 where the trainer has it:
             <= BF16_BOUND), one GSPO step, the save/reload round trip (same log-probs), and no CPU patch in force
             (train/megatron_cpu.py) on CUDA.
  stage      the weight path beside SGLang, between two processes: this one runs the node agent's EngineStager
             (agent/engine_stage.py: the trained version as safetensors in a RAM-disk folder, /dev/shm; its first
             hop, the Mooncake pull, read from the snapshot folder instead: the device image has no Mooncake), the
             engine process loads it with /update_weights_from_disk; then an NCCL group of two processes on one
             GPU, which NCCL must refuse.
  attention  peak memory of one forward+backward of the model's core attention at --attn-lengths tokens: it grows
             about linearly (no seq x seq score matrix).
  memory     memory after a step, and after dropping the trainer (gc + empty_cache): it returns.
  engine     the embedded engine on the device: 8 concurrent requests with log-probs, release/resume, the same
             tokens after.
The last line is the summary. Exits non-zero when a step fails or the check overruns --budget-s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_slurm.engines.client import EngineClient, SamplingParams  # noqa: E402
from gyre_slurm.spawn import gyre_argv, spawn, wait_until  # noqa: E402

FP32_BOUND = 1e-4  # Megatron vs Hugging Face log-probs, both fp32 (max absolute difference, nats)
# bf16 parameters against the fp32 reference: bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%), which
# a log-prob of ~|6| nats (this random model's) carries through every layer; the bound is the max absolute difference.
BF16_BOUND = 0.1
MIB = 2**20


@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    model: Path | None = None
    trainer: object | None = None  # the dense trainer of `dense`, dropped by `memory`
    mem: dict[str, float] = field(default_factory=dict)
    engine_proc: subprocess.Popen | None = None
    client: EngineClient | None = None
    snapshot: Path | None = None  # the trained version's snapshot folder (`dense`)
    stager: object | None = None  # agent/engine_stage.EngineStager of `stage`
    staged: Path | None = None  # its RAM-disk folder

    @property
    def cuda(self) -> bool:
        return self.args.device.startswith("cuda")

    @property
    def device(self) -> torch.device:
        d = torch.device(self.args.device)
        return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d

    def engine(self) -> EngineClient:
        """The embedded engine serving the model on the device (started once, by the first step that needs it)."""
        if self.client is None:
            ready, log = self.work / "engine.json", self.work / "engine.log"
            self.engine_proc = spawn(gyre_argv("engine", "--model-path", str(self.model), "--device",
                                               self.args.device, "--ready-file", str(ready), "--threads", "4"), log)
            wait_until(ready.is_file, what="the engine", timeout_s=300, procs=self.engine_proc, log=log)
            self.client = EngineClient(json.loads(ready.read_text())["url"])
        return self.client


class Failed(Exception):
    """A step's check did not hold (its message is the step's figures)."""


def need(cond: bool, why: str) -> None:
    if not cond:
        raise Failed(why)


# --- the model and the batch --------------------------------------------------------------------------------------
def make_model(out: Path, hidden: int, layers: int) -> Path:
    """The built-in tokenizer and chat template (as the tiny model has them), with a larger random Qwen3 body."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre_slurm.model.tiny import create_tiny_model

    create_tiny_model(out, seed=0)
    cfg = Qwen3Config.from_pretrained(out)
    heads = max(2, hidden // 128)
    tiny = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}  # one per layer: derived again
    big = Qwen3Config(**{**tiny, "hidden_size": hidden, "intermediate_size": 3 * hidden,
                         "num_hidden_layers": layers, "num_attention_heads": heads,
                         "num_key_value_heads": heads // 2 if heads >= 4 else heads, "head_dim": 128})
    torch.manual_seed(0)
    Qwen3ForCausalLM(big).save_pretrained(out)
    return out


def make_batch(prompts: list[list[int]], outputs: list[tuple[list[int], list[float]]]):
    """One run per prompt: its output tokens the target, behaviour log-probs as given."""
    from gyre_slurm.train.batch import TrainBatch, TrainSample

    samples = [TrainSample(i, p + ids, [0] * len(p) + [1] * len(ids), [0.0] * len(p) + lps)
               for i, (p, (ids, lps)) in enumerate(zip(prompts, outputs, strict=True))]
    adv = {i: (1.0 if i % 2 else -0.5) for i in range(len(samples))}  # not summing to 0: a visible loss
    return TrainBatch(samples, adv, {i: len(ids) for i, (ids, _) in enumerate(outputs)}, step=0, version_in=0)


def random_tokens(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def probe_ids(device: torch.device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of 64 random tokens, every position but the first a target."""
    ids = torch.tensor(random_tokens(4, 64, vocab, seed=1), device=device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, 0] = False
    return ids, mask


@torch.no_grad()
def megatron_logprobs(trainer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from gyre_slurm.train.megatron_model import gpt_target_logprobs

    return gpt_target_logprobs(trainer.gpt, ids, mask).float()


def build_trainer(model: Path, device: torch.device, precision: str = "fp32"):
    """MegatronTrainer on the device in `precision` (named always: its default, auto, is bf16 on CUDA)."""
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    return MegatronTrainer(model, device=device, lr=1e-4, precision=precision)


def gspo_step(trainer, prompts: list[list[int]], outputs: list[list[int]], behaviour: list[list[float]]) -> dict:
    metrics = trainer.train_step(make_batch(prompts, list(zip(outputs, behaviour, strict=True))))
    need(all(v == v for v in metrics.values()) and metrics["grad_norm"] > 0, f"step metrics {metrics}")
    return metrics


# --- the steps ----------------------------------------------------------------------------------------------------
def step_versions(ctx: Ctx) -> str:
    te = importlib.util.find_spec("transformer_engine") is not None
    try:
        mcore = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise Failed("megatron-core is not installed (carry .whl)") from None
    line = (f"torch {torch.__version__}, CUDA {torch.version.cuda}, Transformer Engine "
            f"{'present' if te else 'absent'}, megatron-core {mcore}")
    if not ctx.cuda:
        return line + "; NCCL and free GPU memory skipped on cpu: no CUDA"
    free, total = torch.cuda.mem_get_info()
    nccl = torch.cuda.nccl.version()
    return (line + f", NCCL {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}, "
            f"{torch.cuda.get_device_name()}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def step_moe(ctx: Ctx) -> str:
    """The tiny Qwen3-MoE's step: megatron-core 0.16.1's router calls moe_utils.te_general_gemm, defined only where
    Transformer Engine imports."""
    from gyre_slurm.model.tiny import build_tiny_moe

    tr = build_trainer(build_tiny_moe(ctx.work / "moe"), ctx.device)
    prompts, outs = random_tokens(4, 16, 250, seed=0), random_tokens(4, 32, 250, seed=2)
    m = gspo_step(tr, prompts, outs, [[-1.5] * 32] * 4)
    del tr
    return f"loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}"


def _reference(ctx: Ctx, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from gyre_slurm.train.torch_trainer import load_policy, target_logprobs

    hf = load_policy(ctx.model).to(ctx.device).eval()
    with torch.no_grad():
        ref = target_logprobs(hf, ids, mask).float()
    del hf
    return ref


def _bf16_against(ctx: Ctx, ref: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> str:
    tr = build_trainer(ctx.model, ctx.device, "bf16")
    diff = (megatron_logprobs(tr, ids, mask) - ref).abs().max().item()
    del tr
    need(diff <= BF16_BOUND, f"bf16 log-probs differ from Hugging Face's fp32 by {diff:.3g} > {BF16_BOUND}")
    return f"bf16 vs HF fp32 max |diff| {diff:.2e} (bound {BF16_BOUND})"


def _no_cpu_patch(ctx: Ctx) -> str:
    from gyre_slurm.train import megatron_cpu

    if not ctx.cuda:
        return "no-CPU-patch skipped on cpu: the CPU answers are what --cpu runs on"
    need(megatron_cpu.patch_for_cpu() is False and not megatron_cpu._applied, "a CPU patch is in force on CUDA")
    need(torch.cuda.current_device.__module__ == "torch.cuda" and torch.cuda.synchronize.__module__ == "torch.cuda",
         "torch.cuda.current_device or synchronize is not torch's own")
    return "no CPU patch in force"


def step_dense(ctx: Ctx) -> str:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (TF32 would cost ~1e-3)
    ids, mask = probe_ids(ctx.device, 250)
    ref = _reference(ctx, ids, mask)
    if ctx.cuda:
        gc.collect()
        ctx.mem["before trainer"] = torch.cuda.memory_allocated()
    tr = build_trainer(ctx.model, ctx.device)
    fp32 = (megatron_logprobs(tr, ids, mask) - ref).abs().max().item()
    need(fp32 <= FP32_BOUND, f"fp32 log-probs differ from Hugging Face's by {fp32:.3g} > {FP32_BOUND}")
    rows = [r.tolist() for r in ids.cpu()]
    behaviour = ref.view(len(rows), -1)[:, 31:].tolist()  # on-policy: the targets after a 32-token prompt
    m = gspo_step(tr, [r[:32] for r in rows], [r[32:] for r in rows], behaviour)
    trained = megatron_logprobs(tr, ids, mask)
    moved = (trained - ref).abs().max().item()
    need(moved > 0, "the step changed no log-prob")
    if ctx.cuda:
        torch.cuda.synchronize()
        ctx.mem["after step"] = torch.cuda.memory_allocated()
        ctx.mem["peak"] = torch.cuda.max_memory_allocated()
    saved = ctx.snapshot = tr.save(ctx.work / "v1")
    again = build_trainer(saved, ctx.device)
    round_trip = (megatron_logprobs(again, ids, mask) - trained).abs().max().item()
    del again
    need(round_trip <= 1e-6, f"reloaded weights give log-probs {round_trip:.3g} away from the trained ones")
    ctx.trainer = tr
    return (f"fp32 vs HF max |diff| {fp32:.2e} (bound {FP32_BOUND}); {_bf16_against(ctx, ref, ids, mask)}; GSPO "
            f"step loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}, log-probs moved {moved:.3g}; save/reload "
            f"max |diff| {round_trip:.1e}; {_no_cpu_patch(ctx)}")


def _ram_disk() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class SnapshotPuller:
    """Stands in for the stage path's first hop (the node agent's WeightPuller over Mooncake, which the device image
    lacks): the tensors of the version's snapshot folder, the bytes the core published."""

    def __init__(self, snapshot: Path) -> None:
        self.snapshot = snapshot

    def pull(self, handle, at_least: bool = False) -> tuple[dict[str, torch.Tensor], object]:
        from safetensors.torch import load_file

        from gyre_slurm.transfer.report import TransferReport

        t = time.perf_counter()
        tensors = {k: v for f in sorted(self.snapshot.glob("*.safetensors")) for k, v in load_file(f).items()}
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        return tensors, TransferReport("file", 1, nbytes, time.perf_counter() - t, "agent:0")

    def close(self) -> None:
        pass


def _probe_engine(client: EngineClient) -> tuple[list[int], list[float], object]:
    out = asyncio.run(client.generate([11, 22, 33, 44] * 8, SamplingParams(max_new_tokens=8, temperature=0.0)))
    return out.output_ids, out.output_logprobs, out.weight_version


NCCL_PAIR = """
import os, sys, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=int(sys.argv[1]), world_size=2, device_id=torch.device("cuda", 0))
t = torch.ones(1, device="cuda:0")
dist.broadcast(t, 0)
torch.cuda.synchronize()
print("BROADCAST DONE", flush=True)
"""


def nccl_duplicate_gpu(ctx: Ctx, timeout_s: float = 60.0) -> str:
    """Two ranks of one NCCL communicator on GPU 0: NCCL must refuse it ("Duplicate GPU detected",
    ncclInvalidUsage: NVIDIA/nccl src/init.cc), the rule the weight path beside SGLang must keep."""
    if not ctx.cuda:
        return "NCCL duplicate-GPU refusal skipped on cpu: NCCL needs CUDA"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_DEBUG": "WARN"}
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_PAIR, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise Failed(f"NCCL neither refused nor completed a two-rank group on one GPU within {timeout_s:.0f} s") \
            from None
    text = "\n".join(logs)
    need("BROADCAST DONE" not in text, "NCCL accepted two ranks on one GPU (the duplicate-GPU rule does not hold)")
    refused = "duplicate gpu" in text.lower() or "invalid usage" in text.lower()
    need(refused, "the two-rank group failed for another reason: " + (text.strip().splitlines() or ["?"])[-1][:200])
    return "NCCL refused two ranks on one GPU (Duplicate GPU / ncclInvalidUsage)"


def step_stage(ctx: Ctx) -> str:
    """agent/engine_stage.py's EngineStager, as the node agent runs it beside SGLang: the version written into a
    RAM-disk folder, the server paused in abort mode, idle, loading it with /update_weights_from_disk, continued."""
    from gyre_slurm.agent.engine_stage import EngineStager
    from gyre_slurm.protocol import WeightsHandle, WeightsRef

    need(ctx.snapshot is not None, "no trained version (dense failed)")
    client = ctx.engine()
    ids0, lps0, _ = _probe_engine(client)
    ctx.staged = _ram_disk() / f"gyre-gpu-check-{os.getpid()}"
    ctx.stager = EngineStager(lambda: None, 0, ctx.staged / "cell0")
    ctx.stager.puller = SnapshotPuller(ctx.snapshot)
    reports: list = []
    snapshot = WeightsHandle(peer="snapshot", addr=0, version=1, nbytes=0, bucket_bytes=64, tensors=[])  # one part
    ctx.stager.update(client, WeightsRef(version=1, path=str(ctx.snapshot)), [snapshot], None, reports.append)
    ids1, lps1, version = _probe_engine(client)
    need(str(version) == "1", f"the engine reports weight version {version}, not 1")
    moved = max(abs(a - b) for a, b in zip(lps0, lps1, strict=False))
    need(ids0 != ids1 or moved > 0, "the engine's log-probs did not move after loading the staged version")
    load = reports[-1]
    return (f"{load.nbytes / MIB:.1f} MiB staged in {ctx.stager.folder(1)}; the engine paused, loaded it and "
            f"continued in {load.seconds:.2f} s; log-probs moved {moved:.3g}; {nccl_duplicate_gpu(ctx)}")


def _core_attention(ctx: Ctx, dtype: torch.dtype):
    """The core attention module the trainer's GPT layers use (train/megatron_model.py's layer spec)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import Qwen3Config

    from gyre_slurm.train.megatron_model import layer_spec

    cfg = Qwen3Config.from_pretrained(ctx.model)
    core = layer_spec().submodules.self_attention.submodules.core_attention
    core = getattr(core, "module", core)  # a ModuleSpec or the class itself
    tc = TransformerConfig(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                           num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, params_dtype=dtype,
                           bf16=dtype == torch.bfloat16)
    return core(tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").to(ctx.device), cfg


def _attention_pass(attn, cfg, s: int, dtype: torch.dtype, device: torch.device) -> None:
    q = torch.randn(s, 1, cfg.num_attention_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, 1, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    attn(q, k, v, None).float().sum().backward()


def step_attention(ctx: Ctx) -> str:
    lengths = [int(x) for x in ctx.args.attn_lengths.split(",")]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32  # the flash kernel needs bf16/fp16
    attn, cfg = _core_attention(ctx, dtype)
    if not ctx.cuda:
        for s in lengths:
            _attention_pass(attn, cfg, s, dtype, ctx.device)
        return (f"forward+backward at {', '.join(map(str, lengths))} tokens; peak memory skipped on cpu: it needs "
                "torch.cuda's allocator statistics")
    peaks = []
    for s in lengths:
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _attention_pass(attn, cfg, s, dtype, ctx.device)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    scores = [s * s * cfg.num_attention_heads * torch.finfo(dtype).bits // 8 for s in lengths]
    growth, ratio = peaks[-1] / peaks[0], lengths[-1] / lengths[0]
    figures = ", ".join(f"{s} tokens {p / MIB:.0f} MiB (a score matrix alone: {m / MIB:.0f} MiB)"
                        for s, p, m in zip(lengths, peaks, scores, strict=True))
    need(growth <= ratio * 1.3 and peaks[-1] < scores[-1],
         f"peak grew {growth:.2f}x for {ratio:.0f}x tokens ({figures}): the kernel materialises seq x seq")
    return f"{dtype} {figures}; grew {growth:.2f}x for {ratio:.0f}x tokens"


def step_memory(ctx: Ctx) -> str:
    need(ctx.trainer is not None, "no trainer to drop (dense failed)")
    alive = weakref.ref(ctx.trainer.gpt)
    ctx.trainer = None
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    need(alive() is None, "the dropped trainer's model is still referenced")
    if not ctx.cuda:
        return "the dropped trainer was collected; memory figures skipped on cpu: they need torch.cuda"
    left = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    m = ctx.mem
    need(left <= m["before trainer"] + 16 * MIB,
         f"{(left - m['before trainer']) / MIB:.0f} MiB still allocated after dropping the trainer")
    return (f"allocated before the trainer {m['before trainer'] / MIB:.0f} MiB, after its step "
            f"{m['after step'] / MIB:.0f} MiB (peak {m['peak'] / MIB:.0f} MiB), after dropping it {left / MIB:.0f} "
            f"MiB; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")


def step_engine(ctx: Ctx) -> str:
    client = ctx.engine()
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * 8 for i in range(8)]
    sp = SamplingParams(max_new_tokens=ctx.args.new_tokens, ignore_eos=True, temperature=1.0, seed=7)

    async def batch():
        return await asyncio.gather(*(client.generate(p, sp) for p in prompts))

    t = time.perf_counter()
    outs = asyncio.run(batch())
    took = time.perf_counter() - t
    need(all(len(o.output_logprobs) == len(o.output_ids) == ctx.args.new_tokens for o in outs),
         "a request came back without its tokens' log-probs")
    client.release_memory()
    client.resume_memory()
    again = asyncio.run(client.generate(prompts[0], sp))
    need(again.output_ids == outs[0].output_ids, "different tokens after release/resume")
    tokens = sum(len(o.output_ids) for o in outs)
    return (f"8 requests with log-probs, {tokens / took:,.0f} tokens/s; release/resume: the same tokens after, "
            f"weight version {again.weight_version}")


STEPS = [("versions", step_versions), ("moe", step_moe), ("dense", step_dense), ("stage", step_stage),
         ("attention", step_attention), ("memory", step_memory), ("engine", step_engine)]


def run_step(name: str, fn, ctx: Ctx) -> bool:
    t = time.perf_counter()
    try:
        figures, ok = fn(ctx), True
    except Failed as e:
        figures, ok = str(e), False
    except Exception as e:  # noqa: BLE001 - any error is this step's failure, and the next steps still run
        figures, ok = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", False
    print(f"{name}: {'ok' if ok else 'FAIL'} {figures} ({time.perf_counter() - t:.1f} s)", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--attn-lengths", default="8192,16384", help="token counts of the attention memory step")
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ctx = Ctx(args, Path(tempfile.mkdtemp(prefix="gyre-gpu-check-")))
    ctx.model = make_model(ctx.work / "model", args.hidden, args.layers)
    try:
        failed = [name for name, fn in STEPS if not run_step(name, fn, ctx)]
    finally:
        if ctx.stager is not None:
            ctx.stager.close()
        if ctx.engine_proc is not None:
            ctx.engine_proc.terminate()
            ctx.engine_proc.wait()
        for folder in (ctx.staged, ctx.work):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
    total = time.perf_counter() - t0
    over = total > args.budget_s
    where = torch.cuda.get_device_name() if ctx.cuda else "cpu"
    verdict = "OK" if not failed and not over else "FAILED " + ", ".join(failed + (["over budget"] if over else []))
    print(f"gpu check on {args.device} ({where}): {verdict}: {len(STEPS) - len(failed)}/{len(STEPS)} steps ok in "
          f"{total:.1f} s (budget {args.budget_s:.0f} s)", flush=True)
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
