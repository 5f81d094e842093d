"""Against a real Slurm on this machine (tools/slurm/local_cluster.sh, 4 emulated nodes): the sbatch script and
`gyre submit` (submitit) start the daemon and one agent per node; cells switch through the CLI.

When Slurm cannot be brought up these tests fail; they never skip."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gyre_slurm.rundir import read_control

from .conftest import REPO, gyre, q, wait_for

# one xdist worker runs these in turn: they share the local cluster's 4 nodes (conftest.py)
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
    from gyre_slurm.bootstrap.base_model import builtin_dir
    from gyre_slurm.config import load_config

    cfg = load_config(config).model_copy()
    dest = state_dir / builtin_dir(cfg).relative_to(cfg.run.state_dir)
    shutil.copytree(warm_model, dest)
    (dest / "gyre_model.json").write_text('{"kind": "tiny-qwen3"}\n')


def job_state(job: str) -> str:
    r = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True)
    return r.stdout.strip().split("\n")[0]


def reassign_by_hand(state: Path, run_id: str, cell: int, timeout_s: float = 120) -> int:
    """`gyre cells reassign` of a ROLLOUT cell to TRAIN; its switch's id. Colocate moves every cell to TRAIN for each
    step and back (steps of 8 runs: every few seconds), so the cell is caught in ROLLOUT: a reassign that found it
    in TRAIN already (pinned there, no switch), switching or DOWN is released and tried again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = gyre("cells", "reassign", run_id, str(cell), "--role", "train", "--state-dir", state)
        if r.returncode == 0 and re.search(r"done in ([0-9.]+) s", r.stdout):
            rows = q(state / run_id, "SELECT max(id) FROM role_switches WHERE cell_id = ? AND reason = 'manual'", cell)
            return rows[0][0]
        if r.returncode == 0:  # pinned where it was
            assert gyre("cells", "release", run_id, str(cell), "--state-dir", state).returncode == 0
        else:  # switching now, or DOWN for a moment (heartbeats late on a machine this busy): again
            assert "already switching" in r.stderr or "is DOWN" in r.stderr, r.stderr
        time.sleep(0.3)
    raise AssertionError(f"cell {cell} never caught in ROLLOUT in {timeout_s:g} s")


