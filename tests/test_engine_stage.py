"""weights.engine_update: stage (agent/engine_stage.py), with real parts: a WeightLink in this process (the cell's
node agent) pulls each version from a core's publication over the Mooncake Transfer Engine, writes it as a Hugging
Face folder into its stage folder (here under the test's tmp folder, on clusters /dev/shm) and has a running
embedded engine (a real process, over HTTP) load it with /update_weights_from_disk, as an SGLang server does. What
the engine serves is read back over the Transfer Engine, bit for bit. Also: the folders kept, a sharded folder, a
refused load and a failed write (the engine keeps serving its version), calls in flight during a load, a reload
after a memory release."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from gyre_slurm.agent.engine_stage import EngineStager, write_hf_folder
from gyre_slurm.agent.weight_link import WeightLink
from gyre_slurm.config import parse_config
from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import read_safetensors
from gyre_slurm.protocol import WeightsRef
from gyre_slurm.transfer.engine import TransferAgent, available
from tests import test_engine_push as push
from tests.test_engine import PROMPT
from tests.test_engine_push import GREEDY, assert_serves, rows

pytestmark = pytest.mark.skipif(available() is not None, reason=f"Transfer Engine: {available()}")
base, engine, core = push.base, push.engine, push.core  # the same model, engine and core fixtures as the push


def _link(tmp: Path, stage_dir: Path) -> WeightLink:
    cfg = parse_config({"run": {"name": "stage", "state_dir": str(tmp / "state")},
                        "cluster": {"cells": 1, "engine": "embedded"},
                        "weights": {"engine_update": "stage", "stage_dir": str(stage_dir)}})
    return WeightLink(cfg, 0)


@pytest.fixture(scope="module")
def stage_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def link(tmp_path_factory, stage_dir):
    w = _link(tmp_path_factory.mktemp("link"), stage_dir)
    yield w
    w.close()


def staged(link: WeightLink) -> list[str]:
    return sorted(p.name for p in link._stage_root.iterdir())


def test_versions_are_staged_loaded_and_older_folders_removed(engine, link, core, base, stage_dir):
    before = asyncio.run(engine.client.generate(PROMPT, GREEDY))
    assert before.weight_version == 0
    assert link._stage_root.is_relative_to(stage_dir)
    for version in (1, 2, 3):
        tensors = core.weights(version)
        link.update_engine(engine.client, core.publish(version, tensors), server=engine.proc)
        assert_serves(engine, base, version, tensors)
        folder = link._stage_root / f"v{version:05d}"
        # two hops: the Transfer Engine into the agent, the RAM disk into the engine
        got = rows(link)
        assert got == [("agent:0", "mooncake", version, core.nbytes, True),
                       ("engine:0", "file", version, (folder / "model.safetensors").stat().st_size, True)]
        assert engine.client.model_info()["model_path"] == str(folder)
        assert staged(link) == [folder.name]  # only the version served is kept
        # a Hugging Face folder: the weights, and the snapshot folder's config and tokenizer files
        assert {p.name for p in folder.iterdir()} == {p.name for p in base.iterdir()}
        assert (folder / "config.json").read_text() == (base / "config.json").read_text()
    after = asyncio.run(engine.client.generate(PROMPT, GREEDY))
    assert after.weight_version == 3 and after.output_logprobs != before.output_logprobs


def test_the_same_version_again_is_loaded_from_its_folder_without_a_pull(engine, link, core, base):
    """A resume after a memory release gives the version served again: its folder is still there."""
    engine.client.release_memory(abort_first=True)
    engine.client.resume_memory()
    link.update_engine(engine.client, WeightsRef(version=3, path=str(core.root / "v00003"),
                                                 parts=[core.publisher.last]), server=engine.proc)
    assert_serves(engine, base, 3, core.weights(3))
    assert [r[:3] for r in rows(link)] == [("engine:0", "file", 3)]


def test_calls_in_flight_come_back_aborted_and_new_ones_get_the_new_version(engine, link, core, base):
    """The load runs inside an abort pause: a call in flight returns what it sampled (the proxy continues it) and
    nothing is sampled while the server loads; afterwards it serves the new version."""
    push.check_update_during_a_call(engine, link, core, base, "file")


def test_a_refused_load_is_recorded_and_the_engine_keeps_serving_its_version(engine, link, core, base):
    """A version whose last tensor has a wrong shape: written, then refused by the engine. The engine loads the
    folder it served back before it serves again; the failed version's folder is removed."""
    bad = {n: -t for n, t in core.weights(5).items()}
    bad["model.norm.weight"] = torch.ones(129)
    with pytest.raises(GyreError, match=r"version 5 .*failed.*129.*serves version 4"):
        link.update_engine(engine.client, core.publish(5, bad), server=engine.proc)
    got = link.drain()
    assert [(t.receiver, t.transport, t.version, t.ok) for t in got] == [
        ("agent:0", "mooncake", 5, True), ("engine:0", "file", 5, False), ("engine:0", "file", 4, True)]
    assert "129" in got[1].error and got[1].nbytes == 0 and got[2].nbytes > 0
    assert staged(link) == ["v00004"]
    assert_serves(engine, base, 4, core.weights(4))

    tensors = core.weights(6)
    link.update_engine(engine.client, core.publish(6, tensors), server=engine.proc)
    assert_serves(engine, base, 6, tensors)
    assert staged(link) == ["v00006"]
    assert [r[:3] + (r[4],) for r in rows(link)] == [("agent:0", "mooncake", 6, True), ("engine:0", "file", 6, True)]


