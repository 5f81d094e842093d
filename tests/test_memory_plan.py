"""The memory plan (launch/memory_plan.py, memory_fit.py): its terms on a shape small enough to count by hand,
Megatron's published bytes per parameter, the one-line refusal and the change it suggests, the planning shapes, the
paper configs through `gyre check`, and one measured training step within 15% (tools/bench_memory_plan.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gyre_slurm.config import parse_config
from gyre_slurm.errors import GyreError
from gyre_slurm.launch.memory_fit import fit_problem, plan_memory
from gyre_slurm.launch.memory_plan import TrainerLayout, stage_memory, trainer_memory
from gyre_slurm.launch.model_shape import BUILTIN_SHAPES, ModelShape, read_shape, refuse_planning_shape
from gyre_slurm.launch.ranks import check_model_fits
from gyre_slurm.launch.start_check import check_model_at_start

from .conftest import REPO, gyre

GiB = 1 << 30
# a dense Qwen3 small enough to count: hidden 8, 2 layers, 2 heads on 1 KV head of 4, MLP 16, vocabulary 32, untied
TINY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "vocab_size": 32, "tie_word_embeddings": False, "max_position_embeddings": 64}
# an 8B-class dense Qwen3 (Qwen3-8B's published shape)
DENSE_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
            "max_position_embeddings": 40960}


def layout(**kw) -> TrainerLayout:
    return TrainerLayout(**{"tp": 1, "pp": 1, "dp": 1, "ep": 1, "precision": "bf16", "distributed_optimizer": True,
                            "recompute": "none", "micro_batch_tokens": 10, "on_gpu": True, **kw})


def test_each_term_of_a_shape_counted_by_hand() -> None:
    m = trainer_memory(ModelShape.from_config(TINY), layout())
    # parameters: embedding 32·8 + head 32·8 + final norm 8 + 2 layers × (q,k,v 16·8 + o 8·8 + 2 norms of 8 + q/k
    # norms of 4 + MLP 3·8·16) = 256 + 256 + 8 + 2 × 600
    n = 1720
    assert m.params == n
    assert (m.parameters, m.main_gradients, m.fp32_masters, m.adam_moments) == (2 * n, 4 * n, 4 * n, 8 * n)
    # per token and layer (bf16 on a GPU): 2 fused norms (2·2·8 + 4), q (4·2·8) and k (3·2·4), rstd and logsumexp
    # (8·2 + 4·1), RoPE (4·2·4), SwiGLU (5·2·16)
    assert m.activations == 10 * 2 * (2 * 36 + 64 + 24 + 20 + 32 + 160)
    assert m.logits == 10 * (36 + 2 * 8 + 16 * 32 + 64)  # final norm, head input, fp32 logits, the loss's terms
    assert m.backward_temps == 10 * (11 * 2 * 16 // 4 + 10 * 8)
    assert (m.recomputed_layer, m.token_exchange, m.token_buffer, m.comm_buffer) == (0, 0, 0, 0)
    assert m.optimizer_temps == 4 * n  # √v of every parameter at once (AdamW's multi-tensor path on CUDA)
    assert m.total == m.state + m.activations + m.logits and m.state == 18 * n
    # full recomputation keeps each layer's input (2·8 B per token) and makes one layer again in its backward
    r = trainer_memory(ModelShape.from_config(TINY), layout(recompute="full"))
    assert r.activations == 10 * 2 * 16 and r.recomputed_layer == m.activations // 2


@pytest.mark.parametrize(("precision", "without", "per_replica"), [("bf16", 18, (6, 12)), ("fp32", 16, (8, 8))])
def test_bytes_per_parameter_are_megatrons_distributed_optimizer_table(precision, without, per_replica) -> None:
    """Megatron-LM's docs ("Distributed Optimizer"): 18 B per parameter for bf16 weights with fp32 gradients, 6 +
    12/d with the distributed optimizer; 16 and 8 + 8/d in fp32."""
    shape = ModelShape.from_config({**DENSE_8B, "vocab_size": 1024})  # no tensor larger than a replica's share
    for d in (1, 8, 64):
        m = stage_memory(shape, layout(precision=precision, dp=d), 0)
        assert m.state / m.params == pytest.approx(per_replica[0] + per_replica[1] / d if d > 1 else without, rel=2e-3)
        off = stage_memory(shape, layout(precision=precision, dp=d, distributed_optimizer=False), 0)
        assert off.state / off.params == pytest.approx(without)


def _gpu_config(model: Path, **train) -> dict:
    return {"run": {"name": "plan"}, "cluster": {"cells": 2, "gpus_per_cell": 8, "engine": "embedded"},
            "model": {"path": str(model)}, "weights": {"transport": "file"},
            "train": {"backend": "megatron", "data_parallel": 8, "micro_batch_tokens": 32768, **train}}


def _apply(data: dict, change: str) -> dict:
    """The config with a refusal's "set a.b: v, c.d: w" applied."""
    for key, value in re.findall(r"(\w+\.\w+): ([\w.]+)", change):
        section, name = key.split(".")
        data[section][name] = yaml.safe_load(value)
    return data


