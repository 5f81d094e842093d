"""Torch trainer, batch file and warm-up on a tiny random Qwen3 (real transformers, real torch, CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gyre_slurm.train.batch import BatchError, TrainBatch, TrainSample, read_batch, write_batch
from gyre_slurm.train.gspo import EPS_HIGH, EPS_LOW
from gyre_slurm.train.torch_trainer import TorchTrainer, pack_micro_batches, target_logprobs

VOCAB = 384


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def build_tiny_qwen3(d: Path) -> Path:
    """A random 2-layer Qwen3 with the tiny tokenizer, saved to d (other trainer tests reuse it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gyre_slurm.model.tiny import build_tokenizer

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d


def own_logprobs(trainer: TorchTrainer, s: TrainSample) -> list[float]:
    """The trainer's log-probs for a sample's targets, in the batch's per-token layout (0 off-target)."""
    ids = torch.tensor([s.tokens])
    mask = torch.tensor([s.loss_mask], dtype=torch.bool)
    with torch.no_grad():
        lp = iter(target_logprobs(trainer.model, ids, mask).tolist())
    return [next(lp) if m else 0.0 for m in s.loss_mask]


def make_batch(trainer: TorchTrainer, seed: int, runs: dict[int, tuple[float, int]], length: int = 40,
               offsets: dict[int, float] | None = None) -> TrainBatch:
    """runs: run_id -> (advantage, n_segments). Behaviour log-probs = the trainer's own, shifted per run."""
    rng = random.Random(seed)
    vocab = min(VOCAB, trainer.model.config.vocab_size)
    samples = []
    for run_id, (_, n_seg) in runs.items():
        for _ in range(n_seg):
            n = rng.randint(length // 2, length)
            tokens = [rng.randrange(vocab) for _ in range(n)]
            mask = [0] * 5 + [int(rng.random() < 0.6) for _ in range(n - 5)]
            s = TrainSample(run_id, tokens, mask, [0.0] * n)
            shift = (offsets or {}).get(run_id, 0.0)
            s.behav_logp = [lp - shift if m else 0.0 for lp, m in zip(own_logprobs(trainer, s), mask, strict=True)]
            samples.append(s)
    targets = {r: sum(sum(s.loss_mask) for s in samples if s.run_id == r) for r in runs}
    return TrainBatch(samples, {r: a for r, (a, _) in runs.items()}, targets, step=0, version_in=0)


def run_mean_logp(trainer: TorchTrainer, batch: TrainBatch, run_id: int) -> float:
    vals = []
    for s in batch.samples:
        if s.run_id == run_id:
            vals += [lp for lp, m in zip(own_logprobs(trainer, s), s.loss_mask, strict=True) if m]
    return sum(vals) / len(vals)


def test_step_moves_logprobs_with_the_advantage_sign(model_dir):
    tr = TorchTrainer(model_dir, device="cpu", lr=1e-3, seed=0)
    batch = make_batch(tr, 0, {10: (1.0, 2), 11: (-1.0, 1), 12: (0.5, 3)})
    before = {r: run_mean_logp(tr, batch, r) for r in (10, 11, 12)}
    m = tr.train_step(batch)
    after = {r: run_mean_logp(tr, batch, r) for r in (10, 11, 12)}
    assert after[10] > before[10] and after[12] > before[12] and after[11] < before[11]
    assert m["mismatch"] < 1e-6 and m["clip_frac"] == 0.0 and m["mean_abs_log_s"] < 1e-6
    assert m["runs"] == 3 and m["tokens_trained"] == sum(batch.targets_per_run.values())
    assert m["grad_norm"] > 0 and m["seconds"] > 0 and m["skipped"] == 0
    # At s_r = 1 the loss is −mean_r Â_r.
    assert m["loss"] == pytest.approx(-(1.0 - 1.0 + 0.5) / 3, abs=1e-5)


def test_trainer_gradient_equals_paper_objective_on_full_logits(model_dir):
    """End to end: packing, next-token alignment and per-run mean against a direct computation from logits."""
    # A small token budget makes runs straddle micro-batches (pre-pass path).
    tr = TorchTrainer(model_dir, device="cpu", micro_batch_tokens=60, seed=0)
    runs = {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1), 4: (-1.2, 2)}
    offsets = {1: 1e-4, 2: 5e-3, 3: -2e-3, 4: -1e-2}  # inside and outside the clip window
    batch = make_batch(tr, 1, runs, offsets=offsets)
    tr.zero_grad()
    m = tr.forward_backward(batch)
    assert m["prepass_micro_batches"] > 0
    got = tr.export_grads()

    tr.zero_grad()
    terms = []
    for r, (adv, _) in runs.items():
        lp, old = [], []
        for s in (s for s in batch.samples if s.run_id == r):
            logits = tr.model(input_ids=torch.tensor([s.tokens])).logits[0].double().log_softmax(-1)
            for i in range(1, len(s.tokens)):
                if s.loss_mask[i]:
                    lp.append(logits[i - 1, s.tokens[i]])
                    old.append(s.behav_logp[i])
        ratio = torch.exp((torch.stack(lp) - torch.tensor(old, dtype=torch.float64)).mean())
        terms.append(torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv))
    ref = -torch.stack(terms).mean()
    ref.backward()
    want = tr.export_grads()
    assert m["loss"] == pytest.approx(ref.item(), abs=1e-5)
    for name, g in want.items():
        assert torch.allclose(got[name], g.float(), atol=1e-5, rtol=1e-4), name
    assert 0 < m["clip_frac_runs"] < 1
    assert m["mismatch"] == pytest.approx(0.5 * (2e-3 + 5e-3), rel=1e-3)  # median |offset|


