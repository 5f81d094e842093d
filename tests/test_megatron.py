"""The Megatron trainer backend on CPU (gloo, world 1, TP = PP = DP = 1): weight conversion both ways against
the Hugging Face model's logits, and a GSPO step that equals the torch backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gyre_slurm.config import parse_config
from gyre_slurm.errors import ConfigError
from gyre_slurm.model.qwen3 import Qwen3Config as GyreQwen3Config
from gyre_slurm.train.backends import make_trainer
from gyre_slurm.train.megatron_convert import hf_to_megatron, megatron_to_hf
from gyre_slurm.train.megatron_model import build_gpt, ensure_process_groups, gpt_logits, gpt_state
from gyre_slurm.train.megatron_trainer import MegatronTrainer
from gyre_slurm.train.shards import shard_id, split_batch
from gyre_slurm.train.step_runner import CoreStep, SatelliteStep
from gyre_slurm.train.torch_trainer import TorchTrainer, load_policy
from tests.megatron_rank import hf_state, load_hf_state
from tests.test_trainer import VOCAB, build_tiny_qwen3, make_batch

ADAM_EPS = 1e-3  # as tests/test_satellite.py: AdamW's update is smooth in g, so weights compare the gradients
RUNS = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2)}
OFFSETS = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2}  # inside and outside the clip window


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    """tests/test_trainer.py's tiny Qwen3: tied embeddings, 4 heads on 2 KV groups."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("tied"))


