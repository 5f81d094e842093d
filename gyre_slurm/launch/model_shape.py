"""A policy model's shape, for the memory plan (launch/memory_plan.py): read from a Hugging Face config.json, no torch.

A folder that holds a config.json and no weights is a "planning shape": `gyre check` plans from it, and a run refuses
it at start (`refuse_planning_shape`). The built-in models' shapes are known without building them (`builtin_shape`):
their config.json once built, else the shape model/tiny.py and model/long.py give them (tests/test_memory_plan.py
keeps the two in step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.safetensors.index.json", "*.bin.index.json")

# The built-in models (model/tiny.py tiny_config, model/long.py long_config): tiny's vocabulary is its 256 byte tokens
# and 9 special tokens rounded up to a multiple of 64.
_BUILTIN_TRUNK = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {**_BUILTIN_TRUNK, "vocab_size": 320, "max_position_embeddings": 4096},
    "long": {**_BUILTIN_TRUNK, "vocab_size": 151_936, "max_position_embeddings": 65_536},
}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a Qwen3 / Qwen3-MoE model (Hugging Face config.json names in the comments)."""

    vocab: int  # vocab_size
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (default hidden_size / num_attention_heads)
    ffn: int  # intermediate_size: the dense MLP's width
    tied: bool  # tie_word_embeddings
    max_positions: int  # max_position_embeddings
    experts: int = 0  # num_experts (num_local_experts); 0: dense
    top_k: int = 0  # num_experts_per_tok
    moe_ffn: int = 0  # moe_intermediate_size
    moe_layers: int = 0  # layers with experts (every decoder_sparse_step-th, except mlp_only_layers)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> ModelShape:
        m = raw.get("text_config") or raw  # multimodal folders keep the language model's config inside
        try:
            heads, hidden, layers = int(m["num_attention_heads"]), int(m["hidden_size"]), int(m["num_hidden_layers"])
            experts = int(m.get("num_experts", m.get("num_local_experts")) or 0)
            step, dense_only = int(m.get("decoder_sparse_step") or 1), set(m.get("mlp_only_layers") or ())
            moe = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0) if experts else 0
            return cls(vocab=int(m["vocab_size"]), hidden=hidden, layers=layers, heads=heads,
                       kv_heads=int(m.get("num_key_value_heads") or heads),
                       head_dim=int(m.get("head_dim") or hidden // heads), ffn=int(m.get("intermediate_size") or 0),
                       tied=bool(m.get("tie_word_embeddings", False)),
                       max_positions=int(m.get("max_position_embeddings") or 0), experts=experts,
                       top_k=int(m.get("num_experts_per_tok") or 0) if experts else 0,
                       moe_ffn=int(m.get("moe_intermediate_size") or 0) if experts else 0, moe_layers=moe)
        except KeyError as e:
            raise ValueError(f"config.json has no {e.args[0]} (needed for the memory plan)") from None

    # -- parameter counts ---------------------------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """One decoder layer's attention: q, k, v, o projections, its two norms and the q/k norms."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim * self.hidden
        return qkv + self.heads * self.head_dim * self.hidden + 2 * self.hidden + 2 * self.head_dim

    @property
    def expert_params(self) -> int:
        """One expert's SwiGLU (gate, up, down)."""
        return 3 * self.hidden * self.moe_ffn

    def count(self, active: bool = False) -> int:
        """Parameters of the whole model; active: with only top_k experts per MoE layer (what one token uses)."""
        dense_layers = self.layers - self.moe_layers
        per_moe = self.experts * self.hidden + (self.top_k if active else self.experts) * self.expert_params
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return (embeddings + self.hidden + self.layers * self.attention_params + dense_layers * 3 * self.hidden
                * self.ffn + self.moe_layers * per_moe)


def read_shape(folder: Path) -> ModelShape:
    """The shape in folder/config.json (GyreError when it is missing or unreadable)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GyreError(f"{path}: cannot read it ({e})") from None
    try:
        return ModelShape.from_config(raw)
    except (ValueError, TypeError) as e:
        raise GyreError(f"{path}: {e}") from None


def has_weights(folder: Path) -> bool:
    return any(next(Path(folder).glob(g), None) is not None for g in WEIGHT_GLOBS)


def refuse_planning_shape(folder: Path) -> None:
    """One line for a run started on a folder that holds a config.json but no weights."""
    if (Path(folder) / "config.json").is_file() and not has_weights(folder):
        raise GyreError(f"model.path {folder} holds a config.json but no weights (a shape for planning)")


def builtin_shape(cfg: RunConfig, built: Path | None = None) -> ModelShape:
    """The built-in model's shape: its config.json when it is built (`built`), else the shape it will be made at."""
    if built is not None and (built / "config.json").is_file():
        return read_shape(built)
    return ModelShape.from_config(BUILTIN_SHAPES[cfg.model.builtin])


def config_shape(cfg: RunConfig, builtin_dir: Path | None = None) -> tuple[ModelShape | None, str]:
    """The run's model shape and where it comes from, or (None, why not): model.path's config.json, else the
    built-in model (its folder `builtin_dir` when known)."""
    if cfg.model.path is None:
        return builtin_shape(cfg, builtin_dir), f"the built-in model ({cfg.model.builtin})"
    if not (cfg.model.path / "config.json").is_file():
        return None, f"no {cfg.model.path / 'config.json'}"
    kind = "a shape for planning" if not has_weights(cfg.model.path) else "a checkpoint"
    return read_shape(cfg.model.path), f"{cfg.model.path} ({kind})"
