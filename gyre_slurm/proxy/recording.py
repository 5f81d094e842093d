"""Recording calls: each finished call becomes a CallRecord for the daemon (journaled first: journal.py, sent by
daemon_link.py), counted in the proxy's statistics, which /health reports."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre_slurm.protocol import CallRecord
from gyre_slurm.proxy.daemon_link import DaemonLink
from gyre_slurm.proxy.generation import EngineCounters, Generation
from gyre_slurm.proxy.sessions import Lineage, Session

log = logging.getLogger("gyre.proxy")


@dataclass
class Taken:
    """A finished call, ready to join its session: `journal` is what a restarted proxy replays (a conversation's
    delta; None for completions), `apply()` takes it in."""
    journal: dict[str, Any] | None
    apply: Callable[[], None]


@dataclass
class Stats:
    calls: int = 0
    branches: Counter = field(default_factory=Counter)
    reused_tokens: int = 0
    prompt_tokens: int = 0
    canonical_checked: int = 0
    canonical_mismatch: int = 0
    malformed_tool_calls: int = 0


class Recording:
    def __init__(self, link: DaemonLink, stats: Stats, engine_counters: EngineCounters) -> None:
        self.link, self.stats, self.engine_counters = link, stats, engine_counters

    def record(self, rollout_id: int, session: Session, api: str, gen: Generation, lineage: Lineage,
               finish_reason: str, take: Callable[[int], Taken]) -> int:
        """Hand the call to the daemon (journaled first), then take it into the session (`take(call_index)`). A
        journal that cannot grow (DiskFull: the client gets a 503) leaves the session as it was: the call was not
        made, and the client's retry is the session's next call, not a child of one the daemon never hears of."""
        call_index = session.next_index  # taken at completion: records reach the daemon in index order
        taken = take(call_index)
        delta = taken.journal
        # the record carries only what is new: the daemon has the parent's ids (docs/algorithms.md §2.5)
        rec = CallRecord(rollout_id=rollout_id, call_index=call_index, api=api,
                         prompt_ids=lineage.prompt_ids[lineage.reused_tokens:],
                         output_ids=gen.output_ids, output_logprobs=gen.output_logprobs,
                         weight_version=gen.weight_version, cell=gen.cell, finish_reason=finish_reason,
                         started_at=gen.started_at, latency_s=gen.latency_s, reused_tokens=lineage.reused_tokens,
                         parent_call=lineage.parent_call, branch_reason=lineage.branch_reason, kind=lineage.kind)
        journal_state = None
        if delta is not None:  # its ids are the record's
            journal_state = {k: v for k, v in delta.items() if k not in ("tail", "output_ids")}
        self.link.submit(rec, journal_state)  # an append to the journal (flushed, not synced): no thread hop
        session.next_index += 1
        taken.apply()
        self._count(lineage, rollout_id, call_index)
        return call_index

    def _count(self, lineage: Lineage, rollout_id: int, call_index: int) -> None:
        self.stats.calls += 1
        self.stats.prompt_tokens += len(lineage.prompt_ids)
        self.stats.reused_tokens += lineage.reused_tokens
        if lineage.branch_reason is not None:
            self.stats.branches[lineage.branch_reason] += 1
            log.info("rollout %d call %d: new branch (%s, %s)", rollout_id, call_index, lineage.branch_reason,
                     lineage.kind)

    def health(self, proxy_id: str, url: str, n_sessions: int) -> dict[str, Any]:
        s, e = self.stats, self.engine_counters
        return {"ok": True, "proxy_id": proxy_id, "url": url, "sessions": n_sessions, "calls": s.calls,
                "branches": dict(s.branches), "reused_tokens": s.reused_tokens, "prompt_tokens": s.prompt_tokens,
                "canonical_checked": s.canonical_checked, "canonical_mismatch": s.canonical_mismatch,
                "malformed_tool_calls": s.malformed_tool_calls, "engine_retries": e.engine_retries,
                "continued_generations": e.continued_generations, "mixed_version_calls": e.mixed_version_calls,
                "kv_migrations": e.kv_migrations, "kv_migration_fallbacks": e.kv_migration_fallbacks,
                "pending_records": self.link.journal.n_pending(), "acks": self.link.n_acks}
