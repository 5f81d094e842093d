"""What the agent's two ways into its own rollout server share (agent/engine_push.py: NCCL or gloo buckets;
agent/engine_stage.py: a folder on a RAM disk): the version pulled over the Transfer Engine into host memory, what
the server served before (the folder a failed update loads back), the abort pause and the wait until the server is
idle, and the restore. A subclass says how the pulled tensors get into the server (`_load_into`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

from gyre_slurm.agent.weight_link import folder_bytes
from gyre_slurm.engines.client import EngineClient, parse_weight_version
from gyre_slurm.errors import GyreError
from gyre_slurm.protocol import WeightsHandle, WeightsRef
from gyre_slurm.transfer.engine import TransferAgent
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weight_parts import pull_full
from gyre_slurm.transfer.weights import WeightPuller

log = logging.getLogger("gyre.agent")
IDLE_TIMEOUT_S = 60.0  # an abort-paused server finishes its aborted calls within a step or two
Record = Callable[[TransferReport], None]


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")


def wait_idle(client: EngineClient, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until the paused server has no call left (POST /flush_cache answers 200 only then: SGLang asserts the flush
    an update asks for, and crashes on a busy server)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(client.base_url + "/flush_cache", timeout=30)
        if r.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise GyreError(f"{client.base_url} still runs calls {timeout_s:.0f} s after an abort pause "
                            f"(/flush_cache -> {r.status_code})")
        time.sleep(0.05)


class EngineUpdater:
    """One cell's way into its own server. `agent` gives this process's Transfer Engine; `verb` names the update
    in messages ("push", "load")."""

    verb = "update"

    def __init__(self, agent: Callable[[], TransferAgent], cell: int) -> None:
        self._agent, self.cell = agent, cell
        self.puller: WeightPuller | None = None
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None  # the last version pulled, in staging memory
        self._server: object = None  # the server start `_served` belongs to
        self._served: WeightsRef | None = None  # what that server serves now: what a failed update restores
        self._lock = threading.Lock()

    @property
    def receiver(self) -> str:
        return f"engine:{self.cell}"

    def _new_server(self, client: EngineClient, server: object) -> bool:
        """Note the server start `server` (None: its URL); True when it is another one than before."""
        server = client.base_url if server is None else server
        if server == self._server:
            return False
        self._server, self._served = server, None
        return True

    def _pull(self, parts: list[WeightsHandle], ref: WeightsRef,
              record: Record) -> tuple[WeightsRef, dict[str, torch.Tensor]]:
        """The version in host memory, full Hugging Face tensors: pulled over the Transfer Engine part by part
        (transfer/weight_parts.py: a model-parallel core's slices assembled), or still held from the last pull (a
        server that lost its weights to a memory release gets the same version again). Where `ref` was replaced
        before it was read (this cell came back late), the newest version after it: returned with its snapshot
        folder."""
        if self.held is not None and self.held[0].version >= ref.version:
            return self.held
        self.held = None  # the staging buffer is about to be overwritten
        t0 = time.perf_counter()
        try:
            if self.puller is None:
                self.puller = WeightPuller(self._agent(), f"agent:{self.cell}")
            pulled = pull_full(self.puller, parts, at_least=True)
        except Exception as exc:
            record(TransferReport("mooncake", ref.version, 0, time.perf_counter() - t0, f"agent:{self.cell}",
                                  ok=False, error=error_text(exc)))
            raise
        for r in pulled.reports:  # one per sending rank
            record(r)
        got = ref if pulled.version == ref.version else WeightsRef(version=pulled.version,
                                                                    path=pulled.source or ref.path)
        self.held = got, pulled.tensors
        return self.held

    def _know_served(self, client: EngineClient) -> None:
        """What a server we have not updated serves: the folder it started from, under its version label."""
        if self._served is not None:
            return
        try:
            info = client.model_info()
        except Exception as exc:  # the update will fail too, and say why
            log.warning("cell %d: cannot ask %s what it serves: %s", self.cell, client.base_url, error_text(exc))
            return
        version = parse_weight_version(info.get("weight_version"))
        path = info.get("model_path")
        self._served = WeightsRef(version=version, path=str(path)) if version is not None and path else None

    def _paused_update(self, client: EngineClient, version: int, transport: str, record: Record,
                       load: Callable[[], TransferReport], *, prepare: Callable[[], object] = lambda: None,
                       on_failure: Callable[[], None] = lambda: None) -> None:
        """`prepare` (while the server still serves), then pause in abort mode, wait until idle, `load` (returns its
        report), continue. A failure is recorded (`transport`, ok=false), `on_failure` runs, the version served before
        is loaded back if the pause was reached, and GyreError says what the server serves."""
        t0, paused = time.perf_counter(), False
        try:
            prepare()
            paused = True  # from here on a failure restores (a pause that failed halfway may have held)
            client.pause_generation("abort")
            wait_idle(client)
            report = load()
        except Exception as exc:
            record(TransferReport(transport, version, 0, time.perf_counter() - t0, self.receiver, ok=False,
                                  error=error_text(exc)))
            on_failure()
            if paused:
                self._restore(client, record)
            raise GyreError(f"cell {self.cell}: the {self.verb} of weights version {version} into {client.base_url} "
                            f"failed ({error_text(exc)}); it serves version "
                            f"{self._served.version if self._served else '?'}") from None
        record(report)
        client.continue_generation()
        log.info("cell %d: %s of version %d into %s (%d bytes in %.3f s)", self.cell, self.verb, version,
                 client.base_url, report.nbytes, report.seconds)

    def _restore(self, client: EngineClient, record: Record) -> None:
        """Load back the version the server served before a failed update, then let generation continue. If that
        fails too, the server stays paused: better no calls than calls on a mix of versions."""
        served, t0 = self._served, time.perf_counter()
        try:
            if served is None:
                raise GyreError("the version it served before is not known")
            client.update_weights_from_disk(served.path, served.version)
        except Exception as exc:
            record(TransferReport("file", -1 if served is None else served.version, 0, time.perf_counter() - t0,
                                  self.receiver, ok=False, error=error_text(exc)))
            raise GyreError(f"cell {self.cell}: a failed {self.verb} left {client.base_url} with weights of two "
                            f"versions and restoring failed ({error_text(exc)}): generation stays paused") from None
        record(TransferReport("file", served.version, folder_bytes(Path(served.path)), time.perf_counter() - t0,
                              self.receiver))
        client.continue_generation()
        log.warning("cell %d: %s failed; %s serves version %d again (from %s)", self.cell, self.verb,
                    client.base_url, served.version, served.path)

    def _close_puller(self) -> None:
        if self.puller is not None:
            self.puller.close()
        self.puller, self.held, self._served = None, None, None


__all__ = ["IDLE_TIMEOUT_S", "EngineUpdater", "error_text", "wait_idle"]
