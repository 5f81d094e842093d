"""Against a real Slurm on this machine (tools/slurm/local_cluster.sh, 4 emulated nodes): the sbatch script and
`gyre submit` (submitit) start the daemon and one agent per node; cells switch through the CLI.

When Slurm cannot be brought up these tests fail; they never skip."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, gyre, q, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("sinfo") is None or subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        r = subprocess.run(["bash", str(REPO / "tools/slurm/local_cluster.sh"), "up"], capture_output=True,
                           text=True, timeout=900)
        if r.returncode != 0:
            pytest.fail(f"the local Slurm cluster could not be started:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    r = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True)
    nodes = sum(int(line.split()[0]) for line in r.stdout.splitlines() if line.split()[1] in ("idle", "mix", "alloc"))
    assert nodes >= 4, f"expected 4 usable Slurm nodes, sinfo says: {r.stdout}"






def seed_model_cache(state_dir: Path, warm_model: Path, config: Path) -> None:
    """Put the built-in model where the run looks for it (as a previous run would have left it)."""
    from gyre_slurm.config import load_config
    from gyre_slurm.train.base_model import builtin_dir

    cfg = load_config(config).model_copy()
    dest = state_dir / builtin_dir(cfg).relative_to(cfg.run.state_dir)
    shutil.copytree(warm_model, dest)
    (dest / "gyre_model.json").write_text('{"kind": "tiny-qwen3"}\n')


def job_state(job: str) -> str:
    r = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return r.stdout.strip().split("\n")[0]


def test_sbatch_four_agents_register_and_a_cell_switches(slurm, tmp_path: Path, warm_model: Path) -> None:
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    gyre_bin = str(Path(sys.executable).parent / "gyre")
    r = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--export=ALL,GYRE={gyre_bin}",
                        str(REPO / "sbatch/gyre.sbatch"), str(REPO / "configs/tiny-slurm.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    run_id = f"tiny-slurm-{job}"
    db = tmp_path / "state" / run_id / "ledger.db"
    out = tmp_path / f"gyre-{job}.out"
    logs = lambda: out.read_text() if out.exists() else "(no job output yet)"  # noqa: E731
    try:
        wait_for(lambda: q(db, "SELECT count(*) FROM agents WHERE status = 'UP'") == [(4,)], 120,
                 "four agents to register", logs)
        agents = q(db, "SELECT node_index, node_name, slurm_job_id, cell_id FROM agents ORDER BY node_index")
        assert [(a[0], a[1], a[2], a[3]) for a in agents] == [(k, f"node{k + 1}", job, k) for k in range(4)]
        assert q(db, "SELECT role FROM cells ORDER BY id") == [("ROLLOUT",)] * 4
        assert q(db, "SELECT slurm_job_id FROM runs") == [(job,)]

        r = gyre("cells", "reassign", run_id, "2", "--role", "train", "--state-dir", tmp_path / "state")
        assert r.returncode == 0, r.stderr
        m = re.search(r"done in ([0-9.]+) s", r.stdout)
        assert m, r.stdout
        (status, to, dur), = q(db, "SELECT status, to_role, duration_s FROM role_switches WHERE cell_id = 2 "
                                   "AND reason = 'manual'")
        assert status == "DONE" and to == "TRAIN" and 0 < dur < 30
        # pinned: the policy leaves the cell alone until it is released; then colocate takes it back to rollouts
        assert q(db, "SELECT pinned FROM cells WHERE id = 2") == [(1,)]
        r = gyre("cells", "release", run_id, "2", "--state-dir", tmp_path / "state")
        assert r.returncode == 0, r.stderr
        wait_for(lambda: q(db, "SELECT count(*) FROM role_switches WHERE cell_id = 2 AND to_role = 'ROLLOUT' "
                               "AND reason LIKE 'scheduler:%' AND status = 'DONE'") == [(1,)], 60,
                 "the scheduler's switch back", logs)
        # the RL loop runs inside the allocation: engines on the nodes, proxy and worker beside the daemon
        wait_for(lambda: q(db, "SELECT count(*) FROM model_calls")[0][0] > 0, 180, "a model call", logs)
        r = gyre("status", run_id, "--state-dir", tmp_path / "state")
        assert r.returncode == 0 and f"slurm job {job}" in r.stdout
    finally:
        subprocess.run(["scancel", job])
    # scancel: the daemon stops cleanly and closes the run in the ledger
    wait_for(lambda: q(db, "SELECT status FROM runs") == [("STOPPED",)], 60, "run STOPPED after scancel", logs)
    wait_for(lambda: job_state(job) not in ("", "RUNNING", "PENDING"), 60, "job to end")
    assert q(db, "PRAGMA integrity_check") == [("ok",)]


def test_gyre_submit_runs_the_daemon_and_each_cell_as_jobs(slurm, tmp_path: Path, warm_model: Path) -> None:
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    cfg = yaml.safe_load((REPO / "configs/tiny-slurm.yaml").read_text())
    cfg["run"]["state_dir"] = str(tmp_path / "state")
    cfg["cluster"]["cells"] = 2
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = gyre("submit", path, "--run-id", "sub1", timeout=300)
    jobs = re.findall(r"\b(\d+)\b", r.stdout.split("daemon job", 1)[-1]) if "daemon job" in r.stdout else []
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        db = tmp_path / "state" / "sub1" / "ledger.db"
        rows = q(db, "SELECT node_index, cell_id, slurm_job_id, status FROM agents ORDER BY node_index")
        assert [(n, c, s) for n, c, _j, s in rows] == [(0, 0, "UP"), (1, 1, "UP")]
        daemon_job = q(db, "SELECT slurm_job_id FROM runs")[0][0]
        assert len({daemon_job, rows[0][2], rows[1][2]}) == 3  # three separate Slurm jobs
        assert sorted(jobs) == sorted([daemon_job, rows[0][2], rows[1][2]])
        r = gyre("cells", "reassign", "sub1", "1", "--role", "train", "--state-dir", tmp_path / "state")
        assert r.returncode == 0, r.stderr
        assert gyre("cells", "release", "sub1", "1", "--state-dir", tmp_path / "state").returncode == 0
        wait_for(lambda: q(db, "SELECT role FROM cells WHERE id = 1") == [("ROLLOUT",)], 60, "cell 1 back")
        # a cell job lost to Slurm (preemption, node failure) turns its cell DOWN; the rest goes on
        subprocess.run(["scancel", rows[0][2]], check=True)
        wait_for(lambda: q(db, "SELECT role FROM cells WHERE id = 0") == [("DOWN",)], 60, "cell 0 DOWN")
        assert q(db, "SELECT role FROM cells WHERE id = 1") == [("ROLLOUT",)]
    finally:
        for j in jobs:
            subprocess.run(["scancel", j])
    wait_for(lambda: all(job_state(j) not in ("", "RUNNING", "PENDING") for j in jobs), 60, "jobs to end")
