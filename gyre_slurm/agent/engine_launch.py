"""How a cell's rollout engine starts and stops (cluster.engine): the one choice between the embedded engine and
SGLang. CellBackend asks its launcher for a running engine and drives it through EngineClient either way.

- EmbeddedLauncher: `gyre engine` on the cell's first node; it picks its port and names its URL in a ready file.
- SGLangLauncher: `python -m sglang.launch_server` (engines/sglang.py) on *every* node of the cell, with
  SGLANG_RETURN_ORIGINAL_LOGPROB=1. The first node (node rank 0) serves HTTP on sglang.port (0: a free port
  picked here); a cell of several nodes passes --nnodes/--node-rank/--dist-init-addr, and the first node
  publishes that address (a free port on it unless sglang.dist_port) in the run folder for the others
  (engines/cell<C>-sglang.json, written before its server starts). The server is started from a thread that lives
  as long as the agent, with the parent-death signal, in a process group of its own: stopping it (or the agent's
  death) stops SGLang's scheduler and detokenizer processes too.

Either way the agent waits for GET /health_generate (the engine has generated a token), or for the process to
exit, which fails the start at once with its log named.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.beacon import beacon_env
from gyre_slurm.config import RunConfig
from gyre_slurm.engines.client import EngineClient
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import WeightsRef
from gyre_slurm.spawn import free_port, gyre_argv, read_ready_file, spawn, wait_until, write_ready_file
from gyre_slurm.spawn import stop as stop_processes

log = logging.getLogger("gyre.agent")


@dataclass
class Engine:
    """A started engine process; url is None on a cell's other nodes (they serve no HTTP)."""

    proc: subprocess.Popen
    url: str | None
    weight_version: int


