"""The names of the figures gyre sends to experiment trackers: one table that series.py, the sinks and
docs/tracking.md all use.

One naming scheme: veRL's tag where veRL logs the same figure (critic/score/mean, actor/grad_norm, timing_s/gen,
training/global_step…), else `gyre/…`; evaluations use `eval/…` (veRL's validation tags carry the data source in
the name, so there is no fixed veRL name to reuse). The slime counterpart is documented beside each, never logged.
Each record's `source` is the key series.py computes the figure under; a tag is sent only when its source has a
value for that step or evaluation (a figure the ledger lacks is absent, never a made-up 0).
"""

from __future__ import annotations

from dataclasses import dataclass

STEP_AXIS = "training/global_step"  # the x of every point: the policy version a step published / an eval scored


@dataclass(frozen=True)
class Metric:
    source: str  # what series.py computes it from: train_steps.<column>, metrics.<key of train_steps.metrics>,
    # runs.<figure over the step's runs>, switches.*, cells.*, evals.<column>
    tag: str  # the name written to TensorBoard and W&B
    verl: str  # veRL's name for the figure ("" none)
    slime: str  # slime's name for the figure ("" none)
    meaning: str


STEP_METRICS: tuple[Metric, ...] = (
    Metric("train_steps.version_out", STEP_AXIS, "training/global_step", "rollout/step",
           "The version the step published (step s publishes s+1): the x of every point."),
    # the runs of the step: rollouts of the groups trained in it (groups.train_step = s)
    Metric("runs.reward_mean", "critic/score/mean", "critic/score/mean", "rollout/raw_reward",
           "Mean reward of the step's trained runs (scored, not excluded). gyre puts no KL penalty into rewards, so "
           "veRL's critic/rewards/mean would be the same figure."),
    Metric("runs.reward_max", "critic/score/max", "critic/score/max", "", "Highest reward of the trained runs."),
    Metric("runs.reward_min", "critic/score/min", "critic/score/min", "", "Lowest reward of the trained runs."),
    Metric("runs.reward_std", "gyre/score/std", "", "",
           "Standard deviation (population) of the trained runs' rewards."),
    Metric("runs.pass_rate", "gyre/pass_rate", "", "passrate/pass@1",
           "Share of the trained runs whose reward is at least eval.pass_score (1.0 when the config has none)."),
    Metric("runs.trained", "gyre/runs/trained", "", "", "Runs with an advantage (scored, not excluded)."),
    Metric("runs.total", "gyre/runs/total", "", "", "All runs of the step's groups, excluded ones included."),
    Metric("runs.completion_tokens_mean", "response_length/mean", "response_length/mean",
           "rollout/response_len/mean", "Mean completion tokens per run of the step's groups (all its model calls)."),
    Metric("runs.prompt_tokens_mean", "prompt_length/mean", "prompt_length/mean", "",
           "Mean prompt tokens per run, summed over its model calls (each call re-sends the context)."),
    Metric("runs.prompt_tokens", "gyre/tokens/prompt", "", "", "Prompt tokens of all runs of the step's groups."),
    Metric("runs.completion_tokens", "gyre/tokens/completion", "", "",
           "Completion tokens of all runs of the step's groups."),
    Metric("train_steps.tokens_trained", "gyre/tokens/trained", "", "", "Target tokens the step trained on."),
    # time
    Metric("train_steps.step_s", "timing_s/step", "timing_s/step", "perf/step_time",
           "Seconds from the step's start to its end (train_steps.ended_at − started_at)."),
    Metric("train_steps.rollout_s", "timing_s/gen", "timing_s/gen", "perf/rollout_time",
           "Seconds from the first admission of its groups to the last of its runs ending."),
    Metric("train_steps.train_s", "timing_s/update_actor", "timing_s/update_actor", "perf/train_time",
           "Seconds from sending the step to the trainer to its new weights."),
    Metric("metrics.publish_s", "timing_s/update_weights", "timing_s/update_weights", "perf/update_weights_time",
           "Seconds the core took to publish the new weights."),
    Metric("metrics.train_busy_s", "gyre/time/train_busy_s", "", "perf/actor_train_time",
           "Seconds the step's shards were computed, plus the core's optimizer step and save."),
    Metric("metrics.open_s", "gyre/time/open_s", "", "",
           "Seconds the step stayed open to groups joining it (streaming steps)."),
    Metric("metrics.finish_seconds", "gyre/time/finish_s", "", "",
           "Seconds of the core's optimizer step and weight save."),
    Metric("metrics.overlap_share", "gyre/overlap_share", "", "",
           "Share of the step's training time during which runs were still rolling out."),
    Metric("metrics.overlap_s", "gyre/overlap_s", "", "", "Training seconds that overlapped rollouts."),
    # the cells: role switches that ended within the step's window [started_at, ended_at], time per role in it
    Metric("switches.to_train_s", "gyre/switch/to_train_s", "", "",
           "Mean seconds (requested → done) of the switches to TRAIN that ended within the step."),
    Metric("switches.to_rollout_s", "gyre/switch/to_rollout_s", "", "",
           "Mean seconds (requested → done) of the switches to ROLLOUT that ended within the step."),
    Metric("switches.count", "gyre/switch/count", "", "", "Role switches (DONE) that ended within the step."),
    Metric("cells.rollout_s", "gyre/cells/rollout_s", "", "",
           "Cell-seconds in ROLLOUT within the step's window (cell_spans clipped to it)."),
    Metric("cells.train_s", "gyre/cells/train_s", "", "", "Cell-seconds in TRAIN within the step's window."),
    Metric("cells.switching_s", "gyre/cells/switching_s", "", "",
           "Cell-seconds in SWITCHING within the step's window."),
    Metric("cells.down_s", "gyre/cells/down_s", "", "", "Cell-seconds DOWN within the step's window."),
    # off-policyness
    Metric("metrics.staleness_mean", "gyre/staleness/mean", "", "",
           "Mean versions between a run's oldest sampled token and the weights trained."),
    Metric("metrics.staleness_max", "gyre/staleness/max", "", "", "Most versions behind of any run of the step."),
    Metric("metrics.mismatch", "gyre/mismatch", "rollout_corr/kl", "train/train_rollout_logprob_abs_diff",
           "Median over runs of |δ_r|, the run's mean log-ratio of the trained policy to the sampling one (veRL "
           "and slime estimate the same gap per token)."),
    # the optimizer
    Metric("metrics.loss", "actor/pg_loss", "actor/pg_loss", "train/loss",
           "The GSPO loss; with train.kl_coef > 0 it includes kl_coef · KL (veRL logs that apart)."),
    Metric("metrics.clip_frac", "actor/pg_clipfrac", "actor/pg_clipfrac", "train/pg_clipfrac",
           "Share of trained tokens whose ratio was clipped."),
    Metric("metrics.grad_norm", "actor/grad_norm", "actor/grad_norm", "train/grad_norm",
           "Gradient norm before clipping."),
    Metric("metrics.kl", "actor/kl_loss", "actor/kl_loss", "train/kl_loss",
           "KL to the reference policy (k3, per-run mean); only with a reference (train.kl_coef > 0)."),
    Metric("metrics.lr", "actor/lr", "actor/lr", "train/lr-pg_0", "Learning rate of the step."),
    # what did not make it into the step
    Metric("metrics.groups_dropped", "gyre/groups_dropped", "", "",
           "Groups dropped before the step, groups_dropped_small + groups_dropped_zero_var (too few valid runs, "
           "zero reward variance; slime's dynamic filter counts the latter as rollout/dynamic_filter/drop_*)."),
    Metric("metrics.frac_excluded_eval", "gyre/runs/eval_error_share", "", "",
           "Share of the step's runs excluded because the evaluator failed."),
    Metric("metrics.frac_excluded_infra", "gyre/runs/infra_error_share", "", "",
           "Share of the step's runs excluded for an infrastructure error."),
    Metric("metrics.frac_timeout_scored", "gyre/runs/timeout_share", "", "",
           "Share of the step's runs killed at the harness time limit (scored from their workspace)."),
    Metric("metrics.frac_truncated_context", "gyre/runs/truncated_share", "response_length/clip_ratio",
           "rollout/truncated_ratio", "Share of the step's runs whose reply hit a length limit."),
)

