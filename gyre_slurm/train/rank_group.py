"""A model-parallel cell's trainer ranks, driven from the node agent (SPMD).

Rank 0, the leader, lives in the agent's own process and is the trainer the step runners see (its Hugging Face
mirror is what the weight transport publishes and a satellite's pull writes). Ranks 1…n-1 are `gyre trainer-rank`
processes started by the leader: on its own node as child processes, on the cell's other nodes as Slurm steps of
the same job (`srun --overlap -w NODE`, which carries their stdin there). Every trainer call in CALLS is announced
to the followers (its name, one line on each follower's stdin) and its arguments broadcast over the cell's
torch.distributed world before the leader runs it, so that every rank makes the same calls in the same order and
meets the others in the same collectives (train/megatron_parallel.py).

Why a pipe for the announcement: between steps a follower waits as long as the rollouts take, and a gloo collective
would time out; a collective with a dead peer, on the other hand, fails within train.rank_timeout_s. A follower
exits when its stdin closes (the group closing, or the agent gone, even by kill -9). A group that lost a rank or
failed a call mid-way is `broken`: the agent closes it and builds a new one from the last saved version (the core
takes up its per-rank optimizer state), as after a restart.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gyre_slurm.config import TrainSection
from gyre_slurm.errors import GyreError, TrainerRanksLost
from gyre_slurm.spawn import free_port, gyre_argv, spawn

log = logging.getLogger("gyre.ranks")

# the trainer interface the step runners call (train/gspo_trainer.py); everything else is read on the leader only
CALLS = frozenset({"train_step", "forward_backward", "proximal_logprobs", "export_grads", "add_grads", "zero_grad",
                   "scale_grads", "optimizer_step", "load_weights", "save"})


@dataclass(frozen=True)
class RankSpec:
    """What every rank of one group builds its trainer from (a JSON file beside the agent's log)."""

    model_dir: str
    train: dict
    seed: int
    resume_optimizer: bool
    host: str
    port: int
    world: int
    timeout_s: float
    device: str | None = None
    per_node: int = 0  # ranks on each node (rank r uses GPU r mod per_node); 0: all on one node

    def build(self, rank: int):
        """This rank's trainer; returns when every rank of the world has joined."""
        from gyre_slurm.train.backends import make_trainer
        from gyre_slurm.train.megatron_parallel import Rendezvous, bind_cuda_device

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda":  # one GPU per rank of a node, current before the trainer allocates anything
            device = bind_cuda_device(f"cuda:{rank % self.per_node if self.per_node else rank}")
        rendezvous = Rendezvous(self.host, self.port, rank, self.world, self.timeout_s)
        return make_trainer(Path(self.model_dir), TrainSection.model_validate(self.train), seed=self.seed,
                            device=device, resume_optimizer=self.resume_optimizer, rendezvous=rendezvous)


class RankGroup:
    """The leader's side: starts the followers, builds rank 0's trainer, forwards CALLS. Use it as the trainer."""

    def __init__(self, model_dir: Path, train: TrainSection, *, seed: int, resume_optimizer: bool, log_dir: Path,
                 world: int, device: str | None = None, host: str = "127.0.0.1",
                 nodes: list[str | None] | None = None, per_node: int = 0) -> None:
        """nodes: where ranks 1…n-1 run (None: on this node; a Slurm node name: started there with srun); host:
        this node's address as those nodes reach it (the rendezvous)."""
        self.world, self.broken = world, False
        nodes = nodes if nodes is not None else [None] * (world - 1)
        spec = RankSpec(str(model_dir), train.model_dump(mode="json"), seed, resume_optimizer, host,
                        free_port(host), world, train.rank_timeout_s, device, per_node)
        log_dir.mkdir(parents=True, exist_ok=True)
        spec_file = log_dir / f"ranks-{os.getpid()}-{spec.port}.json"  # on the run folder every node sees
        spec_file.write_text(json.dumps(asdict(spec)))
        self.logs = [log_dir / f"rank{r}-{spec.port}.log" for r in range(1, world)]
        self.procs = [self._start(spec_file, r, log, node)
                      for r, log, node in zip(range(1, world), self.logs, nodes, strict=True)]
        try:
            self.trainer = spec.build(0)
        except BaseException:
            self._stop()
            raise
        log.info("rank group of %d ranks up (followers %s)", world, [p.pid for p in self.procs])

    @staticmethod
    def _start(spec_file: Path, rank: int, log_file: Path, node: str | None) -> subprocess.Popen:
        argv = gyre_argv("trainer-rank", str(spec_file), "--rank", str(rank))
        if node is None:  # a process of this node: it also ends when this one is gone
            argv += ["--parent-pid", str(os.getpid())]
        else:  # a step of this job on another of the cell's nodes; srun carries the pipe (and its EOF) there
            argv = ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--kill-on-bad-exit=1",
                    "--quiet", *argv]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # started from a short-lived job thread: --parent-pid, not die_with_parent, ties a local follower to us
        return spawn(argv, log_file, env=env, die_with_parent=False, stdin_pipe=True)

    def __getattr__(self, name: str):
        if name == "trainer":  # not built (yet): never recurse
            raise AttributeError(name)
        value = getattr(self.trainer, name)
        if name not in CALLS:
            return value

        def forwarded(*args, **kwargs):
            return self._call(name, args, kwargs)

        return forwarded

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [r for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    @property
    def healthy(self) -> bool:
        """Every rank is up and no call failed: the group can take the next call."""
        return not self.broken and not self.dead()

    def _wait_dead(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while not self.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.dead())

    def _gone(self) -> str:
        r = self.dead()[0]
        return f"trainer rank {r} of this cell exited (code {self.procs[r - 1].returncode}); see {self.logs[r - 1]}"

    def _call(self, name: str, args: tuple, kwargs: dict):
        if self.dead():
            self.broken = True
            raise TrainerRanksLost(self._gone())
        if self.broken:
            raise GyreError("this cell's rank group failed a call before: it is closed and started again")
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(name.encode() + b"\n")
                p.stdin.flush()
            self.trainer.par.broadcast((args, kwargs))
            return getattr(self.trainer, name)(*args, **kwargs)
        except BaseException as e:
            self.broken = True  # the ranks may have left the call at different points: no further call is safe
            if self._wait_dead(2.0):  # a peer's death fails the collective before its exit is reaped
                raise TrainerRanksLost(f"{name}: {self._gone()}") from None
            raise GyreError(f"{name} failed on the cell's leader: {type(e).__name__}: {e}") from e

    def _stop(self, wait_s: float = 10.0) -> None:
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()  # EOF: the follower leaves its loop and exits
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        """Stop the followers and end this process's world (a new group may start after)."""
        from gyre_slurm.train.megatron_parallel import teardown_parallel

        self._stop(wait_s=2.0 if self.broken else 30.0)
        teardown_parallel()


def follow(spec_file: Path, rank: int) -> None:
    """A follower rank: build the trainer, then run each announced call with the leader's arguments until stdin
    closes. Any error ends the process (its peers' collectives fail and the agent rebuilds the group)."""
    from gyre_slurm.train.megatron_parallel import teardown_parallel

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = RankSpec(**json.loads(Path(spec_file).read_text()))
    where = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(f"trainer rank {rank} of {spec.world} on {where} (pid {os.getpid()}), leader at {spec.host}:{spec.port}",
          flush=True)
    trainer = spec.build(rank)
    calls = 0
    for line in sys.stdin.buffer:
        name = line.decode().strip()
        if name not in CALLS:
            raise GyreError(f"rank {rank}: the leader announced {name!r}, not a trainer call")
        args, kwargs = trainer.par.broadcast(None)
        getattr(trainer, name)(*args, **kwargs)
        calls += 1
    print(f"trainer rank {rank}: {calls} calls, stdin closed: leaving", flush=True)
    teardown_parallel()
