"""How a cell's weights come and go (weights.transport): published by the core, received by engines and satellites.

mooncake: the core publishes every version it trains (and the one a step starts from) in registered memory
(transfer/weights.py), in parts (transfer/weight_parts.py: a model-parallel core's every sending rank its own
slices, from its own process; any other core its whole model as one part); a satellite pulls it into its trainer
(each of a model-parallel satellite's ranks its own cut), and a rollout engine gets it as weights.engine_update
says: pull (the embedded engine pulls it itself, POST /update_weights_from_transfer_engine), stage (the cell's agent
pulls it into host memory, writes it to a RAM disk on its node and its server loads it from there: engine_stage.py;
how one-node SGLang cells get a version), push (the agent pushes it from host memory into its own server over
SGLang's distributed update on a GPU the server leaves free: engine_push.py) or disk. file: every receiver reads the
snapshot folder. The snapshot folder is written either way (engine restarts, daemon recovery and a failed push's
restore read it), but with mooncake no receiver reads it for a new version unless engine_update says disk: a
version that comes without a handle is an error, never a quiet switch to the file.

Every receive is kept as a `Transfer` until the agent reports it (WeightsReceived → the ledger's weight_transfers).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import Transfer, WeightsRef
from gyre_slurm.sglang_gpus import push_gpu
from gyre_slurm.transfer.report import TransferReport

if TYPE_CHECKING:  # the agent process itself needs no torch (3 CPU-s at every start)
    from gyre_slurm.train.gspo_trainer import GSPOTrainer

log = logging.getLogger("gyre.agent")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def stage_root(stage_dir: Path, run_name: str, state_dir: Path, cell: int) -> Path:
    """A cell's folder under weights.stage_dir (engine_stage.py): runs of one name in two state folders do not
    meet there."""
    tag = hashlib.sha256(str(Path(state_dir).absolute()).encode()).hexdigest()[:8]
    return Path(stage_dir) / f"{run_name}-{tag}" / f"cell{cell}"


class WeightLink:
    def __init__(self, cfg: RunConfig, cell: int) -> None:
        self.w = cfg.weights
        self.cell = cell
        self.host = cfg.control.reachable(cfg.control.bind_host)
        self._publisher = None
        self._puller = None
        self.engine_update = cfg.weights.engine_update_for(cfg.cluster.engine, cfg.cluster.nodes_per_cell)
        self._sglang = cfg.cluster.engine == "sglang"
        self._engine_ranks = cfg.sglang.tp_size if self._sglang else 1  # SGLang joins as rank_offset + tp_rank
        # the push rank's GPU: the first one SGLang's ranks leave free (config.py refuses push where none is)
        self._push_gpu = push_gpu(cfg.cluster.gpus_per_node, cfg.sglang.tp_size, cfg.cluster.nodes_per_cell,
                                  cfg.sglang.extra_args) if self._sglang else None
        self._stage_root = stage_root(cfg.weights.stage_dir, cfg.run.name, cfg.run.state_dir, cell)
        self._stager = None  # engine_stage.EngineStager, made by the first stage
        self._bind_host = cfg.control.bind_host
        self._pusher = None  # engine_push.EnginePusher, made by the first push
        self._done: list[Transfer] = []
        self._lock = threading.Lock()

    @property
    def mooncake(self) -> bool:
        return self.w.transport == "mooncake"

    def _agent(self):
        from gyre_slurm.transfer.engine import TransferAgent

        return TransferAgent.shared(self.host, self.w.protocol, self.w.device)

    def grad_agent(self):
        """The Transfer Engine gradients travel over (None: inline in the ZeroMQ message, the file transport)."""
        return self._agent() if self.mooncake else None

    def rank_link(self, hosts: list[str]):
        """What each rank of a model-parallel trainer needs for its own Transfer Engine (`hosts`: each rank's
        address, by rank)."""
        from gyre_slurm.transfer.weight_parts import RankLink

        return RankLink(tuple(hosts), self.w.protocol, self.w.device, self.w.bucket_mb << 20, self.w.verify)

    def grad_link(self, hosts: list[str]):
        """Where each rank's gradient receiver binds and how peers reach it; the bytes over the Transfer Engine with
        mooncake, inline with file."""
        from gyre_slurm.train.rank_grads import GradLink

        return GradLink(self._bind_host, tuple(hosts), self.rank_link(hosts) if self.mooncake else None)

    # --- the core -------------------------------------------------------------------------------------------------
    def publish(self, version: int, trainer, path: Path, hosts: list[str] | None = None) -> WeightsRef:
        """The version the trainer now holds, as receivers will get it: a model-parallel trainer's every sending
        rank publishes its own slices (train/slice_parts.py; `hosts`: each rank's address), any other trainer its
        whole model as one part."""
        if not self.mooncake:
            return WeightsRef(version=version, path=str(path))
        if hasattr(trainer, "publish"):
            t0 = time.perf_counter()
            parts = trainer.publish(version, self.rank_link(hosts or [self.host]), str(path))
            log.info("version %d published over the Transfer Engine in %d part(s) (%d bytes, %.3f s)", version,
                     len(parts), sum(h.nbytes for h in parts), time.perf_counter() - t0)
            return WeightsRef(version=version, path=str(path), parts=parts)
        model = trainer.model
        from gyre_slurm.transfer.weights import WeightPublisher, named_weights

        if self._publisher is None:
            self._publisher = WeightPublisher(self._agent(), bucket_bytes=self.w.bucket_mb << 20, verify=self.w.verify)
        last = self._publisher.last
        if last is None or last.version != version:
            t0 = time.perf_counter()
            last = self._publisher.publish(version, named_weights(model), source=str(path))
            log.info("published version %d over the Transfer Engine (%d bytes in %.3f s)", version, last.nbytes,
                     time.perf_counter() - t0)
        return WeightsRef(version=version, path=str(path), parts=[last])

    # --- receivers ------------------------------------------------------------------------------------------------
    def _handle(self, ref: WeightsRef):
        """The version's parts (transfer/weight_parts.py), each a handle of the same version."""
        if not ref.parts or any(h.version != ref.version for h in ref.parts):
            raise GyreError(f"weights version {ref.version} came without its Transfer Engine handle "
                            "(weights.transport is mooncake; the snapshot folder is not read instead)")
        return ref.parts

    @property
    def pushes(self) -> bool:
        """The engine takes versions from this agent: after a memory release it must be given the weights again
        (an engine reloads only the folder it last loaded from disk)."""
        return self.engine_update == "push"

    def update_engine(self, client, ref: WeightsRef, server: object = None) -> WeightsRef:
        """Make the cell's rollout engine serve `ref`, or a newer version where `ref` was replaced before it was
        read (a cell slow to come back); returns the version it serves (its snapshot folder as the publisher
        named it). `server` names the engine's start (a new one gets a new weight-update group; default: its URL)."""
        if self.engine_update in ("push", "stage"):
            return self._from_agent(client, ref, server)
        receiver = f"engine:{self.cell}"
        t0 = time.perf_counter()
        try:
            if self.engine_update == "pull":
                parts = client.update_weights_from_transfer_engine(self._handle(ref), ref.version,
                                                                   model_path=ref.path)
                for p in parts:  # one per sending rank
                    self._record(dataclasses.replace(p, receiver=receiver), asked=ref.version)
                r = parts[0]
                return ref if r.version == ref.version else WeightsRef(version=r.version, path=r.source or ref.path)
            client.update_weights_from_disk(ref.path, ref.version)
            self._record(TransferReport("file", ref.version, folder_bytes(Path(ref.path)),
                                        time.perf_counter() - t0, receiver))
            return ref
        except Exception as e:
            transport = "mooncake" if self.engine_update == "pull" else "file"
            self._record(TransferReport(transport, ref.version, 0, time.perf_counter() - t0, receiver, ok=False,
                                        error=f"{type(e).__name__}: {e}"))
            raise

    def _from_agent(self, client, ref: WeightsRef, server: object) -> WeightsRef:
        """push or stage: this agent pulls the version (or a newer one) and hands it to its engine."""
        try:
            handle = self._handle(ref)
        except GyreError as e:
            self._record(TransferReport("mooncake", ref.version, 0, 0.0, f"agent:{self.cell}", ok=False, error=str(e)))
            raise
        record = functools.partial(self._record, asked=ref.version)
        if self.engine_update == "stage":
            if self._stager is None:
                from gyre_slurm.agent.engine_stage import EngineStager

                self._stager = EngineStager(self._agent, self.cell, self._stage_root)
            return self._stager.update(client, ref, handle, server, record)
        if self._pusher is None:
            from gyre_slurm.agent.engine_push import EnginePusher

            self._pusher = EnginePusher(self._agent, self.cell, self.host, self._bind_host,
                                        bucket_bytes=self.w.bucket_mb << 20, engine_ranks=self._engine_ranks,
                                        sglang=self._sglang, gpu=self._push_gpu)
        return self._pusher.update(client, ref, handle, server, record)

    def close(self) -> None:
        """Destroy the push path's weight-update group (on the engine too) and free its staging memory; remove
        the stage path's folders."""
        if self._pusher is not None:
            self._pusher.close()
            self._pusher = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def satellite_pull(self, ref: WeightsRef,
                       hosts: list[str] | None = None) -> Callable[[GSPOTrainer], TransferReport]:
        """What a satellite loads the step's weights into its trainer with: exactly the step's version_in (its
        gradients are added to the core's at that version), so a replaced version fails the shard (handed back to
        the queue), never a newer one. A model-parallel trainer's ranks each pull their own cut (`hosts`: each
        rank's address); another trainer the whole version."""
        receiver = f"satellite:{self.cell}"
        parts = self._handle(ref) if self.mooncake else None

        def pull(trainer: GSPOTrainer) -> TransferReport:
            t0 = time.perf_counter()
            try:
                if parts is None:
                    trainer.load_weights(Path(ref.path))
                    reports = [TransferReport("file", ref.version, folder_bytes(Path(ref.path)),
                                              time.perf_counter() - t0, receiver)]
                elif hasattr(trainer, "load_parts"):  # every rank its own cut; an error comes back, not raised
                    reports, why = trainer.load_parts(parts, self.rank_link(hosts or [self.host]), receiver)
                    if why is not None:
                        raise GyreError(f"weights version {ref.version}: {why}")
                else:
                    from gyre_slurm.transfer.weight_parts import pull_full
                    from gyre_slurm.transfer.weights import WeightPuller, load_into

                    if self._puller is None:
                        self._puller = WeightPuller(self._agent(), receiver)
                    got = pull_full(self._puller, parts)
                    load_into(trainer.model, got.tensors)
                    reports = got.reports
            except Exception as e:
                self._record(TransferReport(self.w.transport, ref.version, 0, time.perf_counter() - t0, receiver,
                                            ok=False, error=f"{type(e).__name__}: {e}"))
                raise
            for r in reports:
                self._record(r)
            return TransferReport(reports[0].transport, ref.version, sum(r.nbytes for r in reports),
                                  time.perf_counter() - t0, receiver)

        return pull

    # --- reports --------------------------------------------------------------------------------------------------
    def _record(self, r: TransferReport, asked: int | None = None) -> None:
        """Keep a receive for the ledger; `asked`: the version the receiver was sent (noted when it got a newer)."""
        t = Transfer(transport=r.transport, version=r.version, nbytes=r.nbytes, seconds=max(r.seconds, 0.0),
                     receiver=r.receiver, ok=r.ok, error=(r.error or None) and r.error[:2000],
                     asked=asked if asked is not None and r.ok and r.version > asked else None,
                     sender_rank=r.sender_rank)
        with self._lock:
            self._done.append(t)

    def drain(self) -> list[Transfer]:
        with self._lock:
            out, self._done = self._done, []
        return out
