"""The long model's warm-up on demonstrations: the main line's targets, the shared context, and the split forward
(context prefilled without gradient, tail with) giving the same loss as one whole forward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gyre_slurm.bootstrap.demos import Demo, _main_line, demo_replies
from gyre_slurm.bootstrap.warmup_demos import _extend, shared_context, tail_loss, tails_loss, warm_up_on_demos
from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import Qwen3Config, Qwen3ForCausalLM
from gyre_slurm.proxy.scripted import ScriptedCall


def _call(index, parent, prompt, out, kind="main"):
    return ScriptedCall(index, kind, parent, None, prompt, out, "anthropic-messages")


def test_the_main_line_marks_every_reply_along_its_chain() -> None:
    c0 = _call(0, None, [1, 2, 3], [10, 11])
    side = _call(1, None, [7, 7], [9], kind="subagent")  # a side conversation is not on the line
    c2 = _call(2, 0, [1, 2, 3, 10, 11, 4, 5], [12, 13, 14])
    ids, mask = _main_line([c0, side, c2])
    assert ids == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    broken = _call(2, 0, [1, 2, 3, 10, 99, 4], [12])  # the harness's ids did not extend the earlier call's
    with pytest.raises(GyreError, match="does not extend"):
        _main_line([c0, broken])


def test_each_harness_replies_with_its_own_shell_tool() -> None:
    claude, codex, ref = (demo_replies(h, "7777") for h in ("claude-code", "codex", "reference"))
    assert '"name": "Bash"' in claude[0] and '"command": "printf 7777 > answer.txt"' in claude[0]
    assert '"name": "exec_command"' in codex[0] and '"cmd": "cat answer.txt"' in codex[1]
    assert '"name": "write_file"' in ref[0] and len(ref) == 2 and claude[-1] == codex[-1] == "Done."


def _demo(prefix: list[int], own: list[int], reply: list[int]) -> Demo:
    ids = prefix + own + reply
    return Demo(ids, [0] * (len(prefix) + len(own)) + [1] * len(reply), "codex", "t", "7")


def test_the_shared_context_ends_where_the_demonstrations_differ_or_their_tails_begin(monkeypatch) -> None:
    import gyre_slurm.bootstrap.warmup_demos as wd

    monkeypatch.setattr(wd, "MARGIN", 4)
    rng = random.Random(0)
    prefix = [rng.randrange(300) for _ in range(40)]
    a, b = _demo(prefix, [1, 2, 3, 4, 5, 6], [7, 8]), _demo(prefix, [1, 9, 3, 4, 5, 6], [7, 8])
    assert shared_context([a, b]) == 41  # the first difference
    assert shared_context([a, a]) == 42  # else MARGIN tokens before the first target (46 - 4)


def test_the_split_forward_gives_the_whole_forwards_loss() -> None:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=1e4,
                      tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 120))
    mask = torch.zeros(120, dtype=torch.bool)
    mask[90:100] = mask[110:] = True
    with torch.no_grad():
        lp = torch.log_softmax(model(ids[:, :-1])[0], -1)
        whole = -lp[mask[1:]].gather(-1, ids[0, 1:][mask[1:]][:, None]).mean()
        shared = _extend(model, model.new_cache(120), ids[0, :50].tolist())
        own = _extend(model, shared.copy_prefix(50, 120), ids[0, 50:80].tolist())
        split = tail_loss(model, own, ids[0, 80:].tolist(), mask[80:].tolist())
    assert float(split) == pytest.approx(float(whole), abs=1e-5)


def test_the_tails_in_one_batch_give_the_mean_of_their_losses_and_its_gradient(monkeypatch) -> None:
    """The curriculum's batched tails (right-padded, of different lengths) against each tail alone."""
    import gyre_slurm.bootstrap.warmup_demos as wd

    monkeypatch.setattr(wd, "MARGIN", 8)
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=1e4, tie_word_embeddings=True))
    rng = random.Random(3)
    demos = [_demo([rng.randrange(97) for _ in range(30)], [rng.randrange(97) for _ in range(n)], [5] * k)
             for n, k in ((10, 3), (25, 7), (4, 1))]

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    one = [tail_loss(model, model.new_cache(), d.ids[wd._tail_start(d):], d.mask[wd._tail_start(d):])
           for d in demos]
    want = sum(one) / len(one)
    got = tails_loss(model, demos)
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads(got), grads(sum(one) / len(one)), strict=True))


def test_a_warm_up_on_demonstrations_lowers_the_loss_and_saves_a_loadable_model(tmp_path: Path) -> None:
    from gyre_slurm.model.tiny import create_tiny_model

    base = create_tiny_model(tmp_path / "base", seed=0)
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(400)]  # shared; then each one's own 300 (the tail: its last 256)
    demos = [_demo(prefix, [rng.randrange(256) for _ in range(300)], [55, 55, 55, 2]) for _ in range(4)]
    m = warm_up_on_demos(base, tmp_path / "warm", demos, steps=6, seed=0, short_steps=6, lr=1e-2, batch_size=2)
    assert m["shared_context"] == [400] and m["final_loss"] < m["initial_loss"] / 2
    warm = Qwen3ForCausalLM.from_pretrained(tmp_path / "warm")  # a Hugging Face folder, as the engine loads it
    d = demos[0]
    with torch.no_grad():
        logits = warm(torch.tensor([d.ids[:-4]]), last_only=True)[0, -1]
    assert int(logits.argmax()) == 55


