"""The built-in tiny policy: a Qwen3-architecture causal LM in the Hugging Face format, made locally.

Byte-level tokenizer (256 byte tokens + Qwen3's special tokens) with a ChatML / Qwen3-style chat template
(tools, `<tool_call>` JSON, `<tool_response>`, `<think>`), so that the proxy, engine and trainer run the same
code paths as with a real Qwen3 checkpoint; switching to one is a change of `model.path`. A small vocabulary
keeps the logits layer cheap: generation runs at thousands of tokens/s on one CPU core.
Creation is deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
EOS = "<|im_end|>"
PAD = "<|endoftext|>"

# (Hugging Face renders templates with trim_blocks: a newline right after a block tag is written as {{ '\\n' }}.)
# ChatML as Qwen3 renders it, kept append-only: earlier turns render the same whatever follows (thinking kept),
# which is what token-in/token-out needs. Tool arguments given as a JSON string are rendered verbatim.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\nCall a tool as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n"
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role in ['user', 'system'] %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}"
    "{% set fn = tc.function if tc.function is defined else tc %}"
    "{% if not loop.first or message.content %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ fn.name }}\", \"arguments\": "
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's byte → printable character map (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_tokenizer():
    """Byte-level BPE without merges: every byte is a token, special tokens on top."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: b for b, ch in _byte_chars().items()}  # token id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=SPECIAL_TOKENS[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
    )


def tiny_moe_config(vocab_size: int):
    """The tiny model's shape with a Qwen3-MoE MLP in both layers: 4 experts, 2 per token, renormalised."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
    )


def create_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Qwen3 (config, safetensors, tokenizer, chat template) to out_dir."""
    from transformers import Qwen3ForCausalLM

    return _write_tiny(Path(out_dir), seed, tiny_config, Qwen3ForCausalLM, "tiny-qwen3")


def build_tiny_moe(out_dir: Path, seed: int = 0) -> Path:
    """As create_tiny_model, a tiny Qwen3-MoE (model_type qwen3_moe; experts saved one by one, as published)."""
    from transformers import Qwen3MoeForCausalLM

    return _write_tiny(Path(out_dir), seed, tiny_moe_config, Qwen3MoeForCausalLM, "tiny-qwen3-moe")


def _write_tiny(out_dir: Path, seed: int, make_config, model_class, kind: str) -> Path:
    import torch

    from gyre_slurm.model import quiet_transformers

    quiet_transformers()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = ((len(tok) + 63) // 64) * 64
    cfg = make_config(vocab)
    cfg.eos_token_id = tok.convert_tokens_to_ids(EOS)
    cfg.pad_token_id = tok.convert_tokens_to_ids(PAD)
    cfg.bos_token_id = None
    torch.manual_seed(seed)
    model = model_class(cfg).to(torch.float32)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / "gyre_model.json").write_text(json.dumps({"kind": kind, "seed": seed}) + "\n")
    return out_dir
