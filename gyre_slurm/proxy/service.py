"""The proxy's parts wired together, started and stopped: the tokenizer and chat template of the policy, the
per-rollout sessions, and (at start, on the event loop) the journal, the link to the daemon, the engines and the
API calls. The HTTP face (app.py) serves `Proxy.calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
    # made by start(); the app serves requests only after it
    journal: Journal
    engines: Engines
    recording: Recording
    calls: Calls

    def __init__(self, run_dir: Path, model_path: Path, *, proxy_id: str | None = None, parser: str | None = None,
                 served_models: Iterable[str] | None = None, check_canonical: bool = False,
                 route_timeout_s: float = 10.0,
                 engine_retry_s: float = 60.0, engine_timeout_s: float = 3600.0,
                 template_kwargs: dict[str, Any] | None = None, hello_interval_s: float = 2.0,
                 idle_check_s: float = 300.0) -> None:
        from transformers import AutoTokenizer

        self.run_dir, self.model_path = Path(run_dir), Path(model_path)
        self.proxy_id = proxy_id or socket.gethostname()
        # fnmatch patterns of the model names answered (default: any; apierrors.DEFAULT_SERVED_MODELS)
        self.served_models = ServedModels(served_models)
        self.check_canonical = check_canonical
        self.route_timeout_s, self.engine_retry_s = route_timeout_s, engine_retry_s
        self.engine_timeout_s = engine_timeout_s
        self.hello_interval_s = hello_interval_s
        self.idle_check_s = idle_check_s
        self._sweeper: asyncio.Task | None = None
        self.renderer = ChatRenderer(AutoTokenizer.from_pretrained(self.model_path), template_kwargs)
        self.max_context, model_type, eos = read_model_info(self.model_path)
        self.stop_token_ids = eos or [self.renderer.eos_id]
        self.parse = get_parser(parser or parser_for_model_type(model_type))
        self.url = ""
        self.sessions = Sessions()
        self.stats = Stats()
        self.link: DaemonLink | None = None  # set_url may come first

    async def start(self) -> None:
        self.journal = Journal(self.run_dir, self.proxy_id)
        self.sessions.restore(self.journal.restored)  # a restarted proxy keeps extending open rollouts
        self.journal.restored = {}
        link = self.link = DaemonLink(self.run_dir, self.proxy_id, self.journal, url=self.url,
                                      hello_interval_s=self.hello_interval_s)
        loop = asyncio.get_running_loop()
        link.on_closed = lambda rid: loop.call_soon_threadsafe(self.sessions.drop, rid)
        link.start()
        self.engines = Engines(link, self.sessions, self.renderer, self.max_context, self.stop_token_ids,
                               route_timeout_s=self.route_timeout_s, retry_s=self.engine_retry_s,
                               timeout_s=self.engine_timeout_s)
        self.recording = Recording(link, self.stats, self.engines.counters)
        self.calls = Calls(link, self.sessions, self.engines, self.recording, self.renderer, self.parse,
                           self.served_models, self.check_canonical)
        self._sweeper = asyncio.create_task(self._sweep(link))

    async def _sweep(self, link: DaemonLink) -> None:
        """A rollout's last call is usually acked while it is still open, so the proxy would never hear that it
        ended: ask the daemon about rollouts idle for a while; a closed one's state is dropped (on_closed)."""
        while True:
            await asyncio.sleep(self.idle_check_s / 4)
            now = time.monotonic()
            for rid in self.sessions.idle(now, self.idle_check_s):
                with contextlib.suppress(RouteUnavailable):
                    await link.aroute(rid, self.route_timeout_s, refresh=True)
                self.sessions.checked(rid, now)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.engines.aclose()
        if self.link is not None:
            self.link.stop()
        self.journal.close()

    def set_url(self, url: str) -> None:
        self.url = url
        if self.link is not None:
            self.link.url = url

    def health(self) -> dict[str, Any]:
        return self.recording.health(self.proxy_id, self.url, len(self.sessions))
