"""Versions in parts, slice by slice (transfer/weight_parts.py, train/slice_parts.py, train/slice_snapshot.py,
train/rank_grads.py) where no spawned cell is needed: the embedded engine pulls a version a TP2×PP2 cell published in
four parts over its HTTP route and serves exactly the weights the same version's folder gives it; parts are put
together piece by piece (a replica's copy once, a missing or conflicting piece refused, parts that came at different
versions pulled again); a one-rank Megatron core and satellite exchange a version and a gradient rank to rank through
the step runners; the ledger keeps each transfer's sending rank. The cells of two and four ranks (TP2, PP2, DP2,
TP2×PP2, MoE DP2×EP2, TP2×DP2) run tests/slice_checks.py inside tests/test_dist_optimizer.py's worlds.

The Transfer Engine is Mooncake's own (the non-CUDA wheel, TCP on 127.0.0.1): publishers and pullers in this
process each on an engine of their own where a cell's would be, the embedded engine in its process on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gyre_slurm.model.qwen3 import Qwen3Config, Qwen3ForCausalLM, read_safetensors
from gyre_slurm.protocol import WeightsHandle
from gyre_slurm.train.megatron_shard import RankCoords, local_state, local_tensors, state_reader
from gyre_slurm.train.slice_snapshot import iter_pieces, plan_pieces
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.report import TransferReport
from gyre_slurm.transfer.weight_parts import Assembly, PieceInfo, publish_part, pull_full, pull_pieces
from gyre_slurm.transfer.weights import WeightPublisher, WeightPuller
from tests.test_trainer import build_tiny_qwen3, make_batch
from tests.test_weight_transport import embedded_engine

TP2XPP2 = [RankCoords(tp=2, tp_rank=t, pp=2, pp_rank=p) for p in range(2) for t in range(2)]


def cell_parts(agent, folder: Path, state: dict[str, torch.Tensor], coords: list[RankCoords], version: int,
               layout: list[int]) -> tuple[list[WeightsHandle], list[WeightPublisher]]:
    """What the ranks of a cell of these coordinates publish for `state` (each rank its slices, as
    MegatronTrainer.publish does, DP 1), from publishers of this process (kept alive by the caller)."""
    cfg = Qwen3Config.from_pretrained(folder)
    parts, pubs = [], []
    for rank, c in enumerate(coords):
        local = local_tensors(cfg, c)
        slices = local_state(cfg, c, state_reader(state, c))
        pieces = plan_pieces(c, local, slices, copies=True)
        pub = WeightPublisher(agent, bucket_bytes=4096, verify=True)
        meta = [(PieceInfo(p.name, p.dim, p.tp_rank, p.tp), torch.empty(p.shape, dtype=p.dtype, device="meta"))
                for p in pieces]
        parts.append(publish_part(pub, version, meta, lambda pieces=pieces, local=local, slices=slices: (
            (p.name, t) for p, t in iter_pieces(pieces, local, slices)), rank=rank, layout=layout))
        pubs.append(pub)
    return parts, pubs


@pytest.mark.slow
def test_the_embedded_engine_serves_a_version_published_in_parts(tmp_path):
    from gyre_slurm.engines.client import SamplingParams

    model = build_tiny_qwen3(tmp_path / "m")
    trained = Qwen3ForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(-1.5)  # a visibly different policy
    on_disk = trained.save_pretrained(tmp_path / "v5")
    state = read_safetensors(on_disk)
    parts, pubs = cell_parts(TransferAgent(), model, state, TP2XPP2, 5, [2, 2, 1, 1])
    assert [h.rank for h in parts] == [0, 1, 2, 3] and all(h.cuts for h in parts)

    try:
        with embedded_engine(model, tmp_path) as client:
            greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

            def generate():
                return asyncio.run(client.generate(list(range(40, 80)), greedy))

            before = generate()
            reports = client.update_weights_from_transfer_engine(parts, 5, model_path=str(on_disk))
            assert [(r.version, r.sender_rank, r.nbytes) for r in reports] == [(5, h.rank, h.nbytes) for h in parts]
            pulled = generate()
            client.update_weights_from_disk(str(on_disk), 5)  # the same version from its folder
            loaded = generate()
            assert pulled.weight_version == loaded.weight_version == 5
            # the same computation on the same weights, bit for bit: ids and log-probs equal exactly
            assert pulled.output_ids == loaded.output_ids and pulled.output_logprobs == loaded.output_logprobs
            assert pulled.output_logprobs != before.output_logprobs
            assert len(pubs) == 4
    finally:
        for pub in pubs:
            pub.close()


# --- parts put together (pure, one process) --------------------------------------------------------------------------
def test_parts_are_put_together_piece_by_piece(tmp_path):
    model = build_tiny_qwen3(tmp_path / "m")
    state = read_safetensors(model)
    parts, pubs = cell_parts(TransferAgent(), model, state, TP2XPP2, 3, [2, 2, 1, 1])
    agent = TransferAgent()  # the receivers' engine
    try:
        got = pull_full(WeightPuller(agent, "engine:1"), parts)
        assert sorted(got.tensors) == sorted(state)
        assert all(torch.equal(got.tensors[n], t) for n, t in state.items())
        assert got.version == 3 and [r.sender_rank for r in got.reports] == [0, 1, 2, 3]
        # a satellite rank of the same layout pulls its twin's part only (tied embeddings: the last stage's part
        # holds its copy of the embedding), and gets its own cut
        cfg = Qwen3Config.from_pretrained(model)
        c = TP2XPP2[3]
        names = {n for lt in local_tensors(cfg, c) for n in lt.map.hf}
        mine = pull_pieces(WeightPuller(agent, "satellite:1"), parts,
                           lambda p: p.name in names and (p.dim is None or p.tp_rank == c.tp_rank), prefer=3)
        assert [r.sender_rank for r in mine.reports] == [3] and set(mine.tensors) == names
        want = local_state(cfg, c, state_reader(state, c))
        have = local_state(cfg, c, lambda n, _dim: mine.tensors[n])
        assert all(torch.equal(have[n], t) for n, t in want.items())
        # without the last part a piece is missing: refused, never half a model
        with pytest.raises(TransferError, match="pieces missing"):
            pull_full(WeightPuller(agent, "engine:1"), parts[:3])
    finally:
        for pub in pubs:
            pub.close()


def test_an_assembly_takes_a_copy_once_and_refuses_a_different_one():
    a = Assembly()
    t = torch.arange(12.0).reshape(4, 3)
    a.add(PieceInfo("w", 0, 0, 2), t[:2])
    a.add(PieceInfo("n", None, 0, 2), torch.ones(3))
    a.add(PieceInfo("n", None, 1, 2), torch.ones(3))  # TP rank 1's copy of a whole tensor: the same, taken once
    a.add(PieceInfo("w", 0, 1, 2), t[2:])
    a.add(PieceInfo("w", 0, 1, 2), t[2:])  # the last stage's copy of a tied embedding
    assert torch.equal(a.done()["w"], t)
    with pytest.raises(TransferError, match="different values"):
        a.add(PieceInfo("w", 0, 0, 2), t[2:])


class _Replacing:
    """A puller whose core publishes a new version between two parts the first time, as at_least lets it see."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def pull(self, h: WeightsHandle, at_least: bool = False):
        self.calls.append((h.rank, at_least))
        version = 7 if len(self.calls) == 1 else 8  # part 0 came at 7, then the core published 8
        return {h.tensors[0][0]: torch.full((2,), float(h.rank))}, \
            TransferReport("mooncake", version, 8, 0.01, "engine:0", source=f"/w/v{version}")


