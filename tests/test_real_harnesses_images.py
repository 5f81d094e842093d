"""`gyre run` on the SWE fixture inside its image with the real CLIs: Claude Code (its npm install and Node bound
into the image) and mini-swe-agent by its shipped spec (its PyPI environment and the worker's Python bound in),
each with the built-in long-context model warmed up on its own conversations (the model `gyre run
configs/<cli>.yaml` builds, tools/test.sh's background build). A step completes with no API error; the CLIs' tool
calls run in the image's repository (/testbed): the answers they write are in the runs' layers, and the tool
results the policy read back came from there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.harness.cli_spec import resolve
from gyre_slurm.harness.install import find_binary
from gyre_slurm.rundir import new_run_id

from .conftest import REPO, q, run_to_the_end
from .images import FIXTURES, fixture_images_built
from .test_real_harnesses import PROXY_ERROR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
STATE = REPO / "state"


@pytest.fixture(scope="module", params=["claude-code", "mini-swe-agent"])
def cli_model(request) -> tuple[str, Path]:
    """(the CLI, its warmed-up long-context model), built as `gyre run configs/<cli>.yaml` builds it."""
    from gyre_slurm.bootstrap.base_model import ensure_model

    name = request.param
    find_binary(name if name == "claude-code" else resolve(name), STATE)
    fixture_images_built()
    data = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    data["run"]["state_dir"] = str(STATE)
    path = Path(request.config.cache.mkdir("gyre")) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return name, ensure_model(load_config(path), print)


def test_a_real_cli_trains_on_the_swe_fixture_inside_its_image(tmp_path: Path, cli_model: tuple[str, Path]) -> None:
    name, model = cli_model
    rows = (FIXTURES / "swe" / "tasks.jsonl").read_text().splitlines()
    suite = tmp_path / "swe.jsonl"
    suite.write_text("".join(r + "\n" for r in rows if json.loads(r)["instance_id"] == "gyre__sevens-1"))
    data = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    data["run"].update(state_dir=str(STATE), max_wall_s=1200)
    data["model"] = {"path": str(model)}
    data["tasks"].update(suite=f"swe:{suite}", group_size=4, groups_per_step=1)
    data["train"]["steps"] = 1  # (by hand: 2 and 3 steps, docs/images.md; one RL step can unsettle the tiny policy)
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(data))
    run = run_to_the_end(config, new_run_id(name), timeout_s=1300)
    db = run.run_dir / "ledger.db"
    assert q(db, "SELECT step, status FROM train_steps ORDER BY step") == [(0, "DONE")]
    rollouts = q(db, "SELECT id, status, reward, n_calls, workspace, error FROM rollouts ORDER BY id")
    for rid, status, _reward, _n, ws, error in rollouts:
        log = (Path(ws) / ".gyre" / "harness.log").read_text(errors="replace")
        assert status in ("COMPLETED", "TIMEOUT_SCORED", "TRUNCATED_CONTEXT"), (rid, status, error, log[-2000:])
        assert not PROXY_ERROR.search(log), log[-2000:]  # 0 API errors
    # the tool calls ran in the image's repository: what they wrote is in the runs' own layers...
    written = [Path(ws) / "changes" / "answer.txt" for *_r, ws, _e in rollouts]
    assert sum(p.is_file() for p in written) >= len(rollouts) // 2, [p for p in written if not p.is_file()]
    assert not any((Path(ws) / "answer.txt").exists() for *_r, ws, _e in rollouts)  # (not in the host's folder)
    # ...and the scores came from the image's tests on them (partial credit: a third per FAIL_TO_PASS test)
    assert {r for _i, _s, r, *_x in rollouts} <= {0.0, 1 / 3, 2 / 3, 1.0}
    (told,) = q(db, "SELECT message FROM events WHERE kind = 'sandbox'")
    assert "tasks with images run in bubblewrap over the image" in told[0], told
    shutil.rmtree(run.run_dir)  # kept for a look when an assertion above failed
