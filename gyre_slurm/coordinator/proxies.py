"""The TITO proxies as the daemon knows them: where they listen and which runs' model calls they still owe; and
the peers that say hello every few seconds (proxies, workers), told silent and back (`Silences`)."""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.protocol import ProxyHello

HOLD_AFTER_START_S = 5.0  # proxies say hello every 2 s (proxy/daemon_link.py): by then each has said what it owes
PROXY_SILENT_S = 6.0  # three hellos missed: the proxy is down or restarting
PROXY_GONE_S = 60.0  # silent this long: gone for good, and what it owed with it (training goes on)
WORKER_SILENT_S = 6.0  # workers say hello every 2 s (worker/service.py)


class Silences:
    """Peers of one kind (`noun`) that say hello every few seconds: one not heard from for `silent_s` (down,
    restarting, hung or cut off from the daemon) is an events row `<noun>_silent`, and `<noun>_back` when it is
    heard from again."""

    def __init__(self, noun: str, silent_s: float, meanwhile: str) -> None:
        self.noun, self.silent_s, self.meanwhile = noun, silent_s, meanwhile
        self.seen: dict[str, float] = {}
        self._silent: set[str] = set()  # told silent, not heard from since

    def heard(self, peer: str, now: float) -> None:
        self.seen[peer] = now

    def check(self, now: float) -> list[tuple[str, str]]:
        """(events kind, message) for each peer that went silent or was heard from again since the last call."""
        told: list[tuple[str, str]] = []
        for peer, seen in self.seen.items():
            quiet = now - seen > self.silent_s
            if quiet and peer not in self._silent:
                self._silent.add(peer)
                told.append((f"{self.noun}_silent", f"{self.noun} {peer}: no hello for {now - seen:.0f} s (down, "
                             f"hung or cut off from the daemon); {self.meanwhile}"))
            elif not quiet and peer in self._silent:
                self._silent.discard(peer)
                told.append((f"{self.noun}_back", f"{self.noun} {peer} is heard from again"))
        return told


@dataclass
class ProxySeen:
    """A proxy as its last hello described it."""

    url: str
    seen: float
    owed: set[int]  # rollouts it holds journaled, un-acked records of


class ProxyBook:
    def __init__(self) -> None:
        self.seen: dict[str, ProxySeen] = {}
        self._hold_until = 0.0  # a resumed daemon trains nothing before its proxies have said what they owe
        self._silences = Silences("proxy", PROXY_SILENT_S, "steps wait for the model calls it may owe")

    def hold(self, now: float) -> None:
        """A resumed daemon: what its proxies owe is unknown until each has said hello."""
        self._hold_until = now + HOLD_AFTER_START_S

    def hello(self, msg: ProxyHello, now: float) -> bool:
        """Record a hello; True for a proxy not seen before."""
        new = msg.proxy_id not in self.seen
        self.seen[msg.proxy_id] = ProxySeen(msg.url, now, set(msg.owed))
        self._silences.heard(msg.proxy_id, now)
        return new

    def silences(self, now: float) -> list[tuple[str, str]]:
        """proxy_silent and proxy_back rows due (Silences)."""
        return self._silences.check(now)

    def url(self) -> str | None:
        """The proxy heard from last: where new runs are sent."""
        live = [(p.seen, p.url) for p in self.seen.values()]
        return max(live)[1] if live else None

    def owed(self, now: float) -> tuple[str | None, set[int]]:
        """Model calls a proxy may still send: (why any run's may be missing, or None; the runs live proxies say
        they owe records of). A proxy says what it owes in its hello; one gone silent (killed? restarting: its
        journal comes back with it) may owe anything, and so may every proxy in a resumed daemon's first
        seconds (they have not said yet)."""
        if now < self._hold_until:
            return "the daemon has just resumed: its proxies have not said what they owe", set()
        owed: set[int] = set()
        for proxy, p in self.seen.items():
            if PROXY_SILENT_S < now - p.seen < PROXY_GONE_S:
                return f"proxy {proxy} is silent: it may owe model calls", set()
            if now - p.seen <= PROXY_SILENT_S:
                owed |= p.owed
        return None, owed
