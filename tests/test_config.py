"""The run config: good configs load; every kind of bad config fails with one message naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import load_config, parse_config
from gyre_slurm.config_reference import field_reference
from gyre_slurm.errors import ConfigError

from .conftest import REPO, gyre


@pytest.mark.parametrize("name", ["tiny-cpu.yaml", "tiny-slurm.yaml", "paper-122b.yaml"])
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


def test_every_field_is_documented_and_the_config_doc_is_current() -> None:
    rows = field_reference()
    assert len(rows) > 20
    for name, _t, _d, doc in rows:
        assert doc, f"{name} has no description"
    r = gyre("config-doc")
    assert r.returncode == 0
    assert r.stdout.strip() in (REPO / "docs" / "config.md").read_text(), "docs/config.md is stale: gyre config-doc"


def _mt(cluster: dict | None = None, **train) -> dict:
    return {"run": {"name": "a"}, "cluster": {"engine": "none", **(cluster or {})},
            "train": {"backend": "megatron", **train}}


def test_the_122b_config_is_the_papers_shape() -> None:
    cfg = load_config(REPO / "configs" / "paper-122b.yaml")
    c, t = cfg.cluster, cfg.train
    assert (c.cells, c.nodes_per_cell, c.gpus_per_cell, c.engine) == (4, 8, 64, "sglang")
    assert (t.backend, t.tensor_parallel, t.pipeline_parallel, t.data_parallel, t.expert_parallel) == (
        "megatron", 1, 1, 64, 64)  # an MoE: TP = PP = 1, experts over EP inside DP
    assert (cfg.sglang.tp_size, cfg.sglang.dp_size, cfg.weights.transport) == (8, 8, "mooncake")


def test_gyre_check_prints_the_cell_shape() -> None:
    r = gyre("check", REPO / "configs" / "paper-122b.yaml")
    assert r.returncode == 0, r.stderr
    assert ("cells 4 × 8 node(s) × 8 GPUs: trainer megatron TP 1 · PP 1 · DP 64 (EP 64) = 64 rank(s); SGLang tp 8 "
            "dp 8") in r.stdout
    assert "qwen3.6-122b-shape: its heads, layers, vocabulary and experts fit" in r.stdout
    assert r.stdout.rstrip().endswith("valid")


def test_gyre_check_checks_the_models_sizes(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 2,
                                                   "num_hidden_layers": 4, "vocab_size": 1024}))
    cfg = tmp_path / "c.yaml"
    for tp, ok in ((2, True), (4, False)):
        cfg.write_text(yaml.safe_dump({**_mt(tensor_parallel=tp), "model": {"path": str(model)}}))
        r = gyre("check", cfg)
        if ok:
            assert r.returncode == 0 and "fit the parallel sizes" in r.stdout, r.stderr
        else:
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 1 and len(lines) == 1, r.stderr
            assert lines[0].endswith("the model's num_key_value_heads (2) is not divisible by train.tensor_parallel "
                                     "(4)"), r.stderr


@pytest.mark.parametrize(("data", "says"), [
    (_mt({"gpus_per_cell": 8}, tensor_parallel=2, data_parallel=2),
     "train.tensor_parallel·pipeline_parallel·data_parallel (2·1·2 = 4) must equal cluster.gpus_per_cell (8)"),
    (_mt({"gpus_per_cell": 16, "nodes_per_cell": 4}, tensor_parallel=8, data_parallel=2),
     "train.tensor_parallel (8) must divide the GPUs of a node (cluster.gpus_per_cell 16 / nodes_per_cell 4 = 4)"),
    (_mt({"gpus_per_cell": 6, "nodes_per_cell": 4}), "gpus_per_cell (6) must be divisible by nodes_per_cell (4)"),
    (_mt(data_parallel=4, expert_parallel=3), "train.expert_parallel (3) must divide train.data_parallel (4)"),
    (_mt(tensor_parallel=8, expert_parallel=2), "train.expert_parallel (2) must divide train.data_parallel (1)"),
    (_mt(tensor_parallel=8, data_parallel=16), "(8·1·16 = 128) is more than 64 CPU ranks"),
    (_mt(pipeline_parallel=0), "train.pipeline_parallel: Input should be greater than or equal to 1"),
    (_mt(data_parallel=-2), "train.data_parallel: Input should be greater than or equal to 1"),
    (_mt(tensor_parallel=True), "train.tensor_parallel: Input should be a valid integer"),
    (_mt(expert_parallel="2"), "train.expert_parallel: Input should be a valid integer"),
    ({"run": {"name": "a"}, "train": {"expert_parallel": 2}}, "train.expert_parallel > 1 needs train.backend: "
                                                              "megatron"),
])
def test_nonsense_parallel_sizes_are_refused_in_one_line(data: dict, says: str) -> None:
    msg = _err(data)
    assert says in msg and "\n" not in msg, msg


def test_parallel_sizes_that_fit_load() -> None:
    cfg = parse_config(_mt({"gpus_per_cell": 16, "nodes_per_cell": 2}, tensor_parallel=4, pipeline_parallel=2,
                           data_parallel=2, expert_parallel=2), "x.yaml")
    assert cfg.train.expert_parallel == 2 and cfg.cluster.gpus_per_node == 8
    assert parse_config(_mt(tensor_parallel=2, data_parallel=3), "x.yaml").train.data_parallel == 3  # 6 CPU ranks
    assert parse_config(_mt({"gpus_per_cell": 8}), "x.yaml").train.tensor_parallel == 1  # the one-rank trainer


def test_check_model_fits() -> None:
    from gyre_slurm.launch.ranks import check_model_fits

    dense = {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 24, "vocab_size": 151936}
    check_model_fits({"tensor_parallel": 8, "pipeline_parallel": 4}, dense)
    check_model_fits({"tensor_parallel": 2}, {"text_config": {**dense, "num_experts": 256}, "vocab_size": 3})
    for sizes, model, says in [
        ({"tensor_parallel": 16}, dense, "num_key_value_heads (8) is not divisible by train.tensor_parallel (16)"),
        ({"tensor_parallel": 3}, dense, "num_attention_heads (32) is not divisible by train.tensor_parallel (3)"),
        ({"pipeline_parallel": 5}, dense, "num_hidden_layers (24) is not divisible by train.pipeline_parallel (5)"),
        ({"tensor_parallel": 4}, {**dense, "vocab_size": 50257}, "vocab_size (50257) is not divisible"),
        ({"expert_parallel": 3}, {**dense, "num_experts": 128}, "num_experts (128) is not divisible by "
                                                                "train.expert_parallel (3)"),
        ({"expert_parallel": 3}, {"text_config": {**dense, "num_experts": 8}}, "num_experts (8)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            check_model_fits(sizes, model)


def test_follower_ranks_run_on_the_cells_nodes() -> None:
    from gyre_slurm.launch.ranks import follower_nodes

    cpu = parse_config(_mt({"cells": 2, "nodes_per_cell": 2}, tensor_parallel=2, pipeline_parallel=2), "x.yaml")
    # one allocation of 4 nodes: cell 1 is n3, n4; 4 CPU ranks, 2 per node (rank 0 is the leader, on n3)
    assert follower_nodes(cpu, 1, {"SLURM_JOB_NODELIST": "n[1-4]"}) == [None, "n4", "n4"]
    assert follower_nodes(cpu, 0, {"SLURM_JOB_NODELIST": "n[1-5]"}) == [None, "n3", "n3"]  # n1: services
    assert follower_nodes(cpu, 1, {"SLURM_JOB_NODELIST": "c[7-8]"}) == [None, "c8", "c8"]  # a cell job of its own
    assert follower_nodes(cpu, 1, {}) == [None, None, None]  # a local run: every rank on this machine
    gpu = parse_config(_mt({"cells": 1, "nodes_per_cell": 2, "gpus_per_cell": 16}, tensor_parallel=8,
                           data_parallel=2), "x.yaml")
    assert follower_nodes(gpu, 0, {"SLURM_JOB_NODELIST": "g[1-2]"}) == [None] * 7 + ["g2"] * 8


def test_the_kl_anchor_and_embedding_lr_are_refused_where_they_are_not_built() -> None:
    from gyre_slurm.config import TrainSection

    assert TrainSection(kl_coef=0.05).kl_coef == 0.05 and TrainSection(embedding_lr=1e-3).embedding_lr == 1e-3
    with pytest.raises(ValueError, match="kl_coef > 0 needs train.backend: torch"):
        TrainSection(kl_coef=0.05, backend="megatron")
    with pytest.raises(ValueError, match="embedding_lr needs train.backend: torch"):
        TrainSection(embedding_lr=1e-3, backend="megatron")
    with pytest.raises(ValueError):
        TrainSection(embedding_lr=0.0)
    with pytest.raises(ValueError):
        TrainSection(kl_coef=-1.0)


# --- how a version reaches an SGLang server (weights.engine_update; docs/cells.md) ---------------------------------

def _sg(tmp_path: Path, cluster: dict, weights: dict | None = None, **sglang) -> dict:
    import sys

    return {"run": {"name": "sg", "state_dir": str(tmp_path)}, "cluster": {"engine": "sglang", **cluster},
            "weights": weights or {}, "sglang": {"python": sys.executable, **sglang}}


def test_auto_stages_on_one_node_sglang_cells_and_reads_the_shared_folder_on_several(tmp_path: Path) -> None:
    from gyre_slurm.agent.weight_link import WeightLink

    for cluster, weights, want in [({}, {}, "stage"), ({"nodes_per_cell": 2}, {}, "disk"),
                                   ({}, {"transport": "file"}, "disk"), ({"engine": "embedded"}, {}, "pull"),
                                   ({"engine": "embedded"}, {"engine_update": "stage"}, "stage")]:
        cfg = parse_config(_sg(tmp_path, cluster, weights), "x.yaml")
        assert WeightLink(cfg, 0).engine_update == want, (cluster, weights)
    cfg = parse_config(_sg(tmp_path, {}, {"stage_dir": "/dev/shm/x"}), "x.yaml")
    assert WeightLink(cfg, 2)._stage_root.parent.parent == Path("/dev/shm/x")
    assert parse_config(_sg(tmp_path, {}), "x.yaml").weights.stage_dir == Path("/dev/shm/gyre")  # a RAM disk


def test_stage_and_push_are_refused_where_they_cannot_work(tmp_path: Path) -> None:
    msg = _err(_sg(tmp_path, {"nodes_per_cell": 2}, {"engine_update": "stage"}))
    assert "engine_update: stage is for one-node SGLang cells (nodes_per_cell is 2" in msg and "use disk" in msg
    msg = _err(_sg(tmp_path, {}, {"transport": "file", "engine_update": "stage"}))
    assert "engine_update: stage needs transport: mooncake" in msg
    # SGLang's tp ranks on every GPU of the node: the agent's NCCL rank would share one (Duplicate GPU detected)
    msg = _err(_sg(tmp_path, {"gpus_per_cell": 4}, {"engine_update": "push"}, tp_size=4))
    assert "push needs a GPU SGLang leaves free on each node (its ranks take GPU 0, 1, 2, 3 of the node's 4" in msg
    assert "use engine_update: stage" in msg and "\n" not in msg
    msg = _err(_sg(tmp_path, {"gpus_per_cell": 8, "nodes_per_cell": 2}, {"engine_update": "push"}, tp_size=8))
    assert "take GPU 0, 1, 2, 3 of the node's 4" in msg
    # SGLang in its own environment: another NCCL build
    other = tmp_path / "sglang-venv" / "bin" / "python"
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    msg = _err(_sg(tmp_path, {"gpus_per_cell": 8}, {"engine_update": "push"}, tp_size=4, python=str(other)))
    assert f"push needs SGLang in the node agent's environment (sglang.python {other} is not" in msg
    assert "NCCL refuses ranks of two builds); use engine_update: stage" in msg
    assert parse_config(_sg(tmp_path, {"gpus_per_cell": 8}, tp_size=4, python=str(other)), "x.yaml")  # auto: stage


def test_rdma_is_refused_for_the_embedded_engines_own_pull(tmp_path: Path) -> None:
    """The embedded engine's Transfer Engine is made with tcp: under rdma the core's publication is not reachable
    from it (Mooncake's multi_transport.cpp selectTransport: "Transport rdma not installed")."""
    msg = _err(_sg(tmp_path, {"engine": "embedded"}, {"protocol": "rdma"}))
    assert "weights.engine_update: pull does not go with weights.protocol: rdma" in msg and "\n" not in msg
    for update in ("push", "stage"):
        assert parse_config(_sg(tmp_path, {"engine": "embedded"}, {"protocol": "rdma", "engine_update": update}),
                            "x.yaml").weights.protocol == "rdma"


def test_the_push_rank_takes_the_first_gpu_sglang_leaves_free(tmp_path: Path) -> None:
    from gyre_slurm.agent.weight_link import WeightLink

    for gpus, tp, extra, want in [(8, 4, {}, 4), (8, 4, {"base-gpu-id": 2}, 0), (8, 4, {"base_gpu_id": 0,
                                  "gpu_id_step": 2}, 1), (2, 1, {}, 1)]:
        cfg = parse_config(_sg(tmp_path, {"gpus_per_cell": gpus}, {"engine_update": "push"}, tp_size=tp,
                               extra_args=extra), "x.yaml")
        w = WeightLink(cfg, 0)
        assert w.pushes and w._push_gpu == want, (gpus, tp, extra)
    # the sender stages each bucket there (NCCL picks a communicator's GPU from its tensors), not on GPU 0
    import torch

    from gyre_slurm.engines.sglang_weights import DistributedWeightSender

    sender = DistributedWeightSender("http://127.0.0.1:1", "127.0.0.1", 1, backend="nccl", gpu=w._push_gpu)
    assert sender.device == torch.device("cuda", 1)
