"""SGLang's ways of moving weights and calls, from both ends: a trainer pushing weights into an engine over
torch.distributed, a new engine pulling them from a running one over the Mooncake Transfer Engine, and a cell that
leaves the pool handing its in-flight calls back to the proxy.

SGLang's routes (python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py), which the embedded engine
serves too (gloo on CPU where SGLang uses NCCL on GPUs):

- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}: the
  engine joins a new process group (the trainer is rank 0, the engine's ranks start at rank_offset) through a TCP
  store at master_address:master_port hosted by rank 0; it answers once the group is formed.
- POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
  weight_version}: the engine receives each tensor in order from a broadcast of rank 0 and loads them; the HTTP
  call returns after the broadcast, so the trainer broadcasts while its call is under way.
- POST /destroy_weights_update_group {group_name}.
- POST /begin_weight_update {selector?} and POST /end_weight_update {} (SGLang since the session API,
  managers/scheduler_components/weight_updater.py): the updates of one version go between them; a server of that
  generation refuses /update_weights_from_distributed outside a session, an older one has neither route (404).
  Each answers {success, message}, 400 with success false.
- GET /remote_instance_transfer_engine_info?rank=R -> {rank, remote_instance_transfer_engine_info: [session_id,
  {name: [address, numel, element_size]}]}: where a running engine's parameters lie in its Transfer Engine's
  registered memory (SGLang: a seed started with --remote-instance-weight-loader-start-seed-via-transfer-engine).

Both sides build the process group the way SGLang's `init_custom_process_group` does (a TCP rendezvous, a
PrefixStore named after the group, a group that is not the process's default one), so a gyre trainer can push into a
real SGLang server as well as into the embedded engine; a cell's node agent pushes each new version into its own
server this way (agent/engine_push.py, weights.engine_update: push). Each path returns a `TransferReport`
(transport "nccl" for the distributed update whatever its backend, "remote_instance" for the pull), like
transfer/weights.py's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gyre_slurm.engines.client import EngineClient, EngineError, parse_weight_version
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.report import TransferReport

GROUP_TIMEOUT_S = 300.0  # a collective that waits longer than this fails (a peer died or never came)
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


# --- the process group (both sides) ------------------------------------------------------------------------------

def join_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float = GROUP_TIMEOUT_S) -> dist.ProcessGroup:
    """Join (rank 0: host) a process group of its own, next to any default group the process has. Blocks until
    all `world_size` ranks have joined or `timeout_s` has passed."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are the ranks given here
    return group


def torch_dtype(name: str) -> torch.dtype:
    """SGLang's dtype names ("bfloat16", also "torch.bfloat16") as torch dtypes; ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _start(fn: Callable[..., Any], *args: Any) -> Future:
    """Run fn in a daemon thread (a collective that never completes must not keep the process alive)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits on the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=f"gyre-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut


