"""The pure-torch Qwen3 (model/qwen3.py) against transformers' Qwen3ForCausalLM on the same folders, fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from gyre_slurm.model.qwen3 import KVCache, Qwen3Config, Qwen3ForCausalLM, read_safetensors
from gyre_slurm.model.tiny import create_tiny_model, tiny_config

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def untied_sharded(tmp_path_factory) -> Path:
    """An untied-head, bias-free Qwen3 saved in several safetensors shards with an index."""
    cfg = tiny_config(320)
    cfg.tie_word_embeddings = False
    cfg.eos_token_id = 256
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("untied")
    HFQwen3(cfg).save_pretrained(out, max_shard_size="200KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    return out


def both(path: Path) -> tuple[HFQwen3, Qwen3ForCausalLM]:
    return HFQwen3.from_pretrained(path, dtype=torch.float32).eval(), Qwen3ForCausalLM.from_pretrained(path).eval()


def test_full_forward_matches_transformers(tiny, untied_sharded):
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (3, 57))
    for path in (tiny, untied_sharded):
        hf, ours = both(path)
        with torch.no_grad():
            ref, got = hf(ids).logits, ours(ids)
        assert got.shape == ref.shape == (3, 57, 320)
        assert (got - ref).abs().max().item() < TOL
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight  # untied stays untied
    tied = Qwen3ForCausalLM.from_pretrained(tiny)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_prefill_then_decode_with_cache_matches(tiny):
    hf, ours = both(tiny)
    torch.manual_seed(1)
    ids = torch.randint(0, 320, (1, 48))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        cache = ours.new_cache(capacity=4)  # small on purpose: the cache must grow
        got = [ours(ids[:, :20], cache)[0]]  # prefill
        got += [ours(ids[:, t : t + 1], cache)[0] for t in range(20, 30)]  # one-token decode
        got.append(ours(ids[:, 30:48], cache)[0])  # a second prefill chunk on top of a cache
    assert cache.length == 48 and cache.capacity >= 48
    assert (torch.cat(got) - ref).abs().max().item() < TOL
    with torch.no_grad():
        last = ours(ids[:, :20], ours.new_cache(), last_only=True)
    assert last.shape == (1, 1, 320) and (last[0, 0] - ref[19]).abs().max().item() < TOL


def test_keep_narrows_the_last_layer_to_the_positions_needed(tiny):
    """keep="none" fills the cache as a full forward does; "last" and a mask give the full forward's logits at those
    positions, with the same gradients (the warm-up's tails train through it)."""
    _, ours = both(tiny)
    torch.manual_seed(3)
    ids = torch.randint(0, 320, (1, 40))
    with torch.no_grad():
        full = ours.new_cache()
        ref = ours(ids, full)[0]
        part = ours.new_cache()
        assert ours.hidden_states(ids[:, :25], part, keep="none") is None
        assert part.length == 25
        for layer in range(ours.config.num_hidden_layers):
            assert torch.allclose(part.keys[layer][:, :, :25], full.keys[layer][:, :, :25], atol=1e-6)
            assert torch.allclose(part.values[layer][:, :, :25], full.values[layer][:, :, :25], atol=1e-6)
        last = ours(ids[:, 25:], part, last_only=True)
        assert last.shape == (1, 1, 320) and (last[0, 0] - ref[39]).abs().max().item() < TOL
    at = torch.zeros(1, 15, dtype=torch.bool)
    at[0, [0, 3, 4, 14]] = True

    def loss_and_grads(narrow: bool):
        ours.zero_grad(set_to_none=True)
        cache = ours.new_cache()
        with torch.no_grad():
            ours.hidden_states(ids[:, :25], cache, keep="none")
        logits = ours(ids[:, 25:], cache, at=at) if narrow else ours(ids[:, 25:], cache)[at]
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in ours.parameters()]

    (got, g_got), (want, g_want) = loss_and_grads(True), loss_and_grads(False)
    assert got.shape == (4, 320) and (got - want).abs().max().item() < TOL
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_got, g_want, strict=True))


def test_ragged_batched_decode_matches(tiny):
    """Rows with different past lengths decode together, each in its own cache (the engine's batched step)."""
    hf, ours = both(tiny)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 320, (1, n)) for n in (7, 31, 16)]
    with torch.no_grad():
        caches = []
        for s in seqs:
            caches.append(ours.new_cache())
            ours(s[:, :-3], caches[-1])
        for step in (3, 2, 1):
            batch = torch.cat([s[:, -step : s.shape[1] - step + 1] for s in seqs])
            out = ours(batch, caches)
            for row, s in enumerate(seqs):
                ref = hf(s).logits[0, s.shape[1] - step]
                assert (out[row, 0] - ref).abs().max().item() < TOL


def test_positions_and_cache_copy(tiny):
    _, ours = both(tiny)
    ids = torch.randint(0, 320, (1, 24))
    with torch.no_grad():
        full = ours(ids)
        explicit = ours(ids, positions=torch.arange(24)[None])
        cache = ours.new_cache()
        ours(ids[:, :16], cache)
        prefix = cache.copy_prefix(10)  # reuse 10 tokens, recompute the rest
        tail = ours(ids[:, 10:], prefix)
    assert torch.equal(full, explicit)
    assert (tail[0] - full[0, 10:]).abs().max().item() < TOL
    assert isinstance(prefix, KVCache) and prefix.length == 24