EVAL_METRICS: tuple[Metric, ...] = (
    Metric("evals.pass_at_1", "eval/pass@1", "val-core/<data_source>/acc/mean@<n>", "eval/<name>-pass@1",
           "pass@1 on the held-out tasks: mean over tasks of the share of runs scoring at least pass_score."),
    Metric("evals.pass_at_k", "eval/pass@k", "val-core/<data_source>/acc/best@<k>/mean", "eval/<name>-pass@<k>",
           "Unbiased pass@k, k in eval/k (one tag whatever k is, so the curve stays one line)."),
    Metric("evals.k", "eval/k", "", "", "The k of eval/pass@k (eval.samples)."),
    Metric("evals.score_mean", "eval/score_mean", "val-core/<data_source>/reward/mean@<n>", "eval/<name>",
           "Mean score of the evaluation's scored runs."),
    Metric("evals.timeout_share", "eval/timeout_share", "", "",
           "Share of scored runs that hit the harness time limit."),
    Metric("evals.n_runs", "eval/runs", "", "", "Runs that were scored."),
    Metric("evals.n_excluded", "eval/excluded", "", "", "Runs excluded for evaluator or infrastructure errors."),
)

METRICS: tuple[Metric, ...] = STEP_METRICS + EVAL_METRICS
_BY_SOURCE = {m.source: m for m in METRICS}
assert len(_BY_SOURCE) == len(METRICS) and len({m.tag for m in METRICS}) == len(METRICS), "names must be unique"


def tag(source: str) -> str:
    return _BY_SOURCE[source].tag


def tagged(values: dict[str, float]) -> dict[str, float]:
    """Figures keyed by source → the same keyed by tag (KeyError for a source the table lacks: add it there)."""
    return {_BY_SOURCE[s].tag: v for s, v in values.items()}
