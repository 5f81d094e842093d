"""Check the memory plan (gyre_slurm/launch/memory_plan.py) against the measured peak of a real GSPO training step.

    .venv/bin/python tools/bench_memory_plan.py [--sizes base,long,...] [--cells tp2,dp2,dp2-bf16,pp2,ep2] [--census]

For each size: a small random Qwen3 (or Qwen3-MoE) checkpoint, made here; MegatronTrainer on the CPU (world 1, or a
cell of ranks over gloo, one process each); one warm-up step (AdamW's moments exist from then on, as in a run), then
one measured step: two micro-batches per data-parallel rank of exactly train.micro_batch_tokens tokens (every token
after the first a target), forward, backward, gradient all-reduce and clip, AdamW step. The measured peak is the
bytes the trainer's tensors held before the step (parameters, fp32 masters, moments, Megatron's global buffer:
their storages, each once) plus the peak of what the step allocated on top (torch.profiler's allocator events,
profile_memory=True: every tensor and kernel buffer; RSS would count the allocator's cache and Python). Each rank of
a cell is measured; the plan is that of its stage (the first or the last).
--census: the tensors autograd keeps per token for one decoder layer (what layer_bytes encodes), against the plan.

The figure, last: the largest |plan / measured - 1| over the sizes; exits 1 above 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from gyre_slurm.launch.memory_plan import TrainerLayout, layer_bytes, stage_memory  # noqa: E402
from gyre_slurm.launch.model_shape import ModelShape  # noqa: E402

TOLERANCE = 0.15
DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "tie_word_embeddings": True}
LONG = {**DENSE, "num_hidden_layers": 4, "hidden_size": 96, "intermediate_size": 256}
VOCAB = {**DENSE, "vocab_size": 16384, "tie_word_embeddings": False}
MOE = {**DENSE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


@dataclass(frozen=True)
class Case:
    fields: dict  # config.json fields
    tokens: int  # train.micro_batch_tokens
    precision: str = "fp32"
    sizes: dict = field(default_factory=dict)  # tensor_parallel, pipeline_parallel, data_parallel, expert_parallel
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.sizes.get("tensor_parallel", 1) * self.sizes.get("pipeline_parallel", 1) \
            * self.sizes.get("data_parallel", 1)


SIZES = {
    "base": Case(DENSE, 256),
    "long": Case(LONG, 4096),
    "vocab": Case(VOCAB, 1024),
    "moe": Case(MOE, 1024),
    "bf16": Case({**DENSE, "num_hidden_layers": 4}, 2048, "bf16"),
    "recompute": Case(LONG, 4096, recompute="full"),
}
CELLS = {  # two processes each
    "tp2": Case(VOCAB, 1024, sizes={"tensor_parallel": 2}),
    "dp2": Case(LONG, 2048, sizes={"data_parallel": 2}),
    "dp2-bf16": Case(LONG, 2048, "bf16", sizes={"data_parallel": 2}),
    "pp2": Case(LONG, 2048, sizes={"pipeline_parallel": 2}),
    "ep2": Case({**MOE, "hidden_size": 128}, 2048, sizes={"data_parallel": 2, "expert_parallel": 2}),
}


def build_model(folder: Path, fields: dict) -> Path:
    """A random Qwen3 / Qwen3-MoE checkpoint of these config.json fields (transformers' own classes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gyre_slurm.model import quiet_transformers

    quiet_transformers()
    moe = "num_experts" in fields
    common = {"max_position_embeddings": 8192, "rope_theta": 10000.0, "pad_token_id": 0}
    cfg = (Qwen3MoeConfig(**fields, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common) if moe
           else Qwen3Config(**fields, **common))
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg).float()
    model.save_pretrained(folder)
    return folder


def make_batch(vocab: int, tokens: int, runs: int = 2):
    """`runs` runs of one sample each, `tokens` long, every token after the first a target."""
    from gyre_slurm.train.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(1)
    samples = []
    for r in range(runs):
        ids = torch.randint(0, vocab, (tokens,), generator=g).tolist()
        mask = [0] + [1] * (tokens - 1)
        samples.append(TrainSample(r, ids, mask, [-6.0 * m for m in mask]))
    return TrainBatch(samples, {r: (1.0 if r % 2 else -1.0) for r in range(runs)},
                      {r: tokens - 1 for r in range(runs)}, step=0, version_in=0)


def storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def trainer_bytes(tr) -> int:
    """The trainer's own tensors between steps: its GPTModel's parameters, the fp32 masters, AdamW's state, grads,
    and Megatron's global buffer (the MoE allgather dispatcher gathers tokens into it and it stays)."""
    from megatron.core import parallel_state as ps

    state = [v for s in tr.optimizer.state.values() for v in s.values()]
    grads = [p.grad for p in tr.params if p.grad is not None]
    kept = list(ps.get_global_memory_buffer().buffer.values())
    return storage_bytes([*tr.gpt.parameters(), *tr.params, *state, *grads, *kept])