def test_autograd_matches_transformers(tiny):
    """Usable by a trainer: the same loss gives the same gradients."""
    hf, ours = both(tiny)
    torch.manual_seed(3)
    ids = torch.randint(0, 320, (2, 33))

    def loss(model, logits_of):
        logits = logits_of(model)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 320), ids[:, 1:].reshape(-1))

    loss(hf, lambda m: m(ids).logits).backward()
    loss(ours, lambda m: m(ids)).backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert (p.grad - hf_grads[name].grad).abs().max().item() < 1e-5, name


def test_state_dict_uses_hugging_face_names(tiny):
    _, ours = both(tiny)
    assert set(read_safetensors(tiny)) <= set(ours.state_dict())


def test_load_weights_in_place_and_refusals(tiny, untied_sharded, tmp_path):
    other = create_tiny_model(tmp_path / "seed1", seed=1)
    hf1 = HFQwen3.from_pretrained(other, dtype=torch.float32).eval()
    ours = Qwen3ForCausalLM.from_pretrained(tiny).eval()
    ids = torch.randint(0, 320, (1, 12))
    ours.load_weights(other)
    with torch.no_grad():
        assert (ours(ids) - hf1(ids).logits).abs().max().item() < TOL
    with pytest.raises(ValueError, match="config differs"):
        ours.load_weights(untied_sharded)
    cfg = Qwen3Config.from_pretrained(tiny)
    assert cfg.eos_token_ids == (256,) and cfg.rope_theta == 10000.0 and cfg.tie_word_embeddings
    legacy = Qwen3Config.from_dict({**{k: v for k, v in vars(cfg).items() if k != "eos_token_ids"},
                                    "model_type": "qwen3", "rope_theta": 5e5, "eos_token_id": [1, 2]})
    assert legacy.rope_theta == 5e5 and legacy.eos_token_ids == (1, 2)
    with pytest.raises(ValueError, match="rope scaling"):
        Qwen3Config.from_dict({**vars(cfg), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_chunked_prefill_of_a_long_prompt_matches_one_forward(tiny):
    """Chunks on top of a cache (the past attended unmasked, the chunk causally, merged by log-sum-exp) give the
    full forward's logits, and so does the masked attention they replace."""
    import gyre_slurm.model.qwen3 as qwen3

    hf, ours = both(tiny)
    torch.manual_seed(4)
    ids = torch.randint(0, 320, (1, 1500))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        for flash in (qwen3._FLASH_CPU, None):
            saved, qwen3._FLASH_CPU = qwen3._FLASH_CPU, flash
            try:
                cache = ours.new_cache(1500)
                got = torch.cat([ours(ids[:, s : s + 256], cache)[0] for s in range(0, 1500, 256)])
            finally:
                qwen3._FLASH_CPU = saved
            assert (got - ref).abs().max().item() < TOL, flash
    assert qwen3._FLASH_CPU is not None  # this torch has the kernel: the fast path was the one tested first


def test_packed_head_matches_and_follows_the_weights(tiny, tmp_path, monkeypatch):
    """The output head on its oneDNN-packed copy: the plain head's logits, re-packed when the weights change."""
    import gyre_slurm.model.qwen3 as qwen3

    ours = Qwen3ForCausalLM.from_pretrained(tiny).eval()
    x = torch.randn(3, 5, ours.config.hidden_size)
    with torch.no_grad():
        ours._head(x)
    assert ours._packed_head is None  # the tiny model's head is too small to pack
    monkeypatch.setattr(qwen3, "PACKED_HEAD_MIN", 0)
    with torch.no_grad():
        got = ours._head(x)
        assert got.shape == (3, 5, 320) and (got - ours.lm_head(x)).abs().max().item() < 1e-5
        assert qwen3._ONEDNN_HEAD and ours._packed_head is not None  # the packed path ran
        ours.lm_head.weight.mul_(2)  # in place: the packed copy is re-made
        assert (ours._head(x) - ours.lm_head(x)).abs().max().item() < 1e-5
        ours.load_weights(create_tiny_model(tmp_path / "seed2", seed=2))
        assert (ours._head(x) - ours.lm_head(x)).abs().max().item() < 1e-5
    with torch.inference_mode():  # weights loaded inside inference mode have no version counter
        inf = Qwen3ForCausalLM.from_pretrained(tiny).eval()
        assert (inf._head(x) - inf.lm_head(x)).abs().max().item() < 1e-5
    out = ours._head(x.requires_grad_())  # autograd: the plain head
    assert out.grad_fn is not None


def test_copy_prefix_with_room(tiny):
    _, ours = both(tiny)
    ids = torch.randint(0, 320, (1, 40))
    with torch.no_grad():
        cache = ours.new_cache()
        full = ours(ids, cache)
        part = cache.copy_prefix(30, capacity=100)
        assert part.length == 30 and part.capacity == 100
        tail = ours(ids[:, 30:], part)
    assert part.capacity == 100  # no re-allocation
    assert (tail[0] - full[0, 30:]).abs().max().item() < TOL