def _sbatch(tmp_path: Path, config: Path, nodes: int = 4) -> str:
    gyre_bin = str(Path(sys.executable).parent / "gyre")
    r = subprocess.run(["sbatch", "--parsable", "-N", str(nodes), f"--chdir={tmp_path}",
                        f"--export=ALL,GYRE={gyre_bin}", str(REPO / "sbatch/gyre.sbatch"), str(config)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def test_sbatch_one_allocation_stops_on_scancel_and_the_same_command_resumes(slurm, tmp_path: Path,
                                                                             warm_model: Path) -> None:
    """3 cells in a 4-node allocation: the daemon, proxy and worker get node1 to themselves, one agent per other
    node; a cell switches by hand; scancel stops the run cleanly; the same sbatch command (run.id fixed) resumes it
    from the ledger and its steps continue from the last weight version."""
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    cfg = yaml.safe_load((REPO / "configs/tiny-slurm.yaml").read_text())
    cfg["run"]["id"] = "sb-resume"
    cfg["cluster"]["cells"] = 3
    cfg["tasks"]["group_size"] = 4  # steps of 8 runs: this test is about the allocation and the resume
    cfg["train"]["steps"] = 1000  # scancel ends it, not its last step (steps of 8 runs go by in seconds)
    config = tmp_path / "sb.yaml"
    config.write_text(yaml.safe_dump(cfg))
    job = _sbatch(tmp_path, config)
    db = tmp_path / "state" / "sb-resume" / "ledger.db"
    logs = lambda: "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("gyre-*.out"))  # noqa: E731
    jobs = [job]
    try:
        wait_for(lambda: q(db, "SELECT count(*) FROM agents WHERE status = 'UP'") == [(3,)], 120,
                 "three agents to register", logs)
        agents = q(db, "SELECT node_index, node_name, slurm_job_id, cell_id FROM agents ORDER BY node_index")
        assert agents == [(k, f"node{k + 2}", job, k) for k in range(3)]  # node1: daemon, proxy and worker alone
        assert q(db, "SELECT slurm_job_id FROM runs") == [(job,)]
        assert "daemon, proxy and worker on node1; 3 agent(s) on node2,node3,node4" in logs()

        manual = reassign_by_hand(tmp_path / "state", "sb-resume", 2)
        (status, to), = q(db, "SELECT status, to_role FROM role_switches WHERE id = ?", manual)
        assert (status, to) == ("DONE", "TRAIN") and q(db, "SELECT pinned FROM cells WHERE id = 2") == [(1,)]
        assert gyre("cells", "release", "sb-resume", "2", "--state-dir", tmp_path / "state").returncode == 0
        wait_for(lambda: q(db, "SELECT count(*) FROM role_switches WHERE cell_id = 2 AND to_role = 'ROLLOUT' "
                               "AND reason LIKE 'scheduler:%' AND status = 'DONE' AND id > ?", manual)[0][0] >= 1,
                 60, "the scheduler's switch back", logs)
        wait_for(lambda: q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE'")[0][0] >= 1, 240,
                 "a first step", logs)
        r = gyre("status", "sb-resume", "--state-dir", tmp_path / "state")
        assert r.returncode == 0 and f"slurm job {job}" in r.stdout

        subprocess.run(["scancel", job], check=True)  # the daemon stops cleanly and closes the run in the ledger
        wait_for(lambda: q(db, "SELECT status FROM runs") == [("STOPPED",)], 60, "run STOPPED after scancel", logs)
        wait_for(lambda: job_state(job) not in ("", "RUNNING", "PENDING"), 60, "job to end")
        # its nodes free again (a job is CANCELLED in sacct while its nodes still complete: minutes on a busy machine)
        wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip(),
                 300, "the job to leave the queue")
        assert q(db, "PRAGMA integrity_check") == [("ok",)]
        done = q(db, "SELECT step, version_out FROM train_steps WHERE status = 'DONE' ORDER BY step")
        last_step, last_version = done[-1]

        resumed = time.time()
        job2 = _sbatch(tmp_path, config)  # the same command
        jobs.append(job2)
        wait_for(lambda: q(db, "SELECT daemon_starts, status FROM runs") == [(2, "RUNNING")], 300, "the resume", logs)
        wait_for(lambda: q(db, "SELECT count(*) FROM train_steps WHERE status = 'DONE' AND step > ?",
                           last_step)[0][0] >= 1, 300, "a step after the resume", logs)
        (step, version_in), = q(db, "SELECT step, version_in FROM train_steps WHERE step = ?", last_step + 1)
        assert version_in == last_version  # continues from the last weight version, not from the base model
        assert q(db, "SELECT DISTINCT slurm_job_id FROM agents") == [(job2,)]
        assert q(db, "SELECT slurm_job_id FROM runs") == [(job2,)]
        # the runs the stop cut short never report (their worker stopped too): closed at the resume, not waited for
        assert q(db, "SELECT count(*) FROM rollouts WHERE status = 'RUNNING' AND started_at < ?", resumed) == [(0,)]
        assert q(db, "SELECT registrations FROM agents") == [(2,)] * 3
    finally:
        subprocess.run(["scancel", *jobs])
    wait_for(lambda: q(db, "SELECT status FROM runs") == [("STOPPED",)], 60, "run STOPPED after scancel", logs)
    assert q(db, "PRAGMA integrity_check") == [("ok",)]


def test_sbatch_starts_the_plans_harness_workers(slurm, tmp_path: Path, warm_model: Path) -> None:
    """harness.workers: 3 → the batch step runs the daemon, the proxy and three workers (gyre node-run --services),
    each of which asks the daemon for work under its own name; the second node runs the one agent."""
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    cfg = yaml.safe_load((REPO / "configs/tiny-slurm.yaml").read_text())
    cfg["run"]["id"] = "sb-workers"
    cfg["cluster"]["cells"] = 1
    cfg["harness"]["workers"] = 3
    config = tmp_path / "workers.yaml"
    config.write_text(yaml.safe_dump(cfg))
    job = _sbatch(tmp_path, config, nodes=2)  # the services get the first node to themselves
    run_dir = tmp_path / "state" / "sb-workers"
    logs = lambda: "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("gyre-*.out"))  # noqa: E731
    asked = lambda: sorted(m.split(":")[0] for (m,) in q(run_dir / "ledger.db",  # noqa: E731
                                                          "SELECT message FROM events WHERE kind = 'sandbox'"))
    try:
        wait_for(lambda: (run_dir / "ledger.db").is_file() and len(asked()) >= 3, 120, "three workers", logs)
        assert asked() == ["worker w0", "worker w1", "worker w2"]  # each its own process, named by the plan
        wait_for(lambda: q(run_dir / "ledger.db", "SELECT count(*) FROM agents WHERE status = 'UP'") == [(1,)], 60,
                 "the agent", logs)
        services = re.search(r"gyre: (\S+) runs daemon, proxy, worker-0, worker-1, worker-2\n", logs())
        agent = re.search(r"gyre: (\S+) runs agent-0\n", logs())
        assert services and agent, logs()
        assert q(run_dir / "ledger.db", "SELECT node_name FROM agents") == [(agent[1],)] and agent[1] != services[1]
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["state_dir"] == str(tmp_path / "state")
        assert not (run_dir / "slurm").exists()  # one saved copy of the config: the run's config.yaml
    finally:
        subprocess.run(["scancel", job])
    wait_for(lambda: q(run_dir / "ledger.db", "SELECT status FROM runs") == [("STOPPED",)], 60, "run STOPPED", logs)


def _submit_config(tmp_path: Path, warm_model: Path) -> Path:
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    cfg = yaml.safe_load((REPO / "configs/tiny-slurm.yaml").read_text())
    cfg["run"]["state_dir"] = str(tmp_path / "state")
    cfg["scheduler"]["policy"] = "elastic"
    cfg["slurm"]["poll_s"] = 2.0
    cfg["tasks"]["group_size"] = 4  # steps of 8 runs, not 32: this test is about the jobs, not learning
    cfg["train"]["steps"] = 1000  # `gyre stop` ends it, not its last step (steps of 8 runs go by in seconds)
    path = tmp_path / "submit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _steps_after(db: Path, t: float) -> list[tuple]:
    return q(db, "SELECT step, n_cells FROM train_steps WHERE status = 'DONE' AND ended_at > ?", t)


def _kill_inside_the_jobs(db: Path, run_dir: Path, cell1_job: str, daemon_job: str, logs) -> None:
    """kill -9 of a cell's agent and of the daemon: each job's supervisor starts the process again, in the same job."""
    (agent_pid, regs), = q(db, "SELECT pid, registrations FROM agents WHERE node_index = 1")
    os.kill(agent_pid, signal.SIGKILL)
    wait_for(lambda: q(db, "SELECT registrations, status FROM agents WHERE node_index = 1") == [(regs + 1, "UP")],
             120, "cell 1's agent started again in its job", logs)
    starts = q(db, "SELECT daemon_starts FROM runs")[0][0]
    os.kill(read_control(run_dir).daemon_pid, signal.SIGKILL)
    wait_for(lambda: q(db, "SELECT daemon_starts FROM runs") == [(starts + 1,)], 120, "the daemon started again", logs)
    killed_at = time.time()
    wait_for(lambda: _steps_after(db, killed_at), 300, "a step after the kills", logs)
    told = [m for (m,) in q(db, "SELECT message FROM events WHERE kind = 'process_restarted'")]
    assert any(m.startswith("agent-1 died (exit -9)") for m in told), told
    assert any(m.startswith("daemon died (exit -9)") for m in told), told
    assert q(db, "SELECT slurm_job_id, slurm_state FROM cells WHERE id = 1") == [(cell1_job, "RUNNING")]
    assert q(db, "SELECT slurm_job_id FROM runs") == [(daemon_job,)]


@pytest.mark.timeout(1200)  # about 4 minutes alone here; twice that on a slower or busier machine
def test_gyre_submit_cells_come_go_and_requeue_as_slurm_jobs(slurm, tmp_path: Path, warm_model: Path) -> None:
    """4 cells as 4 Slurm jobs beside the daemon's: one cancelled → the run goes on with 3 and loses no run; `gyre
    cells add` brings it back and the policy uses it; a requeued cell job rejoins; a requeued daemon job resumes."""
    path = _submit_config(tmp_path, warm_model)
    state = tmp_path / "state"
    r = gyre("submit", path, "--run-id", "sub1", timeout=300)
    m = re.search(r"daemon job (\d+), cell jobs ([\d, ]+);", r.stdout)
    jobs = [m.group(1), *m.group(2).split(", ")] if m else []
    db = state / "sub1" / "ledger.db"
    logs = lambda: "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(  # noqa: E731
        (state / "sub1" / "slurm").glob("*_log.err")))
    try:
        assert r.returncode == 0 and len(jobs) == 5, r.stdout + r.stderr
        daemon_job, cell_jobs = jobs[0], jobs[1:]
        assert q(db, "SELECT slurm_job_id FROM runs") == [(daemon_job,)]
        assert q(db, "SELECT id, slurm_job_id, slurm_state FROM cells ORDER BY id") == [
            (c, j, "RUNNING") for c, j in enumerate(cell_jobs)]
        assert q(db, "SELECT node_index, cell_id, slurm_job_id, status FROM agents ORDER BY node_index") == [
            (c, c, j, "UP") for c, j in enumerate(cell_jobs)]
        wait_for(lambda: _steps_after(db, 0), 240, "a first step", logs)

        # a cell job cancelled mid-run: its cell is DOWN from Slurm's word; the run goes on on 3 cells
        subprocess.run(["scancel", cell_jobs[3]], check=True)
        cancelled_at = time.time()
        wait_for(lambda: q(db, "SELECT role FROM cells WHERE id = 3") == [("DOWN",)], 30, "cell 3 DOWN", logs)
        wait_for(lambda: len(_steps_after(db, cancelled_at + 1)) >= 2, 240, "two steps on 3 cells", logs)
        assert all(n <= 3 for _s, n in _steps_after(db, cancelled_at + 1))
        assert q(db, "SELECT count(*) FROM rollouts WHERE status IN ('INFRA_ERROR', 'FAILED')") == [(0,)]
        assert q(db, "SELECT count(*) FROM events WHERE kind = 'agent_lost' AND message LIKE ?",
                 f"%Slurm job {cell_jobs[3]} is %") == [(1,)]

        # gyre cells add: the DOWN cell comes back under its number, in a new job, and the policy uses it
        added_at = time.time()
        r = gyre("cells", "add", "sub1", "1", "--state-dir", state, timeout=120)
        assert r.returncode == 0 and "cell(s) 3: submitted job(s)" in r.stdout, r.stdout + r.stderr
        new_job = re.search(r"submitted job\(s\) (\d+)", r.stdout).group(1)
        wait_for(lambda: q(db, "SELECT status, slurm_job_id FROM agents WHERE node_index = 3") == [("UP", new_job)],
                 120, "cell 3's new agent", logs)
        wait_for(lambda: q(db, "SELECT (SELECT count(*) FROM rollouts WHERE cell_id = 3 AND started_at > :t) + "
                               "(SELECT count(*) FROM shards WHERE done_by = 3 AND done_at > :t)",
                           added_at)[0][0] > 0, 240, "the policy to use cell 3 again", logs)
        r = gyre("status", "sub1", "--state-dir", state)
        assert r.returncode == 0 and f"{new_job} RUNNING" in r.stdout, r.stdout

        # scontrol requeue of a cell job: its agents come back in the same job and the cell rejoins
        subprocess.run(["scontrol", "requeue", new_job], check=True)
        wait_for(lambda: q(db, "SELECT registrations, status FROM agents WHERE node_index = 3") == [(3, "UP")], 180,
                 "the requeued cell job's agent", logs)
        wait_for(lambda: q(db, "SELECT role FROM cells WHERE id = 3")[0][0] in ("ROLLOUT", "TRAIN"), 60,
                 "cell 3 back after its requeue", logs)
        assert q(db, "SELECT slurm_job_id, slurm_state FROM cells WHERE id = 3") == [(new_job, "RUNNING")]

        # the daemon's own job requeued: it resumes from the ledger, the agents wait and register again
        subprocess.run(["scontrol", "requeue", daemon_job], check=True)
        wait_for(lambda: q(db, "SELECT daemon_starts FROM runs") == [(2,)], 180, "the daemon's second start", logs)
        resumed_at = time.time()
        wait_for(lambda: _steps_after(db, resumed_at), 300, "a step after the daemon's requeue", logs)
        assert q(db, "SELECT status FROM runs") == [("RUNNING",)]
        assert q(db, "SELECT count(*) FROM events WHERE kind = 'daemon_suspended'") == [(1,)]
        steps = [s for (s,) in q(db, "SELECT step FROM train_steps WHERE status = 'DONE' ORDER BY step")]
        assert steps == list(range(len(steps)))  # every step once, none skipped

        _kill_inside_the_jobs(db, state / "sub1", cell_jobs[1], daemon_job, logs)

        r = gyre("stop", "sub1", "--state-dir", state)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: q(db, "SELECT status FROM runs") == [("STOPPED",)], 60, "run STOPPED", logs)
        live = [*cell_jobs[:3], new_job, daemon_job]
        wait_for(lambda: all(job_state(j) not in ("", "RUNNING", "PENDING") for j in live), 120, "jobs to end", logs)
        assert q(db, "PRAGMA integrity_check") == [("ok",)]
    finally:
        subprocess.run(["scancel", *jobs, *re.findall(r"submitted job\(s\) (\d+)", r.stdout)])