def test_micro_batch_split_gives_the_same_gradient(model_dir):
    grads, metrics = [], []
    for budget in (100_000, 50):
        tr = TorchTrainer(model_dir, device="cpu", micro_batch_tokens=budget, seed=0)
        batch = make_batch(tr, 2, {1: (1.0, 4), 2: (-0.5, 1), 3: (2.0, 2)}, offsets={1: 2e-4, 2: 1e-3, 3: -1e-3})
        tr.zero_grad()
        metrics.append(tr.forward_backward(batch))
        grads.append(tr.export_grads())
    assert metrics[0]["micro_batches"] == 1 and metrics[1]["micro_batches"] > 3
    assert metrics[1]["prepass_micro_batches"] > 0
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)
    for k in ("clip_frac", "clip_frac_runs", "mean_abs_log_s", "mismatch"):
        assert metrics[0][k] == pytest.approx(metrics[1][k], abs=1e-6)
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-5, rtol=0), name


def test_decoupled_mode_matches_bypass_on_fresh_data(model_dir):
    # With behaviour = the trainer's own log-probs, w_r = 1 and s_r = 1 in both modes: same gradient.
    grads = []
    for mode in ("bypass", "decoupled"):
        tr = TorchTrainer(model_dir, device="cpu", seed=0, mode=mode)
        batch = make_batch(tr, 3, {1: (1.0, 2), 2: (-1.0, 1)})
        tr.zero_grad()
        m = tr.forward_backward(batch)
        grads.append(tr.export_grads())
    assert m["w_trunc_frac"] == 0 and abs(m["mean_log_w"]) < 1e-6
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name