def test_a_config_that_does_not_fit_is_refused_in_one_line_with_a_change_that_fits(tmp_path) -> None:
    model = tmp_path / "dense-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DENSE_8B))
    data = _gpu_config(model)
    cfg = parse_config(data)
    line = fit_problem(read_shape(model), cfg)
    need = plan_memory(read_shape(model), cfg).trainer.total
    assert line is not None and "\n" not in line
    assert line.startswith(f"the trainer needs {need / GiB:.1f} GiB per GPU of 80 (largest: activations ")
    change = re.search(r": set (.*) \(then ([\d.]+) GiB\)$", line)
    assert change is not None, line
    fixed = parse_config(_apply(data, change.group(1)))
    assert fit_problem(read_shape(model), fixed) is None
    assert plan_memory(read_shape(model), fixed).trainer.total / GiB == pytest.approx(float(change.group(2)), abs=0.05)
    # nothing fits GPUs of 8 GiB: the line names the least the config needs on its nodes, and the GPU for it
    data["cluster"]["gpu_memory_gb"] = 8
    small = fit_problem(read_shape(model), parse_config(data))
    last = re.search(r": set (.*) and use GPUs of at least \d+ GiB \(cluster.gpu_memory_gb: (\d+)\)$", small)
    assert last is not None, small
    data = _apply(data, last.group(1))
    data["cluster"]["gpu_memory_gb"] = int(last.group(2))
    assert fit_problem(read_shape(model), parse_config(data)) is None
    # through the CLI: the plan printed, then the refusal as the one line on stderr
    data = _gpu_config(model)
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    r = gyre("check", path)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {path}: {line}", r.stderr
    assert "memory plan per GPU of 80 GiB" in r.stdout and "does not fit" in r.stdout
    # CPU cells: the same plan per rank, for information, never refused
    cpu = {**data, "cluster": {"cells": 2, "gpus_per_cell": 0, "engine": "embedded"}}
    assert fit_problem(read_shape(model), parse_config(cpu)) is None


def test_an_sglang_engine_without_room_for_one_context_is_refused(tmp_path) -> None:
    model = tmp_path / "dense-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DENSE_8B))
    data = {**_gpu_config(model, recompute="full", micro_batch_tokens=8192),
            "sglang": {"python": sys.executable, "tp_size": 1, "extra_args": {"context_length": 1 << 20}}}
    data["cluster"].update(engine="sglang", gpu_memory_gb=141)  # an H200: the trainer fits
    line = fit_problem(read_shape(model), parse_config(data))
    assert line is not None and line.startswith("the SGLang engine does not fit: its KV cache holds "), line
    tp = int(re.search(r"set sglang.tp_size: (\d+)", line).group(1))
    data["sglang"]["tp_size"] = tp
    assert fit_problem(read_shape(model), parse_config(data)) is None


def test_planning_shapes_plan_and_are_refused_at_start(tmp_path) -> None:
    for name, total, active in (("qwen3.6-122b-shape", 122e9, 10e9), ("qwen3.8-2.4t-shape", 2.4e12, 95e9)):
        folder = REPO / "configs" / "models" / name
        shape = read_shape(folder)
        assert shape.count() == pytest.approx(total, rel=0.03) and shape.count(active=True) == pytest.approx(
            active, rel=0.05), name
        with pytest.raises(GyreError, match=re.escape(f"model.path {folder} holds a config.json but no weights (a "
                                                      "shape for planning)")):
            refuse_planning_shape(folder)
    data = yaml.safe_load((REPO / "configs" / "paper-122b.yaml").read_text())
    data.update(weights={"transport": "file"}, model={"path": str(REPO / "configs/models/qwen3.6-122b-shape")})
    cfg = parse_config(data, "paper-122b.yaml")  # (the transport file: only the model checks are under test here)
    check_model_fits(cfg.train, json.loads((REPO / "configs/models/qwen3.6-122b-shape/config.json").read_text()))
    with pytest.raises(GyreError, match="holds a config.json but no weights"):
        check_model_at_start(cfg, cfg.model.path)
    (tmp_path / "config.json").write_text((cfg.model.path / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_at_start(cfg, tmp_path)  # weights there (as far as the start looks): it fits, so nothing is refused


def test_the_builtin_shapes_are_the_ones_the_models_are_made_with() -> None:
    from gyre_slurm.model.long import long_config
    from gyre_slurm.model.tiny import build_tokenizer, tiny_config

    vocab = (len(build_tokenizer()) + 63) // 64 * 64
    for name, made in (("tiny", tiny_config(vocab)), ("long", long_config())):
        assert ModelShape.from_config(BUILTIN_SHAPES[name]) == ModelShape.from_config(made.to_dict()), name


@pytest.mark.parametrize("name", ["paper-122b.yaml", "paper-2.4t.yaml"])
def test_the_paper_configs_pass_gyre_check_with_the_plan(name: str) -> None:
    r = gyre("check", REPO / "configs" / name)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"memory plan per GPU of \d+ GiB: configs/models/qwen3\.\d-[\d.]+[bt]-shape \(a shape for "
                     r"planning\)", out), out
    assert re.search(r"peak \(state \+ largest phase\) +[\d.]+ GiB fits", out), out
    assert re.search(r"KV cache: [\d,]+ tokens; one context of 262,144 fits", out), out
    assert out.rstrip().endswith("valid")


@pytest.mark.slow
def test_the_plan_is_within_15_percent_of_a_measured_step() -> None:
    """tools/bench_memory_plan.py at its smallest size: one GSPO step of MegatronTrainer on the CPU, its peak of live
    tensor bytes against the plan (the tool exits 1 beyond 15%)."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "bench_memory_plan.py"), "--sizes", "base"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    ratio = re.search(r"base .* plan/measured ([\d.]+)", r.stdout)
    assert ratio is not None and abs(float(ratio.group(1)) - 1) <= 0.15, r.stdout
