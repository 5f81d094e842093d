"""What a node runs in each role. A role switch is `leave(old)` then `enter(new, weights)` on its backend.

- ControlPlaneBackend: holds nothing (cluster.engine = none): the cell only reports its role.
- CellBackend: ROLLOUT serves an SGLang-compatible engine (the embedded torch engine or SGLang, started by the
  launcher of engine_launch.py; it stays up across switches, its memory released while the cell trains, with
  SGLang's memory saver or the embedded engine's equivalent); TRAIN on the core cell
  holds the trainer, whose weights and optimizer state live on across steps; a satellite builds a trainer the first
  time its switch to TRAIN is reported (`prepare`, so the switch stays quick and a step it joins starts at once).
  Both keep their trainer (a multi-rank cell: its processes and process group, train/rank_group.py) across role
  switches: on a CUDA cell it gives its GPU memory back while the cell serves rollouts (`_free_gpu`) and takes it
  again when the cell trains; on the CPU nothing needs to move. A rank group that lost a rank is closed and built
  again. The step loops are in step_jobs.py.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from gyre_slurm.agent.engine_launch import launcher_for
from gyre_slurm.agent.train_link import TrainLink
from gyre_slurm.agent.weight_link import WeightLink
from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import JoinStep, TrainDone, TrainStep, Transfer, WeightsRef
from gyre_slurm.roles import Role

log = logging.getLogger("gyre.agent")


class RoleBackend(Protocol):
    engine_url: str | None

    def enter(self, role: Role, weights: WeightsRef | None) -> None: ...

    def leave(self, role: Role) -> None: ...

    def prepare(self, role: Role) -> None: ...

    def load_weights(self, weights: WeightsRef) -> None: ...

    def train(self, msg: TrainStep, link: TrainLink) -> TrainDone: ...

    def join(self, msg: JoinStep, link: TrainLink) -> int: ...

    def close(self) -> None: ...

    def drain_transfers(self) -> list[Transfer]: ...


class ControlPlaneBackend:
    """Holds no engine or trainer; keeps the history of roles so a node can say what it did and when."""

    engine_url = None

    def __init__(self) -> None:
        self.history: list[tuple[float, str, Role]] = []

    def enter(self, role: Role, weights: WeightsRef | None = None) -> None:
        self.history.append((time.time(), "enter", role))

    def leave(self, role: Role) -> None:
        self.history.append((time.time(), "leave", role))

    def prepare(self, role: Role) -> None:
        pass

    def load_weights(self, weights: WeightsRef) -> None:
        pass

    def train(self, msg: TrainStep, link: TrainLink) -> TrainDone:
        return TrainDone(step=msg.step, ok=False, error="this cell holds no trainer (cluster.engine is none)",
                         attempt=msg.attempt)

    def join(self, msg: JoinStep, link: TrainLink) -> int:
        return 0

    def close(self) -> None:
        pass

    def drain_transfers(self) -> list[Transfer]:
        return []


class CellBackend:
    def __init__(self, cfg: RunConfig, run_dir: Path, node_index: int) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.node_index = node_index
        npc = cfg.cluster.nodes_per_cell
        self.lead = node_index % npc == 0  # the cell's first node serves its engine / holds its trainer
        self.cell = node_index // npc
        self.core = self.cell == cfg.cluster.core_cell
        self.launcher = launcher_for(cfg, run_dir, node_index)  # embedded or SGLang (cluster.engine)
        self.engine: subprocess.Popen | None = None
        self.engine_url: str | None = None  # None on a node that serves no HTTP
        self.serving: int | None = None  # weight version the engine serves
        self.serving_ref: WeightsRef | None = None  # and where it came from (an engine started again loads it)
        self.released = False  # the engine's weights and KV cache left memory when the cell left ROLLOUT
        self.stale = False  # resumed, but its weights are not yet the version it is to serve (see _serve)
        self.trainer = None  # the core's, with its optimizer state
        self.trainer_source: Path | None = None  # weights a fresh trainer starts from
        self.satellite = None  # a satellite's SatelliteStep, from its first TRAIN on
        self.on_host: set[int] = set()  # id() of the trainers whose GPU memory went to the engine (_free_gpu)
        self.weights = WeightLink(cfg, self.cell)  # how versions are published (core) and received

    # --- rollout engine -------------------------------------------------------------------------------------
    def _client(self):
        from gyre_slurm.engines.client import EngineClient

        assert self.engine_url is not None
        return EngineClient(self.engine_url)

    def _engine_up(self) -> bool:
        return self.engine is not None and self.engine.poll() is None

    def _start_engine(self, weights: WeightsRef) -> None:
        if self.engine is not None:
            self.launcher.stop(self.engine)
        self.engine = self.engine_url = None
        started = self.launcher.start(weights)
        self.engine, self.engine_url = started.proc, started.url
        self.serving, self.serving_ref, self.released, self.stale = weights.version, weights, False, False

    def revive_engine(self) -> None:
        """The engine is gone (hung and killed, or dead): start it again at the version it served, its memory
        released again if the cell is not serving (it resumes at the next ROLLOUT, as before)."""
        if self.serving_ref is None:
            raise GyreError("no version to serve is known yet")
        released = self.released
        self._start_engine(self.serving_ref)
        if released:
            self._client().release_memory()
            self.released = True

    def _update_engine(self, client, weights: WeightsRef) -> None:
        """Load `weights` into the engine: what it serves then is that version, or a newer one where `weights` was
        replaced before the engine read it (a cell slow to come back), and that one is what the cell reports."""
        served = self.weights.update_engine(client, weights, server=self.engine)  # raises: the engine keeps its own
        if served.version != weights.version:
            log.info("version %d was replaced before this cell read it: it serves version %d", weights.version,
                     served.version)
        self.serving, self.serving_ref = served.version, served

    def _serve(self, weights: WeightsRef | None) -> None:
        if weights is None:
            raise GyreError("a cell entering ROLLOUT needs the weights to serve")
        if not self._engine_up() or not (self.lead or self.launcher.current()):
            self._start_engine(weights)
            return
        if not self.lead:
            return  # another node of an SGLang cell: the first node's server drives this one
        client = self._client()
        if self.released:
            # Generation stays paused (since the release) until the version to serve is in: a call admitted in
            # between would be served by what the resume brought back (the folder the engine last loaded from disk;
            # on SGLang without CPU backup, no weights at all). A pushed version is in no such folder: pushed again.
            client.resume_memory(continue_generation=False)
            self.released, self.stale = False, self.launcher.resume_reloads or self.weights.pushes
        if self.stale or weights.version != self.serving:
            self._update_engine(client, weights)  # raises: the engine stays paused
            self.stale = False
        client.continue_generation()

    def enter(self, role: Role, weights: WeightsRef | None) -> None:
        if weights is not None and self.trainer is None:
            self.trainer_source = Path(weights.path)
        if role == Role.ROLLOUT and self.launcher.runs_here:
            self._free_gpu()
            self._serve(weights)
        if not self.lead:
            return
        if role == Role.TRAIN and self.core:
            if _broken(self.trainer):
                self._mend_core()  # built again from its version
            elif self.trainer is not None:
                self._to_gpu(self.trainer)
            if self.trainer is None:
                if self.trainer_source is None:
                    raise GyreError("the core cell has no weights to train from yet")
                self.trainer = self._new_trainer(self.trainer_source, core=True)

    def _new_trainer(self, src: Path, core: bool = False):
        """This cell's trainer from src: one process, or a multi-rank cell's rank group led from here. The core
        takes up the optimizer state saved with its version (a core killed with -9 resumes exactly)."""
        from gyre_slurm.launch.ranks import cell_ranks, follower_nodes, ranks_per_node

        world = cell_ranks(self.cfg.train)
        if world > 1:
            from gyre_slurm.train.rank_group import RankGroup

            nodes = follower_nodes(self.cfg, self.cell, os.environ)
            # the rendezvous: this node as the others reach it (here: any address of this machine)
            host = self.cfg.control.advertised() if any(nodes) else "127.0.0.1"
            trainer = RankGroup(src, self.cfg.train, seed=self.cfg.run.seed, resume_optimizer=core, world=world,
                                log_dir=self.run_dir / "logs" / f"cell{self.cell}-ranks", nodes=nodes, host=host,
                                per_node=ranks_per_node(self.cfg))
        else:
            from gyre_slurm.bootstrap.base_model import base_model_path
            from gyre_slurm.train.backends import make_trainer

            ref = base_model_path(self.cfg) if self.cfg.train.kl_coef > 0 else None
            trainer = make_trainer(src, self.cfg.train, seed=self.cfg.run.seed, resume_optimizer=core,
                                   reference_dir=ref)
        log.info("%s trainer (%d rank%s) loaded from %s", self.cfg.train.backend, world, "s" * (world > 1), src)
        return trainer

    @staticmethod
    def _drop(trainer) -> None:
        """A trainer leaves memory; a rank group stops its followers and ends its world."""
        if trainer is not None and hasattr(trainer, "close"):
            trainer.close()

    def _free_gpu(self) -> None:
        """Before the engine starts or resumes on a CUDA cell: the trainers (the core's, a satellite's) give their
        GPU memory back, then the allocator's cache goes back to the driver. SGLang's resume maps its weights and KV
        cache back at the sizes it allocated at start (managers/scheduler_components/weight_updater.py
        resume_memory_occupation), which a trainer held on the GPU would leave it short of. A trainer keeps its
        processes, process group, weights and optimizer state: every rank moves its tensors to host memory
        (rank_group.release_memory) and takes them back when the cell next trains (_to_gpu), so a switch neither
        starts processes nor reloads a version. A rank group that lost a rank is closed instead (built again when
        needed). On the CPU nothing moves: no GPU share to give back."""
        torch = sys.modules.get("torch")  # never imported: nothing of ours can be on a GPU
        if torch is None or not torch.cuda.is_available():  # the trainer runs on CUDA wherever there is one
            return
        from gyre_slurm.train.rank_group import memory_call

        for who, trainer in (("core", self.trainer), ("satellite", self.satellite and self.satellite.trainer)):
            if trainer is None or id(trainer) in self.on_host:
                continue
            if _broken(trainer):
                self._drop_trainer(trainer)
                continue
            t0 = time.perf_counter()
            try:
                moves = memory_call(trainer, "release_memory") or []
            except Exception:
                log.exception("the %s trainer could not release its GPU memory: closed (built again when needed)",
                              who)
                self._drop_trainer(trainer)
                continue
            self.on_host.add(id(trainer))
            log.info("the %s trainer gave its GPU memory to the engine: %.1f MiB from %d rank(s) in %.3f s", who,
                     sum(m.nbytes for m in moves) / 2**20, len(moves), time.perf_counter() - t0)
        gc.collect()  # what the trainers let go of is freed now, not whenever the collector next runs
        torch.cuda.empty_cache()

    def _to_gpu(self, trainer) -> None:
        """A trainer that gave its GPU memory to the engine takes it back (the cell trains again)."""
        if id(trainer) not in self.on_host:
            return
        from gyre_slurm.train.rank_group import memory_call

        t0 = time.perf_counter()
        moves = memory_call(trainer, "reclaim_memory") or []
        self.on_host.discard(id(trainer))
        log.info("trainer back on the GPU: %.1f MiB on %d rank(s) in %.3f s", sum(m.nbytes for m in moves) / 2**20,
                 len(moves), time.perf_counter() - t0)

    def _drop_trainer(self, trainer) -> None:
        """Close a trainer that cannot go on (a rank group that lost a rank); the next TRAIN builds it again."""
        self.on_host.discard(id(trainer))
        self._drop(trainer)
        if trainer is self.trainer:
            self.trainer = None
        if self.satellite is not None and trainer is self.satellite.trainer:
            self.satellite = None

    def _drop_satellite(self) -> None:
        if self.satellite is not None:
            self.on_host.discard(id(self.satellite.trainer))
            self._drop(self.satellite.trainer)
        self.satellite = None

    def _satellite_ready(self) -> bool:
        """The satellite's trainer can take a step: a group that lost a rank is closed (its shards go to a new
        one), one whose memory went to the engine takes it back. False when there is none."""
        if self.satellite is not None and _broken(self.satellite.trainer):
            log.warning("the satellite's rank group lost a rank or failed a call: built again")
            self._drop_satellite()
        if self.satellite is None:
            return False
        self._to_gpu(self.satellite.trainer)
        return True

    def _mend_core(self) -> None:
        """Build the core's trainer again from the last version when its rank group lost a rank."""
        if _broken(self.trainer):
            log.warning("the core's rank group lost a rank or failed a call: starting its ranks again from %s "
                        "(with their optimizer state)", self.trainer_source)
            self._drop_trainer(self.trainer)
            assert self.trainer_source is not None
            self.trainer = self._new_trainer(self.trainer_source, core=True)

    def load_weights(self, weights: WeightsRef) -> None:
        """A new version while serving: calls in flight finish on the old weights (the engine's writer lock)."""
        if self.lead and self._engine_up() and weights.version != self.serving:
            self._update_engine(self._client(), weights)

    def leave(self, role: Role) -> None:
        if self.lead and role == Role.ROLLOUT and self._engine_up():
            # the engine stays up; weights and KV cache leave memory. The calls in flight are answered (the embedded
            # engine: with their KV exported, so that the proxy continues them elsewhere without computing their
            # prefill again; an SGLang server exports nothing and they are prefilled where they continue).
            self._client().release_memory(abort_first=True, export_kv=self.launcher.kv_export)
            self.released = True
        if role == Role.TRAIN and self.satellite is not None and _broken(self.satellite.trainer):
            self._drop_satellite()  # a group that lost a rank goes now; a healthy one stays for the next TRAIN

    def train(self, msg: TrainStep, link: TrainLink) -> TrainDone:
        """The core's step: shards with satellites (step_jobs.core_step), or the whole batch here (no shards:
        train.minibatches > 1)."""
        from gyre_slurm.agent.step_jobs import core_step
        from gyre_slurm.train.batch import read_batch
        from gyre_slurm.train.grad_channel import GradReceiver

        if self.trainer is None:
            return TrainDone(step=msg.step, ok=False, error="this node holds no trainer (not the core cell in TRAIN)",
                             attempt=msg.attempt)
        self._mend_core()
        hosts = self._rank_hosts()
        if msg.sharded:
            # the version the step starts from, as satellites will pull it (the file transport: its folder)
            weights_in = self.weights.publish(msg.version_in, self.trainer, self.trainer_source, hosts)
            if hasattr(self.trainer, "open_grads"):  # every rank its own receiver (train/rank_grads.py)
                endpoints = self.trainer.open_grads(link.token, msg.step, self.weights.grad_link(hosts))
                receiver, close = self.trainer.grad_inbox, self.trainer.close_grads
            else:
                host = self.cfg.control.bind_host
                max_bytes = 4 * sum(math.prod(s) for s in self.trainer.grad_shapes().values())  # fp32 gradients
                receiver = GradReceiver(link.token, host, advertise_host=self.cfg.control.reachable(host),
                                        agent=self.weights.grad_agent(), max_bytes=max_bytes)
                endpoints, close = [receiver.endpoint], receiver.close
            try:
                done = core_step(self.trainer, msg, link, self.cell, receiver, weights_in, endpoints)
            finally:
                close()
        else:
            t0 = time.time()
            metrics = self.trainer.train_step(read_batch(Path(msg.batch_path)))
            out = self.trainer.save(Path(msg.out_dir))
            metrics["seconds"] = time.time() - t0
            done = TrainDone(step=msg.step, ok=True, weights=WeightsRef(version=msg.version_in + 1, path=str(out)),
                             metrics={k: float(v) for k, v in metrics.items()}, attempt=msg.attempt)
        assert done.weights is not None
        t0 = time.perf_counter()
        ref = self.weights.publish(done.weights.version, self.trainer, Path(done.weights.path), hosts)
        self.trainer_source = Path(done.weights.path)
        return done.model_copy(update={"weights": ref,
                                       "metrics": {**done.metrics, "publish_s": time.perf_counter() - t0}})

    def join(self, msg: JoinStep, link: TrainLink) -> int:
        """A satellite's part in the step (step_jobs.satellite_step); its trainer is built the first time."""
        from gyre_slurm.agent.step_jobs import satellite_step
        from gyre_slurm.train.step_runner import SatelliteStep

        if not self.lead or self.core:
            return 0
        if not self._satellite_ready():  # not prepared: built before it takes a shard, nobody waits while it loads
            self.satellite = SatelliteStep(self._new_trainer(Path(msg.weights.path)), name=str(self.cell))
        hosts = self._rank_hosts()
        return satellite_step(self.satellite, msg, link, self.cell, self.weights.satellite_pull(msg.weights, hosts),
                              self.weights.grad_agent(), self.weights.grad_link(hosts))

    def _rank_hosts(self) -> list[str]:
        """Each rank's address for the Transfer Engine and gradient receivers, by rank: this node's as peers reach
        it for the ranks here, the Slurm node's name for a rank on another of the cell's nodes."""
        from gyre_slurm.launch.ranks import follower_nodes

        here = self.weights.host
        local = here in ("127.0.0.1", "localhost")  # a one-machine run: every rank is reached on loopback
        return [here] + [here if n is None or local else n for n in follower_nodes(self.cfg, self.cell, os.environ)]

    def prepare(self, role: Role) -> None:
        """After a switch into TRAIN: a satellite builds its trainer now (the first time), or takes its GPU memory
        back, rather than when a step asks it to join."""
        from gyre_slurm.train.step_runner import SatelliteStep

        if role == Role.TRAIN and self.lead and not self.core and not self._satellite_ready() \
                and self.trainer_source is not None and self.cfg.train.satellites:
            self.satellite = SatelliteStep(self._new_trainer(self.trainer_source), name=str(self.cell))

    def drain_transfers(self) -> list[Transfer]:
        return self.weights.drain()

    def close(self) -> None:
        self._drop_satellite()
        self._drop(self.trainer)
        self.weights.close()  # the push path's weight-update group, on the engine too
        if self.engine is not None:
            self.launcher.stop(self.engine)


def _broken(trainer) -> bool:
    """A trainer that cannot take another call: a rank group that lost a rank or failed a call (a one-process
    trainer has no `healthy` and never is)."""
    return trainer is not None and not getattr(trainer, "healthy", True)


def backend_for(cfg: RunConfig, run_dir: Path, node_index: int) -> RoleBackend:
    """What a node of the run (its saved config, run_context.py) does in its roles."""
    if cfg.cluster.engine == "none":
        return ControlPlaneBackend()
    return CellBackend(cfg, run_dir, node_index)