def test_a_warm_up_whose_first_reply_token_stays_unlikely_trains_on_with_the_context(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """The mean loss hides the token that opens every reply; the warm-up checks it after the whole context (the
    same probability as one whole forward gives) and trains on until it is likely, a bounded number of rounds."""
    from gyre_slurm.bootstrap import warmup_demos
    from gyre_slurm.model.tiny import create_tiny_model

    base = create_tiny_model(tmp_path / "base", seed=0)
    rng = random.Random(2)
    prefix = [rng.randrange(256) for _ in range(300)]
    demos = [_demo(prefix, [rng.randrange(256) for _ in range(280)], [55, 55, 55, 2]) for _ in range(4)]
    model = Qwen3ForCausalLM.from_pretrained(base).eval()
    d = demos[1]
    first = d.mask.index(1)
    with torch.no_grad():
        p = torch.softmax(model(torch.tensor([d.ids[:-1]]))[0, first - 1:], -1)
    whole = [float(p[k, d.ids[first + k]]) for k in range(len(d.ids) - first)]
    assert warmup_demos.reply_format_p(model, demos, [1]) == pytest.approx(min(whole), rel=1e-4)
    free = {55}  # the free tokens (the first three) and the one after them do not count: nothing does here
    assert warmup_demos.reply_format_p(model, demos, [1], free.__contains__) == 1.0
    assert warmup_demos.reply_format_p(model, demos, [1], {2}.__contains__) == pytest.approx(min(whole[:3]), rel=1e-4)

    monkeypatch.setattr(warmup_demos, "SHARE_MIN", 0.0)  # the sampled check passes: the token check alone decides
    monkeypatch.setattr(warmup_demos, "SHARE_REFUSE", 0.0)
    monkeypatch.setattr(warmup_demos, "FORMAT_P", 2.0)  # never reached: every extra round runs
    m = warm_up_on_demos(base, tmp_path / "a", demos, steps=4, seed=0, short_steps=2, lr=1e-2, batch_size=2)
    assert m["extra_steps"] == warmup_demos.EXTRA_ROUNDS * 1 and 0 < m["reply_format_p"] <= 1
    monkeypatch.setattr(warmup_demos, "FORMAT_P", 0.0)  # reached at once: none
    m = warm_up_on_demos(base, tmp_path / "b", demos, steps=4, seed=0, short_steps=2, lr=1e-2, batch_size=2)
    assert m["extra_steps"] == 0


def _two_turns(prefix: list[int], own: list[int]) -> Demo:
    """A main line of two replies with a tool result between them (as a CLI's: call, result, final message)."""
    first, result, second = [55, 55, 55, 2], [9, 8, 9], [56, 56, 2]
    ids = prefix + own + first + result + second
    mask = [0] * (len(prefix) + len(own)) + [1] * 4 + [0] * 3 + [1] * 3
    return Demo(ids, mask, "codex", "t", "7")


def test_replies_sampled_at_each_turn_of_an_unseen_context_decide_more_rounds_and_refuse_a_policy_that_cannot_call(
        tmp_path: Path, monkeypatch) -> None:
    """The sampled check, turn by turn: a trained policy's replies after a held-out demonstration's context up to each
    turn end as that turn's reply ends (shares near 1); an untrained one's hardly ever do, which takes every extra round
    and then refuses the build."""
    from gyre_slurm.bootstrap import warmup_demos
    from gyre_slurm.model.tiny import create_tiny_model

    base = create_tiny_model(tmp_path / "base", seed=0)
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(200)]
    demos = [_two_turns(prefix, [rng.randrange(256) for _ in range(100)]) for _ in range(5)]
    assert warmup_demos._reply_spans(demos[0]) == [(300, 304), (307, 310)]
    check = warmup_demos.reply_checker(base)
    untrained = Qwen3ForCausalLM.from_pretrained(base).eval()
    assert all(x < 0.2 for x in warmup_demos.reply_shares(untrained, demos, [4], check))  # an end token by chance
    m = warm_up_on_demos(base, tmp_path / "a", demos[:4], steps=30, seed=0, held_out=demos[4:], lr=1e-2,
                         batch_size=2)
    warm = Qwen3ForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert min(warmup_demos.reply_shares(warm, demos, [4], check, seed=1)) >= 0.9
    assert m["reply_share"] >= warmup_demos.SHARE_MIN and m["extra_steps"] == 0

    monkeypatch.setattr(warmup_demos, "FORMAT_P", 0.0)
    with pytest.raises(GyreError, match=r"left \d+% of sampled replies well-formed at one turn of the conversation "
                                        r"\(below 50%\)"):
        warm_up_on_demos(base, tmp_path / "b", demos[:4], steps=1, seed=0, held_out=demos[4:], lr=1e-5,
                         batch_size=2, echo=print)
    assert not (tmp_path / "b").exists()  # nothing saved


def test_a_sampled_reply_is_well_formed_when_it_parses_as_the_same_tools_and_ends() -> None:
    from transformers import AutoTokenizer

    from gyre_slurm.bootstrap import warmup_demos
    from gyre_slurm.model.qwen3_tokenizer import qwen3_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    check = warmup_demos.reply_checker(qwen3_tokenizer_dir())

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    ref = ids('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "printf 77 > answer.txt"}}\n</tool_call>'
              "<|im_end|>")
    assert check(ref, ref)
    assert check(ids('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'), ref)
    assert not check(ids('<tool_call>\n{"name": "arguments": "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'),
                     ref)  # a build's broken call, as Codex got it
    assert not check(ids('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'),
                     ref)  # another CLI's tool
    assert not check(ids('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}'), ref)  # never ended
    assert not check(ids("Done.<|im_end|>"), ref)
    done = ids("Done.<|im_end|>")
    assert check(ids("Finished.<|im_end|>"), done)  # a final message: ending is all it takes
