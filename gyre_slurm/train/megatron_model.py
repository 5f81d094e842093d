"""Megatron-Core's GPTModel as a Qwen3 policy: process groups, the TE-free layer spec, target log-probs.

The layer spec is Megatron's local one (`get_gpt_layer_local_spec`: RMSNorm, QK-norm, SwiGLU, separate norms)
with one module swapped: core attention is torch's `scaled_dot_product_attention` (causal, grouped-query)
instead of Megatron's `DotProductAttention`. That one materialises the [b·heads, s, s] score matrix, which does not
fit agent trajectories of tens of thousands of tokens, and it draws its buffer and dropout RNG from CUDA-only
helpers; SDPA runs flash/memory-efficient kernels (`causal_attention`: on CUDA nothing else) and the same maths
everywhere (attention dropout is 0 here: the trained policy is the one the engine samples).

Parallelism: the TransformerConfig takes the cell's sizes (`build_gpt` overrides); a pipeline stage builds only its
layers (`stage_hidden` / `stage_target_logprobs` are what train/megatron_parallel.py's schedule runs per stage).

Activation recomputation (`recompute="full"`, the config's train.recompute): Megatron's full, uniform recompute of
one layer at a time (TransformerConfig recompute_granularity/method/num_layers): each layer keeps only its input
for the backward and runs its forward again there (megatron/core/tensor_parallel/random.py `CheckpointFunction`; its
CUDA RNG bookkeeping is answered on the CPU by train/megatron_cpu.py). The block recomputes only in training mode,
while the trainer keeps the model in eval mode (no dropout): `keep_recompute` sets the block's own flag.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from gyre_slurm.model.qwen3 import Qwen3Config
from gyre_slurm.train.megatron_convert import check_supported

RECOMPUTE = ("none", "full")

def ensure_process_groups(device: torch.device) -> None:
    """torch.distributed (world 1, in-process store) and Megatron's model-parallel groups, once per process."""
    from gyre_slurm.train.megatron_parallel import init_parallel

    init_parallel(1, 1, 1, 1, device)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal grouped-query SDPA over [b, heads, s, d] that never builds the [s, s] score matrix.

    On CUDA only the flash and memory-efficient kernels may run (`torch.nn.attention.sdpa_kernel`): where neither
    takes the inputs, torch raises instead of falling back to the math kernel, whose scores would not fit agent
    lengths. Flash takes bf16/fp16 with grouped KV heads; fp32 goes to the memory-efficient kernel, which not every
    torch build lets take grouped heads (torch's `sdp_utils.cpp` constraints), so there the KV heads are expanded
    first (repeat_interleave: query head h reads KV group h // (heads / groups), as enable_gqa does). On the CPU
    torch's own choice stays: its flash kernel (fp32 and bf16, grouped heads) for these causal, mask-free inputs."""
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if gqa and q.dtype == torch.float32:
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def _sdpa_core_attention():
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """Megatron's core-attention interface over F.scaled_dot_product_attention (causal, GQA, no dropout)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
            if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
                raise ValueError("SDPA core attention is causal only (no mask, bias or packed sequences)")
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = causal_attention(q, k, v, self.scale)
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


def layer_spec(num_experts: int = 0):
    """The local (TE-free) GPT layer spec with RMSNorm and QK-norm, core attention on SDPA; with num_experts > 0
    the MLP is Megatron's MoE layer (router + SequentialMLP experts: one linear_fc1/fc2 pair each, no grouped GEMM,
    so every expert is its own tensor as in the Hugging Face checkpoint)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
    return spec


def build_gpt(cfg: Qwen3Config, dtype: torch.dtype = torch.float32, *, pre_process: bool = True,
              post_process: bool = True, parallel_output: bool = False, recompute: str = "none", **overrides):
    """An uninitialised GPTModel of the Qwen3 shape, on the CPU (weights come from a checkpoint next).

    pre_process / post_process: this pipeline stage holds the embedding / the final norm and head; recompute: "none"
    or "full" (the module docstring); `overrides` go into TransformerConfig as they are (the parallel sizes,
    variable_seq_lengths, ...), after the Qwen3 shape."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(cfg)
    if cfg.num_experts:
        from gyre_slurm.train.megatron_cpu import answer_missing_te, patch_for_cpu

        answer_missing_te()  # the router names a TE GEMM: on every device without Transformer Engine
        patch_for_cpu()  # MoE code names the CUDA device (router, dispatcher); a no-op where CUDA is available
    tcfg = TransformerConfig(**{**dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    ), **_moe_config(cfg), **_recompute_config(recompute), **overrides})
    gpt = GPTModel(
        config=tcfg, transformer_layer_spec=layer_spec(cfg.num_experts), vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=cfg.rope_theta, parallel_output=parallel_output,
    )
    # torch's RMSNorm (the local spec's norms) ignores params_dtype: the whole module in `dtype`, as Megatron's
    # Float16Module makes it (transformer/module.py: module.bfloat16()); RoPE's inv_freq is no buffer and stays fp32
    return gpt.to(dtype)


def _recompute_config(recompute: str) -> dict:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be none or full, not {recompute!r}")
    if recompute == "none":
        return {}
    from gyre_slurm.train.megatron_cpu import patch_for_cpu

    patch_for_cpu()  # the checkpoint's CUDA RNG state on a machine without CUDA (a no-op where it is available)
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def keep_recompute(gpt) -> None:
    """Recompute in eval mode too: Megatron's TransformerBlock checkpoints its layers only while its own `training`
    flag is set; set that flag alone (every module inside stays in eval mode; no dropout either way)."""
    if gpt.config.recompute_granularity == "full":
        gpt.decoder.training = True


def _moe_config(cfg: Qwen3Config) -> dict:
    """TransformerConfig's MoE fields for Qwen3-MoE's routing (none for a dense Qwen3). Hugging Face takes a softmax
    over all experts, then the top k, renormalised over them iff norm_topk_prob. Megatron's pre-softmax router is
    softmax-then-top-k as it is; its default (top k of the logits, softmax over those k) is the renormalised one.
    No load-balancing loss, token dropping or expert bias: the routing is the checkpoint's, in fp32 as HF's. The
    allgather dispatcher (which also serves expert parallelism): megatron-core 0.16.1's alltoall one makes a CUDA
    stream when it is built, so it does not build on the CPU."""
    if not cfg.num_experts:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_dtype="fp32", moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
    )


def gpt_hidden(gpt, input_ids: Tensor) -> Tensor:
    """The final-norm hidden states [b, s, hidden] of a right-padded batch (positions 0..s-1 per row)."""
    return stage_hidden(gpt, input_ids).transpose(0, 1)


def stage_hidden(gpt, input_ids: Tensor) -> Tensor:
    """This pipeline stage's output [s, b, hidden] for a right-padded batch: from the embedding on the first stage,
    from the input tensor the pipeline schedule set (the previous stage's output) on the others."""
    b, s = input_ids.shape
    x = None
    if gpt.pre_process:
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        x = gpt.embedding(input_ids=input_ids, position_ids=positions)  # [s, b, h]
    return gpt.decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=_rotary(gpt, s, input_ids.device))


def stage_target_logprobs(gpt, input_ids: Tensor, target_mask: Tensor) -> Tensor:
    """`gpt_target_logprobs` on the last pipeline stage; the stage's hidden states [s, b, h] on the others."""
    hidden = stage_hidden(gpt, input_ids[:, :-1])
    return _target_logprobs(gpt, hidden.transpose(0, 1), input_ids, target_mask) if gpt.post_process else hidden


def _rotary(gpt, s: int, device: torch.device) -> Tensor:
    """RoPE angles [s, 1, 1, head_dim] as RotaryEmbedding.get_emb makes them (rotate-half layout), on `device`:
    its own method moves the table to `torch.cuda.current_device()`, which a CPU run does not have."""
    inv_freq = gpt.rotary_pos_emb.inv_freq.to(device)
    freqs = torch.outer(torch.arange(s, device=device, dtype=inv_freq.dtype), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def gpt_head(gpt, hidden: Tensor) -> Tensor:
    """Logits of hidden states [..., hidden] (the tied embedding or the output layer), fp32."""
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden, weight=weight)
    return logits.float()


def gpt_logits(gpt, input_ids: Tensor) -> Tensor:
    """Full logits [b, s, vocab] (tests, scoring)."""
    return gpt_head(gpt, gpt_hidden(gpt, input_ids))


def gpt_target_logprobs(gpt, input_ids: Tensor, target_mask: Tensor) -> Tensor:
    """As torch_trainer.target_logprobs: log π(token_i | tokens_<i) where target_mask[b, i], row-major; the head
    runs only on the positions that predict a target."""
    return _target_logprobs(gpt, gpt_hidden(gpt, input_ids[:, :-1]), input_ids, target_mask)


def _target_logprobs(gpt, hidden: Tensor, input_ids: Tensor, target_mask: Tensor) -> Tensor:
    pred = target_mask[:, 1:]
    logits = gpt_head(gpt, hidden[pred])
    targets = input_ids[:, 1:][pred]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)


def gpt_state(gpt) -> dict[str, Tensor]:
    """The GPTModel's parameters by name (each once: a tied head is the embedding)."""
    return dict(gpt.named_parameters())

