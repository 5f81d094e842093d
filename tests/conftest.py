"""Shared fixtures: configs on disk, the gyre CLI as a subprocess, a local run of real processes."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.launch.local import start_local_run

REPO = Path(__file__).resolve().parents[1]
# the fixture tasks' own repositories and hidden tests: theirs to run, inside their images, not this suite's
collect_ignore_glob = ["fixtures/*"]


def write_config(path: Path, state_dir: Path, **sections) -> Path:
    data = {
        "run": {"name": "t", "state_dir": str(state_dir)},
        "cluster": {"cells": 2, "engine": "none"},  # control-plane tests: no engines or trainers
        "control": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "switch_timeout_s": 20},
        "ledger": {"flush_interval_s": 0.02},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def warm_model() -> Path:
    """The tiny policy after a short warm-up: it writes well-formed write_file tool calls. It is the built-in model
    of a `builtin:sevens` run, built once under the repository's state/models/ as `gyre model create` builds it
    (under its lock, so parallel test workers and later sessions share the one build)."""
    from gyre_slurm.bootstrap.base_model import ensure_model
    from gyre_slurm.config import parse_config

    cfg = parse_config({"run": {"name": "warm", "state_dir": str(REPO / "state")}, "model": {"warmup_steps": 100},
                        "tasks": {"suite": "builtin:sevens"}}, "the test suite's warm model")
    return ensure_model(cfg)


REAL_CLI_TESTS = "tests/test_real_harnesses"  # (and _images): they wait for tools/test.sh's background model builds


def pytest_collection_modifyitems(config, items) -> None:
    """The order under xdist (tools/test.sh): the Slurm tests first, then the other slow end-to-end tests, then the
    short ones, which fill the workers' gaps; the real-CLI tests last, so that no worker sits waiting for the long
    models' build (tens of minutes on a fresh clone) while other tests could run."""
    items.sort(key=lambda i: (i.nodeid.startswith(REAL_CLI_TESTS), i.get_closest_marker("slurm") is None,
                              i.get_closest_marker("slow") is None))


def pytest_addoption(parser) -> None:
    parser.addoption("--cpu-report", metavar="FILE", help="write each test's wall and machine-wide CPU seconds (all "
                     "its processes: on 2 cores the wall time alone hides what a test costs the others) as TSV")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("--cpu-report")
    if not out:
        yield
        return
    t, c = time.monotonic(), _busy_cpu_s()
    yield
    with open(out, "a") as f:  # appended per test: workers (xdist) and an interrupted run still leave their rows
        f.write(f"{item.nodeid}\t{time.monotonic() - t:.1f}\t{_busy_cpu_s() - c:.1f}\n")


def _busy_cpu_s() -> float:
    """The machine's busy CPU seconds so far (/proc/stat: every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (tools/test.sh): a test module is one work unit, run in its order by one worker, as its
    module-scoped fixtures expect (test_engine.py's engine carries its weight version from test to test) and
    built once; the Slurm tests share the local cluster's 4 nodes that way too. Units go out in the order
    pytest_collection_modifyitems gives (xdist's default re-sorts them by size, which would start the short
    modules first). pytest-xdist's own loadgroup cannot be used: its xdist_group mark renames node ids in a way
    pytest 9.2 no longer honours."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModulesInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

    return ModulesInOrder(config, log)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def config_file(tmp_path: Path, state_dir: Path) -> Path:
    return write_config(tmp_path / "run.yaml", state_dir)


def gyre(*args: str, timeout: float = 60, cwd: Path | None = None, env: dict | None = None):
    """Run the real `gyre` CLI in a subprocess."""
    return subprocess.run([sys.executable, "-m", "gyre_slurm", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env={**os.environ, "COLUMNS": "160", **(env or {})})


@pytest.fixture
def local_run(config_file: Path):
    """A daemon and one agent per node as real processes, all registered."""
    cfg = load_config(config_file)
    run = start_local_run(cfg, "r1")
    yield run
    run.kill()


def q(db: Path, sql: str, *params):
    """Read a ledger (or a run folder's ledger) with plain sqlite3, as a user would."""
    db = Path(db)
    conn = sqlite3.connect(db / "ledger.db" if db.is_dir() else db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def wait_for(pred, timeout: float = 15.0, what: str = "condition", on_fail=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
        except sqlite3.OperationalError:  # the ledger is not created yet
            v = None
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{on_fail()}")


async def until_decoding(client, n: int = 1, timeout: float = 60.0) -> None:
    """Wait until an engine decodes `n` requests submitted just before (asyncio tasks not yet started): a fixed
    sleep races the engine on a loaded machine, where a request may still wait to be admitted after it."""
    import asyncio

    import httpx

    def state() -> tuple[int, int]:
        info = httpx.get(client.base_url + "/get_server_info", timeout=10).json()["internal_states"][0]
        return info["running_requests"], info["generated_tokens"]

    start = state()[1]  # before the tasks run: this coroutine has not yielded yet
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        running, generated = await asyncio.to_thread(state)
        if running >= n and generated - start >= 2 * n:  # every one admitted, and a few tokens out
            return
    raise AssertionError(f"the engine did not decode {n} request(s) within {timeout} s")


def alive(pid: int) -> bool:
    """A process that still runs (a zombie nobody reaped has stopped running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def embedded_config(tmp_path: Path, model: Path, name: str, **sections: dict) -> Path:
    """A small embedded run's config file (2 cells, fast heartbeats, the given model); `sections` override
    whole sections, e.g. tasks={...}."""
    cfg = {
        "run": {"name": name, "state_dir": str(tmp_path / "state"), "max_wall_s": 600},
        "cluster": {"cells": 2, "engine": "embedded", "rollouts_per_cell": 8},
        "control": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10},
        "model": {"path": str(model)},
        **sections,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_to_the_end(config: Path, run_id: str, timeout_s: float = 400):
    """Start a local run of `config`, wait until its daemon ends it, and check that no process failed."""
    run = start_local_run(load_config(config), run_id)
    try:
        assert run.daemon.wait(timeout=timeout_s) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    assert not run.failed(), run.failed()
    return run


def kill_and_resume_daemon(run, config: Path, run_id: str, timeout: float = 300) -> None:
    """kill -9 the run's daemon, check the ledger survived, start it again on the same run and let it finish."""
    import signal

    from gyre_slurm.spawn import gyre_argv, spawn

    os.kill(run.daemon.pid, signal.SIGKILL)
    run.daemon.wait()
    assert q(run.run_dir / "ledger.db", "PRAGMA integrity_check") == [("ok",)]
    run.daemon = spawn(gyre_argv("daemon", str(config), "--run-id", run_id), run.run_dir / "logs" / "daemon2.log")
    assert run.daemon.wait(timeout=timeout) == 0
    run.wait(timeout_s=30)


def mount_tmpfs(folder: Path, size: str) -> None:
    """A small file system of its own at `folder` (root, as the suite's set-up is), so that a test can fill it."""
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.fail(f"this test mounts a small tmpfs, as root: {r.stderr.strip()}")


def fill_disk(folder: Path) -> Path:
    """Another writer fills the file system of `folder` to ENOSPC and holds it: the file to delete for room."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    from disk_faults import fill  # tools/disk_faults.py: chaos.py's filler

    return fill(folder / "filler")
