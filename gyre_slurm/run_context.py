"""A run as each of its processes sees it: its id, its folder, its config and its daemon's control info.

The run's config is saved once, as state/<run>/config.yaml, by whatever starts or resumes the run (a launcher, or
`gyre daemon CONFIG`), before its daemon starts; every process of the run — the daemon started by a launcher,
agents, proxies, workers, on any node — reads that copy, never the user's file again. The copy holds absolute
folders, so a process started elsewhere (another node, a requeued job) finds the same state folder and model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.config import RunConfig, load_config
from gyre_slurm.errors import GyreError
from gyre_slurm.rundir import CONFIG_FILE, ControlInfo, load_run_config, read_control, run_id_for, save_config


def run_dir_for(cfg: RunConfig, run_id: str | None = None) -> Path:
    """The folder of the run of `cfg`: <run.state_dir>/<run id> (given, else GYRE_RUN_ID, run.id, a new id)."""
    return (cfg.run.state_dir / run_id_for(cfg, run_id)).absolute()


def locate(run_dir: Path | None, config: Path | None = None, run_id: str | None = None) -> Path:
    """The folder of a run named by a process's options: --run-dir, or --config (and --run-id)."""
    if config is not None:
        return run_dir_for(load_config(config), run_id)
    if run_dir is None:
        raise GyreError("needs --run-dir, or --config (and --run-id)")
    return Path(run_dir).absolute()


@dataclass(frozen=True)
class RunContext:
    run_dir: Path
    cfg: RunConfig | None  # the saved copy; None only for a folder without one (a process started by hand)
    control: ControlInfo | None = None  # the daemon's control.json when the process waited for it

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @property
    def config(self) -> RunConfig:
        if self.cfg is None:
            raise GyreError(f"{self.run_dir} has no {CONFIG_FILE}: not a gyre run folder")
        return self.cfg

    @classmethod
    def create(cls, cfg: RunConfig, run_id: str | None = None) -> RunContext:
        """Start or resume the run of `cfg` (run id: given, else GYRE_RUN_ID, run.id, a new one): its folder, and the
        saved copy of its config, which a resumed run takes from the config it is resumed with."""
        run_dir = run_dir_for(cfg, run_id)
        model = cfg.model if cfg.model.path is None else cfg.model.model_copy(
            update={"path": cfg.model.path.absolute()})
        saved = cfg.model_copy(update={"run": cfg.run.model_copy(update={"state_dir": run_dir.parent}),
                                       "model": model})
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(run_dir, saved)
        return cls(run_dir, saved)

    @classmethod
    def open(cls, run_dir: Path, *, wait_s: float = 0.0, config_optional: bool = False) -> RunContext:
        """A process of the run: with wait_s, first wait that long for its daemon's control.json (the saved config is
        there before it); then read the saved config (config_optional: a folder without one gives None)."""
        run_dir = Path(run_dir).absolute()
        control = read_control(run_dir, wait_s=wait_s) if wait_s else None
        if config_optional and not (run_dir / CONFIG_FILE).is_file():
            return cls(run_dir, None, control)
        return cls(run_dir, load_run_config(run_dir), control)

    @classmethod
    def of_process(cls, run_dir: Path | None, config: Path | None, run_id: str | None, *, wait_s: float = 0.0,
                   config_optional: bool = False) -> RunContext:
        """`gyre agent/proxy/worker`'s run: --run-dir, or --config and --run-id (the saved copy is read either way)."""
        return cls.open(locate(run_dir, config, run_id), wait_s=wait_s, config_optional=config_optional)