def test_save_reloads_identically(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = TorchTrainer(model_dir, device="cpu", lr=1e-2, seed=0)
    tr.train_step(make_batch(tr, 4, {1: (1.0, 1), 2: (-1.0, 1)}))
    out = tr.save(tmp_path / "v1")
    tr.save(out)  # overwriting an existing snapshot works
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "optimizer.pt"} <= \
        {p.name for p in out.iterdir()}
    tr.save(tmp_path / "v2")
    tr.save(tmp_path / "v3")  # only the two newest versions keep their optimizer state
    assert [(tmp_path / v / "optimizer.pt").is_file() for v in ("v1", "v2", "v3")] == [False, True, True]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, tr.model(input_ids=ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>user")
    # load_weights keeps the optimizer attached and brings the saved weights back.
    fresh = TorchTrainer(model_dir, device="cpu", seed=0)
    fresh.load_weights(out)
    with torch.no_grad():
        assert torch.equal(fresh.model(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_lr_warm_up_ramps_each_step_and_goes_on_after_a_resume(model_dir, tmp_path):
    tr = TorchTrainer(model_dir, device="cpu", lr=1e-2, seed=0, lr_warmup_steps=4)
    before = [p.detach().clone() for p in tr.params]
    lrs = [tr.train_step(make_batch(tr, 20, {1: (1.0, 1), 2: (-1.0, 1)}))["lr"]]
    # AdamW's first step moves a weight by lr·g/(|g| + eps): the largest move is the warmed-up lr, not lr
    moved = max(float((a - b).abs().max()) for a, b in zip(before, tr.params, strict=True))
    assert moved == pytest.approx(2.5e-3, rel=1e-3)
    lrs.append(tr.train_step(make_batch(tr, 21, {1: (1.0, 1), 2: (-1.0, 1)}))["lr"])
    out = tr.save(tmp_path / "v2")
    resumed = TorchTrainer(out, device="cpu", lr=1e-2, seed=0, lr_warmup_steps=4, resume_optimizer=True)
    lrs += [resumed.train_step(make_batch(resumed, 22 + i, {1: (1.0, 1), 2: (-1.0, 1)}))["lr"] for i in range(3)]
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        TorchTrainer(model_dir, device="cpu", lr_warmup_steps=-1)


def test_embedding_lr_moves_the_token_embeddings_at_their_own_rate_warm_up_and_resume_included(model_dir, tmp_path):
    def largest_moves(tr, step) -> tuple[float, float]:
        emb = tr.model.get_input_embeddings().weight
        before = {id(p): p.detach().clone() for p in tr.params}
        step()
        moved = {id(p): float((p.detach() - before[id(p)]).abs().max()) for p in tr.params}
        return moved.pop(id(emb)), max(moved.values())

    tr = TorchTrainer(model_dir, device="cpu", lr=1e-3, seed=0, lr_warmup_steps=2, embedding_lr=2e-2)
    assert tr.model.get_output_embeddings().weight is tr.model.get_input_embeddings().weight  # tied: one group
    # AdamW's first step moves a weight by at most its group's lr (warmed up: half of it at step 1 of 2)
    emb, rest = largest_moves(tr, lambda: tr.train_step(make_batch(tr, 30, {1: (1.0, 1), 2: (-1.0, 1)})))
    assert emb == pytest.approx(1e-2, rel=1e-3) and rest == pytest.approx(5e-4, rel=1e-3)
    out = tr.save(tmp_path / "v1")
    resumed = TorchTrainer(out, device="cpu", lr=1e-3, seed=0, lr_warmup_steps=2, embedding_lr=2e-2,
                           resume_optimizer=True)
    resumed.train_step(make_batch(resumed, 31, {1: (1.0, 1), 2: (-1.0, 1)}))
    assert [g["lr"] for g in resumed.optimizer.param_groups] == pytest.approx([1e-3, 2e-2])
    plain = TorchTrainer(model_dir, device="cpu", lr=1e-3, seed=0)
    assert len(plain.optimizer.param_groups) == 1


def test_empty_batch_skips_the_step(model_dir):
    tr = TorchTrainer(model_dir, device="cpu", seed=0)
    before = [p.detach().clone() for p in tr.params]
    m = tr.train_step(TrainBatch([TrainSample(1, [1, 2, 3], [0, 0, 0], [0.0] * 3)], {}, {}, step=0, version_in=0))
    assert m["skipped"] == 1 and m["runs"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.params, strict=True))


def test_pack_micro_batches():
    lengths = [100, 30, 30, 30, 60, 10, 500]
    runs = [1, 2, 2, 2, 3, 3, 4]
    packed = pack_micro_batches(lengths, runs, budget=200)
    assert sorted(i for mb in packed for i in mb) == list(range(len(lengths)))
    for mb in packed:
        assert len(mb) * max(lengths[i] for i in mb) <= 200 or len(mb) == 1
    where = {i: k for k, mb in enumerate(packed) for i in mb}
    assert where[1] == where[2] == where[3] and where[4] == where[5]  # runs that fit stay together
    assert pack_micro_batches(lengths, runs, budget=200) == packed
    # A run too big for one micro-batch is split by sample.
    big = pack_micro_batches([100] * 4, [7] * 4, budget=200)
    assert len(big) == 2


def test_batch_roundtrip_and_validation(tmp_path):
    b = TrainBatch([TrainSample(3, [5, 6, 7, 8], [0, 1, 1, 0], [0.0, -0.5, -1.25, 0.0]),
                    TrainSample(4, [5, 9], [0, 1], [0.0, -2.0])],
                   {3: 0.5, 4: -0.5, 99: 1.0}, {3: 2, 4: 1}, step=7, version_in=6)
    p = tmp_path / "b" / "step7.msgpack"
    write_batch(p, b)
    assert read_batch(p) == b
    assert [x.name for x in p.parent.iterdir()] == ["step7.msgpack"]

    def bad(**changes):
        d = b.to_dict()
        d.update(changes)
        return TrainBatch.from_dict(d)

    with pytest.raises(BatchError, match="lengths differ"):
        write_batch(p, bad(samples=[[3, [5, 6], [0, 1, 1], [0.0, -1.0]]]))
    with pytest.raises(BatchError, match="no finite advantage"):
        bad(advantages={4: 0.1}).validate()
    with pytest.raises(BatchError, match="whole runs"):
        bad(targets_per_run={3: 5, 4: 1}).validate()
    with pytest.raises(BatchError, match="token 0"):
        bad(samples=[[4, [5, 9], [1, 1], [-1.0, -1.0]]], targets_per_run={4: 2}).validate()
    with pytest.raises(BatchError, match="log-probability"):
        bad(samples=[[4, [5, 9], [0, 1], [0.0, float("nan")]]]).validate()
    (tmp_path / "junk").write_bytes(b"\xc1garbage")
    with pytest.raises(BatchError):
        read_batch(tmp_path / "junk")
    assert read_batch(p).step == 7  # a failed write left the old file intact


def test_assistant_target_mask():
    from gyre_slurm.bootstrap.warmup import assistant_target_mask

    start, end = [1, 2], 9
    ids = [0, 1, 2, 5, 6, 9, 3, 1, 2, 7, 9, 4]
    assert assistant_target_mask(ids, start, end) == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]


def test_warm_up_on_tiny_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gyre_slurm.bootstrap.warmup import encode_demo
    from gyre_slurm.harness import builtin_suite
    from gyre_slurm.model.tiny import create_tiny_model

    src = create_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(src)
    ids, mask = encode_demo(tok, builtin_suite.demo_conversation(3, 5, random.Random(0), 0.35))
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained.startswith('<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt"')
    assert trained.endswith("</tool_call><|im_end|>done<|im_end|>")

    m = warm_up_run(src, tmp_path / "w1")
    warm_up_run(src, tmp_path / "w2")
    assert m["final_loss"] < m["initial_loss"] and m["steps"] == 6
    # Deterministic: the same seed gives the same weights.
    assert (tmp_path / "w1" / "model.safetensors").read_bytes() == (tmp_path / "w2" / "model.safetensors").read_bytes()
    AutoModelForCausalLM.from_pretrained(tmp_path / "w1")
    AutoTokenizer.from_pretrained(tmp_path / "w1")


def warm_up_run(src: Path, out: Path) -> dict:
    from gyre_slurm.bootstrap.warmup import warm_up

    return warm_up(src, out, steps=6, seed=1, batch_size=2, device="cpu")


# one core trainer process: build from a version's folder (taking up its optimizer state unless FRESH), train the
# given batches, save each new version; with HANG it then waits to be killed
CORE = """
import json, os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from gyre_slurm.config import TrainSection
from gyre_slurm.train.backends import make_trainer
from gyre_slurm.train.batch import read_batch
src, out, train, *batches = sys.argv[1:]
tr = make_trainer(Path(src), TrainSection(**json.loads(train)), device="cpu",
                  resume_optimizer=not os.environ.get("FRESH"))
for i, b in enumerate(batches):
    tr.train_step(read_batch(Path(b)))
    tr.save(Path(out) / f"v{i + 1}")
print("saved", flush=True)
if os.environ.get("HANG"):
    time.sleep(600)
"""


def _core(src: Path, out: Path, train: dict, *batches: Path, **env: str):
    import json
    import os
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", CORE, str(src), str(out), json.dumps(train), *map(str, batches)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env})


def _snapshot(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from gyre_slurm.train.gspo_trainer import OPTIMIZER_FILE

    out = {f"w:{k}": v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    if not (folder / OPTIMIZER_FILE).is_file():  # a Megatron trainer's: by Hugging Face name (train/optimizer_state.py)
        from gyre_slurm.train.optimizer_state import read_index

        for f in sorted(folder.glob("optimizer.rank*.pt")):
            out.update({f"opt:{k}": v for k, v in torch.load(f, weights_only=True).items()})
        out["steps"] = torch.tensor(read_index(folder).steps)
        return out
    opt = torch.load(folder / OPTIMIZER_FILE, weights_only=True)
    for i, st in opt["optimizer"]["state"].items():
        out.update({f"opt:{i}:{k}": torch.as_tensor(v) for k, v in st.items()})
    out["steps"] = torch.tensor(opt["steps"])
    return out


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_a_core_trainer_killed_between_steps_takes_the_next_step_as_if_never_killed(model_dir, tmp_path,
                                                                                    backend) -> None:
    """kill -9 of the core's trainer after it saved version 1: built again from that folder it takes step 2 to the
    same weights and AdamW state as a trainer that was never killed (1e-6); without the saved state it would not."""
    import os
    import signal

    tr = TorchTrainer(model_dir, device="cpu", seed=0)
    batches = []
    for k in (1, 2):
        batches.append(tmp_path / f"b{k}.batch")
        write_batch(batches[-1], make_batch(tr, k, {1: (1.0, 2), 2: (-0.5, 1), 3: (0.25, 2)}))
    train = {"backend": backend, "lr": 1e-2, "micro_batch_tokens": 64}  # several micro-batches, a large step
    ref = _core(model_dir, tmp_path / "ref", train, *batches)
    assert ref.wait(timeout=300) == 0
    first = _core(model_dir, tmp_path / "killed", train, batches[0], HANG="1")
    assert first.stdout.readline().strip() == "saved"
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    again = _core(tmp_path / "killed" / "v1", tmp_path / "again", train, batches[1])
    fresh = _core(tmp_path / "killed" / "v1", tmp_path / "fresh", train, batches[1], FRESH="1")
    assert again.wait(timeout=300) == 0 and fresh.wait(timeout=300) == 0

    want, got = _snapshot(tmp_path / "ref" / "v2"), _snapshot(tmp_path / "again" / "v1")
    assert sorted(got) == sorted(want) and int(got["steps"]) == 2
    worst = max(float((got[k].double() - want[k].double()).abs().max()) for k in want)
    assert worst <= 1e-6, worst
    lost = _snapshot(tmp_path / "fresh" / "v1")  # the optimizer from zero: a different update
    assert max(float((lost[k] - want[k]).abs().max()) for k in want if k.startswith("w:")) > 1e-4


def test_kl_penalty_is_zero_at_the_reference_and_pulls_back_towards_it() -> None:
    from gyre_slurm.train.gspo import kl_penalty

    ref = torch.tensor([-0.1, -2.0, -0.5, -1.0], dtype=torch.float64)
    run_index, t_r = torch.tensor([0, 0, 1, 1]), torch.tensor([2, 2])
    loss, per_run = kl_penalty(ref.clone().requires_grad_(), ref, run_index, t_r, 2)
    assert float(loss.detach()) == 0.0 and per_run.tolist() == [0.0, 0.0]
    new = torch.tensor([-3.0, -2.0, -0.1, -1.0], dtype=torch.float64, requires_grad=True)  # one dropped, one raised
    loss, per_run = kl_penalty(new, ref, run_index, t_r, 2)
    loss.backward()
    d = ref - new.detach()
    assert torch.allclose(per_run, torch.stack([(d.exp() - d - 1)[:2].sum(), (d.exp() - d - 1)[2:].sum()]))
    assert float(loss) > 0 and new.grad[0] < 0 < new.grad[2]  # descent raises the dropped token, lowers the other
    assert new.grad[1] == 0 and new.grad[3] == 0


def test_the_kl_anchor_pulls_a_drifted_policy_back_to_version_0(model_dir, tmp_path) -> None:
    """With every advantage 0 the GSPO term has no gradient: only the anchor moves the weights, towards the
    reference (version 0); without it nothing moves."""
    drifted = TorchTrainer(model_dir, device="cpu", seed=0)
    with torch.no_grad():
        for p in drifted.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drifted.save(tmp_path / "drifted")
    tr = TorchTrainer(tmp_path / "drifted", device="cpu", lr=3e-3, seed=0, kl_coef=1.0, reference_dir=model_dir)
    batch = make_batch(tr, 1, {1: (0.0, 2), 2: (0.0, 1)})
    kls = [tr.train_step(batch)["kl"] for _ in range(6)]
    assert kls[0] > 0.01 and kls[-1] < 0.7 * kls[0], kls
    plain = TorchTrainer(tmp_path / "drifted", device="cpu", lr=3e-3, seed=0)
    before = run_mean_logp(plain, batch, 1)
    m = plain.train_step(batch)
    assert "kl" not in m and run_mean_logp(plain, batch, 1) == before
    with pytest.raises(ValueError, match="reference_dir"):
        TorchTrainer(model_dir, device="cpu", kl_coef=0.1)