def build_untied_qwen3(d: Path, layers: int = 3, heads: int = 6, ffn: int = 160, seed: int = 1) -> Path:
    """A small random Qwen3 with its own output head, `heads` query heads on 2 KV groups, norms away from 1 (so a
    misplaced norm weight shows in the logits)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre_slurm.model.tiny import build_tokenizer

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory) -> Path:
    """3 query heads per KV group."""
    return build_untied_qwen3(tmp_path_factory.mktemp("untied"))


def ids(n_rows: int = 3, length: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n_rows, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(model_dir: Path, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_policy(model_dir, "cpu").eval()(input_ids=x).logits


def megatron_trainer(model_dir: Path, **kw) -> MegatronTrainer:
    tr = MegatronTrainer(model_dir, device="cpu", seed=0, **kw)
    for group in tr.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return tr


def torch_trainer(model_dir: Path, **kw) -> TorchTrainer:
    tr = TorchTrainer(model_dir, device="cpu", seed=0, **kw)
    for group in tr.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return tr


def assert_close_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert set(a) == set(b)
    for n in a:
        assert torch.allclose(a[n], b[n], atol=atol, rtol=0), (n, float((a[n] - b[n]).abs().max()))


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_hf_to_megatron_gives_the_hf_logits(which, tied_dir, untied_dir):
    model_dir = tied_dir if which == "tied" else untied_dir
    cfg = GyreQwen3Config.from_pretrained(model_dir)
    hf = load_policy(model_dir, "cpu").eval()
    ensure_process_groups(torch.device("cpu"))
    gpt = build_gpt(cfg).eval()
    state = gpt_state(gpt)
    conv = hf_to_megatron(hf.state_dict(), cfg)
    assert set(conv) == set(state)
    with torch.no_grad():
        for n, p in state.items():
            p.copy_(conv[n])
        x = ids()
        assert torch.allclose(gpt_logits(gpt, x), hf(input_ids=x).logits, atol=1e-5, rtol=0)
    # the conversion is a pure re-arrangement: back to Hugging Face gives every tensor bit for bit
    back = megatron_to_hf(state, cfg)
    want = dict(hf.named_parameters())
    assert set(back) == set(want)
    assert all(torch.equal(back[n], want[n]) for n in want)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_megatron_to_hf_snapshot_reloads_with_the_same_logits(which, tied_dir, untied_dir, tmp_path):
    """Megatron weights (moved by a large step) → Hugging Face snapshot → reload: the GPTModel's logits."""
    from transformers import AutoModelForCausalLM

    model_dir = tied_dir if which == "tied" else untied_dir
    tr = megatron_trainer(model_dir, lr=5e-2)
    before = gpt_logits(tr.gpt, ids()).detach()
    m = tr.train_step(make_batch(torch_trainer(model_dir), 4, {1: (1.0, 2), 2: (-1.0, 1)}))
    assert m["skipped"] == 0
    with torch.no_grad():
        after = gpt_logits(tr.gpt, ids())
    assert (after - before).abs().max() > 1e-2  # the step moved the Megatron weights
    out = tr.save(tmp_path / "v1")
    assert {"config.json", "model.safetensors.index.json", "model-rank0-of-1.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids()).logits, after, atol=1e-5, rtol=0)
    # and back in: a fresh Megatron trainer loading that snapshot computes the same logits
    fresh = megatron_trainer(model_dir)
    fresh.load_weights(out)
    with torch.no_grad():
        assert torch.allclose(gpt_logits(fresh.gpt, ids()), after, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("mode", "minibatches"), [("bypass", 1), ("decoupled", 2)])
def test_gspo_step_equals_the_torch_backend(mode, minibatches, tied_dir):
    """Same weights, same batch (runs straddling micro-batches, some clipped): same loss, gradient, grad norm,
    metrics and updated weights."""
    kw = dict(lr=1e-3, micro_batch_tokens=60, mode=mode, minibatches=minibatches)
    t, mg = torch_trainer(tied_dir, **kw), megatron_trainer(tied_dir, **kw)
    batch = make_batch(t, 1, RUNS, offsets=OFFSETS)

    t.zero_grad()
    mg.zero_grad()
    mt, mm = t.forward_backward(batch), mg.forward_backward(batch)
    assert mt["prepass_micro_batches"] > 0
    assert 0 < mt["clip_frac_runs"] < 1 if mode == "bypass" else mt["w_trunc_frac"] == 0  # decoupled: s_r = 1
    assert_close_state(t.export_grads(), megatron_to_hf(mg.export_grads(), mg.config))  # world 1: Megatron names
    for k in mt:
        assert mm[k] == pytest.approx(mt[k], abs=1e-5), k
    t.zero_grad()
    mg.zero_grad()

    st, sm = t.train_step(batch), mg.train_step(batch)
    assert sm["minibatches"] == minibatches and sm["optimizer_steps"] == minibatches
    for k in ("loss", "grad_norm", "clip_frac", "clip_frac_runs", "mean_abs_log_s", "mismatch", "tokens_trained"):
        assert sm[k] == pytest.approx(st[k], abs=1e-5), k
    want = {n: p.detach() for n, p in t.model.named_parameters()}
    assert_close_state(hf_state(mg), want)  # the fp32 masters
    conv = megatron_to_hf({n: p.detach() for n, p in mg.gpt.named_parameters()}, mg.config)
    assert_close_state(conv, want)  # and the GPTModel itself


def test_core_and_satellite_steps_on_megatron(tied_dir, tmp_path):
    """The step runners with Megatron trainers: a satellite's gradient message (its rank's slices by Megatron name)
    adds into the core, weights a satellite receives reach its GPTModel, and the result is one cell's step."""

    batch = make_batch(torch_trainer(tied_dir), 11, RUNS, offsets=OFFSETS)
    batch.step, batch.version_in = 5, 4
    one = torch_trainer(tied_dir, micro_batch_tokens=60)
    one.train_step(batch)

    shards = split_batch(batch, n_shards=2)
    core = CoreStep(megatron_trainer(tied_dir, micro_batch_tokens=60), 5, 4, [shard_id(s) for s in shards])
    sat_trainer = megatron_trainer(tied_dir, micro_batch_tokens=60)
    with torch.no_grad():  # wrong weights first: the pull below must replace them in the GPTModel too
        for p in sat_trainer.gpt.parameters():
            p.add_(0.1)
    sat = SatelliteStep(sat_trainer, name="sat")
    start = hf_state(core.trainer)
    sat.load(tied_dir, 5, 4, pull=lambda tr: load_hf_state(tr, start))
    assert core.run_shard(shards[0])
    assert core.accept(sat.run_shard(shards[1])) == "added"
    _, metrics = core.finish(tmp_path / "v5")
    assert metrics["shards"] == 2 and metrics["satellites"] == 1
    assert_close_state(hf_state(core.trainer), {n: p.detach() for n, p in one.model.named_parameters()})


def test_factory_and_refused_parallel_sizes(tied_dir):
    cfg = parse_config({"run": {"name": "m"}, "train": {"backend": "megatron"}})
    tr = make_trainer(tied_dir, cfg.train, device="cpu")
    assert isinstance(tr, MegatronTrainer) and tr.minibatches == cfg.train.minibatches
    assert isinstance(make_trainer(tied_dir, parse_config({"run": {"name": "t"}}).train, device="cpu"),
                      TorchTrainer)
    for field in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
        with pytest.raises(ConfigError, match=f"train.{field} > 1 needs train.backend: megatron"):
            parse_config({"run": {"name": "t"}, "train": {field: 2}})
        # a process outside a cell of that shape is refused before anything is built
        with pytest.raises(ValueError, match=r"= 2 ranks, but this cell's torch.distributed world has 1"):
            MegatronTrainer(tied_dir, device="cpu", **{field: 2})
