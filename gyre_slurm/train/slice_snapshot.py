"""A model-parallel cell's version folder written slice by slice: the Hugging Face layout, and no rank ever holds
the whole model.

Each full Hugging Face tensor is written by one rank, its writer: the TP rank 0 among the ranks that send it
(`MegatronTrainer._senders`: DP rank 0 for dense tensors, expert-DP rank 0 for experts). For a tensor that tensor
parallelism cuts, the writer gathers its TP peers' slices over the TP group into one buffer the size of that tensor
(a bucket), streams it into its own safetensors file and drops it before the next: beyond its own slices a rank holds
at most one full tensor (and, for a row-parallel tensor, a block of its rows reordered for the file). A replicated
tensor (a norm, the router, an expert) is written by its sender as it is.

Every writer writes one file, `model-rank{r}-of-{world}.safetensors`, in the safetensors format (an 8-byte header
length, a JSON header of dtype, shape and byte offsets, the bytes in C order: github.com/huggingface/safetensors
README "Format"), the header first (shapes are known from the slices) and then each tensor as it is assembled. The
leader writes `model.safetensors.index.json` from the names every writer reports (gathered as small lists) and
copies the config and tokenizer files, all in `save_policy`'s temporary folder, which is renamed into place only
after every rank has written: a crash leaves the previous version as it was.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gyre_slurm.train.megatron_shard import LocalTensor, RankCoords
from gyre_slurm.train.torch_trainer import save_policy

INDEX = "model.safetensors.index.json"
CONFIG_FILES = ("config.json", "generation_config.json")  # what save_pretrained writes besides the weights
ROW_BLOCK_BYTES = 16 << 20  # a row-parallel tensor is reordered for the file in blocks of rows of this size
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor's slice that this rank sends: its name, cut (dim None: whole), this rank's TP rank
    and size, the full tensor's shape, and where it comes from (part `index` of the split of local tensor `local`)."""

    name: str
    dim: int | None
    tp_rank: int
    tp: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    local: str
    index: int

    @property
    def full_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return tuple(n * self.tp if d == self.dim else n for d, n in enumerate(self.shape))

    @property
    def writer(self) -> bool:
        """Whether this rank writes the full tensor (TP rank 0 of the slices' group)."""
        return self.tp_rank == 0


def plan_pieces(c: RankCoords, senders: Sequence[LocalTensor], tensors: Mapping[str, Tensor],
                copies: bool = False) -> list[Piece]:
    """The Hugging Face slices of this rank's primary sender tensors, in order, shapes only (nothing copied).
    `copies`: its other sender tensors too (a whole tensor on TP rank > 0, the last stage's tied embedding)."""
    out = []
    for lt in senders:
        if not (lt.primary or copies):
            continue
        t = tensors[lt.name]
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        parts = lt.map.split(meta) if lt.map.split else (meta,)
        out += [Piece(n, lt.dim, c.tp_rank, c.tp, tuple(p.shape), t.dtype, lt.name, k)
                for k, (n, p) in enumerate(zip(lt.map.hf, parts, strict=True))]
    return out


def iter_pieces(pieces: Sequence[Piece], senders: Sequence[LocalTensor],
                tensors: Mapping[str, Tensor]) -> Iterator[tuple[Piece, Tensor]]:
    """Each piece's values, one local tensor split at a time (a fused tensor's parts, then the next)."""
    maps = {lt.name: lt.map for lt in senders}
    split: tuple[str, Sequence[Tensor]] | None = None
    for p in pieces:
        if split is None or split[0] != p.local:
            t = tensors[p.local]
            split = p.local, (maps[p.local].split(t) if maps[p.local].split else (t,))
        yield p, split[1][p.index]


