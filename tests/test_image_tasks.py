"""Image tasks without running them: the task fields, the suites in the paper's shapes (swe:, nl2repo:, Harbor with
images) and their one-line errors, the grading of an evaluator's output, the runtime rule, how limits apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre_slurm.config_eval import EvalSection
from gyre_slurm.errors import ConfigError
from gyre_slurm.harness import harbor
from gyre_slurm.harness.cgroups import RunLimits, how_limits_apply
from gyre_slurm.harness.swe_suite import patched_files
from gyre_slurm.harness.task_split import check_runtime, load_split
from gyre_slurm.harness.tasks import Grade, TaskSpec, load_suite, parse_task
from gyre_slurm.scoring.grading import PATCH_FAILED, grade_pytest, pytest_outcomes

from .conftest import gyre
from .images import FIXTURES

PYTEST_OUT = """============================= test session starts ==============================
collected 5 items

tests/test_ops.py ..F.E                                                  [100%]
=========================== short test summary info ============================
PASSED tests/test_ops.py::test_add
PASSED tests/test_ops.py::test_divide
FAILED tests/test_ops.py::test_divide_by_zero - Failed: DID NOT RAISE <class 'ValueError'>
PASSED tests/test_ops.py::test_mean_of_nothing
ERROR tests/test_ops.py::test_broken - NameError: x
XFAIL tests/test_ops.py::test_known - reason
==================== 1 failed, 3 passed, 1 error in 0.03s =====================
"""


def test_pytest_outcomes_are_read_as_swe_bench_reads_them() -> None:
    seen = pytest_outcomes(PYTEST_OUT)
    assert seen["tests/test_ops.py::test_divide_by_zero"] == "FAILED"
    assert seen["tests/test_ops.py::test_broken"] == "ERROR" and seen["tests/test_ops.py::test_known"] == "XFAIL"
    assert len(seen) == 6


def test_the_swe_rule_and_the_share_rule() -> None:
    f2p = ["tests/test_ops.py::test_divide_by_zero", "tests/test_ops.py::test_mean_of_nothing"]
    assert grade_pytest(PYTEST_OUT, Grade(kind="pytest", fail_to_pass=f2p, pass_to_pass=[
        "tests/test_ops.py::test_add"])) == 0.5
    # a PASS_TO_PASS test that fails, or never ran, makes it 0 whatever FAIL_TO_PASS did
    for p2p in (["tests/test_ops.py::test_broken"], ["tests/test_ops.py::test_gone"]):
        assert grade_pytest(PYTEST_OUT, Grade(kind="pytest", fail_to_pass=f2p, pass_to_pass=p2p)) == 0.0
    # XFAIL passes (SWE-bench's rule); a FAIL_TO_PASS test not in the output did not pass
    assert grade_pytest(PYTEST_OUT, Grade(kind="pytest", fail_to_pass=["tests/test_ops.py::test_known",
                                                                       "tests/test_ops.py::nope"])) == 0.5
    # NL2Repo: the share of all hidden tests, out of `total` when more than the output reports
    assert grade_pytest(PYTEST_OUT, Grade(kind="pytest")) == 4 / 6
    assert grade_pytest(PYTEST_OUT, Grade(kind="pytest", total=8)) == 4 / 8


def test_no_pytest_run_is_an_evaluator_error_but_a_test_patch_that_fails_is_a_zero() -> None:
    with pytest.raises(ValueError, match="pytest did not start"):
        grade_pytest("/usr/bin/python: No module named pytest\n", Grade(kind="pytest", total=3))
    assert grade_pytest(f"error: patch failed\n{PATCH_FAILED}: the test patch does not apply\n",
                        Grade(kind="pytest", fail_to_pass=["a::b"])) == 0.0


def test_an_image_task_takes_its_fields_and_a_host_task_refuses_them() -> None:
    t = parse_task({"id": "t", "prompt": "p", "image": "localhost/x:1", "workdir": "/srv//app/", "evaluator": ["sh"],
                    "eval_files": {"run.sh": "x"}, "grade": {"kind": "pytest", "total": 3}}, "here")
    assert t.workdir == "/srv/app" and t.tests_at == "/tests"
    for bad, says in [({"workdir": "/a"}, "workdir needs an image"), ({"grade": {"kind": "harbor"}}, "needs an image"),
                      ({"image": "x:1", "workdir": "rel"}, "absolute folder"),
                      ({"image": "x:1", "workdir": "/a/../b"}, "without '..'"),
                      ({"image": "x:1", "workdir": "/"}, "not /"),
                      ({"image": "x:1", "evaluator": ["{python}", "e.py"]}, "{python}"),
                      ({"image": "x:1", "eval_files": {"../x": "y"}}, "eval_files")]:
        with pytest.raises(ConfigError, match=says.replace("{", r"\{").replace("(", r"\(")):
            parse_task({"id": "t", "prompt": "p", "evaluator": ["sh"], **bad}, "here")


def test_relative_image_paths_resolve_against_the_suite_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    row = {"id": "t", "prompt": "p", "image": "oci-archive:img.tar", "evaluator": ["sh"], "tests_dir": "t"}
    (tmp_path / "sub" / "t").mkdir()
    (tmp_path / "sub" / "s.jsonl").write_text(json.dumps(row) + "\n")
    (t,) = load_suite(str(tmp_path / "sub" / "s.jsonl"))
    assert t.image == f"oci-archive:{tmp_path / 'sub' / 'img.tar'}" and t.tests_dir == tmp_path / "sub" / "t"
    (tmp_path / "sub" / "s.jsonl").write_text(json.dumps({**row, "image": "Not_An_Image!"}) + "\n")
    with pytest.raises(ConfigError, match=r"s.jsonl:1: image: .*not an image reference"):
        load_suite(str(tmp_path / "sub" / "s.jsonl"))


def test_the_swe_fixture_rows_become_image_tasks() -> None:
    tasks = {t.id: t for t in load_suite(f"swe:{FIXTURES / 'swe' / 'tasks.jsonl'}")}
    t = tasks["gyre__calc-1"]
    assert t.image == "localhost/gyre-fixtures/swe-calc:1" and t.workdir == "/testbed"
    assert t.grade.fail_to_pass == ["tests/test_ops.py::test_divide_by_zero", "tests/test_ops.py::test_mean_of_nothing"]
    assert t.evaluator[:3] == ["sh", "/tests/run-swe.sh", "4e91f9bda1c7a9d2692a14058aeff60955e573d3"]
    assert t.evaluator[-4:] == [*t.grade.fail_to_pass, *t.grade.pass_to_pass]  # after the test command
    assert t.eval_files["test-files.txt"] == "tests/test_ops.py\n" and "test.patch" in t.eval_files
    assert patched_files("diff --git a/x/y.py b/x/y.py\n--- a/x\ndiff --git a/z b/z\n") == ["x/y.py", "z"]


@pytest.mark.parametrize(("row", "says"), [
    ({"FAIL_TO_PASS": "[1, 2]"}, "FAIL_TO_PASS must be a list of test ids"),
    ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is neither a list nor the JSON text of one"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
    ({"test_cmd": "pytest -x"}, "test_cmd must be a non-empty list"),
    ({"image": None}, "image"),
    ({"instance_id": "bad id!"}, "id:"),
])
def test_a_bad_swe_row_is_one_line_naming_its_line(tmp_path: Path, row: dict, says: str) -> None:
    good = json.loads((FIXTURES / "swe" / "tasks.jsonl").read_text().splitlines()[0])
    data = {**good, **row}
    if row.get("image", "") is None:
        del data["image"]
    (tmp_path / "s.jsonl").write_text("\n" + json.dumps(data) + "\n")
    with pytest.raises(ConfigError, match=f"s.jsonl:2: .*{says.replace('(', '.').replace(')', '.')}"):
        load_suite(f"swe:{tmp_path / 's.jsonl'}")


def test_the_nl2repo_fixture_and_its_errors(tmp_path: Path) -> None:
    (t,) = load_suite(f"nl2repo:{FIXTURES / 'nl2repo'}")
    assert t.id == "kvstore" and t.grade.total == 4 and t.workdir == "/workspace"
    assert t.tests_dir == FIXTURES / "nl2repo" / "kvstore" / "tests" and t.prompt.startswith("# kvstore")
    d = tmp_path / "x"
    (d / "tests").mkdir(parents=True)
    (d / "spec.md").write_text("spec")
    (d / "task.toml").write_text('image = "localhost/a:1"\n')
    with pytest.raises(ConfigError, match=r"total is required"):
        load_suite(f"nl2repo:{d}")
    (d / "task.toml").write_text('[verifier]\ntotal = 2\n')
    with pytest.raises(ConfigError, match=r"image is required"):
        load_suite(f"nl2repo:{d}")


def test_harbor_tasks_with_images_load_and_compose_is_refused(tmp_path: Path) -> None:
    tasks, refused = harbor.load(FIXTURES / "harbor-images")
    by_id = {t.id: t for t in tasks}
    assert by_id["hello-image"].image == "localhost/gyre-fixtures/base:bookworm"
    assert by_id["lua-sum"].image == f"dockerfile:{FIXTURES / 'harbor-images' / 'lua-sum' / 'environment'}"
    for t in tasks:
        assert t.grade.kind == "harbor" and t.evaluator == ["bash", "/tests/test.sh"] and t.template_dir is None
    assert refused == []
    d = tmp_path / "multi"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "tests" / "test.sh").write_text("true")
    (d / "instruction.md").write_text("x")
    (d / "task.toml").write_text("")
    (d / "environment" / "compose.yaml").write_text("services: {}")
    with pytest.raises(ConfigError, match="no Harbor task in it can run here"):
        harbor.load(d)
    assert harbor.refusal(d, {}) == ("it needs several containers (environment/compose.yaml), which no runtime here "
                                     "starts")


def test_the_runtime_rule_refuses_in_one_line(tmp_path: Path) -> None:
    image_tasks = load_suite(f"nl2repo:{FIXTURES / 'nl2repo'}")
    host_tasks = load_suite("builtin:sevens")
    check_runtime(image_tasks + host_tasks, "auto")
    with pytest.raises(ConfigError, match="harness.runtime is host, but task kvstore names an image"):
        check_runtime(image_tasks, "host")
    with pytest.raises(ConfigError, match=r"harness.runtime is podman, but task digits-7x4 names no image \(5 such"):
        check_runtime(host_tasks, "podman")
    with pytest.raises(ConfigError, match="runtime is image"):
        load_split("builtin:sevens", EvalSection(), 0, runtime="image")


def test_each_limit_says_what_enforces_it() -> None:
    limits = RunLimits(cpus=1.0, memory_mb=512, processes=64, disk_mb=100)
    grouped = how_limits_apply(limits, "cgroup v1", True)
    assert grouped == {"cpus": "cgroup v1 (CPU quota)", "memory": "cgroup v1", "processes": "cgroup v1",
                       "disk": "the writable layer's size, watched each 0.5 s, and RLIMIT_FSIZE per file"}
    apart = how_limits_apply(limits, "no cgroup here", False)
    assert apart["cpus"].startswith("not enforced") and apart["memory"].startswith("RLIMIT_AS")
    assert apart["processes"].startswith("RLIMIT_NPROC")


def test_a_task_spec_round_trips_through_the_wire() -> None:
    (t,) = [x for x in load_suite(f"swe:{FIXTURES / 'swe' / 'tasks.jsonl'}") if x.id == "gyre__sevens-1"]
    assert TaskSpec.model_validate(json.loads(json.dumps(t.model_dump(mode="json")))) == t


def test_gyre_images_fetches_lists_and_removes(tmp_path: Path) -> None:
    """`gyre images` on a cache of its own: an image from an OCI archive made here with tar (a folder of one file)."""
    import hashlib
    import io
    import tarfile

    def blob(data: bytes) -> tuple[str, bytes]:
        return "sha256:" + hashlib.sha256(data).hexdigest(), data

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        t.addfile(info, io.BytesIO(b"hi\n"))
    layer_d, layer_b = blob(layer.getvalue())
    config_d, config_b = blob(json.dumps({"architecture": "amd64", "os": "linux", "config": {"WorkingDir": "/w"},
                                          "rootfs": {"type": "layers", "diff_ids": [layer_d]}}).encode())
    manifest_d, manifest_b = blob(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_d, "size": len(config_b)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_d,
                    "size": len(layer_b)}]}).encode())
    index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                           "digest": manifest_d, "size": len(manifest_b)}]})
    oci = tmp_path / "img"
    (oci / "blobs" / "sha256").mkdir(parents=True)
    (oci / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (oci / "index.json").write_text(index)
    for d, b in ((layer_d, layer_b), (config_d, config_b), (manifest_d, manifest_b)):
        (oci / "blobs" / "sha256" / d.removeprefix("sha256:")).write_bytes(b)
    cache = tmp_path / "cache"
    r = gyre("images", "fetch", f"oci:{oci}", "--cache-dir", cache)
    assert r.returncode == 0 and f"oci:{oci}: {config_d}" in r.stdout and "working folder /w" in r.stdout, r.stderr
    assert (cache / f"sha256-{config_d[7:]}" / "rootfs" / "hello.txt").read_text() == "hi\n"
    r = gyre("images", "list", "--cache-dir", cache)
    assert config_d[7:19] in r.stdout and f"oci:{oci}"[:20] in r.stdout, r.stdout
    r = gyre("images", "rm", "nope", "--cache-dir", cache)
    assert r.returncode == 1 and r.stderr.strip() == "error: nope: no cached images match (gyre images list)"
    assert gyre("images", "rm", config_d[7:19], "--cache-dir", cache).returncode == 0
    assert not (cache / f"sha256-{config_d[7:]}").exists()
    r = gyre("images", "fetch", "Not An Image", "--cache-dir", cache)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "white space" in r.stderr, r.stderr


def test_a_runtime_the_config_requires_and_the_node_lacks_stops_the_worker(tmp_path: Path, monkeypatch) -> None:
    """harness.runtime podman (or image) where podman (bwrap) is not installed: one line, before any run; auto says
    why and runs tasks without images on the host."""
    from gyre_slurm.config_harness import HarnessSection
    from gyre_slurm.errors import GyreError
    from gyre_slurm.harness.image_runtime import image_runtime_of

    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # neither bwrap nor podman here
    with pytest.raises(GyreError, match=r"^harness.runtime is podman, but podman is not installed \(Debian: apt-get"):
        image_runtime_of(HarnessSection(runtime="podman"), tmp_path)
    with pytest.raises(GyreError, match=r"^harness.runtime is image, but bwrap is not installed"):
        image_runtime_of(HarnessSection(runtime="image"), tmp_path)
    rt, why = image_runtime_of(HarnessSection(), tmp_path)
    assert rt is None and why.startswith("bwrap is not installed")
    assert image_runtime_of(HarnessSection(runtime="host"), tmp_path) == (None, "harness.runtime is host")
