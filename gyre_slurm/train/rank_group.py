"""A model-parallel cell's trainer ranks, driven from the node agent (SPMD).

Rank 0, the leader, lives in the agent's own process and is the trainer the step runners see (what the other ranks
return from a call stays with them: the leader's call gathers what it needs, e.g. a version's parts; a call a
follower may fail without the group being lost returns its error instead of raising: load_parts, send_grads). Ranks
1…n-1 are `gyre trainer-rank` processes started by the leader: on its own node as child processes, on the cell's
other nodes as Slurm steps of the same job (`srun --overlap -w NODE`, which carries their stdin there). Every
trainer call in CALLS is announced to the followers (its name, one line on each follower's stdin) and its arguments
broadcast over the cell's torch.distributed world before the leader runs it, so that every rank makes the same calls
in the same order and meets the others in the same collectives (train/megatron_parallel.py).

Why a pipe for the announcement: between steps a follower waits as long as the rollouts take, and a gloo collective
would time out; a collective with a dead peer, on the other hand, fails within train.rank_timeout_s. A follower
exits when its stdin closes (the group closing, or the agent gone, even by kill -9). A group that lost a rank or
failed a call mid-way is `broken`: the agent closes it and builds a new one from the last saved version (the core
takes up its per-rank optimizer state), as after a restart.

A healthy group lives as long as its cell's agent, across role switches: when the cell serves rollouts its ranks
stay up, idle on their pipes, and on CUDA give their GPU memory back to the engine (`release_memory`: every tensor
the trainer holds on the GPU moves to host memory, the same tensor objects, so the optimizer and the hooks stay as
they are; then torch's cache goes back to the driver) and take it again when the cell trains (`reclaim_memory`).
Both are announced like the trainer's calls, and each returns every rank's account to the leader (a gather), so
every rank is known to have done it. On the CPU nothing needs to move.
"""

from __future__ import annotations

import gc
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
from torch import Tensor

from gyre_slurm.config import TrainSection
from gyre_slurm.errors import GyreError, TrainerRanksLost
from gyre_slurm.spawn import free_port, gyre_argv, spawn

log = logging.getLogger("gyre.ranks")

# the trainer interface the step runners call (train/gspo_trainer.py); everything else is read on the leader only
CALLS = frozenset({"train_step", "forward_backward", "proximal_logprobs", "export_grads", "add_grads", "zero_grad",
                   "scale_grads", "optimizer_step", "load_weights", "save",
                   # versions and gradients slice by slice, every rank from its own process (train/slice_parts.py,
                   # train/rank_grads.py): the token and Transfer Engine settings travel in the call's arguments
                   "publish", "load_parts", "open_grads", "take_grads", "send_grads", "close_grads",
                   # the cell serves rollouts / trains again: GPU memory to the engine and back (module functions)
                   "release_memory", "reclaim_memory"})


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
        if name in MEMORY_CALLS:
            return lambda: self._call(name, (), {})
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
            return run_call(self.trainer, name, args, kwargs)
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
        if "trainer" in self.__dict__:  # the leader's version slots and gradient sockets (train/slice_parts.py)
            self.trainer.close()
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
        run_call(trainer, name, args, kwargs)
        calls += 1
    print(f"trainer rank {rank}: {calls} calls, stdin closed: leaving", flush=True)
    teardown_parallel()


# --- GPU memory while the cell serves rollouts ------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryMove:
    """What one rank's release_memory or reclaim_memory moved: bytes of tensors (0 on the CPU)."""

    rank: int
    device: str
    nbytes: int


RELEASED = "_gyre_released"  # on the trainer: the tensors release_memory moved, with the device each came from


def held_tensors(trainer) -> list[Tensor]:
    """Every tensor a trainer holds, each once: its modules' parameters and buffers, its tensors kept in lists and
    dicts (Megatron's fp32 masters, its parameter lists) and its optimizers' state."""
    seen: set[int] = set()
    out: list[Tensor] = []

    def add(values) -> None:
        for t in values:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)

    for v in vars(trainer).values():
        if isinstance(v, torch.nn.Module):
            add(v.parameters())
            add(v.buffers())
        elif isinstance(v, torch.optim.Optimizer):
            add(p for g in v.param_groups for p in g["params"])
            add(x for st in v.state.values() for x in st.values())
        elif isinstance(v, dict):
            add(v.values())
        elif isinstance(v, list | tuple):
            add(v)
    return out


def _move(t: Tensor, device: torch.device | str) -> int:
    """t's data (and its gradient's) to `device`, in place: the tensor object stays (as torch's Module._apply)."""
    with torch.no_grad():
        t.data = t.data.to(device)
        if t.grad is not None:
            t.grad.data = t.grad.data.to(device)
    return t.numel() * t.element_size() + (t.grad.numel() * t.grad.element_size() if t.grad is not None else 0)


def _accounts(trainer, move: MemoryMove) -> list[MemoryMove] | None:
    """Every rank's account on the leader (a collective in a rank group), None on the others."""
    par = getattr(trainer, "par", None)
    return par.gather_to_leader(move) if par is not None and par.world > 1 else [move]


def release_memory(trainer) -> list[MemoryMove] | None:
    """This rank's trainer gives its GPU memory back: every CUDA tensor it holds moves to host memory, then torch's
    cache goes back to the driver. Nothing moves on the CPU. A view stays (moved apart from its base it would no
    longer share its memory); what no list, dict, module or optimizer of the trainer holds stays too."""
    moved = [(t, t.device) for t in held_tensors(trainer) if t.device.type == "cuda" and t._base is None]
    nbytes = sum(_move(t, "cpu") for t, _ in moved)
    setattr(trainer, RELEASED, [*getattr(trainer, RELEASED, []), *moved])
    if moved:
        gc.collect()
        torch.cuda.empty_cache()
    rank = getattr(getattr(trainer, "par", None), "rank", 0)
    return _accounts(trainer, MemoryMove(rank, str(getattr(trainer, "device", "cpu")), nbytes))


def reclaim_memory(trainer) -> list[MemoryMove] | None:
    """What release_memory moved goes back to the device it came from."""
    moved = getattr(trainer, RELEASED, [])
    nbytes = sum(_move(t, device) for t, device in moved)
    setattr(trainer, RELEASED, [])
    rank = getattr(getattr(trainer, "par", None), "rank", 0)
    return _accounts(trainer, MemoryMove(rank, str(getattr(trainer, "device", "cpu")), nbytes))


MEMORY_CALLS = {"release_memory": release_memory, "reclaim_memory": reclaim_memory}


def run_call(trainer, name: str, args: tuple, kwargs: dict):
    """One announced call on this rank: a trainer method, or one of the memory calls above."""
    if name in MEMORY_CALLS:
        return MEMORY_CALLS[name](trainer, *args, **kwargs)
    return getattr(trainer, name)(*args, **kwargs)


def memory_call(trainer, name: str) -> list[MemoryMove] | None:
    """release_memory / reclaim_memory on a trainer of this process or on every rank of a group."""
    return getattr(trainer, name)() if isinstance(trainer, RankGroup) else MEMORY_CALLS[name](trainer)
