"""Which part of each tensor a model-parallel rank holds, in both layouts (pure tensor code, no Megatron import).

A rank is placed by its tensor-, pipeline- and expert-parallel coordinates (`RankCoords`). From the model's
`TensorMap`s (train/megatron_convert.py) it holds:
- pipeline stage p of pp: decoder layers [p·L/pp, (p+1)·L/pp), named `decoder.layers.{local}` from 0; the
  embedding on the first stage, the final norm and the head on the last (tied embeddings under PP: the last stage
  keeps its own copy of the embedding as `output_layer.weight`, which Megatron keeps equal by all-reducing the two
  gradients);
- tensor rank t of tp: vocabulary rows (embedding, head), output rows (qkv: whole KV groups, fc1: the same rows of
  gate and of up) or input columns (row-parallel o_proj, down_proj) in tp equal contiguous chunks; norms whole;
- expert rank e of ep: experts [e·E/ep, (e+1)·E/ep), named `local_experts.{local}` (each expert whole, tp = 1).

Each Hugging Face tensor a rank holds is cut the same way (`hf_cut`), so a rank loads its slices straight from the
checkpoint's files (safetensors slices, no full copy) and fuses them with the map's own join; the way back splits
the rank's tensor with the map's split and the pieces of all ranks are put together along the same dimension.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.model.qwen3 import Qwen3Config
from gyre_slurm.train.megatron_convert import TensorMap, tensor_maps

# The dimension of the Hugging Face tensors that tensor parallelism cuts, by TensorMap kind (absent: whole).
TP_DIM = {"embedding": 0, "head": 0, "qkv": 0, "fc1": 0, "row": 1}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class RankCoords:
    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


@dataclass(frozen=True)
class LocalTensor:
    """One parameter of this rank's GPTModel: its map, its local name, the Hugging Face cut, and whether this rank's
    copy is the one counted (in the gathered checkpoint, in the gradient norm) among the copies of its TP group."""

    map: TensorMap
    name: str
    dim: int | None
    primary: bool


def check_fits(cfg: Qwen3Config, c: RankCoords) -> None:
    """One line for a model that these sizes cannot cut evenly."""
    need = [("attention heads", cfg.num_attention_heads, c.tp), ("key/value heads", cfg.num_key_value_heads, c.tp),
            ("vocabulary rows", cfg.vocab_size, c.tp), ("MLP rows", cfg.intermediate_size, c.tp),
            ("decoder layers", cfg.num_hidden_layers, c.pp)]
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts:
        need.append(("experts", experts, c.ep))
        if c.pp > 1:  # variable sequence lengths between stages need the alltoall dispatcher, CUDA-only in 0.16.1
            raise ValueError("a mixture-of-experts model trains with pipeline_parallel 1 for now")
        if c.tp > 1:  # Megatron would cut each expert over TP as well (expert tensor parallelism): not converted
            raise ValueError("a mixture-of-experts model trains with tensor_parallel 1 for now (experts spread over "
                             "expert_parallel ranks)")
    elif c.ep > 1:
        raise ValueError(f"expert_parallel {c.ep} needs a mixture-of-experts model (this one is dense)")
    for what, n, size in need:
        if n % size:
            raise ValueError(f"the model's {n} {what} do not split over {size} ranks")


def stage_layers(cfg: Qwen3Config, c: RankCoords) -> range:
    per = cfg.num_hidden_layers // c.pp
    return range(c.pp_rank * per, (c.pp_rank + 1) * per)


def local_tensors(cfg: Qwen3Config, c: RankCoords) -> list[LocalTensor]:
    """This rank's parameters in `tensor_maps` order (the tied head copy of the last stage after the rest)."""
    check_fits(cfg, c)
    layers = stage_layers(cfg, c)
    experts_per_rank = (getattr(cfg, "num_experts", 0) or 0) // c.ep
    out: list[LocalTensor] = []
    tied_head: TensorMap | None = None
    for t in tensor_maps(cfg):
        name = t.megatron
        if t.layer is not None:
            if t.layer not in layers:
                continue
            name = _LAYER.sub(f"decoder.layers.{t.layer - layers.start}.", name)
        elif t.kind == "embedding":
            if c.last_stage and c.pp > 1 and cfg.tie_word_embeddings:
                tied_head = t
            if not c.first_stage:
                continue
        elif not c.last_stage:  # final norm, head
            continue
        expert = getattr(t, "expert", None)
        if expert is not None:
            if expert // experts_per_rank != c.ep_rank:
                continue
            name = _EXPERT.sub(f".local_experts.{expert % experts_per_rank}.", name)
        dim = TP_DIM.get(t.kind)
        out.append(LocalTensor(t, name, dim, primary=dim is not None or c.tp_rank == 0))
    if tied_head is not None:  # a copy: never counted twice
        out.append(LocalTensor(tied_head, "output_layer.weight", 0, primary=False))
    return out


