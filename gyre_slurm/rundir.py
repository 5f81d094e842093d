"""Where a run lives on disk: state/<run>/{ledger.db, config.yaml, control.json, logs/} (run_context.py: a run as
its processes open it).

control.json holds the daemon's endpoint and the run's secret token (mode 0600): only processes of the user
who owns the run can read it, so only the run's own peers can talk to its daemon.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from gyre_slurm.config import RunConfig, dump_config, load_config
from gyre_slurm.errors import GyreError, RunNotFound

CONTROL_FILE = "control.json"
LEDGER_FILE = "ledger.db"
CONFIG_FILE = "config.yaml"


@dataclass
class ControlInfo:
    endpoint: str  # what peers connect to, tcp://host:port
    port: int
    token: str
    daemon_pid: int
    daemon_host: str
    started_at: float
    slurm_job_id: str | None = None  # the daemon's own Slurm job, if it runs in one (agents watch it)
    curve: dict[str, str] | None = None  # control.encrypt: the channel's CURVE keys (Z85), see peer.py


def ledger_path(run_dir: Path) -> Path:
    return Path(run_dir) / LEDGER_FILE


def new_run_id(name: str) -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return f"{name}-{job}" if job else f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_id_for(cfg: RunConfig, given: str | None = None) -> str:
    """The run a start belongs to: --run-id, else GYRE_RUN_ID, else run.id of the config (all three resume the run
    when its ledger exists), else a new id."""
    return given or os.environ.get("GYRE_RUN_ID") or cfg.run.id or new_run_id(cfg.run.name)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 (the file holds the run secret)."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_control(run_dir: Path, info: ControlInfo) -> None:
    write_private(run_dir / CONTROL_FILE, json.dumps(asdict(info), indent=1))


def read_control(run_dir: Path, wait_s: float = 0.0) -> ControlInfo:
    path = Path(run_dir) / CONTROL_FILE
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ControlInfo(**json.loads(path.read_text()))
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise GyreError(f"no daemon has started for this run yet ({path} is missing)") from None
        except (json.JSONDecodeError, TypeError) as e:
            if time.monotonic() >= deadline:
                raise GyreError(f"{path} is damaged: {e}") from None
        time.sleep(0.1)


def save_config(run_dir: Path, cfg: RunConfig) -> None:
    """The run's one saved config (run_context.RunContext.create); atomic: processes of the run may be reading it."""
    path = run_dir / CONFIG_FILE
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    os.replace(tmp, path)


def load_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise GyreError(f"{run_dir} has no {CONFIG_FILE}: not a gyre run folder")
    return load_config(path)


def list_runs(state_dir: Path) -> list[Path]:
    state_dir = Path(state_dir)
    if not state_dir.is_dir():
        return []
    runs = [p for p in state_dir.iterdir() if (p / LEDGER_FILE).is_file()]
    return sorted(runs, key=lambda p: (p / LEDGER_FILE).stat().st_mtime)


def resolve_run(run: str, state_dir: Path = Path("state")) -> Path:
    """A run given as a folder, an id under state_dir, a unique id prefix, or 'last' (most recently written)."""
    p = Path(run)
    if (p / LEDGER_FILE).is_file():
        return p
    runs = list_runs(state_dir)
    if run == "last" and runs:
        return runs[-1]
    exact = [r for r in runs if r.name == run]
    if exact:
        return exact[0]
    prefixed = [r for r in runs if r.name.startswith(run)]
    if len(prefixed) == 1:
        return prefixed[0]
    known = ", ".join(r.name for r in runs[-5:]) or "none"
    if len(prefixed) > 1:
        raise RunNotFound(f"run '{run}' is ambiguous: {', '.join(r.name for r in prefixed[:5])}")
    raise RunNotFound(f"no run '{run}' under {state_dir}/ (recent runs: {known})")
