"""The proxy with a scripted model: a real harness's requests go through the proxy's own API parsing, TITO
prompt building and reply shaping (calls.py), but each reply is the next text of a script instead of a
generation, and the calls are kept here instead of going to a daemon.

What it is for: demonstrations in a harness's exact conversation format. Run Claude Code or Codex against it
with a script of tool calls, and every call comes back as the token ids a rollout of the same harness would
give the policy (prompt ∥ output, the outputs being the scripted replies), ready for a supervised warm-up. A
conversation the script does not cover (a harness's side calls: titles, summaries) gets `fallback`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre_slurm.proxy.apierrors import ServedModels
from gyre_slurm.proxy.calls import Calls
from gyre_slurm.proxy.generation import Generation, GenParams, read_model_info
from gyre_slurm.proxy.keys import make_key
from gyre_slurm.proxy.recording import Stats
from gyre_slurm.proxy.sessions import Lineage, Session, Sessions
from gyre_slurm.proxy.tito import ChatRenderer
from gyre_slurm.proxy.toolcalls import get_parser, parser_for_model_type

Script = Callable[[int, int, str], str]  # (rollout id, call number on the main line, kind) -> reply text


@dataclass
class ScriptedCall:
    index: int
    kind: str
    parent_call: int | None
    branch_reason: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    api: str


@dataclass
class ScriptedRollout:
    calls: list[ScriptedCall] = field(default_factory=list)
    main_calls: int = 0  # replies given on the main line so far


class _Link:
    """What Calls asks of the daemon link: the run token (keys) and whether a rollout is closed (never)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def is_closed(self, _rollout_id: int) -> bool:
        return False


class _Engines:
    """Generation replaced by the script: the reply's ids are its text tokenised, then the end-of-turn id."""

    def __init__(self, server: ScriptedServer) -> None:
        self.server = server

    async def run(self, rollout_id: int, prompt_ids: array, params: GenParams) -> Generation:
        s = self.server
        kind = s.pending_kind.pop(rollout_id, "main")
        r = s.rollouts.setdefault(rollout_id, ScriptedRollout())
        text = s.script(rollout_id, r.main_calls, kind)
        if kind == "main":
            r.main_calls += 1
        out = s.renderer.encode(text) + [s.eos_id]
        return Generation(prompt_ids=prompt_ids, output_ids=out, output_logprobs=[0.0] * len(out), text=text,
                          truncated=False, matched_stop=None, cell=None, weight_version=0, started_at=time.time(),
                          latency_s=0.0)


class _Recording:
    def __init__(self, server: ScriptedServer) -> None:
        self.server, self.stats = server, Stats()

    def record(self, rollout_id: int, session: Session, api: str, gen: Generation, lineage: Lineage,
               finish_reason: str, take: Callable[[int], Any]) -> int:
        index = session.next_index
        session.next_index += 1
        take(index).apply()
        self.server.rollouts.setdefault(rollout_id, ScriptedRollout()).calls.append(ScriptedCall(
            index, lineage.kind, lineage.parent_call, lineage.branch_reason, lineage.prompt_ids.tolist(),
            list(gen.output_ids), api))
        return index


class _Calls(Calls):
    async def chat_call(self, rollout_id: int, messages, tools, params, api, parse_tools, new_id=None,
                        kind_hint=None):
        # the script answers by the kind of conversation: learn it from the same plan the call makes
        plan = self.sessions.touch(rollout_id).conv.plan(self.renderer, messages, tools, kind_hint)
        self.engines.server.pending_kind[rollout_id] = plan.kind
        return await super().chat_call(rollout_id, messages, tools, params, api, parse_tools, new_id, kind_hint)


class ScriptedServer:
    """The proxy's HTTP routes answered by `script`; `key(rollout_id)` is the API key to hand a harness."""

    def __init__(self, model_path: Path, script: Script) -> None:
        from transformers import AutoTokenizer

        self.token = "scripted-" + socket.gethostname()
        self.renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_path))
        _, model_type, eos = read_model_info(Path(model_path))
        self.eos_id = eos[0] if eos else self.renderer.eos_id
        self.script = script
        self.rollouts: dict[int, ScriptedRollout] = {}
        self.pending_kind: dict[int, str] = {}
        self.served_models = ServedModels(None)
        self.calls = _Calls(_Link(self.token), Sessions(), _Engines(self), _Recording(self), self.renderer,
                            get_parser(parser_for_model_type(model_type)), self.served_models, False)

    def key(self, rollout_id: int) -> str:
        return make_key(self.token, rollout_id)

    def health(self) -> dict[str, Any]:
        return {"ok": True, "scripted": True, "rollouts": len(self.rollouts)}

    @contextlib.contextmanager
    def serving(self, host: str = "127.0.0.1") -> Iterator[str]:
        """Serve on a free port in a background thread; yields the base URL (no /v1)."""
        import uvicorn
        from fastapi import FastAPI

        from gyre_slurm.proxy.app import add_error_handlers, add_routes

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        add_error_handlers(app)
        add_routes(app, self)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(64)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.01)
        try:
            yield f"http://{host}:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(10)
            sock.close()
