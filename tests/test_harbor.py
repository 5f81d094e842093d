"""Harbor task folders as a task suite (`tasks.suite: harbor:PATH`): loaded through the real config, laid out as a
worker does, scored by their own tests/test.sh in bubblewrap (gyre_slurm.scoring.harbor_verify), and run through
the worker's rollout path with a harness that plays Harbor's oracle (solution/solve.sh). No mocks: bubblewrap is
installed here and in CI, and a test that needs it fails without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gyre_slurm.config import parse_config
from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.harness.sandbox import make_sandbox
from gyre_slurm.harness.tasks import TaskSpec, load_suite
from gyre_slurm.harness.workspace import lay_out
from gyre_slurm.protocol import RolloutAssignment
from gyre_slurm.scoring.evaluator import run_evaluator
from gyre_slurm.statuses import RolloutStatus
from gyre_slurm.worker.rollout import execute_rollout

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "fixtures" / "harbor"
CONTAINER_SUITE = REPO / "tests" / "fixtures" / "harbor-container"
IDS = ["count-lines", "fix-median", "write-greeting"]
UNSOLVED = {"count-lines": 0.0, "fix-median": 2 / 6, "write-greeting": 0.0}  # partial credit: 2 of 6 cases


@pytest.fixture(scope="module", autouse=True)
def bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed (tools/setup_env.sh installs it: apt-get install bubblewrap)")


def _suite() -> dict[str, TaskSpec]:
    return {t.id: t for t in load_suite(f"harbor:{SUITE}")}


def _solve(task_id: str, workspace: Path) -> None:
    """Harbor's oracle agent: solution/solve.sh, run in the agent's folder."""
    subprocess.run(["bash", str(SUITE / task_id / "solution" / "solve.sh")], cwd=workspace, check=True, timeout=30)


def _task(root: Path, name: str, test_sh: str, toml: str = "[verifier]\ntimeout_sec = 20\n",
          env: dict[str, str] | None = None) -> Path:
    """A Harbor task folder of our own."""
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text(f"do {name}\n")
    (d / "tests" / "test.sh").write_text(f"#!/bin/bash\nmkdir -p /logs/verifier\n{test_sh}\n")
    for rel, text in (env or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    return d


def _score(task_dir: Path, ws: Path) -> tuple[float | None, str | None]:
    (task,) = load_suite(f"harbor:{task_dir}")
    lay_out(task, ws)
    ev = run_evaluator(task, ws, retries=0)
    return ev.score, ev.error


def test_the_suite_loads_through_the_config(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    cfg = parse_config({"run": {"name": "t"}, "tasks": {"suite": "harbor:tests/fixtures/harbor"},
                        "eval": {"suite": "harbor:tests/fixtures/harbor-container"}}, "x.yaml")
    refused: list[str] = []
    tasks = load_suite(cfg.tasks.suite, refused)
    assert [t.id for t in tasks] == IDS and refused == []
    t = next(t for t in tasks if t.id == "fix-median")
    assert t.prompt == (SUITE / "fix-median" / "instruction.md").read_text()
    assert t.template_dir == SUITE / "fix-median" / "environment" and t.files == {}
    assert t.evaluator == ["{python}", "-m", "gyre_slurm.scoring.harbor_verify", str(SUITE / "fix-median"),
                           "{workspace}"]
    assert (t.timeout_s, t.eval_timeout_s) == (300.0, 90.0)  # [agent] 300 s; [verifier] 60 s and a margin
    assert next(t for t in tasks if t.id == "count-lines").timeout_s is None  # no [agent]: the run's timeout
    with pytest.raises(ConfigError, match="no such folder of Harbor tasks"):
        parse_config({"run": {"name": "t"}, "tasks": {"suite": "harbor:tests/fixtures/nowhere"}}, "x.yaml")


@pytest.mark.parametrize("task_id", IDS)
def test_each_task_scores_1_with_its_solution_and_less_without(tmp_path, task_id) -> None:
    task = _suite()[task_id]
    lay_out(task, tmp_path / "unsolved")
    ev = run_evaluator(task, tmp_path / "unsolved", retries=0)
    assert ev.error is None and ev.score == pytest.approx(UNSOLVED[task_id], abs=1e-3), ev
    lay_out(task, tmp_path / "solved")
    _solve(task_id, tmp_path / "solved")
    ev = run_evaluator(task, tmp_path / "solved", retries=0)
    assert (ev.score, ev.error) == (1.0, None), ev.output
    assert ev.output.startswith("--- stdout\n1.0\n")  # test.sh's own output went to stderr


def test_a_dockerfile_task_runs_in_its_image_and_a_from_that_does_not_resolve_is_one_line(tmp_path) -> None:
    """A task whose environment/ holds a Dockerfile is an image task (built with podman when a run needs it:
    tests/test_image_runs.py runs one); this one's FROM (ubuntu:24.04) is neither in podman's storage nor pullable
    here, which its run's build says in one line naming the task's folder."""
    from gyre_slurm.images.cache import ImageCache
    from gyre_slurm.images.reference import parse_ref

    refused: list[str] = []
    tasks = {t.id: t for t in load_suite(f"harbor:{CONTAINER_SUITE}", refused)}
    assert sorted(tasks) == ["say-hello", "serve-static-site"] and refused == []
    env = CONTAINER_SUITE / "serve-static-site" / "environment"
    site = tasks["serve-static-site"]
    assert site.image == f"dockerfile:{env}" and site.template_dir is None and site.grade.kind == "harbor"
    assert tasks["say-hello"].image is None  # a task without an image still runs on the host's files
    with pytest.raises(GyreError) as e:
        ImageCache(tmp_path / "images").get(parse_ref(site.image or ""), echo=lambda _s: None)
    assert str(e.value) == f"{env}: FROM ubuntu:24.04 does not resolve: it is not in podman's local storage and it " \
                           "cannot be pulled"


@pytest.mark.parametrize(("what", "toml", "env", "why"), [
    ("compose", "", {"docker-compose.yaml": "services: {}\n"},
     "it needs several containers (environment/docker-compose.yaml), which no runtime here starts"),
    ("separate", '[verifier]\nenvironment_mode = "separate"\n', {},
     'its verifier runs in an image of its own ([verifier] environment_mode = "separate")'),
])
def test_what_cannot_run_here_and_a_suite_of_nothing_else(tmp_path, what, toml, env, why) -> None:
    _task(tmp_path, what, "echo 1 > /logs/verifier/reward.txt", toml, env)
    with pytest.raises(ConfigError, match="no Harbor task in it can run here") as e:
        load_suite(f"harbor:{tmp_path}")
    assert str(tmp_path) in str(e.value)
    _task(tmp_path, "runs", "echo 1 > /logs/verifier/reward.txt")
    refused: list[str] = []
    assert [t.id for t in load_suite(f"harbor:{tmp_path}", refused)] == ["runs"]
    assert refused == [f"harbor task '{what}' cannot run here: {why}: skipped"]


def test_a_docker_image_task_names_its_image(tmp_path) -> None:
    _task(tmp_path, "img", "echo 1 > /logs/verifier/reward.txt", '[environment]\ndocker_image = "python:3.12-slim"\n')
    (task,) = load_suite(f"harbor:{tmp_path}")
    assert task.image == "python:3.12-slim" and task.evaluator == ["bash", "/tests/test.sh"]
    assert task.tests_dir == tmp_path / "img" / "tests"


def test_one_task_folder_is_a_suite_too_and_needs_no_environment(tmp_path) -> None:
    assert [t.id for t in load_suite(f"harbor:{SUITE / 'count-lines'}")] == ["count-lines"]
    d = _task(tmp_path, "bare", "echo 0.5 > /logs/verifier/reward.txt")
    (task,) = load_suite(f"harbor:{d}")
    assert task.template_dir is None and task.eval_timeout_s == 50.0
    assert _score(d, tmp_path / "ws") == (0.5, None)


@pytest.mark.parametrize(("name", "toml", "match"), [
    ("bad-toml", "[verifier\ntimeout_sec = 1\n", r"bad-toml/task\.toml: not valid TOML"),
    ("bad-timeout", '[verifier]\ntimeout_sec = "soon"\n', r"bad-timeout/task\.toml: \[verifier\] timeout_sec must "),
    ("bad-agent", "agent = 3\n", r"bad-agent/task\.toml: \[agent\] must be a table"),
    ("bad name", "", r"the folder name 'bad name' is the task's id and is not a valid one .*rename the folder"),
])
def test_a_broken_task_is_a_config_error_naming_it(tmp_path, name, toml, match) -> None:
    _task(tmp_path, name, "echo 1 > /logs/verifier/reward.txt", toml)
    with pytest.raises(ConfigError, match=match):
        load_suite(f"harbor:{tmp_path}")


def test_a_task_without_its_verifier_or_a_folder_without_tasks_is_a_config_error(tmp_path) -> None:
    d = _task(tmp_path, "no-tests", "")
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(ConfigError, match=r"no-tests: no tests/test\.sh"):
        load_suite(f"harbor:{tmp_path}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty: no Harbor tasks \(no task\.toml"):
        load_suite(f"harbor:{tmp_path / 'empty'}")


V = "/logs/verifier"


@pytest.mark.parametrize(("test_sh", "error"), [
    ("echo 'all tests passed'", f"test.sh (exit 0) wrote no reward: neither {V}/reward.txt nor reward.json"),
    (f"echo garbage > {V}/reward.txt", f"{V}/reward.txt is not a number: 'garbage'"),
    (f"echo 1.5 > {V}/reward.txt", f"{V}/reward.txt is 1.5, outside [0, 1]"),
    (f"echo nan > {V}/reward.txt", f"{V}/reward.txt is nan, outside [0, 1]"),
    (f": > {V}/reward.txt", f"{V}/reward.txt is empty"),
    (f"echo '{{\"a\": 1, \"b\": 0}}' > {V}/reward.json", f"{V}/reward.json has no 'reward' among 2 values"),
    (f"echo '[1]' > {V}/reward.json", f"{V}/reward.json is not a JSON object"),
    (f"ln -s /etc/hostname {V}/reward.txt", f"{V}/reward.txt cannot be read (Too many levels of symbolic links"),
    ("exit 3", "test.sh (exit 3) wrote no reward"),
], ids=["none", "garbage", "above-1", "nan", "empty", "json-no-reward", "json-list", "symlink", "exit-3"])
def test_a_missing_or_bad_reward_is_an_evaluator_error_not_a_zero(tmp_path, test_sh, error) -> None:
    score, err = _score(_task(tmp_path, "t", test_sh), tmp_path / "ws")
    assert score is None and err.startswith(f"evaluator failed (exit code 1): harbor_verify: {error}"), err


@pytest.mark.parametrize(("test_sh", "score"), [
    ("echo 0.25 > /logs/verifier/reward.txt; exit 1", 0.25),  # test.sh's exit status is not read, as in Harbor
    ("echo '{\"reward\": 0.75, \"speed\": 0.1}' > /logs/verifier/reward.json; echo 0 > /logs/verifier/reward.txt",
     0.75),  # reward.json first, as Harbor
    ("echo '{\"accuracy\": 0.5}' > /logs/verifier/reward.json", 0.5),  # one named reward
], ids=["exit-1", "json-first", "json-one-value"])
def test_rewards_as_harbor_reads_them(tmp_path, test_sh, score) -> None:
    assert _score(_task(tmp_path, "t", test_sh), tmp_path / "ws") == (score, None)


def test_test_sh_past_its_timeout_is_an_evaluator_error(tmp_path) -> None:
    d = _task(tmp_path, "slow", "sleep 30; echo 1 > /logs/verifier/reward.txt", "[verifier]\ntimeout_sec = 1\n")
    score, err = _score(d, tmp_path / "ws")
    assert score is None and "harbor_verify: test.sh timed out after 1 s ([verifier] timeout_sec)" in err


PROBE = """
try() {{ if eval "$2" >/dev/null 2>&1; then echo "$1: ok"; else echo "$1: refused"; fi >> /app/probe.txt; }}
try "read the planted file" "cat {planted}"
try "read the real workspace path" "ls {ws}"
try "write the task folder" "echo x > {task}/tests/x"
try "write /tests" "echo x > /tests/x"
try "write /usr" "echo x > /usr/gyre-planted"
try "write /etc" "echo x > /etc/gyre-planted"
try "write the host's folder" "echo x > {outside}/x"
try "remount /usr writable" "mount -o remount,rw,bind /usr && echo x > /usr/gyre-planted"
try "unmount /tests" "umount /tests"
try "write /app" "echo x > /app/written"
try "write /logs" "echo x > /logs/written"
ls / > /app/root.txt
pwd > /app/pwd.txt
echo 1 > /logs/verifier/reward.txt
"""


def test_test_sh_sees_the_workspace_and_the_system_only_and_writes_nothing_else(tmp_path) -> None:
    planted, outside, ws = tmp_path / "planted.txt", REPO / "tests" / "fixtures", tmp_path / "ws"
    planted.write_text("1")  # what a policy left outside its workspace for test.sh to find
    d = _task(tmp_path, "probe", "")
    (d / "tests" / "test.sh").write_text(PROBE.format(planted=planted, ws=ws, task=d, outside=outside))
    assert _score(d, ws) == (1.0, None)
    probe = dict(line.split(": ") for line in (ws / "probe.txt").read_text().splitlines())
    assert probe == {"read the planted file": "refused", "read the real workspace path": "refused",
                     "write the task folder": "refused", "write /tests": "refused", "write /usr": "refused",
                     "write /etc": "refused", "write the host's folder": "refused",
                     "remount /usr writable": "refused", "unmount /tests": "refused", "write /app": "ok",
                     "write /logs": "ok"}
    seen = set((ws / "root.txt").read_text().split())
    assert {"app", "tests", "logs", "usr", "etc"} <= seen
    assert not seen & {"home", "root", "work", "mnt", "srv"}, seen  # HOME, /root and the checkout are not there
    assert (ws / "pwd.txt").read_text() == "/app\n" and (ws / "written").read_text() == "x\n"
    assert not (d / "tests" / "x").exists() and not (outside / "x").exists()
    assert not Path("/usr/gyre-planted").exists() and not Path("/etc/gyre-planted").exists()


def test_a_reward_planted_in_the_workspace_is_not_taken(tmp_path) -> None:
    d = _task(tmp_path, "t", "echo no reward written", env={"logs/verifier/reward.txt": "1\n", "reward.txt": "1\n"})
    score, err = _score(d, tmp_path / "ws")
    assert score is None and "wrote no reward" in err


def test_without_bubblewrap_a_clear_error(tmp_path, monkeypatch) -> None:
    d = _task(tmp_path, "t", "echo 1 > /logs/verifier/reward.txt")
    monkeypatch.setenv("PATH", "/nonexistent")  # the evaluator's argv starts with this interpreter's full path
    score, err = _score(d, tmp_path / "ws")
    assert score is None and err.startswith("evaluator failed (exit code 1): harbor_verify: bubblewrap (bwrap) is not "
                                            "installed: Harbor tests run only in its sandbox"), err


def _rollout(tmp_path: Path, rid: int, task: TaskSpec, harness: list[str]):
    state = tmp_path / "state"
    a = RolloutAssignment(rollout_id=rid, task=task.model_dump(mode="json"), api_key=f"sk-{rid}",
                          base_url="http://127.0.0.1:9/v1", workspace=str(state / "run" / "workspaces" / f"r{rid}"),
                          timeout_s=60, harness=harness)
    return execute_rollout(a, "w1", state_dir=state, sandbox=make_sandbox("bwrap", "host"))


def test_oracle_rollouts_through_the_worker_in_the_harness_sandbox(tmp_path) -> None:
    """The whole path: layout, a sandboxed harness (the oracle: solve.sh's text, since the sandbox hides the task
    folder and its solution from the harness), the evaluator, the classification."""
    tasks = _suite()
    for rid, task_id in enumerate(IDS, 1):
        solve = (SUITE / task_id / "solution" / "solve.sh").read_text()
        done = _rollout(tmp_path, rid, tasks[task_id], ["bash", "-c", solve])
        assert (done.status, done.reward, done.error) == (RolloutStatus.COMPLETED, 1.0, None), done
    d = SUITE / "write-greeting"
    peek = f"ls -A {d} > seen.txt; test -e {d}/solution/solve.sh || echo hidden >> seen.txt"
    done = _rollout(tmp_path, 9, tasks["write-greeting"], ["bash", "-c", peek])
    assert (done.status, done.reward) == (RolloutStatus.COMPLETED, 0.0), done
    seen = (tmp_path / "state" / "run" / "workspaces" / "r9" / "seen.txt").read_text()
    assert seen == "hidden\n"  # to the harness, the task folder (tests, solution) is an empty tmpfs