def peak_allocated(fn) -> int:
    """The peak of the bytes allocated while fn runs (freed ones subtracted), from the profiler's allocator events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []

    def walk(e) -> None:
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.total_allocated))
        for c in e.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return max((total for _, total in sorted(events)), default=0)


def measure(folder: Path, case: Case) -> int:
    """This process's measured peak of one GSPO step after a warm-up step (see the module docstring)."""
    from gyre_slurm.train.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(folder, device="cpu", seed=0, lr=1e-4, micro_batch_tokens=case.tokens,
                         precision=case.precision, recompute=case.recompute, **case.sizes)
    runs = 2 * case.sizes.get("data_parallel", 1)  # two micro-batches on every DP rank
    tr.train_step(make_batch(tr.config.vocab_size, case.tokens, runs))
    batch = make_batch(tr.config.vocab_size, case.tokens, runs)
    before = trainer_bytes(tr)
    return before + peak_allocated(lambda: tr.train_step(batch))


def planned(case: Case, stage: int = 0) -> int:
    """The plan's peak for the rank of pipeline stage `stage` (on the CPU: fp32 or bf16 as the case says)."""
    shape = ModelShape.from_config({**case.fields, "max_position_embeddings": 8192})
    s = case.sizes
    lay = TrainerLayout(tp=s.get("tensor_parallel", 1), pp=s.get("pipeline_parallel", 1),
                        dp=s.get("data_parallel", 1), ep=s.get("expert_parallel", 1), precision=case.precision,
                        distributed_optimizer=True, recompute=case.recompute, micro_batch_tokens=case.tokens,
                        on_gpu=False)
    return stage_memory(shape, lay, stage).total


def _cell_rank(rank: int, folder: str, port: int, case: Case, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(case.world))
    torch.set_num_threads(1)
    peak = measure(Path(folder), case)
    from megatron.core import parallel_state as ps

    Path(out, f"rank{rank}.json").write_text(json.dumps([peak, ps.get_pipeline_model_parallel_rank()]))


def measure_cell(folder: Path, case: Case) -> list[tuple[int, int]]:
    """(peak, pipeline stage) of every rank of a cell, one process each."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_cell_rank, args=(str(folder), port, case, out), nprocs=case.world, join=True)
        return [tuple(json.loads(Path(out, f"rank{r}.json").read_text())) for r in range(case.world)]


def census() -> None:
    """Saved bytes per token of one dense decoder layer, fp32 and bf16, against layer_bytes."""
    from gyre_slurm.model.qwen3 import Qwen3Config
    from gyre_slurm.train.megatron_model import build_gpt, ensure_process_groups

    ensure_process_groups(torch.device("cpu"))
    tokens = 256
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for h, a, g, d, f in ((64, 4, 2, 16, 128), (96, 6, 2, 16, 320), (128, 8, 4, 32, 256)):
            cfg = Qwen3Config(vocab_size=128, hidden_size=h, intermediate_size=f, num_hidden_layers=1,
                              num_attention_heads=a, num_key_value_heads=g, head_dim=d, max_position_embeddings=4096)
            gpt = build_gpt(cfg, dtype)
            params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
            ids = torch.randint(0, 128, (1, tokens))
            x = gpt.embedding(input_ids=ids, position_ids=torch.arange(tokens)[None]).detach().requires_grad_()
            saved: dict[int, int] = {}

            def pack(t, saved=saved, params=params):
                if t.untyped_storage().data_ptr() not in params:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            inv = gpt.rotary_pos_emb.inv_freq
            freqs = torch.outer(torch.arange(tokens, dtype=inv.dtype), inv)
            rot = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                gpt.decoder.layers[0](hidden_states=x, attention_mask=None, rotary_pos_emb=rot)
            shape = ModelShape.from_config({"vocab_size": 128, "hidden_size": h, "intermediate_size": f,
                                            "num_hidden_layers": 1, "num_attention_heads": a,
                                            "num_key_value_heads": g, "head_dim": d})
            lay = TrainerLayout(1, 1, 1, 1, precision, False, "none", tokens, on_gpu=False)
            print(f"census {precision} h {h} heads {a}/{g} head_dim {d} ffn {f}: kept "
                  f"{sum(saved.values()) / tokens:.0f} B per token, layer_bytes {layer_bytes(shape, lay, False)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, world 1: " + ", ".join(SIZES))
    ap.add_argument("--cells", default="", help="comma-separated cells of two processes: " + ", ".join(CELLS))
    ap.add_argument("--census", action="store_true", help="print the per-layer census first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.census:
        census()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in args.sizes.split(",") if n] + [n for n in args.cells.split(",") if n]:
            case = SIZES.get(name) or CELLS[name]
            folder = build_model(Path(tmp, name), case.fields)
            ranks = measure_cell(folder, case) if case.world > 1 else [(measure(folder, case), 0)]
            for rank, (got, stage) in enumerate(ranks):
                plan = planned(case, stage)
                worst = max(worst, abs(plan / got - 1))
                who = f"{name} rank {rank}" if case.world > 1 else name
                print(f"{who:12s} {case.precision} micro_batch_tokens {case.tokens:5d}: measured {got / 2**20:8.2f} "
                      f"MiB, plan {plan / 2**20:8.2f} MiB, plan/measured {plan / got:.3f}", flush=True)
    print(f"largest |plan/measured - 1|: {worst:.3f} (target <= {TOLERANCE})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
