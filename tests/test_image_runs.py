"""Runs in their tasks' own container images, in both runtimes (bubblewrap over the image, podman), through the
worker's own code (worker/rollout.py): the shipped fixture suites score their solutions and their empty changes as
documented; nothing outside the run's image and workspace can be read from inside; a run that forks without end,
eats memory or fills its disk is ended alone, scored, while another run beside it goes on.

The fixture images are built here from Debian's packages once (tools/fixture_images.py: about a minute the first
time) and unpacked once into the repository's image cache (state/images)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from gyre_slurm.harness.cgroups import RunLimits
from gyre_slurm.harness.tasks import TaskSpec, load_suite

from .images import FIXTURES, REPO, fixture_images_built, run_task, runtime, script_harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
RUNTIMES = ["image", "podman"]


@pytest.fixture(scope="module", autouse=True)
def images() -> dict[str, str]:
    return fixture_images_built()


def _swe() -> tuple[dict[str, TaskSpec], dict[str, dict]]:
    path = FIXTURES / "swe" / "tasks.jsonl"
    rows = {r["instance_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    return {t.id: t for t in load_suite(f"swe:{path}")}, rows


def _apply(patch: str) -> str:
    return f"git apply <<'GYRE_PATCH'\n{patch}GYRE_PATCH\n"


def _kind(name: str) -> str:
    return "podman" if name == "podman" else "bwrap"


@pytest.mark.parametrize("rt_name", RUNTIMES)
def test_swe_fixtures_score_their_solution_one_and_no_change_zero(tmp_path: Path, rt_name: str) -> None:
    """Each SWE row: its gold patch applied by the run inside the image scores 1.0, no change 0.0; the calculator's
    half fix (one of its two FAIL_TO_PASS tests) 0.5, and a fix that breaks a PASS_TO_PASS test 0.0."""
    rt = runtime(_kind(rt_name))
    tasks, rows = _swe()
    half_fix = ("python3 - <<'PY'\nfrom pathlib import Path\np = Path('calc/ops.py')\ns = p.read_text()\n"
                "p.write_text(s.replace('    return a / b', '    if b == 0:\\n        raise ValueError(\"division by "
                "zero\")\\n    return a / b'))\nPY\n")
    breaks_add = _apply(rows["gyre__calc-1"]["patch"]) + "sed -i 's/return a + b/return a - b/' calc/ops.py\n"
    cases = [(iid, "solution", _apply(r["patch"]), 1.0) for iid, r in rows.items()]
    cases += [(iid, "empty", "true", 0.0) for iid in rows]
    cases += [("gyre__calc-1", "half", half_fix, 0.5), ("gyre__calc-1", "breaks-p2p", breaks_add, 0.0)]
    for iid, name, script, want in cases:
        done = run_task(tasks[iid], tmp_path / f"{iid}-{name}", rt, script_harness(script))
        assert (done.status, done.reward) == ("COMPLETED", want), (iid, name, done.error,
                                                                    (tmp_path / f"{iid}-{name}" / ".gyre" /
                                                                     "eval.log").read_text()[-3000:])
    # the run's changes are its layer alone: the gold patch's file, not the image's other files
    changed = tmp_path / "gyre__calc-1-solution" / "changes"
    assert (changed / "calc" / "ops.py").is_file() and not (changed / "README.md").exists()
    assert (changed / "TASK.md").read_text() == tasks["gyre__calc-1"].prompt


@pytest.mark.parametrize("rt_name", RUNTIMES)
def test_the_nl2repo_fixture_scores_the_share_of_its_hidden_tests(tmp_path: Path, rt_name: str) -> None:
    rt = runtime(_kind(rt_name))
    task = load_suite(f"nl2repo:{FIXTURES / 'nl2repo'}")[0]
    solution = (FIXTURES / "nl2repo" / "kvstore" / "solution" / "kvstore" / "__init__.py").read_text()
    write = f"mkdir -p kvstore && cat > kvstore/__init__.py <<'PY'\n{solution}PY\n"
    half = write.replace("    def delete(self, key):", "    def _delete(self, key):").replace(
        "    def __len__(self):", "    def _len(self):")
    for name, script, want in [("solution", write, 1.0), ("empty", "true", 0.0), ("half", half, 0.5)]:
        done = run_task(task, tmp_path / name, rt, script_harness(script))
        assert (done.status, done.reward) == ("COMPLETED", want), (name, done.error)
    # the hidden tests were never in the run's view: its workspace holds what it wrote and its task only
    assert sorted(p.name for p in (tmp_path / "solution" / "changes").iterdir()) == ["TASK.md", "kvstore"]


def _sentinel_world(tmp_path: Path) -> dict[str, Path]:
    """A run folder as a daemon leaves one (control.json, ledger, config, another run's workspace) and a host file."""
    state = tmp_path / "state"
    run = state / "r-1"
    (run / "workspaces" / "r2").mkdir(parents=True)
    files = {"control": run / "control.json", "ledger": run / "ledger.db", "config": run / "config.yaml",
             "other": run / "workspaces" / "r2" / "secret.txt", "host": tmp_path / "host-secret.txt"}
    for p in files.values():
        p.write_text("secret\n")
    return {**files, "state": state, "ws": run / "workspaces" / "r1"}


@pytest.mark.parametrize("rt_name", RUNTIMES)
def test_nothing_outside_the_image_and_the_workspace_can_be_read_or_reached(tmp_path: Path, rt_name: str) -> None:
    """The escape probes (tests/fixtures/escape_probe.sh) from inside an image run, as the run's own harness: the
    run token (control.json), the ledger, the config, another run's workspace, the hidden tests (before grading:
    on the host and at /tests), a host file, the unpacked image on the host, the daemon's port; no write outside
    the workspace, no mount. Every try fails; the probe ran to its end."""
    rt = runtime(_kind(rt_name))
    w = _sentinel_world(tmp_path)
    task = load_suite(f"nl2repo:{FIXTURES / 'nl2repo'}")[0]
    image = rt.image(task.image or "")
    daemon = socket.socket()  # a daemon's port on the host's loopback
    daemon.bind(("127.0.0.1", 0))
    daemon.listen(8)
    probe = (FIXTURES / "escape_probe.sh").read_text()
    args = [str(w["control"]), str(w["ledger"]), str(w["config"]), str(w["other"]), str(task.tests_dir),
            str(w["host"]), str(image.rootfs), f"127.0.0.1:{daemon.getsockname()[1]}"]
    try:
        done = run_task(task, w["ws"], rt, ["bash", "-c", probe, "probe", *args], state_dir=w["state"])
    finally:
        daemon.close()
    lines = (w["ws"] / "changes" / "probe.txt").read_text().splitlines()
    assert lines[-1] == "done", lines
    assert [ln for ln in lines if ln.startswith("GOT")] == [], lines
    assert len(lines) == 16, lines
    # the probe sees what is there: run on the host, outside any sandbox, it reads every file it was given
    (tmp_path / "host-run").mkdir()
    subprocess.run(["bash", "-c", probe, "probe", *args], cwd=tmp_path / "host-run", timeout=60, check=True)
    got = (tmp_path / "host-run" / "probe.txt").read_text().splitlines()
    assert {f"GOT {k}" for k in ("control", "ledger", "config", "other_workspace", "hidden_tests", "host_file",
                                 "image_cache_on_host", "host_processes")} <= set(got), got
    assert done.status == "COMPLETED"
    assert not (Path(image.rootfs) / "gyre-probe").exists() and "x" not in (Path(image.rootfs) / "etc" / "passwd") \
        .read_text().splitlines()[-1:]


FAULTS = {
    "fork-bomb": ("b(){ b | b & }; b; sleep 120", "process limit (64): fork() was refused"),
    "memory-hog": ("python3 -c 'x = bytearray(600 * 2**20); import time; time.sleep(120)'; sleep 120",
                   "memory limit (256 MB): the kernel's OOM killer ended a process of the run"),
    "disk-filler": ("for i in $(seq 1 40); do head -c 10M /dev/zero > fill-$i; done; sleep 120",
                    "disk limit (64 MB of changes)"),
}


@pytest.mark.parametrize("rt_name", RUNTIMES)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_run_past_its_limits_is_ended_alone_and_scored(tmp_path: Path, rt_name: str, fault: str) -> None:
    """A fork bomb, a memory hog and a disk filler each end their own run within seconds (not at its time limit):
    COMPLETED and scored from the workspace, since it was the policy's doing, the limit named in its error; a
    run solving its task beside it at the same time on the node goes on and scores 1.0."""
    rt = runtime(_kind(rt_name), RunLimits(cpus=1.0, memory_mb=256, processes=64, disk_mb=64))
    tasks, rows = _swe()
    task = tasks["gyre__calc-1"].model_copy(update={"timeout_s": 200.0})
    script, limit = FAULTS[fault]
    out: dict[str, object] = {}
    good = threading.Thread(target=lambda: out.update(good=run_task(
        task, tmp_path / "good", rt, script_harness("sleep 3; " + _apply(rows["gyre__calc-1"]["patch"])),
        rollout_id=2)))
    good.start()
    bad = run_task(task, tmp_path / "bad", rt, script_harness(script), rollout_id=1)
    good.join(300)
    assert bad.status == "COMPLETED" and bad.reward == 0.0, (bad.status, bad.error)
    assert limit in (bad.error or "") and "the run ended at its resource limit" in (bad.error or ""), bad.error
    assert bad.harness_s < 60, bad.harness_s  # ended by the limit, not by its 200 s time limit
    g = out["good"]
    assert (g.status, g.reward) == ("COMPLETED", 1.0), g.error


@pytest.mark.parametrize("rt_name", RUNTIMES)
def test_harbor_tasks_with_images_are_built_run_and_verified(tmp_path: Path, rt_name: str) -> None:
    """Harbor tasks with images: one names its image (docker_image), one ships environment/Dockerfile, which the
    image cache builds with podman (FROM the fixtures' base). Each task's solution/solve.sh, run as the harness
    inside the image, gets reward 1 from its tests/test.sh in a fresh copy; no change gets 0. lua-sum's solution
    needs lua5.4, which the image has and this machine does not."""
    rt = runtime(_kind(rt_name))
    suite = FIXTURES / "harbor-images"
    for task in load_suite(f"harbor:{suite}"):
        solve = (suite / task.id / "solution" / "solve.sh").read_text()
        for name, script, want in [("solution", solve, 1.0), ("empty", "true", 0.0)]:
            done = run_task(task, tmp_path / f"{task.id}-{name}", rt, script_harness(script))
            assert (done.status, done.reward) == ("COMPLETED", want), (task.id, name, done.error)
    assert shutil.which("lua5.4") is None  # (the point of lua-sum: only its image can solve it)
    assert (tmp_path / "lua-sum-solution" / "changes" / "sum.txt").read_text().strip() == "189"
    assert (tmp_path / "lua-sum-solution" / "changes" / "numbers.txt").exists() is False  # the image's, unchanged


def test_no_root_is_needed() -> None:
    """The jail as a user that is not root (nobody), on the node's own Python 3: a user namespace of its own, where
    it may mount the overlays, then bubblewrap. Without a control group (nobody can make none here) the limits
    fall back to resource limits. The run's changes belong to that user on the host."""
    from gyre_slurm.harness.image_runtime import harness_env

    rt = runtime("bwrap", RunLimits(cpus=1.0, memory_mb=256, processes=64, disk_mb=64))
    image = rt.image("localhost/gyre-fixtures/base:bookworm")
    tmp_path = Path(tempfile.mkdtemp(prefix="gyre-noroot-"))  # (pytest's own folders are the root user's alone)
    ws = tmp_path / "ws"
    (ws / "changes").mkdir(parents=True)
    script = "id -u > uid.txt; ulimit -v > as.txt; cat /etc/debian_version > version.txt; touch /etc/x || true"
    jail = rt.harness(ws=ws, image=image, workdir="/workspace", argv=["sh", "-c", script],
                      env=harness_env(image, {}, None), state_dir=tmp_path / "no-state", proxy_socket=None,
                      python=False, timeout_s=60)
    try:
        for p in [tmp_path, *tmp_path.rglob("*"), jail.folder, *jail.folder.rglob("*")]:
            os.lchown(p, 65534, 65534)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-m",
                            "gyre_slurm.harness.jail", str(jail.folder / "spec.json")],
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out = ws / "changes"
        assert (out / "uid.txt").read_text().strip() == "0"  # root inside its own user namespace: nobody outside
        assert (out / "as.txt").read_text().strip() == str(256 * 1024)  # RLIMIT_AS, in KB
        assert (out / "version.txt").read_text() == (image.rootfs / "etc" / "debian_version").read_text()
        assert (out / "version.txt").stat().st_uid == 65534
    finally:
        jail.close()
        shutil.rmtree(tmp_path)
