"""weights.engine_update: stage. A new version reaches the cell's own rollout server through a RAM disk on its node,
in two hops, each recorded as a Transfer:

1. pull (transport "mooncake", receiver "agent:<cell>"): the node agent pulls the version the core published into
   its registered host staging buffer (transfer/weights.py WeightPuller), as the push path's first hop does.
2. load (transport "file", receiver "engine:<cell>"): the agent writes it as a Hugging Face folder (safetensors, in
   shards of SHARD_BYTES with model.safetensors.index.json when there are several, plus config.json, tokenizer and
   generation files copied from the version's snapshot folder) into weights.stage_dir/<run>/cell<N>/v<version>
   (written under a hidden name, then renamed: a folder with the final name is complete), and its server loads it
   with POST /update_weights_from_disk {model_path, weight_version}.

Why this path into SGLang (docs/cells.md "How a version reaches an SGLang server"): SGLang holds every GPU of the
node and runs in its own environment, so an NCCL rank of the agent would share a GPU with SGLang's TP rank ("Duplicate
GPU detected", NVIDIA/nccl#1241) and differ in NCCL build ("Mismatched NCCL version"). Files need neither; SGLang
does not bracket /update_weights_from_disk in a weight-update session (managers/scheduler_components/
weight_updater.py), so both of its generations take it the same way.

Never half-loaded weights served. SGLang (model_executor/model_runner_components/weight_updater.py,
update_weights_from_disk) sets its model path to the new folder before loading, and on a failed load "rolls back"
by reading that same new folder again: a bad folder leaves the server with a mix of versions, or none. So the load
runs inside an abort pause (calls in flight come back with what they sampled; the proxy continues them), and a
failed one loads the folder the server served before back before generation continues, as the push path does; the
failure is recorded ok=false and raised. The folder served stays on the RAM disk: SGLang reloads it on a resume
after a memory release. Older versions' folders are removed before a new one is written; the cell's folder at close.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from gyre_slurm.agent.engine_update import EngineUpdater, Record, error_text
from gyre_slurm.agent.weight_link import folder_bytes
from gyre_slurm.engines.client import EngineClient
from gyre_slurm.engines.sglang_weights import buckets
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import WeightsHandle, WeightsRef
from gyre_slurm.transfer.engine import TransferAgent
from gyre_slurm.transfer.report import TransferReport

log = logging.getLogger("gyre.agent")
SHARD_BYTES = 4 << 30  # per safetensors file (Hugging Face shards at 5 GB); one file below that
WRITERS = min(8, os.cpu_count() or 1)  # shards written at once
INDEX = "model.safetensors.index.json"


def shards(tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """The names, in order, cut into runs of at most shard_bytes (a larger tensor gets a file of its own)."""
    return [[name for name, _ in part] for part in buckets(tensors.items(), shard_bytes)]


def write_hf_folder(tensors: Mapping[str, torch.Tensor], source: Path, dest: Path,
                    shard_bytes: int = SHARD_BYTES) -> int:
    """Write `tensors` as a Hugging Face folder at `dest` (absent): the weights as safetensors, the rest of `source`
    (config, tokenizer) copied. Written under a hidden name and renamed at the end. Returns the tensors' bytes."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in Path(source).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX:
                shutil.copyfile(f, tmp / f.name)
        parts = shards(tensors, shard_bytes)
        names = ["model.safetensors"] if len(parts) == 1 else \
            [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
        # safetensors writes each tensor from its own memory (the staging buffer): no second copy in RAM; and it
        # lets go of the GIL while it writes, so shards go out in parallel (2x on 2 cores: tools/bench_stage.py)
        with ThreadPoolExecutor(min(len(parts), WRITERS)) as pool:
            list(pool.map(lambda file, part: save_file({n: tensors[n].contiguous() for n in part}, tmp / file,
                                                       metadata={"format": "pt"}), names, parts))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if len(parts) > 1:
            index = {"metadata": {"total_size": nbytes},
                     "weight_map": {n: file for file, part in zip(names, parts, strict=True) for n in part}}
            (tmp / INDEX).write_text(json.dumps(index, indent=1))
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return nbytes


class EngineStager(EngineUpdater):
    """One cell's stage path into its own server: `agent` gives this process's Transfer Engine; `root` is the
    cell's folder on the RAM disk (weight_link.stage_root)."""

    verb = "load"

    def __init__(self, agent: Callable[[], TransferAgent], cell: int, root: Path, *,
                 shard_bytes: int = SHARD_BYTES) -> None:
        super().__init__(agent, cell)
        self.root, self.shard_bytes = Path(root), int(shard_bytes)

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:05d}"

    def update(self, client: EngineClient, ref: WeightsRef, handle: list[WeightsHandle], server: object,
               record: Record) -> WeightsRef:
        """Make the server behind `client` serve `ref` (published as `handle`), or the newest version after it where
        it was replaced before it was read; returns the version served. Raises after recording a failure."""
        with self._lock:
            self._new_server(client, server)  # a new start serves the folder it started from
            self._know_served(client)
            if self.held is not None and self.held[0].version >= ref.version:
                ref = self.held[0]  # pulled already (a newer version where ref was replaced)
            folder = self.folder(ref.version)
            if not folder.exists():  # else: the same version again (a resume reloads), already written
                self._prune()
                ref = self._write(handle, ref, record)
                folder = self.folder(ref.version)

            def load() -> TransferReport:
                t0 = time.perf_counter()
                client.update_weights_from_disk(str(folder), ref.version)
                return TransferReport("file", ref.version, folder_bytes(folder), time.perf_counter() - t0,
                                      self.receiver)

            def forget() -> None:
                if self._served is None or Path(self._served.path) != folder:
                    shutil.rmtree(folder, ignore_errors=True)  # a failed folder is not reused

            self._paused_update(client, ref.version, "file", record, load, on_failure=forget)
            self._served = WeightsRef(version=ref.version, path=str(folder))
            self._prune()
            return self._served

    def _write(self, handle: list[WeightsHandle], ref: WeightsRef, record: Record) -> WeightsRef:
        """Pull the version (or a newer one: returned) and write it into its folder."""
        got, tensors = self._pull(handle, ref, record)
        folder = self.folder(got.version)
        if folder.exists():
            return got  # the newer version pulled is the one already written
        t0 = time.perf_counter()
        try:
            nbytes = write_hf_folder(tensors, Path(ref.path), folder, self.shard_bytes)  # config: any version's
        except Exception as exc:
            record(TransferReport("file", got.version, 0, time.perf_counter() - t0, self.receiver, ok=False,
                                  error=error_text(exc)))
            raise GyreError(f"cell {self.cell}: staging weights version {got.version} in {folder} failed "
                            f"({error_text(exc)}); the server still serves its version") from None
        log.info("staged version %d in %s (%d bytes in %.3f s)", got.version, folder, nbytes,
                 time.perf_counter() - t0)
        return got

    def _prune(self) -> None:
        """Remove every folder of the cell's but the one served (RAM: at most it and the one being written)."""
        keep = Path(self._served.path) if self._served is not None else None
        for p in self.root.glob("*") if self.root.exists() else ():
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            self._close_puller()
            shutil.rmtree(self.root, ignore_errors=True)
            try:
                self.root.parent.rmdir()  # the run's folder, once its last cell's is gone
            except OSError:
                pass


__all__ = ["EngineStager", "shards", "write_hf_folder"]
