"""What the simulator runs: a workload (cluster shape, batch, run-duration model, training cost) and the paper's
results it is compared with.

Run durations follow docs/algorithms.md §5.2: d = min(m_g·exp(σ_w·Z), T_max) with a per-task scale
m_g = m·exp(σ_b·Z_g): runs of one task (one group) share m_g, and T_max is a point mass (runs killed at their
time limit, scored from their workspace). Training a step costs (c_fix + c_tok·tokens) cell-seconds at full
efficiency; n cells deliver n·eff(n) cell-seconds per second, so T_train(n) = (c_fix + c_tok·tokens)/(n·eff(n)).
A streaming step (docs/algorithms.md §8) gets c_tok·tokens of each group as it joins, and c_fix once, when its last
group is in: a non-streaming step's work is the same.

Load (the `slowdown(load)` hook, docs/algorithms.md §5.2): a sampled duration d is the run's time alone on its cell,
tool time (1 − f)·d plus LLM time f·d, f = llm_frac. With n runs on its cell the LLM part stretches by the
per-stream throughput curve (curves.py), so the run progresses at 1 / ((1 − f) + f·slowdown(n)) of its alone
speed; the harness still kills it at T_max of wall time. No curve: every run at its alone speed (load-free).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from gyre_slurm.sim.curves import Curve, slowdown

# docs/algorithms.md §5.2 / the paper: mean role-switch times measured by QwenGyre
SWITCH_RT_S = 8.52  # rollout → train
SWITCH_TR_S = 3.46  # train → rollout


@dataclass(frozen=True)
class RunSample:
    """One run of a group: its agent time and whether it yields a valid (scored) sample."""

    duration_s: float
    ok: bool = True
    tokens: float = 0.0  # tokens trained from it (drives c_tok)


@dataclass(frozen=True)
class PaperResult:
    """What the QwenGyre paper reports for a workload (from summaries of the paper): elastic's speedups as ranges."""

    vs_async: tuple[float, float]  # T_async / T_elastic, best-tuned async
    vs_colocate: tuple[float, float]  # T_colocate / T_elastic
    hours: dict[str, float] = field(default_factory=dict)  # total hours per policy, where published

    @property
    def colocate_over_async(self) -> float:
        """T_colocate / T_async implied by the two speedup ranges (midpoints): the calibration target."""
        return (sum(self.vs_colocate) / 2) / (sum(self.vs_async) / 2)


