"""The proxy's parts wired together: the tokenizer and chat template of the policy, the per-rollout sessions (as
the journal left them), the link to the daemon, the engines and the API calls. The HTTP face (app.py) serves
`Proxy.calls`, inside `Proxy.serving()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from gyre_slurm.beacon import Beacon
from gyre_slurm.proxy.apierrors import ServedModels
from gyre_slurm.proxy.calls import Calls
from gyre_slurm.proxy.daemon_link import DaemonLink, RouteUnavailable
from gyre_slurm.proxy.generation import Engines, read_model_info
from gyre_slurm.proxy.journal import Journal
from gyre_slurm.proxy.recording import Recording, Stats
from gyre_slurm.proxy.sessions import Sessions
from gyre_slurm.proxy.tito import ChatRenderer
from gyre_slurm.proxy.toolcalls import get_parser, parser_for_model_type


class Proxy:
    """Complete once made (the journal read back, the daemon's control file read: the link waits for it); serving()
    runs the link and the idle sweep while the app serves. `url` is where the app is served (the daemon hands it to
    harnesses)."""

    def __init__(self, run_dir: Path, model_path: Path, *, url: str, proxy_id: str | None = None,
                 parser: str | None = None, served_models: Iterable[str] | None = None,
                 check_canonical: bool = False, route_timeout_s: float = 10.0,
                 engine_retry_s: float = 60.0, engine_timeout_s: float = 3600.0,
                 template_kwargs: dict[str, Any] | None = None, hello_interval_s: float = 2.0,
                 idle_check_s: float = 300.0) -> None:
        from transformers import AutoTokenizer

        self.run_dir, self.model_path, self.url = Path(run_dir), Path(model_path), url
        self.proxy_id = proxy_id or socket.gethostname()
        # fnmatch patterns of the model names answered (default: any; apierrors.DEFAULT_SERVED_MODELS)
        self.served_models = ServedModels(served_models)
        self.route_timeout_s, self.idle_check_s = route_timeout_s, idle_check_s
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(self.model_path), template_kwargs)
        max_context, model_type, eos = read_model_info(self.model_path)
        self.stats = Stats()
        self.journal = Journal(self.run_dir, self.proxy_id)
        self.sessions = Sessions()
        self.sessions.restore(self.journal.restored)  # a restarted proxy keeps extending open rollouts
        self.journal.restored = {}
        self.link = DaemonLink(self.run_dir, self.proxy_id, self.journal, url=url, hello_interval_s=hello_interval_s)
        self.engines = Engines(self.link, self.sessions, renderer, max_context, eos or [renderer.eos_id],
                               route_timeout_s=route_timeout_s, retry_s=engine_retry_s, timeout_s=engine_timeout_s)
        self.recording = Recording(self.link, self.stats, self.engines.counters)
        self.calls = Calls(self.link, self.sessions, self.engines, self.recording, renderer,
                           get_parser(parser or parser_for_model_type(model_type)), self.served_models,
                           check_canonical)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """While the app serves: the link to the daemon runs (a rollout it sees closed is dropped on this event
        loop) and idle rollouts are swept; after, the engines' clients and the journal close."""
        loop = asyncio.get_running_loop()
        self.link.start(on_closed=lambda rid: loop.call_soon_threadsafe(self.sessions.drop, rid))
        sweeper = asyncio.create_task(self._sweep())
        beats = asyncio.create_task(self._beat())
        try:
            yield
        finally:
            beats.cancel()
            sweeper.cancel()
            await self.engines.aclose()
            self.link.stop()
            self.journal.close()

    @staticmethod
    async def _beat() -> None:
        """Its supervisor's sign that the event loop turns (beacon.py)."""
        beacon = Beacon()
        while True:
            beacon.beat()
            await asyncio.sleep(beacon.every_s)

    async def _sweep(self) -> None:
        """A rollout's last call is usually acked while it is still open, so the proxy would never hear that it
        ended: ask the daemon about rollouts idle for a while; a closed one's state is dropped (on_closed)."""
        while True:
            await asyncio.sleep(self.idle_check_s / 4)
            now = time.monotonic()
            for rid in self.sessions.idle(now, self.idle_check_s):
                with contextlib.suppress(RouteUnavailable):
                    await self.link.aroute(rid, self.route_timeout_s, refresh=True)
                self.sessions.checked(rid, now)

    def health(self) -> dict[str, Any]:
        return self.recording.health(self.proxy_id, self.url, len(self.sessions))
