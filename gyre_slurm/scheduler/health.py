"""Is the run failing? Pure: the rollout book feeds it every run's and group's outcome; the daemon asks it before
admitting work. A run whose last `infra_runs` finished runs were all infrastructure errors (the proxy is gone, the
harness cannot start) or whose last `dropped_groups` groups were all dropped (every run of a group scored alike)
is DEGRADED: it admits no more work except one probe group every `probe_s`, so it stops burning the cluster and
says why; the first outcome that breaks the pattern (a run that was not an infrastructure error, a group that was
not dropped) makes it healthy again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RunHealth:
    infra_runs: int = 32
    dropped_groups: int = 10
    probe_s: float = 30.0
    _last_runs: deque = field(default_factory=deque)  # True: an infrastructure error
    _dropped_streak: int = 0
    _last_probe: float | None = None

    def run_finished(self, infra_error: bool) -> None:
        self._last_runs.append(infra_error)
        while len(self._last_runs) > self.infra_runs:
            self._last_runs.popleft()

    def group_finished(self, outcome: str) -> None:
        """"ready", or the reason a group was dropped: only groups whose runs all scored alike ("zero_variance")
        make the streak; one dropped for too few valid runs is the infrastructure rule's business."""
        if outcome == "ready":
            self._dropped_streak = 0
        elif outcome == "zero_variance":
            self._dropped_streak += 1

    def reason(self) -> str | None:
        """Why the run is DEGRADED, or None when it is healthy."""
        if self.infra_runs and len(self._last_runs) >= self.infra_runs and all(self._last_runs):
            return (f"the last {self.infra_runs} runs were all infrastructure errors (is the proxy up? can the "
                    f"harness start? see v_harness_errors)")
        if self.dropped_groups and self._dropped_streak >= self.dropped_groups:
            return (f"the last {self.dropped_groups} groups were all dropped: every run of a group scored alike "
                    f"(the policy may have collapsed, or the suite is too hard or too easy for it)")
        return None

    def may_probe(self, now: float) -> bool:
        """While degraded: one group may go out now (then not again for probe_s)."""
        if self._last_probe is not None and now - self._last_probe < self.probe_s:
            return False
        self._last_probe = now
        return True

    def healthy_again(self) -> None:
        self._last_probe = None
