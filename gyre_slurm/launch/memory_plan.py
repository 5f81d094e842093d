"""How much memory one trainer rank of a cell needs, from the model's shape and the run config (pure: no torch, no
I/O; launch/memory_fit.py adds the engine and the refusal, docs/memory.md the formulas and the measurements).

The rank (of the heaviest pipeline stage, cut as train/megatron_shard.py cuts the model: TP over vocabulary rows,
heads and MLP rows; PP over layers; EP over experts, each whole) holds
- parameters: 2 B each in bf16, 4 B in fp32 (train.precision; auto = bf16 on GPU cells, fp32 on CPU cells);
- main gradients: 4 B each (fp32, accumulated over micro-batches);
- fp32 masters (bf16 only, 4 B) and AdamW's two moments (8 B): with train.distributed_optimizer divided over the
  data-parallel replicas (Megatron's distributed optimizer: 6 + 12/d bytes per parameter in bf16, 18 without;
  experts' over the expert-data-parallel size dp/ep; train/dist_optimizer.py);
- activations of one micro-batch of train.micro_batch_tokens tokens (`layer_bytes`: the tensors autograd keeps per
  token and layer, counted on this code's layers), times the micro-batches a 1F1B pipeline keeps in flight on its
  first stage (pp); with train.recompute full each layer's input, and one layer's tensors again in its backward;
- a layer's backward temporaries; with MoE over EP > 1, the allgather dispatcher's exchange of the EP group's tokens
  and the global buffer it gathers them into (kept between steps);
- the output layer on the last stage: its input and the fp32 logits of every token with their backward's temporaries
  (16 B per token and vocabulary entry, measured; the head gathers the whole vocabulary on every TP rank);
- a communication buffer: the data-parallel gradient all-reduce flattens the gradients it carries into buckets of
  at most ALL_REDUCE_BUCKET_BYTES (train/megatron_parallel.py `_all_reduce`), 4 B each;
- the optimizer step's temporaries: AdamW's multi-tensor path (on CUDA) computes √v of all its parameters at once
  (4 B each), and the gradient norm squares each gradient in float64 (16 B per element of the largest).
The peak is the state (parameters, gradients, masters, moments, the gather buffer) plus the largest of the phases on
top of it: a backward, the all-reduce, the optimizer step. No rank keeps the whole model (train/megatron_trainer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre_slurm.config import RunConfig
from gyre_slurm.launch.model_shape import ModelShape
from gyre_slurm.parallel_sizes import ALL_REDUCE_BUCKET_BYTES

GiB = 1 << 30
NORM_F32 = 4  # bytes of the fp32 copies torch's composite RMSNorm keeps (on the CPU; CUDA has a fused kernel)
LOGIT_BYTES = 16  # per token and vocabulary entry: fp32 logits kept for logsumexp, and its backward's three temporaries
LOSS_BYTES = 64  # per token: the GSPO loss's float64 log-probs, ratios and per-run sums


@dataclass(frozen=True)
class TrainerLayout:
    """What the trainer plan depends on besides the model: the cell's sizes and the training settings."""

    tp: int
    pp: int
    dp: int
    ep: int
    precision: str  # bf16 | fp32
    distributed_optimizer: bool
    recompute: str  # none | full
    micro_batch_tokens: int
    on_gpu: bool

    @property
    def act_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4


def trainer_layout(cfg: RunConfig) -> TrainerLayout:
    t, on_gpu = cfg.train, cfg.cluster.gpus_per_cell > 0
    megatron = t.backend == "megatron"
    precision = t.precision if megatron and t.precision != "auto" else ("bf16" if megatron and on_gpu else "fp32")
    sizes = (t.tensor_parallel, t.pipeline_parallel, t.data_parallel, t.expert_parallel) if megatron else (1,) * 4
    return TrainerLayout(*sizes, precision=precision,
                         distributed_optimizer=bool(getattr(t, "distributed_optimizer", True)) and megatron,
                         recompute=str(getattr(t, "recompute", "none")), micro_batch_tokens=t.micro_batch_tokens,
                         on_gpu=on_gpu)


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes one trainer rank holds (the heaviest pipeline stage), by term."""

    parameters: int
    main_gradients: int
    fp32_masters: int
    adam_moments: int
    activations: int  # kept for the backward: every layer's tensors, or with recompute full every layer's input
    recomputed_layer: int  # recompute full: the one layer whose tensors are made again during its backward
    backward_temps: int  # a layer's backward: the gradients of its largest tensors
    token_exchange: int  # MoE with EP > 1: the tokens of the whole EP group gathered (allgather dispatcher)
    token_buffer: int  # ... and Megatron's global buffer they are gathered into, kept between steps
    logits: int  # the output layer at the start of the backward (last stage)
    comm_buffer: int
    optimizer_temps: int
    params: int  # parameters on this rank (count)
    stage: int

    LABELS = {"parameters": "parameters", "main_gradients": "fp32 main gradients", "fp32_masters": "fp32 masters",
              "adam_moments": "AdamW moments", "activations": "activations", "recomputed_layer": "recomputed layer",
              "backward_temps": "backward temporaries", "token_exchange": "MoE token exchange",
              "token_buffer": "MoE gather buffer", "logits": "output logits", "comm_buffer": "all-reduce buffer",
              "optimizer_temps": "optimizer step temporaries"}

    @property
    def state(self) -> int:
        return self.parameters + self.main_gradients + self.fp32_masters + self.adam_moments + self.token_buffer

    @property
    def backward(self) -> int:
        """On top of the state during a backward: the kept activations, then either the output layer's logits (at
        its start) or a layer's own backward (later, after the logits are freed) with its token exchange."""
        return self.activations + max(self.logits, self.recomputed_layer + max(self.backward_temps,
                                                                               self.token_exchange))

    @property
    def total(self) -> int:
        """The peak: the state plus the largest phase on top of it (backward, all-reduce, optimizer step)."""
        return self.state + max(self.backward, self.comm_buffer, self.optimizer_temps)

    def terms(self) -> list[tuple[str, int]]:
        return [(label, getattr(self, name)) for name, label in self.LABELS.items()]

    def largest(self) -> tuple[str, int]:
        return max(self.terms(), key=lambda t: t[1])