def test_a_failed_write_leaves_the_engine_serving(engine, core, tmp_path):
    """The stage folder cannot be made (its parent is a file): recorded, raised, nothing sent to the engine."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    w = _link(tmp_path, blocker / "gyre")
    served = engine.client.model_info()["weight_version"]
    with pytest.raises(GyreError, match="staging weights version 7 .* failed"):
        w.update_engine(engine.client, core.publish(7, core.weights(7)), server=engine.proc)
    assert [(r[0], r[1], r[2], r[4]) for r in rows(w)] == [("agent:0", "mooncake", 7, True),
                                                            ("engine:0", "file", 7, False)]
    assert engine.client.model_info()["weight_version"] == served
    w.close()


def test_a_sharded_folder_with_its_index_loads(engine, core, base, tmp_path):
    """Above the shard size the version is written as several files and an index, as Hugging Face shards."""
    stager = EngineStager(TransferAgent.shared, 8, tmp_path / "run" / "cell8", shard_bytes=256 << 10)
    tensors = core.weights(8)
    done = []
    stager.update(engine.client, core.publish(8, tensors), [core.publisher.last], engine.proc, done.append)
    folder = tmp_path / "run" / "cell8" / "v00008"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == core.nbytes == done[0].nbytes
    assert all(torch.equal(t, tensors[n]) for n, t in read_safetensors(folder).items())
    assert_serves(engine, base, 8, tensors)
    stager.close()
    assert not (tmp_path / "run").exists()  # the cell's folder, and the run's once empty


def test_write_hf_folder_is_all_or_nothing(base, tmp_path):
    """A write that fails halfway leaves no folder under the final name (a folder with that name is complete)."""
    tensors = {"a": torch.ones(4), "b": torch.ones(3, 2).t()}  # b is not contiguous: written as a copy
    assert write_hf_folder(tensors, base, tmp_path / "v1") == 40
    assert torch.equal(read_safetensors(tmp_path / "v1")["b"], torch.ones(2, 3))
    with pytest.raises(Exception):  # noqa: B017 -- any failure
        write_hf_folder({"a": torch.ones(4)}, tmp_path / "no-such-source", tmp_path / "v2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_a_late_cell_stages_the_newest_version_where_its_own_was_replaced(engine, link, core, base):
    """A cell slow to come back is sent version 9 after 10 and 11 were published (slot 9 % 2 holds 11 now): it
    stages and serves 11, bit for bit, and says so (the rows hold 11, the version it was sent is `asked`)."""
    late = core.publish(9, core.weights(9))
    core.publish(10, core.weights(10))
    tensors = core.weights(11)
    core.publish(11, tensors)
    assert link.update_engine(engine.client, late, server=engine.proc).version == 11
    assert_serves(engine, base, 11, tensors)
    assert [(t.receiver, t.transport, t.version, t.asked, t.ok) for t in link.drain()] == [
        ("agent:0", "mooncake", 11, 9, True), ("engine:0", "file", 11, 9, True)]
    assert staged(link) == ["v00011"]
