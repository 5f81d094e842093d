"""Qwen3-MoE: the pure-torch module (model/qwen3.py) against transformers' Qwen3MoeForCausalLM, the tiny MoE folder's
save/load round trip, and the Megatron-Core MoE GPTModel with converted weights (CPU, gloo, world 1), fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig as HFMoeConfig
from transformers import Qwen3MoeForCausalLM as HFMoe

from gyre_slurm.model.qwen3 import MoE, Qwen3Config, Qwen3ForCausalLM, read_safetensors
from gyre_slurm.model.tiny import build_tiny_moe
from gyre_slurm.train.megatron_convert import hf_to_megatron, megatron_to_hf, tensor_maps
from gyre_slurm.train.megatron_model import build_gpt, ensure_process_groups, gpt_logits, gpt_state
from gyre_slurm.train.torch_trainer import load_policy, save_policy

TOL = 1e-4
VOCAB = 320


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return build_tiny_moe(tmp_path_factory.mktemp("tiny_moe"), seed=0)


def hf_moe(seed: int = 0, **kw) -> HFMoe:
    """A random transformers Qwen3-MoE: 6 experts, top 2 of them, norms away from 1 and a router with large weights
    (decisive routing: a misplaced expert or a wrong top-k shows in the logits)."""
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                 num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = HFMoe(HFMoeConfig(**{**shape, **kw})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors ([E, 2I, H] gate ‖ up, [E, H, I] down) → the published per-expert keys."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, w in enumerate(t):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = w.chunk(2, dim=0)
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out.update({f"{prefix}{e}.down_proj.weight": w for e, w in enumerate(t)})
        else:
            out[name] = t
    return out


def ours_from(hf: HFMoe) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(hf.config.to_dict())).eval()
    model.load_state(per_expert(hf.state_dict()))
    return model


def ids(n_rows: int = 3, length: int = 41, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n_rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw", [{}, {"norm_topk_prob": False}, {"mlp_only_layers": [1]},
                                {"decoder_sparse_step": 2, "tie_word_embeddings": True}])
def test_forward_matches_transformers(kw):
    hf = hf_moe(**kw)
    ours = ours_from(hf)
    want_moe = [hf.config.num_experts > 0 and i not in hf.config.mlp_only_layers
                and (i + 1) % hf.config.decoder_sparse_step == 0 for i in range(3)]
    assert [isinstance(layer.mlp, MoE) for layer in ours.model.layers] == want_moe
    x = ids()
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x)
        assert (got - ref).abs().max().item() < TOL
        # the cached path too: prefill then decode, per row
        cache = ours.new_cache()
        steps = [ours(x[:1, :30], cache)[0]] + [ours(x[:1, t : t + 1], cache)[0] for t in range(30, 41)]
        assert (torch.cat(steps) - ref[0]).abs().max().item() < TOL


def test_refused_variants():
    raw = hf_moe().config.to_dict()
    with pytest.raises(ValueError, match="shared experts"):
        Qwen3Config.from_dict({**raw, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match="bad Qwen3-MoE routing"):
        Qwen3Config.from_dict({**raw, "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match="without moe_intermediate_size"):
        Qwen3Config.from_dict({k: v for k, v in raw.items() if k != "moe_intermediate_size"})
    sparse = Qwen3Config.from_dict({**raw, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="experts in every Qwen3-MoE layer"):
        tensor_maps(sparse)
    with pytest.raises(ValueError, match="top-1 routing"):
        tensor_maps(Qwen3Config.from_dict({**raw, "num_experts_per_tok": 1}))


def test_tiny_moe_folder_round_trips(tiny_moe, tmp_path):
    cfg = Qwen3Config.from_pretrained(tiny_moe)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.norm_topk_prob) == (4, 2, 2, True)
    again = build_tiny_moe(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_moe / "model.safetensors").read_bytes()
    src = read_safetensors(tiny_moe)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in src and "model.layers.0.mlp.gate.weight" in src
    assert not any("gate_up_proj" in n for n in src)  # the published layout, not transformers' fused one

    ours = Qwen3ForCausalLM.from_pretrained(tiny_moe).eval()
    out = ours.save_pretrained(tmp_path / "ours")
    saved = read_safetensors(out)
    assert set(saved) == set(src) and all(torch.equal(saved[n], src[n]) for n in src)
    assert Qwen3Config.from_pretrained(out) == cfg and cfg.model_type == "qwen3_moe"
    # transformers reads our folder, and the trainer's save (transformers' save_pretrained) writes the same tensors
    hf = load_policy(out, "cpu").eval()
    x = ids(2, 33)
    with torch.no_grad():
        assert (hf(input_ids=x).logits - ours(x)).abs().max().item() < TOL
    snap = save_policy(hf, tiny_moe, tmp_path / "snap")
    back = read_safetensors(snap)
    assert set(back) == set(src) and all(torch.equal(back[n], src[n]) for n in src)
    assert Qwen3Config.from_pretrained(snap) == cfg


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_moe_matches_ours(norm_topk_prob):
    hf = hf_moe(seed=3, norm_topk_prob=norm_topk_prob)
    ours = ours_from(hf)
    cfg = ours.config
    ensure_process_groups(torch.device("cpu"))
    gpt = build_gpt(cfg).eval()
    state = gpt_state(gpt)
    hf_state = dict(ours.named_parameters())
    conv = hf_to_megatron(hf_state, cfg)
    assert set(conv) == set(state)
    assert all(conv[n].shape == p.shape for n, p in state.items())
    experts = [(t.layer, t.expert, t.kind) for t in tensor_maps(cfg) if t.expert is not None]
    assert len(experts) == 2 * cfg.num_hidden_layers * cfg.num_experts
    assert {k for _, _, k in experts} == {"expert_fc1", "expert_fc2"}
    with torch.no_grad():
        for n, p in state.items():
            p.copy_(conv[n])
        x = ids()
        assert (gpt_logits(gpt, x) - ours(x)).abs().max().item() < TOL
    back = megatron_to_hf(state, cfg)
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[n], hf_state[n]) for n in hf_state)

