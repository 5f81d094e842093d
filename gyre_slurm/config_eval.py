"""The `eval:` and `tracking:` sections of the run configuration (config.py holds the others)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SUITE_PREFIXES = ("builtin:", "harbor:")  # harness/tasks.py: the rest are JSONL files


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def check_suite(v: str) -> str:
    """A suite spec names a built-in suite, a Harbor or NL2Repo folder, or a JSONL file (of SWE-bench rows with
    swe:) that exists."""
    for prefix, what in (("harbor:", "Harbor"), ("nl2repo:", "NL2Repo")):
        if v.startswith(prefix):
            if not Path(v.removeprefix(prefix)).is_dir():
                raise ValueError(f"no such folder of {what} tasks: {v.removeprefix(prefix)}")
            return v
    if v.startswith("swe:"):
        if not Path(v.removeprefix("swe:")).is_file():
            raise ValueError(f"no such file of SWE-bench rows: {v.removeprefix('swe:')}")
    elif not v.startswith("builtin:") and not Path(v).is_file():
        raise ValueError(f"no such task file: {v}")
    return v


class EvalSection(Section):
    suite: str | None = Field(
        None, description="Evaluation suite of its own (builtin:<name>, harbor:<folder> or a JSONL file); null = "
        "the tasks of tasks.suite named by holdout_tasks / holdout_share, which training never sees.")
    holdout_tasks: list[str] = Field(
        default_factory=list, description="Task ids of tasks.suite held out for evaluation (never trained on).")
    holdout_share: float = Field(
        0.0, ge=0, lt=1, description="Share of tasks.suite held out for evaluation, drawn with run.seed (at least "
        "one task), when holdout_tasks is empty and suite is null.")
    every_steps: int = Field(0, ge=0, description="Evaluate the version each N-th step publishes (0 = only at "
                             "start, at end and on demand: `gyre eval`).")
    at_start: bool = Field(True, description="Evaluate version 0 before the first step (the baseline of the curve).")
    at_end: bool = Field(True, description="Evaluate the last version before the run stops.")
    samples: int = Field(8, ge=1, description="Runs per task in one evaluation: pass@1 is their pass share, pass@k "
                         "the unbiased estimate with k = samples.")
    temperature: float | None = Field(1.0, ge=0, le=2, description="Sampling temperature of evaluation runs (the "
                                      "proxy sets it on every call); null = what the harness asks for.")
    pass_score: float = Field(1.0, gt=0, le=1, description="A run passes when its score is at least this.")
    slot_share: float = Field(0.25, gt=0, le=1, description="Share of each rollout cell's slots (of "
                              "cluster.rollouts_per_cell) evaluation runs may hold; training runs leave them free "
                              "while evaluation runs wait.")

    @field_validator("suite")
    @classmethod
    def _suite_exists(cls, v: str | None) -> str | None:
        return None if v is None else check_suite(v)

    @property
    def enabled(self) -> bool:
        """Whether the run has tasks to evaluate on."""
        return self.suite is not None or bool(self.holdout_tasks) or self.holdout_share > 0

    @model_validator(mode="after")
    def _has_tasks(self) -> EvalSection:
        if self.suite is not None and (self.holdout_tasks or self.holdout_share):
            raise ValueError("eval.suite and eval.holdout_tasks / holdout_share exclude each other: evaluate on a "
                             "suite of its own or on tasks held out of tasks.suite")
        if self.every_steps and not self.enabled:
            raise ValueError(f"eval.every_steps: {self.every_steps} needs tasks to evaluate on: set eval.suite, "
                             "eval.holdout_tasks or eval.holdout_share")
        return self


class TrackingSection(Section):
    backends: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="Experiment trackers the daemon logs every step and evaluation to: "
        "tensorboard (event files in state/<run>/tb/), wandb, or both; empty = none (`gyre export` can replay "
        "the ledger into either later).")
    wandb_project: str = Field("gyre", description="W&B project.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); null = your default.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline writes state/<run>/wandb/ (`wandb sync` uploads it later); "
        "online sends as it goes (needs `wandb login`).")

    @field_validator("backends")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("name each backend once")
        return v
