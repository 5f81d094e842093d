"""What the model thread holds for each request and each control command, and how it answers them.

Both are created on the asyncio thread and answered from the model thread through their event loop's future.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gyre_slurm.engines.validation import GenerateInput
from gyre_slurm.model.qwen3 import KVCache

Reply = tuple[int, Any]  # HTTP status, JSON content
CommandKind = Literal["update_weights", "update_weights_te", "release", "resume", "pause", "continue", "flush",
                      "import_kv", "update_distributed", "destroy_weights_group", "transfer_engine_info",
                      "begin_weight_update", "end_weight_update"]


@dataclass(eq=False)
class Request:
    inp: GenerateInput
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Reply]
    generator: torch.Generator
    created: float = field(default_factory=time.monotonic)
    ids: torch.Tensor | None = None  # input_ids as a tensor (prefix matching)
    reuse_hint: int = 0  # prompt tokens reusable when it was admitted (orders prefills before it has a cache)
    cache: KVCache | None = None  # taken when its prefill starts
    fed: int = 0  # prompt tokens whose KV is in the cache
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False
    export_kv: bool = False  # its abort answer carries a KV handle (model_thread._export_kv)
    finish: dict | None = None
    stop_len: int = 0  # longest stop string, in tokens: how much of the output tail to decode per check
    retracted: list[int] | None = None  # a retract dropped its KV: its prompt + output then, to prefill again

    @property
    def prompt(self) -> list[int]:
        """What its prefill computes: the input ids, or after a retract the input and output ids it had then."""
        return self.inp.input_ids if self.retracted is None else self.retracted

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclass(eq=False)
class Command:
    kind: CommandKind
    payload: Any  # the route's parsed body (validation.*Body) or None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Reply]


def reply(target: Request | Command, value: Reply) -> None:
    """Answer from the model thread: the future belongs to the asyncio thread's loop."""
    def settle(fut: asyncio.Future[Reply] = target.future) -> None:
        if not fut.done():
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is waiting
        target.loop.call_soon_threadsafe(settle)