def test_parts_that_came_at_different_versions_are_pulled_again():
    parts = [WeightsHandle(peer="p", addr=64, version=7, nbytes=8, bucket_bytes=64, rank=r, layout=[2, 1, 1, 1],
                           cuts=[(0, r, 2)], tensors=[("w", "float32", [2], 0, 8)]) for r in range(2)]
    puller = _Replacing()
    got = pull_full(puller, parts, at_least=True)
    assert puller.calls == [(0, True), (1, True), (0, True), (1, True)]  # 7 then 8: everything again, at 8
    assert got.version == 8 and got.source == "/w/v8" and torch.equal(got.tensors["w"], torch.tensor([0., 0, 1, 1]))


# --- a one-rank Megatron core and satellite, through the step runners -------------------------------------------------
def test_one_rank_cells_exchange_a_version_and_a_gradient_rank_to_rank(tmp_path):
    from gyre_slurm.train.rank_grads import GradLink, RankSink
    from gyre_slurm.train.shards import shard_id, split_batch
    from gyre_slurm.train.step_runner import ADDED, CoreStep, SatelliteStep
    from gyre_slurm.train.torch_trainer import TorchTrainer
    from gyre_slurm.transfer.weight_parts import RankLink
    from tests.megatron_rank import hf_state
    from tests.test_megatron import megatron_trainer

    model = build_tiny_qwen3(tmp_path / "m")
    batch = make_batch(TorchTrainer(model, device="cpu", seed=0), 11, {1: (1.0, 3), 2: (-0.7, 2), 3: (0.3, 1)})
    batch.step, batch.version_in = 5, 4
    shards = split_batch(batch, n_shards=2)
    one = megatron_trainer(model, micro_batch_tokens=60)  # AdamW's eps as tests/test_megatron.py's: smooth in g
    one.train_step(batch)

    core = CoreStep(megatron_trainer(model, micro_batch_tokens=60), 5, 4, [shard_id(s) for s in shards])
    link = RankLink(("127.0.0.1",))
    parts = core.trainer.publish(4, link, str(model))
    assert len(parts) == 1 and parts[0].layout == [1, 1, 1, 1] and parts[0].cuts  # one rank: one part, cut 1 way
    sat_trainer = megatron_trainer(model, micro_batch_tokens=60)
    with torch.no_grad():
        for p in sat_trainer.params:
            p.add_(0.1)
    grads = GradLink("127.0.0.1", ("127.0.0.1",))
    endpoints = core.trainer.open_grads("t" * 32, 5, grads)
    with pytest.raises(ValueError, match="arrive at 2 rank"):
        RankSink(sat_trainer, endpoints * 2, "t" * 32, grads)  # another layout: refused in one line
    sat = SatelliteStep(sat_trainer, RankSink(sat_trainer, endpoints, "t" * 32, grads), name="3")
    try:
        sat.load(model, 5, 4, pull=lambda tr: tr.load_parts(parts, link, "satellite:3"))
        (report,), why = sat_trainer.load_parts(parts, link, "satellite:3")  # again, for what it says
        assert why is None and (report.receiver, report.sender_rank) == ("satellite:3", 0)
        refused = [parts[0].model_copy(update={"layout": [2, 1, 1, 1]})]
        assert "this cell is [1, 1, 1, 1]" in sat_trainer.load_parts(refused, link, "satellite:3")[1]
        assert torch.equal(hf_state(sat_trainer)["model.norm.weight"], hf_state(core.trainer)["model.norm.weight"])
        assert core.run_shard(shards[0])
        assert sat.run_shard(shards[1]).grads == {}  # its ranks sent their own slices
        (msg,) = core.trainer.grad_inbox.poll(30)
        assert set(msg.grads) == set(core.trainer.grad_shapes()) and core.accept(msg) == ADDED
    finally:
        sat.sink.close(1.0)
        core.trainer.close_grads()
    _, metrics = core.finish(tmp_path / "v5")
    assert metrics["satellites"] == 1
    got, want = hf_state(core.trainer), hf_state(one)
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    print(f"one-rank core + satellite against one cell: weights within {worst:.1e}")
    assert worst <= 1e-5, worst  # one cell's step (tests/test_megatron.py's bound: the sums in another order)


def test_the_ledger_keeps_the_sending_rank(tmp_path):
    from gyre_slurm.ledger.records import Ledger

    ledger = Ledger(tmp_path / "ledger.db", flush_interval_s=60)
    try:
        ledger.weight_transfer(1.0, 3, 1, "satellite:1/rank1", "mooncake", 1024, 0.5, True, None, sender_rank=1)
        assert ledger.rows("SELECT receiver, sender_rank, bytes FROM weight_transfers") == [
            {"receiver": "satellite:1/rank1", "sender_rank": 1, "bytes": 1024}]
    finally:
        ledger.close()
