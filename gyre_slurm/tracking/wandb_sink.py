"""Points into a Weights & Biases run.

W&B drops a `log(step=…)` whose step is below one already logged, and gyre's points do not arrive in x order: an
evaluation of version v often ends after the step that published v+1. So nothing is logged with `step=`: every row
carries `training/global_step` (the x) and `define_metric` makes it the x-axis of every tag, so rows may come in any
order and none is lost (W&B's own `_step` just counts rows).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Literal

from gyre_slurm.tracking.names import METRICS, STEP_AXIS
from gyre_slurm.tracking.series import Point


def wandb_run_id(run_id: str) -> str:
    """A stable W&B run id for a gyre run (W&B ids allow letters, digits, - and _): the same run id resumes the
    same W&B run after a daemon restart."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:48]
    return f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


class WandbSink:
    name = "wandb"

    def __init__(self, *, project: str, entity: str | None, run_id: str, wandb_id: str, dir: Path,
                 mode: Literal["offline", "online"], config: dict[str, Any]) -> None:
        import wandb  # here: a run without this backend never loads wandb (ImportError → the tracker warns)

        Path(dir).mkdir(parents=True, exist_ok=True)
        # console off: W&B must not take over the daemon's stdout/stderr; no system stats: the daemon's node is
        # not where the GPUs work
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True,
                                  save_code=False)
        self.run = wandb.init(project=project, entity=entity, name=run_id, id=wandb_id, dir=str(dir), mode=mode,
                              config=config, resume="allow", reinit="create_new", settings=settings)
        self.run.define_metric(STEP_AXIS)
        for m in METRICS:
            if m.tag != STEP_AXIS:
                self.run.define_metric(m.tag, step_metric=STEP_AXIS)

    @property
    def folder(self) -> Path:
        """The run's own folder (offline: what `wandb sync` uploads)."""
        return Path(self.run.dir).parent

    def write(self, point: Point) -> None:
        self.run.log({**point.values, STEP_AXIS: point.x})

    def close(self) -> None:
        self.run.finish()