def _broadcast(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0 sends, the others receive into `tensors`, one broadcast per tensor in order (SGLang's receiver)."""
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
    for work in works:
        work.wait()


# --- the engine's side -------------------------------------------------------------------------------------------

class WeightGroups:
    """The embedded engine's weight-update groups by name. Joining runs off the model thread (it waits for the
    trainer); receiving and destroying run on it, serialised with generation and the other weight commands."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, tuple[dist.ProcessGroup, torch.device]] = {}  # and where its tensors arrive
        self._joining: set[str] = set()

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str) -> tuple[int, dict]:
        if backend == "nccl" and not torch.cuda.is_available():
            return _failure("backend nccl needs CUDA and this engine runs on CPU: use backend gloo")
        with self._lock:
            if group_name in self._groups or group_name in self._joining:
                return _failure(f"weight update group {group_name!r} already exists: destroy it first")
            self._joining.add(group_name)
        try:
            group = join_weight_group(master_address, master_port, rank, world_size, group_name, backend)
        except Exception as exc:
            with self._lock:
                self._joining.discard(group_name)
            return _failure(f"Failed to initialize custom process group: {type(exc).__name__}: {exc}")
        with self._lock:  # NCCL receives on the GPU; the embedded engine's model is on the CPU
            self._joining.discard(group_name)
            self._groups[group_name] = group, torch.device("cuda" if backend == "nccl" else "cpu")
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def get(self, group_name: str) -> tuple[dist.ProcessGroup, torch.device]:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}: call /init_weights_update_group first")
        return group

    def destroy(self, group_name: str) -> tuple[int, dict]:
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            return _failure(f"no weight update group {group_name!r}")
        dist.destroy_process_group(group[0])
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def _failure(message: str) -> tuple[int, dict]:
    return 400, {"success": False, "message": message.replace("\n", " ")}


def check_bucket(model: nn.Module, names: list[str], dtypes: list[str],
                 shapes: list[list[int]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """A bucket's description checked against the model before anything is received: a refused bucket never
    enters the broadcast, so the engine does not wait for bytes it would not load. ValueError names what is wrong."""
    params = dict(model.named_parameters(remove_duplicate=False))
    specs, problems = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        try:
            dt = torch_dtype(dtype)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if name not in params:
            problems.append(f"{name}: not a parameter of the model")
        elif tuple(shape) != tuple(params[name].shape):
            problems.append(f"{name}: shape {list(shape)} != the model's {list(params[name].shape)}")
        elif not (dt.is_floating_point and params[name].dtype.is_floating_point):
            problems.append(f"{name}: dtype {dtype} cannot be loaded into {dtype_name(params[name].dtype)}")
        else:
            specs.append((name, dt, tuple(shape)))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{'; '.join(problems[:3])}{more}")
    return specs


def receive_bucket(group: dist.ProcessGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one bucket, received from rank 0 on `device` (all of them, before anything is loaded)."""
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, dtype, shape in specs}
    _broadcast(group, list(out.values()))
    return out


def load_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy named tensors into the model's parameters of those names, in place (cast to their dtype); bytes."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    return sum(t.numel() * t.element_size() for t in tensors.values())


class TransferEngineSeed:
    """The engine's parameters registered with this process's Transfer Engine, registered when first asked for
    (GET /remote_instance_transfer_engine_info) and again for a model loaded anew; `forget` unregisters them so
    that releasing the weights frees their memory."""

    def __init__(self) -> None:
        self._agent: TransferAgent | None = None
        self._model: nn.Module | None = None
        self._params: list[torch.Tensor] = []
        self._info: dict[str, list[int]] = {}

    def info(self, model: nn.Module, host: str) -> tuple[str, dict[str, list[int]]]:
        """(session id, {name: [address, numel, element_size]}) as SGLang's register_memory_region gives it."""
        if self._model is not model:
            self.forget()
            agent = TransferAgent.shared(host)  # the engine's own (transfer_host)
            params = dict(model.named_parameters())  # a tied head is its embedding: listed once, as SGLang does
            for p in params.values():
                agent.register(p.data)
            self._agent, self._model, self._params = agent, model, [p.data for p in params.values()]
            self._info = {n: [p.data_ptr(), p.numel(), p.element_size()] for n, p in params.items()}
        assert self._agent is not None
        return self._agent.peer, self._info

    def forget(self) -> None:
        if self._agent is not None:
            for t in self._params:
                self._agent.release(t)
        self._agent, self._model, self._params, self._info = None, None, [], {}


# --- the trainer's side: a distributed update into one engine ------------------------------------------------------

def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors grouped into buckets of at most `bucket_bytes` (a larger tensor is a bucket alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return [b for b in out if b]


class DistributedWeightSender:
    """The trainer's end of SGLang's distributed weight update into one engine (an SGLang server or the embedded
    engine): `connect()` forms the group (this process is rank 0 and hosts the TCP store at master_address:
    master_port; the engine's `engine_ranks` ranks follow), `send()` pushes named tensors bucket by bucket, `close()`
    destroys the group on both ends. backend: "nccl" on GPUs (tensors go to CUDA), "gloo" on CPU.

    A refused call (the engine answers 400 before it receives) leaves a broadcast of ours waiting until the group's
    timeout: the sender is then broken and `send` refuses; close it (that returns at once: the waiting broadcast
    ends when the engine's side of the group goes, or at the timeout) and connect a new one (another port). Likewise
    a refused connect leaves our half of the rendezvous (and its port) waiting until the timeout."""

    def __init__(self, engine: EngineClient | str, master_address: str, master_port: int, *,
                 group_name: str = "gyre_weights", backend: str | None = None, engine_ranks: int = 1,
                 timeout_s: float = GROUP_TIMEOUT_S, receiver: str = "", gpu: int | None = None) -> None:
        self.client = engine if isinstance(engine, EngineClient) else EngineClient(engine)
        self.gpu = gpu  # NCCL: the GPU buckets are staged on (None: the current one); never one of the engine's
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name, self.engine_ranks, self.timeout_s = group_name, int(engine_ranks), timeout_s
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.receiver = receiver or f"engine:{self.client.base_url}"
        self.group: dist.ProcessGroup | None = None
        self.broken: str | None = None

    @property
    def device(self) -> torch.device:
        if self.backend != "nccl":
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device() if self.gpu is None else self.gpu)

    def connect(self) -> DistributedWeightSender:
        world_size = 1 + self.engine_ranks
        joined = _start(join_weight_group, self.master_address, self.master_port, 0, world_size, self.group_name,
                        self.backend, self.timeout_s)  # hosts the store: it waits for the engine's ranks
        self.client.init_weights_update_group(self.master_address, self.master_port, 1, world_size, self.group_name,
                                              self.backend)  # returns once the engine's side is formed
        self.group = joined.result(timeout=self.timeout_s)
        return self

    def send(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: int | str, *, flush_cache: bool = True,
             bucket_bytes: int = 1 << 30) -> TransferReport:
        """Broadcast the tensors (one /update_weights_from_distributed per bucket, the weight version with the last
        one, which is when the engine starts reporting it). Between buckets the engine serves a mix of versions:
        pause its generation around the send where that matters. Raises EngineError when the engine refuses.

        The buckets go inside a weight-update session (/begin_weight_update ... /end_weight_update) where the server
        has one: recent SGLang refuses the update outside it (managers/scheduler_components/weight_updater.py);
        older builds answer 404 to the probe and load directly. A failed send still ends the session (best effort):
        the next begin would be refused while it stays open."""
        if self.group is None:
            raise EngineError(f"engine {self.client.base_url}: the weight update group is not connected")
        if self.broken:
            raise EngineError(f"engine {self.client.base_url}: the weight update group is broken ({self.broken})")
        t0 = time.perf_counter()
        parts = buckets(((n, t.detach()) for n, t in named), bucket_bytes)
        session = self.client.begin_weight_update()
        try:
            nbytes = self._send_buckets(parts, weight_version, flush_cache)
        except BaseException:
            if session:
                with contextlib.suppress(EngineError):
                    self.client.end_weight_update()
            raise
        if session:
            self.client.end_weight_update()
        version = parse_weight_version(str(weight_version))
        return TransferReport("nccl", -1 if version is None else version, nbytes, time.perf_counter() - t0,
                              self.receiver)

    def _send_buckets(self, parts: list[list[tuple[str, torch.Tensor]]], weight_version: int | str,
                      flush_cache: bool) -> int:
        nbytes = 0
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            tensors = [t.to(self.device).contiguous() for _, t in part]
            call = _start(self.client.update_weights_from_distributed, [n for n, _ in part],
                          [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], self.group_name,
                          weight_version if last else None, flush_cache and last)
            sent = _start(_broadcast, self.group, tensors)
            try:
                call.result()  # the engine answers after it has received (or at once when it refuses)
                sent.result(timeout=self.timeout_s)
            except Exception as exc:
                self.broken = f"{type(exc).__name__}: {exc}"
                raise
            nbytes += sum(t.numel() * t.element_size() for t in tensors)
        return nbytes

    def close(self) -> None:
        """Destroy the group on the engine (best effort: it may be gone) and here."""
        if self.group is None:
            return
        try:
            self.client.destroy_weights_update_group(self.group_name)
        except EngineError:
            pass
        dist.destroy_process_group(self.group)
        self.group = None

    def __enter__(self) -> DistributedWeightSender:
        return self.connect()

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- a new engine's side: pulling every parameter from a running one -----------------------------------------------

def load_from_remote_instance(seed: EngineClient | str, model: nn.Module, agent: TransferAgent | None = None, *,
                              rank: int = 0, receiver: str = "") -> TransferReport:
    """Pull every parameter of `model` from a running engine's Transfer Engine (the answer of its GET
    /remote_instance_transfer_engine_info) and load it: how a new cell starts from a running one instead of from
    disk. All tensors are read into one registered staging buffer first and loaded only when all have arrived and
    the seed still serves the weight version it served before the read (a seed updated meanwhile is refused, the
    model left as it was). `agent` is this process's Transfer Engine (default: the shared one on 127.0.0.1)."""
    client = seed if isinstance(seed, EngineClient) else EngineClient(seed)
    agent = agent or TransferAgent.shared()
    t0 = time.perf_counter()
    before = client.model_info().get("weight_version")
    session_id, remote = client.remote_instance_transfer_engine_info(rank)
    params = dict(model.named_parameters())
    problems = [f"{n}: not served by the seed" for n in params if n not in remote]
    problems += [f"{n}: the seed has {remote[n][1]} x {remote[n][2]} bytes, here {p.numel()} x {p.element_size()}"
                 for n, p in params.items() if n in remote and (remote[n][1], remote[n][2]) != (
                     p.numel(), p.element_size())]
    if problems:
        raise TransferError(f"seed {client.base_url} does not match the local model: {'; '.join(problems[:3])}")
    sizes = [p.numel() * p.element_size() for p in params.values()]
    staging = agent.allocate(sum(sizes))
    try:
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        base = staging.data_ptr()
        agent.read(session_id, [base + o for o in offsets], [int(remote[n][0]) for n in params], sizes)
        after = client.model_info().get("weight_version")
        if after != before:
            raise TransferError(f"seed {client.base_url} changed weights during the read (version {before} -> "
                                f"{after}): nothing loaded")
        with torch.no_grad():
            for (_, p), o, n in zip(params.items(), offsets, sizes, strict=True):
                p.view(-1).view(torch.uint8).copy_(staging[o:o + n])
    finally:
        agent.release(staging)
    version = parse_weight_version(before)
    return TransferReport("remote_instance", -1 if version is None else version, sum(sizes),
                          time.perf_counter() - t0, receiver or "local")


# --- a cell leaving the pool: its calls continue elsewhere ----------------------------------------------------------

def evacuate(client: EngineClient) -> None:
    """Hand every in-flight call of an engine whose cell leaves the pool back to the proxy, to continue elsewhere.

    Generation is paused in retract mode (nothing is sampled after this point, the requests go back to the waiting
    queue and their KV may be freed; new ones are held), then every request is aborted: each /generate answers with
    finish_reason abort and the ids and log-probs sampled so far, and the proxy (proxy/generation.py, Kept) asks the
    daemon for a new route and continues from them on another engine. Route the rollouts away from this cell first:
    a call that arrives afterwards is held until generation continues. The engine stays paused; release its memory
    or continue generation next."""
    client.pause_generation("retract")
    client.abort(abort_all=True)


__all__ = ["DEFAULT_GROUP", "GROUP_TIMEOUT_S", "DistributedWeightSender", "TransferEngineSeed", "WeightGroups",
           "buckets", "check_bucket", "dtype_name", "evacuate", "join_weight_group", "load_from_remote_instance",
           "load_tensors", "receive_bucket", "torch_dtype"]