def hf_cut(t: Tensor, dim: int | None, c: RankCoords) -> Tensor:
    """This TP rank's contiguous chunk of a full Hugging Face tensor along `dim` (the tensor itself when None)."""
    return t if dim is None else t.chunk(c.tp, dim)[c.tp_rank]


PartReader = Callable[[str, int | None], Tensor]  # (Hugging Face name, cut dim) -> this rank's slice


def local_state(cfg: Qwen3Config, c: RankCoords, read: PartReader) -> dict[str, Tensor]:
    """This rank's GPTModel tensors by local name, from a reader of Hugging Face slices."""
    out = {}
    for lt in local_tensors(cfg, c):
        parts = [read(n, lt.dim) for n in lt.map.hf]
        out[lt.name] = lt.map.join(parts) if lt.map.join else parts[0]
    return out


def state_reader(state: Mapping[str, Tensor], c: RankCoords) -> PartReader:
    """Slices of a full Hugging Face state dict in memory."""
    return lambda name, dim: hf_cut(state[name], dim, c)


def folder_reader(folder: Path, c: RankCoords) -> PartReader:
    """Slices read straight from a Hugging Face folder's safetensors files: only this rank's bytes are read."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    handles: dict[str, object] = {}

    def read(name: str, dim: int | None) -> Tensor:
        file = where[name] if where is not None else "model.safetensors"
        if file not in handles:
            handles[file] = safe_open(str(folder / file), framework="pt")
        sl = handles[file].get_slice(name)
        if dim is None:
            return sl[:]
        size = sl.get_shape()[dim] // c.tp
        lo, hi = c.tp_rank * size, (c.tp_rank + 1) * size
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    return read


Piece = tuple[str, int | None, int, Tensor]  # (Hugging Face name, cut dim, tp rank, slice)


def hf_pieces(cfg: Qwen3Config, c: RankCoords, tensors: Mapping[str, Tensor],
              only: Iterable[LocalTensor] | None = None) -> list[Piece]:
    """The Hugging Face slices of this rank's primary tensors (weights or gradients, by local name)."""
    pieces: list[Piece] = []
    for lt in only if only is not None else local_tensors(cfg, c):
        if not lt.primary:
            continue
        t = tensors[lt.name]
        parts = lt.map.split(t) if lt.map.split else (t,)
        pieces += [(n, lt.dim, c.tp_rank, p) for n, p in zip(lt.map.hf, parts, strict=True)]
    return pieces


def assemble(pieces: Iterable[Piece]) -> dict[str, Tensor]:
    """Full Hugging Face tensors from the pieces of every rank (in any order)."""
    by_name: dict[str, list[tuple[int, int | None, Tensor]]] = {}
    for name, dim, rank, t in pieces:
        by_name.setdefault(name, []).append((rank, dim, t))
    out = {}
    for name, parts in by_name.items():
        parts.sort(key=lambda p: p[0])
        if len({p[0] for p in parts}) != len(parts):  # two senders of one cut: a replica sent what it should not
            raise ValueError(f"{name}: pieces from TP ranks {[p[0] for p in parts]} (a rank twice)")
        dim = parts[0][1]
        out[name] = parts[0][2].clone() if dim is None else torch.cat([p[2] for p in parts], dim=dim)
    return out
