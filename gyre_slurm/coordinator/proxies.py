"""The TITO proxies as the daemon knows them: where they listen and which runs' model calls they still owe."""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.protocol import ProxyHello

HOLD_AFTER_START_S = 5.0  # proxies say hello every 2 s (proxy/daemon_link.py): by then each has said what it owes
PROXY_SILENT_S = 6.0  # three hellos missed: the proxy is down or restarting
PROXY_GONE_S = 60.0  # silent this long: gone for good, and what it owed with it (training goes on)


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
        self._silent: set[str] = set()  # told silent (an events row), not heard from since

    def hold(self, now: float) -> None:
        """A resumed daemon: what its proxies owe is unknown until each has said hello."""
        self._hold_until = now + HOLD_AFTER_START_S

    def hello(self, msg: ProxyHello, now: float) -> bool:
        """Record a hello; True for a proxy not seen before."""
        new = msg.proxy_id not in self.seen
        self.seen[msg.proxy_id] = ProxySeen(msg.url, now, set(msg.owed))
        return new

    def silences(self, now: float) -> list[tuple[str, str]]:
        """(events kind, message) for each proxy that went silent (down, restarting, hung or cut off from the
        daemon: what it owes is then unknown) or was heard from again since the last call."""
        told: list[tuple[str, str]] = []
        for proxy, p in self.seen.items():
            quiet = now - p.seen > PROXY_SILENT_S
            if quiet and proxy not in self._silent:
                self._silent.add(proxy)
                told.append(("proxy_silent", f"proxy {proxy}: no hello for {now - p.seen:.0f} s (down, hung or cut "
                                             "off from the daemon); steps wait for the model calls it may owe"))
            elif not quiet and proxy in self._silent:
                self._silent.discard(proxy)
                told.append(("proxy_back", f"proxy {proxy} is heard from again"))
        return told

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