# -- parameters per rank -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageParams:
    dense: int  # replicated over the data-parallel group
    expert: int  # replicated over the expert-data-parallel group (dp / ep)
    largest_dense: int  # the largest tensor of each kind (what one-tensor-at-a-time temporaries scale with)
    largest_expert: int


def stage_params(shape: ModelShape, lay: TrainerLayout, stage: int) -> StageParams:
    """The parameters of a rank of pipeline stage `stage`, as megatron_shard cuts the model."""
    per_stage = shape.layers // lay.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    moe = sum(1 for i in layers if _is_moe(shape, i))
    tp, h = lay.tp, shape.hidden
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim * h // tp
    attention = qkv + shape.heads * shape.head_dim * h // tp + 2 * h + 2 * shape.head_dim
    dense = per_stage * attention + (per_stage - moe) * 3 * h * shape.ffn // tp + moe * shape.experts * h
    vocab_rows = shape.vocab * h // tp
    first, last = stage == 0, stage == lay.pp - 1
    heads = int(first) + int(last and (not shape.tied or lay.pp > 1))  # tied under PP: the last stage keeps a copy
    dense += heads * vocab_rows + (h if last else 0)
    fc1 = 2 * h * shape.ffn // tp if per_stage > moe else 0
    return StageParams(dense, moe * (shape.experts // lay.ep) * shape.expert_params,
                       max(vocab_rows if heads else 0, qkv, fc1), 2 * h * shape.moe_ffn if moe else 0)


def _is_moe(shape: ModelShape, layer: int) -> bool:
    """Whether the plan counts `layer` as one with experts: a stage only needs how many it holds, so the model's
    moe_layers are spread evenly (every layer when all have experts, the Megatron backend's only case)."""
    if not shape.moe_layers:
        return False
    return layer * shape.moe_layers // shape.layers != (layer + 1) * shape.moe_layers // shape.layers


# -- activations --------------------------------------------------------------------------------------------------
def _norm_bytes(width: int, e: int, fused: bool) -> int:
    """What an RMSNorm keeps per token: torch's composite (CPU) keeps its fp32 input and x·rsqrt(mean x²) besides the
    output the next layer keeps; CUDA's fused kernel its input and rstd."""
    return (2 * e * width if fused else (2 * NORM_F32 + e) * width) + 4


def layer_bytes(shape: ModelShape, lay: TrainerLayout, moe: bool) -> int:
    """Bytes autograd keeps per token for one decoder layer (Megatron's local spec as train/megatron_model.py builds
    it: fused QKV, q/k norms, RoPE, flash SDPA that keeps q, k, v, its output and logsumexp, never an s² matrix;
    SwiGLU). Counted with a saved-tensor census of the layer (tools/bench_memory_plan.py --census) on the CPU."""
    e, fused, tp = lay.act_bytes, lay.on_gpu, lay.tp
    d = shape.head_dim
    q, k = shape.heads * d // tp, shape.kv_heads * d // tp
    heads, groups = shape.heads // tp, max(1, shape.kv_heads // tp)
    if fused:  # q: its copy out of QKV, q after RoPE, SDPA's output, QKV itself; k: QKV's k and v, k after RoPE
        attn = 4 * e * q + 3 * e * k
    else:  # and the norms' fp32 copies (of k too where the activations are not fp32)
        attn = (2 * NORM_F32 + 3 * e) * q + (3 * e + NORM_F32 + (NORM_F32 if e < NORM_F32 else 0)) * k
    if lay.on_gpu and e == 4 and shape.heads != shape.kv_heads:  # fp32 on CUDA: KV heads expanded for the kernel
        attn += 2 * e * q
    attn += 8 * heads + 4 * groups + 4 * e * d  # q/k-norm rstd, SDPA's logsumexp, RoPE's cos and sin tables
    if moe:  # router logits and routing map (gathered over EP), routed tokens, each routed copy's SwiGLU
        mlp = 5 * shape.experts * lay.ep + e * shape.top_k * shape.hidden + 6 * e * shape.top_k * shape.moe_ffn \
            + 24 * shape.top_k + 4
    else:  # fc1's output (gate ‖ up), silu(gate), up + 0, their product
        mlp = 5 * e * shape.ffn // tp
    return 2 * _norm_bytes(shape.hidden, e, fused) + attn + mlp


def backward_temp_bytes(shape: ModelShape, lay: TrainerLayout, moe: bool) -> int:
    """Per token, what a layer's backward allocates beyond what it frees: the MLP's gradients (gate ‖ up and the
    pieces it is assembled from), measured at 2.75 activation bytes per MLP row and 10 B per hidden unit."""
    rows = shape.top_k * shape.moe_ffn if moe else shape.ffn // lay.tp
    return 11 * lay.act_bytes * rows // 4 + 10 * shape.hidden


def exchange_bytes(shape: ModelShape, lay: TrainerLayout) -> tuple[int, int]:
    """Per token, MoE with expert parallelism (Megatron's allgather dispatcher, which this trainer uses at PP 1):
    every rank gathers the hidden states of the whole EP group into a global buffer that stays allocated (ep · h · e),
    and while a layer runs it holds the expert outputs of all those tokens and their fp32 copy for the
    reduce-scatter (their gradients on the way back), and the gathered routing map and probabilities. Returns
    (transient, kept) bytes per token."""
    if not shape.moe_layers or lay.ep == 1:
        return 0, 0
    e = lay.act_bytes
    return lay.ep * (shape.hidden * (e + 4) + 5 * shape.experts), lay.ep * shape.hidden * e


def logits_bytes(shape: ModelShape, lay: TrainerLayout) -> int:
    """The last stage's output layer: its final norm and input, and every token's fp32 logits over the whole vocabulary
    (ColumnParallelLinear gathers them: build_gpt's parallel_output=False), with the loss's per-token terms."""
    per_token = _norm_bytes(shape.hidden, lay.act_bytes, lay.on_gpu) + lay.act_bytes * shape.hidden \
        + LOGIT_BYTES * shape.vocab + LOSS_BYTES
    return per_token * lay.micro_batch_tokens


def _optimized(p: StageParams, lay: TrainerLayout) -> int:
    """The parameters whose fp32 master and moments this rank keeps: with the distributed optimizer its 1/d of the
    rows its replicas share (train/dist_optimizer.py: the tensors laid end to end, cut at row starts)."""
    if not lay.distributed_optimizer:
        return p.dense + p.expert
    return math.ceil(p.dense / lay.dp) + math.ceil(p.expert / max(1, lay.dp // lay.ep))


def stage_memory(shape: ModelShape, lay: TrainerLayout, stage: int) -> TrainerMemory:
    p = stage_params(shape, lay, stage)
    n, e, tokens = p.dense + p.expert, lay.act_bytes, lay.micro_batch_tokens
    optimized, exchange = _optimized(p, lay), exchange_bytes(shape, lay)
    bf16 = lay.precision == "bf16"
    per_stage = shape.layers // lay.pp
    moes = [_is_moe(shape, i) for i in range(stage * per_stage, (stage + 1) * per_stage)]
    full = [layer_bytes(shape, lay, m) * tokens for m in moes]
    in_flight = lay.pp - stage  # 1F1B: the first stage holds pp micro-batches' activations, the last one
    recompute = lay.recompute == "full"
    kept = in_flight * (per_stage * e * shape.hidden * tokens if recompute else sum(full))
    largest = max(p.largest_dense, p.largest_expert)
    buffers = [p.dense if lay.dp > 1 else 0, p.expert if lay.dp // lay.ep > 1 else 0]
    adam_temp = 4 * optimized if lay.on_gpu else 4 * largest  # multi-tensor on CUDA; one tensor at a time on the CPU
    return TrainerMemory(
        parameters=n * (2 if bf16 else 4), main_gradients=4 * n, fp32_masters=4 * optimized if bf16 else 0,
        adam_moments=8 * optimized, activations=kept, recomputed_layer=max(full) if recompute else 0,
        backward_temps=max(backward_temp_bytes(shape, lay, m) for m in moes) * tokens,
        token_exchange=exchange[0] * tokens if any(moes) else 0, token_buffer=exchange[1] * tokens if any(moes) else 0,
        logits=logits_bytes(shape, lay) if stage == lay.pp - 1 else 0,
        comm_buffer=min(4 * max(buffers), ALL_REDUCE_BUCKET_BYTES),
        optimizer_temps=max(adam_temp, 16 * largest), params=n, stage=stage)


def trainer_memory(shape: ModelShape, lay: TrainerLayout) -> TrainerMemory:
    """The heaviest of the first and the last pipeline stage (the middle ones hold less than the first)."""
    return max((stage_memory(shape, lay, s) for s in {0, lay.pp - 1}), key=lambda m: m.total)
