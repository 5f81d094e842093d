"""The run config: good configs load; every kind of bad config fails with one message naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import field_reference, load_config, parse_config
from gyre_slurm.errors import ConfigError

from .conftest import REPO, gyre


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-slurm.yaml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.cluster.cells >= 2 and cfg.run.name


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as ei:
        parse_config(data, "x.yaml")
    return str(ei.value)


def test_unknown_key_is_named() -> None:
    msg = _err({"run": {"name": "a"}, "cluster": {"cels": 2}})
    assert msg == "x.yaml: cluster.cels: unknown field"


def test_unknown_section_is_named() -> None:
    assert _err({"run": {"name": "a"}, "trainer": {}}) == "x.yaml: trainer: unknown field"


def test_wrong_type_is_named_with_the_value() -> None:
    msg = _err({"run": {"name": "a"}, "cluster": {"cells": "many"}})
    assert msg.startswith("x.yaml: cluster.cells: ") and "'many'" in msg


def test_negative_count_is_refused() -> None:
    msg = _err({"run": {"name": "a"}, "cluster": {"cells": -2}})
    assert "cluster.cells" in msg and "greater than or equal to 1" in msg and "-2" in msg


def test_missing_required_field() -> None:
    assert _err({"cluster": {"cells": 2}}) == "x.yaml: run: required field is missing"


def test_missing_model_folder(tmp_path: Path) -> None:
    msg = _err({"run": {"name": "a"}, "model": {"path": str(tmp_path / "nope")}})
    assert msg.startswith("x.yaml: model.path: no such folder")


def test_cross_field_rules() -> None:
    assert "core_cell must be < cells" in _err({"run": {"name": "a"}, "cluster": {"cells": 2, "core_cell": 2}})
    msg = _err({"run": {"name": "a"}, "control": {"heartbeat_interval_s": 2, "heartbeat_timeout_s": 3}})
    assert "control" in msg and "at least twice" in msg


def test_bad_run_name() -> None:
    assert "run.name" in _err({"run": {"name": "../etc"}})


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {name: a\ncluster: [")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(top)


def test_cli_reports_a_bad_config_as_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "a"}, "cluster": {"cells": 0}}))
    for cmd in (["check", cfg], ["run", cfg], ["daemon", cfg]):
        r = gyre(*cmd)
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "cluster.cells" in lines[0], r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "state").exists()  # nothing started


@pytest.mark.parametrize(("scheduler", "says"), [
    ({"policy": "fifo"}, "scheduler.policy: unknown policy (available: colocate, async, elastic) (got 'fifo')"),
    ({"policy": "async", "train_cells": 2}, "scheduler.train_cells (2) must leave a rollout cell: async needs "
                                            "train_cells < cluster.cells (2)"),
    ({"policy": "elastic", "max_train_cells": 3}, "scheduler.max_train_cells (3) is more than cluster.cells (2)"),
    ({"release": "teleport"}, "scheduler.release: Input should be 'migrate' or 'drain' (got 'teleport')"),
])
def test_a_bad_scheduler_is_refused_before_anything_starts(tmp_path: Path, scheduler: dict, says: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "a", "state_dir": str(tmp_path / "state")},
                                   "scheduler": scheduler}))
    for cmd in (["check", cfg], ["run", cfg], ["submit", cfg]):
        r = gyre(*cmd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: {cfg}: "), r.stderr
        assert lines[0].endswith(says), r.stderr
    assert not (tmp_path / "state").exists()


def test_the_daemon_needs_a_ready_model_and_never_builds_one(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "a", "state_dir": str(tmp_path / "state")},
                                   "model": {"seed": 7}}))
    r = gyre("daemon", cfg)
    assert r.returncode == 1 and "not built yet" in r.stderr and "gyre model create" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "state" / "models").exists()


def test_every_field_is_documented_and_the_readme_table_is_current() -> None:
    rows = field_reference()
    assert len(rows) > 20
    for name, _t, _d, doc in rows:
        assert doc, f"{name} has no description"
    r = gyre("config-doc")
    assert r.returncode == 0
    assert r.stdout.strip() in (REPO / "README.md").read_text(), "README config table is stale: gyre config-doc"
