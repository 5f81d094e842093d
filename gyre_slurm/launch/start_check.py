"""What a run's start checks of its model (`gyre run`, `gyre submit`; `gyre check` and `gyre layout` print the same):
that model.path holds weights, that the model splits over the parallel sizes, and that the memory plan fits the
GPUs. Each refusal is one line."""

from __future__ import annotations

import json
from pathlib import Path

from gyre_slurm.config import RunConfig
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.memory_fit import fit_problem
from gyre_slurm.launch.model_shape import read_shape, refuse_planning_shape
from gyre_slurm.launch.ranks import check_model_fits


def check_model_at_start(cfg: RunConfig, model_dir: Path) -> None:
    """Refuse, in one line, a planning shape, sizes the model cannot be cut into, or a config that does not fit."""
    refuse_planning_shape(model_dir)
    try:
        check_model_fits(cfg.train, json.loads((Path(model_dir) / "config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise GyreError(f"{model_dir}: {e}") from None
    problem = fit_problem(read_shape(model_dir), cfg)
    if problem is not None:
        raise GyreError(problem)
