"""A Megatron cell's optimizer state on disk, by Hugging Face tensor name and block, so that a cell of any shape
resumes from it (megatron.core.dist_checkpointing's idea: pieces of global tensors, each with its offsets).

AdamW's moments are elementwise, and so is the fp32 master, so each is cut and fused exactly as its weight is
(train/megatron_convert.py's maps: a local tensor's rows are permuted rows of its Hugging Face tensors' TP cuts,
train/megatron_shard.py). A rank steps row ranges of its local tensors (train/dist_optimizer.py `Unit`); the rows of
one range are, in each Hugging Face tensor the local one is made of, one contiguous block, offset by the TP cut
(`unit_blocks`). In a version's folder:
- `optimizer.rank{r}-of-{n}.pt`, one per rank (torch.save of {key: tensor}, loadable with weights_only): the blocks of
  the rows this rank steps, of its TP copy that is counted (a replicated norm from TP rank 0, the tied head's copy
  never), each state under `{state}:{Hugging Face name}:{offsets}`: `exp_avg`, `exp_avg_sq` and, in bf16, `master`;
- `optimizer.index.json`, the leader's (`OptimizerIndex`): the trainer's step count, the shape and precision that
  saved it, and per Hugging Face tensor its blocks (file, offsets, shape, AdamW's step).
A rank of any shape reads, for each of its row ranges, the block of each Hugging Face tensor it covers, put together
from the saved blocks that overlap it (files memory-mapped: only those bytes are read), and scatters the rows back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from pydantic import BaseModel
from torch import Tensor

from gyre_slurm.train.dist_optimizer import Unit
from gyre_slurm.train.megatron_parallel import Parallel
from gyre_slurm.train.megatron_shard import LocalTensor, RankCoords

INDEX = "optimizer.index.json"
FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "master"
Block = tuple[str, tuple[int, ...], Tensor]  # (Hugging Face name, offsets in it, the block)


class SavedBlock(BaseModel):
    file: str
    offset: list[int]
    shape: list[int]
    step: float


class OptimizerIndex(BaseModel):
    format: int = FORMAT
    steps: int
    shape: dict[str, int]  # tensor/pipeline/data/expert parallel sizes and world of the cell that saved it
    precision: str
    distributed: bool
    states: list[str]
    tensors: dict[str, list[SavedBlock]]


def rank_file(rank: int, world: int) -> str:
    return f"optimizer.rank{rank}-of-{world}.pt"


def key(state: str, name: str, offset: Iterable[int]) -> str:
    return f"{state}:{name}:{','.join(map(str, offset))}"


def _hf_rows(lt: LocalTensor, rows: int) -> list[Tensor]:
    """For each Hugging Face tensor of lt (its map's order), the local row of each of its rows in this TP cut."""
    idx = torch.arange(rows)
    if lt.map.split is None:
        return [idx]
    return [part.reshape(-1) for part in lt.map.split(idx.unsqueeze(1))]


def _spans(lt: LocalTensor, c: RankCoords, shape: torch.Size, lo: int, hi: int) \
        -> Iterator[tuple[str, tuple[int, ...], Tensor]]:
    """For rows [lo, hi) of local tensor lt (full shape `shape`) on a rank at c: each Hugging Face tensor they reach,
    the block's offsets in it, and which of the range's rows (from lo) make the block's rows, in order."""
    for name, rows in zip(lt.map.hf, _hf_rows(lt, shape[0]), strict=True):
        at = ((rows >= lo) & (rows < hi)).nonzero().flatten()
        if not len(at):
            continue
        a, b = int(at[0]), int(at[-1]) + 1
        if b - a != len(at):
            raise RuntimeError(f"{lt.name} rows {lo}..{hi} are not one block of {name}")
        offset = [a] + [0] * (len(shape) - 1)
        if lt.dim is not None:  # this rank's TP cut of the Hugging Face tensor
            offset[lt.dim] += c.tp_rank * (len(rows) if lt.dim == 0 else shape[lt.dim])
        yield name, tuple(offset), rows[a:b] - lo


def unit_blocks(lt: LocalTensor, c: RankCoords, shape: torch.Size, lo: int, t: Tensor) -> list[Block]:
    """Rows [lo, lo + len(t)) of local tensor lt, given as t, as blocks of its Hugging Face tensors."""
    return [(name, off, t.index_select(0, rows)) for name, off, rows in _spans(lt, c, shape, lo, lo + len(t))]


def save_state(folder: Path, par: Parallel, local: Iterable[LocalTensor], units: Iterable[Unit],
               shapes: Mapping[str, torch.Size], optimizer: torch.optim.Optimizer, *, masters: bool,
               **fields) -> None:
    """Every rank of the cell (a gather): its file of the blocks of its stepped rows (primary TP copies), the leader
    the index (`fields`: the OptimizerIndex's own). `masters`: save the stepped tensors too (bf16's fp32 masters)."""
    file = rank_file(par.rank, par.world)
    primary = {lt.name: lt for lt in local if lt.primary}
    tensors: dict[str, Tensor] = {}
    meta: dict[str, list[SavedBlock]] = {}
    for u in units:
        st = optimizer.state.get(u.param)
        if not st or u.name not in primary:  # not stepped yet (nothing beyond the weights), or a copy
            continue
        values = {**{s: st[s] for s in MOMENTS}, **({MASTER: u.param} if masters else {})}
        for s, v in values.items():
            for name, off, block in unit_blocks(primary[u.name], par.coords, shapes[u.name], u.lo, v.detach()):
                tensors[key(s, name, off)] = block.cpu()
                if s == MOMENTS[0]:
                    meta.setdefault(name, []).append(SavedBlock(file=file, offset=list(off), shape=list(block.shape),
                                                                step=float(st["step"])))
    torch.save(tensors, Path(folder) / file)
    parts = par.gather_to_leader(meta)
    if parts is not None:
        merged: dict[str, list[SavedBlock]] = {}
        for part in parts:
            for name, blocks in part.items():
                merged.setdefault(name, []).extend(blocks)
        states = [*MOMENTS, *((MASTER,) if masters else ())]
        (Path(folder) / INDEX).write_text(OptimizerIndex(states=states, tensors=merged, **fields).model_dump_json())


def read_index(folder: Path) -> OptimizerIndex | None:
    path = Path(folder) / INDEX
    if not path.is_file():
        return None
    index = OptimizerIndex.model_validate(json.loads(path.read_text()))
    if index.format != FORMAT:
        raise ValueError(f"{path}: optimizer state format {index.format}, this trainer reads {FORMAT}")
    return index


class SavedReader:
    """Blocks of the saved states, put together from the saved blocks that overlap them. Files are opened
    (memory-mapped) on first use; `files` says which were."""

    def __init__(self, folder: Path, index: OptimizerIndex) -> None:
        self.folder, self.index = Path(folder), index
        self.files: dict[str, dict[str, Tensor]] = {}

    def _file(self, name: str) -> dict[str, Tensor]:
        if name not in self.files:
            self.files[name] = torch.load(self.folder / name, map_location="cpu", mmap=True, weights_only=True)
        return self.files[name]

    def block(self, state: str, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Tensor, float]:
        """The block of Hugging Face tensor `name` at `offset` of `shape`, and its AdamW step."""
        out, covered, step = None, 0, 0.0
        for b in self.index.tensors.get(name, []):
            lo = [max(o, bo) for o, bo in zip(offset, b.offset, strict=True)]
            hi = [min(o + n, bo + bn) for o, n, bo, bn in zip(offset, shape, b.offset, b.shape, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            src = self._file(b.file)[key(state, name, b.offset)]
            out = torch.empty(shape, dtype=src.dtype) if out is None else out
            into = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, offset, strict=True))
            out[into] = src[tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, b.offset, strict=True))]
            covered += int(torch.Size([y - x for x, y in zip(lo, hi, strict=True)]).numel())
            step = b.step
        if out is None or covered != out.numel():
            raise ValueError(f"{self.folder}: the saved optimizer state does not cover {name} at {list(offset)} "
                             f"{list(shape)}")
        return out, step

    def unit(self, lt: LocalTensor, c: RankCoords, shape: torch.Size, lo: int, hi: int) \
            -> tuple[dict[str, Tensor], float] | None:
        """Every saved state of rows [lo, hi) of local tensor lt at c, and their AdamW step; None if none was
        saved for it (the cell that saved had not stepped it)."""
        spans = list(_spans(lt, c, shape, lo, hi))
        if not all(name in self.index.tensors for name, _, _ in spans):
            return None
        out, step = {}, 0.0
        for state in self.index.states:
            t = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32)
            for name, off, rows in spans:
                block, step = self.block(state, name, off, (len(rows), *shape[1:]))
                t.index_copy_(0, rows, block.to(t.dtype))
            out[state] = t
        return out, step


def assemble_blocks(blocks: Iterable[Block]) -> dict[str, Tensor]:
    """Full Hugging Face tensors from blocks that cover each exactly once (every rank's, in any order)."""
    by_name: dict[str, list[tuple[tuple[int, ...], Tensor]]] = {}
    for name, off, t in blocks:
        by_name.setdefault(name, []).append((off, t))
    out = {}
    for name, parts in by_name.items():
        shape = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        full = torch.zeros(shape, dtype=parts[0][1].dtype)
        for off, t in parts:
            full[tuple(slice(o, o + n) for o, n in zip(off, t.shape, strict=True))] = t
        if sum(t.numel() for _, t in parts) != full.numel():
            raise ValueError(f"{name}: blocks of {sum(t.numel() for _, t in parts)} elements for {full.numel()}")
        out[name] = full
    return out
