"""What the engine reads from a model folder besides the weights: the tokenizer and the eos token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_slurm.model.qwen3 import Qwen3Config

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def load_tokenizer(path: str) -> Tokenizer | None:
    """The folder's tokenizer.json, or None: without one the engine serves token ids only (no stop strings)."""
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def eos_ids(path: str, config: Qwen3Config, tokenizer: Tokenizer | None) -> set[int]:
    """Like SGLang: the config's eos ids, the generation config's, and the tokenizer's eos token."""
    ids = set(config.eos_token_ids)
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    tok_cfg = Path(path) / "tokenizer_config.json"
    if tokenizer is not None and tok_cfg.exists():
        eos_tok = json.loads(tok_cfg.read_text()).get("eos_token")
        eos_tok = eos_tok.get("content") if isinstance(eos_tok, dict) else eos_tok
        if isinstance(eos_tok, str) and tokenizer.token_to_id(eos_tok) is not None:
            ids.add(tokenizer.token_to_id(eos_tok))
    return ids