# --- the safetensors file, streamed ---------------------------------------------------------------------------------
class StreamedSafetensors:
    """A safetensors file whose header is written first (names, dtypes, shapes known) and whose tensors follow in
    that order, each as it becomes available (whole, or as consecutive byte blocks)."""

    def __init__(self, path: Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        off, self._sizes = 0, []
        for name, dtype, shape in entries:
            n = int(torch.Size(shape).numel()) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self._sizes.append((name, n))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.nbytes = off
        self._f = open(path, "wb")  # noqa: SIM115 (closed by close(), after the last tensor)
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next, self._left = 0, self._sizes[0][1] if self._sizes else 0

    def write(self, name: str, block: Tensor) -> None:
        """The next bytes of tensor `name` (C order); a tensor may come in several consecutive blocks."""
        want = self._sizes[self._next][0]
        if name != want:
            raise RuntimeError(f"safetensors stream: {name} written where {want} comes next")
        data = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel() > self._left:
            raise RuntimeError(f"safetensors stream: {name} gets more bytes than its shape holds")
        self._f.write(memoryview(data.numpy()))
        self._left -= data.numel()
        while self._left == 0 and self._next < len(self._sizes) - 1:
            self._next += 1
            self._left = self._sizes[self._next][1]

    def close(self) -> None:
        self._f.close()
        if self._left or self._next < len(self._sizes) - 1:
            raise RuntimeError("safetensors stream closed before its last tensor was written")

    def abort(self) -> None:
        self._f.close()


# --- the writers ----------------------------------------------------------------------------------------------------
def rank_file(rank: int, world: int) -> str:
    return f"model-rank{rank}-of-{world}.safetensors"


def _tp_gather(piece: Tensor, p: Piece, device: torch.device) -> Tensor | None:
    """The full tensor on TP rank 0 (None elsewhere): the TP peers' slices gathered into one buffer. A cut along
    dim 0 lands in place; a cut along dim 1 comes as [tp, rows, cols/tp] (reordered while it is written)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, dst = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
    mine = piece.to(device).contiguous()
    if not p.writer:
        dist.gather(mine, None, dst=dst, group=group)
        return None
    buf = torch.empty((p.tp, *p.shape), dtype=p.dtype, device=device)
    dist.gather(mine, list(buf.unbind(0)), dst=dst, group=group)
    return buf


def _write_full(out: StreamedSafetensors, p: Piece, buf: Tensor) -> None:
    """A gathered [tp, *slice] buffer into the file as the full tensor (C order)."""
    if p.dim == 0:
        out.write(p.name, buf)
        return
    rows, cols = buf.shape[1], buf.shape[2]
    step = max(1, ROW_BLOCK_BYTES // max(1, p.tp * cols * buf.element_size()))
    for r in range(0, rows, step):
        out.write(p.name, buf[:, r:r + step].permute(1, 0, 2))


def write_rank_file(c: RankCoords, senders: Sequence[LocalTensor], tensors: Mapping[str, Tensor], folder: Path,
                    rank: int, world: int, device: torch.device) -> tuple[str, list[str], int] | None:
    """This rank's part of the folder (collective over each TP group: every rank of the cell calls it): the file
    it wrote, the names in it and its bytes; None when it writes none."""
    pieces = plan_pieces(c, senders, tensors)
    mine = [p for p in pieces if p.writer]
    out = StreamedSafetensors(folder / rank_file(rank, world), [(p.name, p.dtype, p.full_shape) for p in mine]) \
        if mine else None
    try:
        for p, t in iter_pieces(pieces, senders, tensors):
            if p.dim is None or p.tp == 1:
                out.write(p.name, t)  # the writer itself (only TP rank 0's copy of a whole tensor is primary)
                continue
            buf = _tp_gather(t, p, device)
            if buf is not None:
                _write_full(out, p, buf)
            del buf
    except BaseException:
        if out is not None:
            out.abort()
        raise
    if out is not None:
        out.close()
    return (rank_file(rank, world), [p.name for p in mine], out.nbytes) if out is not None else None


def write_index(folder: Path, written: Sequence[tuple[str, list[str], int] | None]) -> None:
    """The leader's index from what every writer reported (a name written twice is a bug in the senders)."""
    where: dict[str, str] = {}
    for w in written:
        if w is None:
            continue
        file, names, _ = w
        for n in names:
            if n in where:
                raise RuntimeError(f"{n} written by {where[n]} and {file}")
            where[n] = file
    total = sum(w[2] for w in written if w is not None)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": dict(sorted(where.items()))}, indent=2))


def copy_config(src_dir: Path, folder: Path) -> None:
    for name in CONFIG_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy2(Path(src_dir) / name, folder / name)


class _SliceWriter:
    """What save_policy calls save_pretrained on (the leader): every rank writes its file into the folder."""

    def __init__(self, write: Callable[[Path], None]) -> None:
        self._write = write

    def save_pretrained(self, folder: Path, safe_serialization: bool = True) -> None:
        self._write(Path(folder))


def save_slices(par, senders: Sequence[LocalTensor], tensors: Mapping[str, Tensor], src_dir: Path, out_dir: Path,
                extra: Callable[[Path], None]) -> Path:
    """The version folder (every rank calls it: `par` is the cell's train/megatron_parallel.Parallel); `extra(folder)`
    runs on every rank before the rename (each rank's optimizer state)."""

    def write(folder: Path) -> None:
        mine = write_rank_file(par.coords, senders, tensors, folder, par.rank, par.world, par.device)
        written = par.gather_to_leader(mine)
        if written is not None:
            write_index(folder, written)
            copy_config(src_dir, folder)

    if par.leader:
        def on_leader(folder: Path) -> None:
            par.broadcast(str(folder))
            write(folder)
            extra(folder)
            par.barrier()  # every rank's extra is in before the folder is renamed

        return save_policy(_SliceWriter(on_leader), src_dir, out_dir)
    folder = Path(par.broadcast(None))
    write(folder)
    extra(folder)
    par.barrier()
    return Path(out_dir)