class EngineLauncher:
    """Start, wait for and stop one node's engine process. Subclasses say what to run (`_command`) and where it
    answers once up (`_locate`)."""

    what = "the rollout engine"
    kv_export = True  # gyre's export_kv on pause/abort (the embedded engine's; an SGLang server has none)
    resume_reloads = False  # after a memory release the weights must be loaded again (SGLang without CPU backup)
    timeout_s = 120.0

    def __init__(self, cfg: RunConfig, run_dir: Path, node_index: int) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.node_index = node_index
        npc = cfg.cluster.nodes_per_cell
        self.cell, self.rank = divmod(node_index, npc)
        self.host = cfg.control.bind_host
        self.log_file = run_dir / "logs" / f"engine-{node_index}.log"

    @property
    def runs_here(self) -> bool:
        """Whether this node runs an engine process at all."""
        return self.rank == 0

    def _command(self, weights: WeightsRef) -> tuple[list[str], dict[str, str] | None, Callable[[], str | None]]:
        """(argv, environment or None, a probe that returns the engine's URL once it listens)."""
        raise NotImplementedError

    @property
    def beacon_name(self) -> str | None:
        """The engine's beacon (beacon.py) in run_dir/alive, which its agent watches; None: it beats none."""
        return None

    def _spawn(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        # Not die_with_parent: the parent-death signal follows the spawning *thread*, and a role switch runs in a
        # job thread that ends long before the engine should. stop() stops the engine; if the agent is killed hard,
        # the embedded engine sees its parent gone (--parent-pid) and stops too.
        return spawn(argv, self.log_file, env=env, die_with_parent=False)

    def start(self, weights: WeightsRef) -> Engine:
        argv, env, locate = self._command(weights)
        proc = self._spawn(argv, env)
        try:
            url = wait_until(locate, what=self.what, timeout_s=self.timeout_s, procs=proc, log=self.log_file,
                             poll_s=0.1) if self.rank == 0 else None
            if url is not None:
                client = EngineClient(url)
                try:
                    wait_until(client.health_generate, what=f"{self.what} (GET /health_generate)",
                               timeout_s=self.timeout_s, procs=proc, log=self.log_file, poll_s=0.2)
                finally:
                    client.close()
        except BaseException:
            self.stop(proc)
            raise
        log.info("%s up%s serving version %d", self.what, f" at {url}" if url else " (no HTTP on this node)",
                 weights.version)
        return Engine(proc, url, weights.version)

    def stop(self, proc: subprocess.Popen) -> None:
        stop_processes(proc, grace_s=10.0)


class EmbeddedLauncher(EngineLauncher):
    def _command(self, weights: WeightsRef) -> tuple[list[str], dict[str, str] | None, Callable[[], str | None]]:
        ready = self.run_dir / "engines" / f"node{self.node_index}.json"
        ready.unlink(missing_ok=True)
        argv = gyre_argv("engine", "--model-path", weights.path, "--weight-version", str(weights.version),
                         "--host", self.host, "--port", "0", "--seed", str(self.cfg.run.seed * 1000 + self.node_index),
                         "--ready-file", str(ready), "--parent-pid", str(os.getpid()))

        def locate() -> str | None:
            info = read_ready_file(ready)
            if info is None:
                return None
            port = info["url"].rsplit(":", 1)[1]
            return f"http://{self.cfg.control.reachable(self.host)}:{port}"

        # its own beacon (not the agent's, which it would otherwise inherit): the agent watches it (engine_watch.py)
        return argv, beacon_env(self.run_dir / "alive", self.beacon_name), locate

    @property
    def beacon_name(self) -> str:
        return f"engine-{self.node_index}"


class _LastingSpawner:
    """Spawns from one thread that lives as long as the process, so that the parent-death signal (tied to the
    spawning thread) reaches the child only when the agent itself is gone."""

    _lock = threading.Lock()
    _jobs: queue.Queue | None = None

    @classmethod
    def spawn(cls, argv: list[str], log_file: Path, env: dict[str, str]) -> subprocess.Popen:
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.Queue()
                threading.Thread(target=cls._serve, args=(cls._jobs,), name="engine-spawner", daemon=True).start()
        done: queue.Queue = queue.Queue(maxsize=1)
        cls._jobs.put((argv, log_file, env, done))
        result = done.get()
        if isinstance(result, BaseException):
            raise result
        return result

    @staticmethod
    def _serve(jobs: queue.Queue) -> None:
        while True:
            argv, log_file, env, done = jobs.get()
            try:
                done.put(spawn(argv, log_file, env=env, die_with_parent=True, new_session=True))
            except BaseException as e:  # handed to the caller
                done.put(e)


class SGLangLauncher(EngineLauncher):
    what = "the SGLang server"
    kv_export = False
    resume_reloads = True

    def __init__(self, cfg: RunConfig, run_dir: Path, node_index: int) -> None:
        super().__init__(cfg, run_dir, node_index)
        self.sg = cfg.sglang
        self.timeout_s = self.sg.start_timeout_s
        self.nnodes = cfg.cluster.nodes_per_cell
        self.rendezvous = run_dir / "engines" / f"cell{self.cell}-sglang.json"
        self._joined: str | None = None  # the rendezvous nonce this node's server was started with
        if self.rank == 0 and self.nnodes > 1:
            self.rendezvous.unlink(missing_ok=True)  # a previous incarnation's address

    @property
    def runs_here(self) -> bool:
        return True  # every node of the cell runs the server; node rank 0 serves HTTP

    def _dist_init_addr(self, weights: WeightsRef) -> str | None:
        if self.nnodes == 1:
            return None
        if self.rank == 0:
            host = self.cfg.control.reachable(self.host)
            addr = f"{host}:{self.sg.dist_port or free_port(self.host)}"
            self._joined = uuid.uuid4().hex
            write_ready_file(self.rendezvous, {"dist_init_addr": addr, "nonce": self._joined,
                                               "weight_version": weights.version})
            return addr

        def published() -> dict | None:
            info = read_ready_file(self.rendezvous)
            return info if info and info.get("nonce") != self._joined else None

        info = wait_until(published, what=f"the address of cell {self.cell}'s first node ({self.rendezvous})",
                          timeout_s=self.timeout_s, poll_s=0.2)
        self._joined = info["nonce"]
        return str(info["dist_init_addr"])

    def argv(self, weights: WeightsRef, port: int, dist_init_addr: str | None) -> list[str]:
        from gyre_slurm.engines.sglang import sglang_launch_argv

        return sglang_launch_argv(
            weights.path, host=self.host, port=port, tp_size=self.sg.tp_size, mem_fraction=self.sg.mem_fraction_static,
            extra=self.sg.extra_args, python=self.sg.python or sys.executable, dp_size=self.sg.dp_size,
            weight_version=weights.version, seed=self.cfg.run.seed * 1000 + self.cell * self.nnodes,
            nnodes=self.nnodes, node_rank=self.rank, dist_init_addr=dist_init_addr)

    def _command(self, weights: WeightsRef) -> tuple[list[str], dict[str, str] | None, Callable[[], str | None]]:
        from gyre_slurm.engines.sglang import sglang_launch_env

        dist = self._dist_init_addr(weights)
        port = self.sg.port or free_port(self.host)
        url = f"http://{self.cfg.control.reachable(self.host)}:{port}"
        return self.argv(weights, port, dist), {**os.environ, **sglang_launch_env()}, lambda: url

    def _spawn(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        try:
            return _LastingSpawner.spawn(argv, self.log_file, env or {})
        except OSError as e:
            raise GyreError(f"cannot start SGLang with {argv[0]} (sglang.python): {e.strerror or e}") from None

    def current(self) -> bool:
        """A node other than the first: whether its server joined the first node's current launch (a first node
        that started its server again published a new address, and this node's server must follow)."""
        info = read_ready_file(self.rendezvous)
        return info is not None and info.get("nonce") == self._joined

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the server's process group (launch_server and the processes it started), SIGKILL after 30 s."""
        stop_processes(proc, grace_s=30.0, group=True)


def launcher_for(cfg: RunConfig, run_dir: Path, node_index: int) -> EngineLauncher:
    if cfg.cluster.engine == "sglang":
        return SGLangLauncher(cfg, run_dir, node_index)
    return EmbeddedLauncher(cfg, run_dir, node_index)


__all__ = ["EmbeddedLauncher", "Engine", "EngineLauncher", "SGLangLauncher", "launcher_for"]
