"""Per-rollout state: the conversations a rollout's chat calls extend (conversations.py), its last token-in
completion, the messages it sent before (per API), and how a call's prompt relates to earlier calls (Lineage)."""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from gyre_slurm.proxy import openai_api
from gyre_slurm.proxy.conversations import Conversations
from gyre_slurm.proxy.journal import Restored


@dataclass
class Session:
    conv: Conversations = field(default_factory=Conversations)  # chat calls (any chat-shaped API): what TITO extends
    next_index: int = 0
    used_at: float = field(default_factory=time.monotonic)
    completion_head: array | None = None  # the last /v1/completions call's prompt + output ids
    completion_prompt_len: int = 0
    completion_call: int | None = None  # its call index
    # recent requests' messages, per API (each converts them its own way): see openai_api.load_with_known
    known: openai_api.KnownMessages = field(default_factory=list)
    known_anthropic: openai_api.KnownMessages = field(default_factory=list)


@dataclass
class Lineage:
    """How a call's prompt relates to earlier calls: what the record carries instead of the whole prompt."""

    prompt_ids: array  # the whole prompt
    reused_tokens: int  # its first ids are the parent call's prompt ∥ output (or prompt, for a retry)
    parent_call: int | None
    branch_reason: str | None
    kind: str = "main"


class Sessions:
    """The Session of every rollout this proxy has served and not yet seen closed, by rollout id."""

    def __init__(self) -> None:
        self.by_rollout: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self.by_rollout)

    def touch(self, rollout_id: int) -> Session:
        """The rollout's session (new at its first call), marked as used now."""
        session = self.by_rollout.get(rollout_id)
        if session is None:
            session = self.by_rollout[rollout_id] = Session()
        session.used_at = time.monotonic()
        return session

    def drop(self, rollout_id: int) -> None:
        """Forget a closed rollout (its key no longer works, so nothing extends it again)."""
        self.by_rollout.pop(rollout_id, None)

    def restore(self, restored: dict[int, Restored]) -> None:
        """A restarted proxy keeps extending open rollouts: the journal's calls are replayed in call order, so the
        conversations come back as they were."""
        for rid, r in restored.items():
            session = self.by_rollout[rid] = Session(next_index=r.next_call_index)
            for rec, delta in r.calls:
                if delta is not None:
                    session.conv.apply({**delta, "tail": rec.prompt_ids, "output_ids": rec.output_ids})

    def idle(self, now: float, idle_s: float) -> list[int]:
        return [rid for rid, s in list(self.by_rollout.items()) if now - s.used_at > idle_s]

    def checked(self, rollout_id: int, now: float) -> None:
        """The daemon was asked about an idle rollout that is still open: not again for another idle period."""
        session = self.by_rollout.get(rollout_id)
        if session is not None:
            session.used_at = now