@dataclass(frozen=True)
class Workload:
    """A simulated RL run. Times in seconds; "cell-seconds" is one cell busy for one second."""

    name: str
    description: str
    cells: int  # C: identical cells the GPUs are split into
    nodes_per_cell: int  # only shown: the cost model works in cells
    runs_per_cell: int  # k: concurrent agent runs one ROLLOUT cell serves
    groups_per_step: int  # B: groups trained per step
    steps: int  # training steps of the run
    median_s: float  # m: median run duration before the time limit
    timeout_s: float  # T_max: the harness's time limit (point mass of the duration distribution)
    train_s_per_mtok: float  # c_tok: training cell-seconds per million trained tokens
    group_size: int = 16  # G (the paper: GSPO with 16 runs per group)
    sigma_run: float = 0.6  # σ_w: run-to-run spread within a task (log scale)
    sigma_task: float = 0.3  # σ_b: task-to-task spread of the median (log scale)
    tokens_per_s: float = 100.0  # tokens trained per second of agent time (tokens ∝ duration)
    train_fix_s: float = 0.0  # c_fix: cell-seconds per step independent of tokens
    eff_alpha: float = 0.05  # eff(n) = 1 / (1 + α(n − 1)): data-parallel overhead per extra cell
    switch_rt_s: float = SWITCH_RT_S
    switch_tr_s: float = SWITCH_TR_S
    sync_s: float = 10.0  # weight broadcast to the rollout cells after a step
    migrate_s: float = 30.0  # re-prefill of one migrated run's context on its new cell
    p_eval_err: float = 0.0  # a run's evaluator fails: the run is excluded (never scored 0)
    p_infra_err: float = 0.0  # a run crashes part-way: excluded, its slot freed early
    min_valid: int = 2  # a group with fewer valid runs is dropped (admission refills it)
    eta: int = 1  # η: default bounded staleness for this workload
    slowdown_curve: Curve | None = None  # per-stream throughput by concurrent streams (None: load-free runs)
    llm_frac: float = 1.0  # f: the LLM share of a run's time alone on its cell (the rest is tool time)
    replay_groups: tuple[tuple[RunSample, ...], ...] = ()  # measured groups (gyre simulate --from-ledger)
    paper: PaperResult | None = None

    def with_(self, **changes) -> Workload:
        return replace(self, **changes)

    def eff(self, n: int) -> float:
        return 1.0 / (1.0 + self.eff_alpha * (n - 1))

    def train_rate(self, n: int) -> float:
        """Cell-seconds of training work n cells finish per second."""
        return n * self.eff(n)

    def token_work(self, tokens: float) -> float:
        """Training cell-seconds that grow with the tokens (a streaming step gets them group by group)."""
        return self.train_s_per_mtok * tokens / 1e6

    def train_work(self, tokens: float) -> float:
        return self.train_fix_s + self.token_work(tokens)

    def run_speed(self, load: int) -> float:
        """Seconds of a run's alone-time done per second with `load` runs on its cell (1 without a curve)."""
        if self.slowdown_curve is None:
            return 1.0
        return 1.0 / ((1.0 - self.llm_frac) + self.llm_frac * slowdown(self.slowdown_curve, max(1, load)))

    def train_time(self, n: int, tokens: float) -> float:
        """T_train(n) for a batch of `tokens` (docs/algorithms.md §5.2)."""
        return self.train_work(tokens) / self.train_rate(n)

    def mean_step_tokens(self) -> float:
        """Expected tokens of one step's batch (B·G runs), for printing T_train(n)."""
        if self.replay_groups:
            runs = [r for g in self.replay_groups for r in g]
            return self.groups_per_step * self.group_size * sum(r.tokens for r in runs) / max(1, len(runs))
        return self.groups_per_step * self.group_size * self.tokens_per_s * self.mean_duration()

    def mean_duration(self) -> float:
        """E[min(d, T_max)] of the log-normal model, closed form (σ² = σ_w² + σ_b²)."""
        s = math.hypot(self.sigma_run, self.sigma_task)
        if s == 0:
            return min(self.median_s, self.timeout_s)
        mu, c = math.log(self.median_s), math.log(self.timeout_s)
        phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731 - the normal CDF
        below = math.exp(mu + s * s / 2) * phi((c - mu - s * s) / s)
        return below + self.timeout_s * (1 - phi((c - mu) / s))

    def sample_group(self, seed: int, gid: int) -> list[RunSample]:
        """The G runs of group `gid`: the same for every policy given the seed (common random numbers)."""
        rng = random.Random(seed * 1_000_003 + gid)
        if self.replay_groups:
            measured = self.replay_groups[rng.randrange(len(self.replay_groups))]
            return [measured[i] if i < len(measured) else rng.choice(measured) for i in range(self.group_size)]
        m_g = self.median_s * math.exp(self.sigma_task * rng.gauss(0.0, 1.0))
        out = []
        for _ in range(self.group_size):
            d = min(m_g * math.exp(self.sigma_run * rng.gauss(0.0, 1.0)), self.timeout_s)
            infra, evalerr, cut = rng.random(), rng.random(), rng.random()  # always drawn: fixed stream per group
            if infra < self.p_infra_err:
                out.append(RunSample(d * cut, ok=False))
            else:
                out.append(RunSample(d, ok=evalerr >= self.p_eval_err, tokens=self.tokens_per_s * d))
        return out