@pytest.mark.timeout(900)
def test_sbatch_starts_a_cells_trainer_ranks_on_its_own_nodes(slurm, tmp_path: Path, warm_model: Path) -> None:
    """2 cells of 2 nodes in a 4-node allocation, each a TP=2 Megatron cell with one rank per node: the agent of a
    cell's first node leads rank 0 and starts rank 1 on the cell's second node with srun; colocate, so both cells
    train every step (the core and a satellite)."""
    seed_model_cache(tmp_path / "state", warm_model, REPO / "configs/tiny-slurm.yaml")
    cfg = yaml.safe_load((REPO / "configs/tiny-slurm.yaml").read_text())
    cfg["run"]["id"] = "sb-ranks"
    cfg["cluster"].update(cells=2, nodes_per_cell=2)
    cfg["tasks"].update(group_size=4, groups_per_step=2)
    cfg["train"].update(steps=2, backend="megatron", tensor_parallel=2, shard_runs=1)
    config = tmp_path / "ranks.yaml"
    config.write_text(yaml.safe_dump(cfg))
    job = _sbatch(tmp_path, config)
    run_dir = tmp_path / "state" / "sb-ranks"
    logs = lambda: "\n".join(p.read_text()[-3000:] for p in (*tmp_path.glob("gyre-*.out"),  # noqa: E731
                                                             *run_dir.glob("logs/agent-*.log")))
    try:
        wait_for(lambda: job_state(job) not in ("", "RUNNING", "PENDING"), 600, "the run to end", logs)
    finally:
        subprocess.run(["scancel", job])
    db = run_dir / "ledger.db"
    assert q(db, "SELECT step, status FROM train_steps ORDER BY step") == [(0, "DONE"), (1, "DONE")], logs()
    assert q(db, "SELECT status FROM runs") == [("STOPPED",)]
    # each training cell's rank 1 ran on that cell's second node (node1-2: cell 0, node3-4: cell 1)
    for cell, node in ((0, "node2"), (1, "node4")):
        ranks = [p.read_text() for p in (run_dir / "logs" / f"cell{cell}-ranks").glob("rank1-*.log")]
        assert ranks and all(f"trainer rank 1 of 2 on {node} " in r for r in ranks), (cell, ranks)
        # a group its leader closed: the pipe's end crossed to the other node (one still starting when the run
        # ended is cancelled with the job's steps)
        assert any("stdin closed: leaving" in r for r in ranks), ranks
    done_by = {c for (c,) in q(db, "SELECT DISTINCT done_by FROM shards WHERE status = 'DONE'")}
    assert 0 in done_by and done_by <= {0, 1}, done_by
