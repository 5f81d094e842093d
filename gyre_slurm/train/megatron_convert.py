"""Weight conversion between the Hugging Face Qwen3 layout and Megatron-Core's GPTModel (local, TE-free spec).

Pure tensor code (no Megatron import), one model-parallel rank (TP = PP = 1). Per decoder layer i:

| Hugging Face (`model.layers.{i}.`)                          | Megatron (`decoder.layers.{i}.`)                     |
|-------------------------------------------------------------|------------------------------------------------------|
| `input_layernorm.weight`                                    | `input_layernorm.weight` (separate norm: local spec) |
| `self_attn.{q,k,v}_proj.weight`                             | `self_attention.linear_qkv.weight`, per KV group:    |
|                                                             | [its q heads ‖ its k head ‖ its v head]              |
| `self_attn.{q,k}_norm.weight`                               | `self_attention.{q,k}_layernorm.weight`              |
| `self_attn.o_proj.weight`                                   | `self_attention.linear_proj.weight`                  |
| `post_attention_layernorm.weight`                           | `pre_mlp_layernorm.weight`                           |
| `mlp.{gate,up}_proj.weight`                                 | `mlp.linear_fc1.weight` = gate ‖ up (SwiGLU)         |
| `mlp.down_proj.weight`                                      | `mlp.linear_fc2.weight`                              |

A Qwen3-MoE layer's MLP instead (SequentialMLP experts, no grouped GEMM; e the global expert index):

| `mlp.gate.weight` (the router, [experts, hidden])           | `mlp.router.weight`                                  |
| `mlp.experts.{e}.{gate,up}_proj.weight`                     | `mlp.experts.local_experts.{e}.linear_fc1.weight`    |
| `mlp.experts.{e}.down_proj.weight`                          | `mlp.experts.local_experts.{e}.linear_fc2.weight`    |

and `model.embed_tokens.weight` ↔ `embedding.word_embeddings.weight`, `model.norm.weight` ↔
`decoder.final_layernorm.weight`, `lm_head.weight` ↔ `output_layer.weight` (absent on both sides when the
embeddings are tied). Every map is a permutation of rows, so it converts gradients exactly as it converts weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gyre_slurm.model.qwen3 import Qwen3Config

# (Hugging Face suffix, Megatron suffix) of the per-layer tensors that are copied as they are.
_LAYER_SAME = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
    ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
)

Join = Callable[[list[Tensor]], Tensor]
Split = Callable[[Tensor], Sequence[Tensor]]


def check_supported(cfg: Qwen3Config) -> None:
    """Refuse, in one line, the Qwen3 variants this conversion does not cover."""
    if cfg.attention_bias:
        raise ValueError("the Megatron backend does not support Qwen3 with attention_bias: true yet")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"{cfg.num_attention_heads} attention heads are not a multiple of "
                         f"{cfg.num_key_value_heads} key/value heads")
    if cfg.num_experts and not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        raise ValueError("the Megatron backend needs experts in every Qwen3-MoE layer "
                         "(decoder_sparse_step 1, no mlp_only_layers)")
    if cfg.num_experts and cfg.num_experts_per_tok == 1 and cfg.norm_topk_prob:
        raise ValueError("the Megatron backend does not support top-1 routing with norm_topk_prob: true")


def _qkv(cfg: Qwen3Config) -> tuple[Join, Split]:
    """Fuse q, k, v into linear_qkv's layout (per KV group: its q heads, its k head, its v head) and back. The
    number of groups is read from the tensors, so the same pair fuses a tensor-parallel rank's slice (its groups)."""
    hd, per_group = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim + 2 * cfg.head_dim

    def join(parts: list[Tensor]) -> Tensor:
        g, rest = parts[1].shape[0] // hd, parts[0].shape[1:]
        return torch.cat([t.reshape(g, -1, *rest) for t in parts], dim=1).reshape(-1, *rest)

    def split(qkv: Tensor) -> list[Tensor]:
        g, rest = qkv.shape[0] // per_group, qkv.shape[1:]
        sizes = [per_group - 2 * hd, hd, hd]
        return [t.reshape(-1, *rest) for t in qkv.reshape(g, per_group, *rest).split(sizes, dim=1)]

    return join, split


def _concat(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=0)


def _halves(t: Tensor) -> Sequence[Tensor]:
    return t.chunk(2, dim=0)


@dataclass(frozen=True)
class TensorMap:
    """One Megatron tensor and the Hugging Face tensors it is made of. `kind` says how model parallelism cuts it
    (train/megatron_shard.py): "embedding" and "head" split vocabulary rows over TP (embedding on the first
    pipeline stage, head and "final_norm" on the last); "qkv" and "fc1" are column-parallel (dim 0, per KV group /
    per half); "row" is row-parallel (dim 1); "norm" is replicated. In a Qwen3-MoE layer: "router" (the gate,
    [experts, hidden]) is replicated; "expert_fc1" (gate ‖ up, as "fc1") and "expert_fc2" (down, as "row") belong to
    global expert `expert`, which expert parallelism places on EP rank expert // (experts / ep) as local expert
    expert % (experts / ep) (the Megatron name here says the global index, as one EP rank holds them all). `layer`
    is the global decoder layer (None outside the decoder); join/split None: the tensor is copied as it is."""

    hf: tuple[str, ...]
    megatron: str
    kind: str
    layer: int | None = None
    join: Join | None = None
    split: Split | None = None
    expert: int | None = None


_LAYER_KIND = {"self_attn.o_proj.weight": "row"}


def _mlp_maps(cfg: Qwen3Config, i: int) -> list[TensorMap]:
    """Layer i's MLP: the dense SwiGLU, or the router and every expert's SwiGLU."""
    h, m = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not cfg.is_moe_layer(i):
        return [TensorMap((h + "gate_proj.weight", h + "up_proj.weight"), m + "linear_fc1.weight", "fc1", i,
                          _concat, _halves),
                TensorMap((h + "down_proj.weight",), m + "linear_fc2.weight", "row", i)]
    maps = [TensorMap((h + "gate.weight",), m + "router.weight", "router", i)]
    for e in range(cfg.num_experts):
        he, me = f"{h}experts.{e}.", f"{m}experts.local_experts.{e}."
        maps += [TensorMap((he + "gate_proj.weight", he + "up_proj.weight"), me + "linear_fc1.weight", "expert_fc1",
                           i, _concat, _halves, expert=e),
                 TensorMap((he + "down_proj.weight",), me + "linear_fc2.weight", "expert_fc2", i, expert=e)]
    return maps


def tensor_maps(cfg: Qwen3Config) -> list[TensorMap]:
    """Every tensor of the model, in a fixed order: embedding, final norm, head, then layer by layer."""
    check_supported(cfg)
    maps = [TensorMap(("model.embed_tokens.weight",), "embedding.word_embeddings.weight", "embedding"),
            TensorMap(("model.norm.weight",), "decoder.final_layernorm.weight", "final_norm")]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap(("lm_head.weight",), "output_layer.weight", "head"))
    qkv_join, qkv_split = _qkv(cfg)
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        maps += [TensorMap((h + hs,), m + ms, _LAYER_KIND.get(hs, "norm"), i) for hs, ms in _LAYER_SAME]
        maps.append(TensorMap(tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"),
                              m + "self_attention.linear_qkv.weight", "qkv", i, qkv_join, qkv_split))
        maps += _mlp_maps(cfg, i)
    return maps


def hf_to_megatron(state: Mapping[str, Tensor], cfg: Qwen3Config) -> dict[str, Tensor]:
    """Hugging Face names → GPTModel names (new tensors where fused; the rest are the same tensor objects)."""
    return {t.megatron: t.join([state[n] for n in t.hf]) if t.join else state[t.hf[0]] for t in tensor_maps(cfg)}


def megatron_to_hf(state: Mapping[str, Tensor], cfg: Qwen3Config) -> dict[str, Tensor]:
    """GPTModel names → Hugging Face names (views where split); the inverse of `hf_to_megatron`."""
    out: dict[str, Tensor] = {}
    for t in tensor_maps(cfg):
        out.update(zip(t.hf, t.split(state[t.megatron]) if t.split else (state[t.megatron],), strict=True))
    return out
