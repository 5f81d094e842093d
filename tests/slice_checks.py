"""Checks that run inside a model-parallel cell's ranks (tests/megatron_rank.py): versions written and published slice
by slice, read back at every kind of receiver, the bytes each rank allocates meanwhile, and satellite gradients
added rank to rank. Every rank calls each function (they meet in the cell's collectives); the leader returns
what it saw, the other ranks None.

The Transfer Engine is Mooncake's own (the non-CUDA wheel over TCP on 127.0.0.1): each rank's process starts its
engine from the RankLink its `publish` or `load_parts` call gets (`TransferAgent.shared`), as a cell's rank does, and
the parts are read from the other ranks' processes through it."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

TOKEN = "slice-checks-token-0123456789abcdef"
WRONG = "not-the-run-token-0123456789abcdef"


class PeakAllocations(TorchDispatchMode):
    """The most bytes of tensor storage allocated inside the block and alive at once (a storage counts until the
    last tensor made in the block that uses it is gone): what a rank holds beyond what it held before."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._bytes: dict[int, int] = {}  # storage address -> bytes
        self._users: dict[int, int] = {}  # storage address -> tensors made here that use it and are alive
        self._refs: dict[int, weakref.ref] = {}  # kept alive so that their callbacks run

    def _gone(self, key: int, ref: weakref.ref) -> None:
        self._refs.pop(id(ref), None)
        self._users[key] -= 1
        if not self._users[key]:
            del self._users[key]
            self.now -= self._bytes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0 or (key in given and key not in self._bytes):
                continue  # a view of what existed before the block
            if key not in self._bytes:
                self._bytes[key], self._users[key] = st.nbytes(), 0
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
            self._users[key] += 1
            ref = weakref.ref(t, lambda r, k=key: self._gone(k, r))
            self._refs[id(ref)] = ref
        return out


# --- what the old code did, for comparison ----------------------------------------------------------------------
def gathered(tr, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Full Hugging Face tensors of every rank's slices on the leader, as MegatronTrainer._gather made the mirror."""
    from gyre_slurm.train.megatron_shard import assemble, hf_pieces

    mine = hf_pieces(tr.config, tr.par.coords, tensors, tr._senders())
    got = tr.par.gather_to_leader(mine)
    return None if got is None else assemble(p for rank in got for p in rank)


def by_name_cut(tr, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's slices of full Hugging Face tensors, as MegatronTrainer.add_grads cut a satellite's gradient."""
    from gyre_slurm.train.megatron_shard import local_state, state_reader

    return local_state(tr.config, tr.par.coords, state_reader(full, tr.par.coords))


# --- the snapshot ---------------------------------------------------------------------------------------------------
def snapshot_state(tr, folder: Path, peak: PeakAllocations | None = None) -> dict[str, torch.Tensor] | None:
    """The weights as a version folder written slice by slice holds them (read on the leader), checked bit for bit
    against the old gather of every rank's slices; `peak`: what the writing allocates is counted there."""
    from gyre_slurm.model.qwen3 import read_safetensors

    if peak is None:
        tr._save_weights(folder, lambda _folder: None)
    else:
        with peak:
            tr._save_weights(folder, lambda _folder: None)
    want = gathered(tr, tr._slices())
    if want is None:
        return None
    got = read_safetensors(folder)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    for n, t in want.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), f"snapshot {n} differs from the gathered one"
    return got


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def run(tr, make_trainer, batch, where: Path) -> dict | None:
    """Everything of this module on one trained cell `tr`; `make_trainer()` builds another trainer of its layout in
    these ranks (a satellite)."""
    import gyre_slurm.train.slice_snapshot as snap
    from gyre_slurm.train.slice_snapshot import plan_pieces
    from gyre_slurm.transfer.weight_parts import RankLink

    snap.ROW_BLOCK_BYTES = 256  # a row-parallel tensor reordered in small blocks: the bucket is the full tensor
    par = tr.par
    out: dict = {"rank": par.rank}
    link = RankLink(("127.0.0.1",) * par.world)
    slices = tr._slices()
    pieces = plan_pieces(par.coords, tr._senders(), slices)
    out["slices_bytes"] = sum(_nbytes(t) for t in tr._gpt.values())
    out["largest_local"] = max(_nbytes(t) for t in tr._gpt.values())
    out["largest_full"] = max((p.dtype.itemsize * int(torch.Size(p.full_shape).numel()) for p in pieces), default=0)

    parts = tr.publish(7, link)  # the first: the slots are allocated (registered memory)
    with PeakAllocations() as m:
        parts = tr.publish(8, link)
    out["publish_peak"] = m.peak
    m = PeakAllocations()
    state = snapshot_state(tr, where / "v8", m)
    out["save_peak"] = m.peak
    parts = par.broadcast(parts)
    out["part_bytes"] = [h.nbytes for h in parts]
    _receivers(tr, make_trainer, parts, link, state, out)
    _grads(tr, make_trainer, batch, out)
    got = par.gather_to_leader(out)
    return None if got is None else {"ranks": got, "parts": [(h.rank, h.layout, len(h.tensors)) for h in parts]}


def _receivers(tr, make_trainer, parts, link, state, out: dict) -> None:
    from gyre_slurm.transfer.weight_parts import pull_full
    from gyre_slurm.transfer.weights import WeightPuller

    par = tr.par
    sat = make_trainer()
    with torch.no_grad():  # other weights first: the pull must replace every slice
        for n, p in sat._gpt.items():
            p.add_(0.25)
            if sat._main[n] is not p and sat._shards.holds(n):
                sat._main[n].add_(0.25)
    got = sat.load_parts(parts, link, "satellite:9")
    assert got is None or got[1] is None, got
    same = all(torch.equal(sat._main[n], tr._main[n]) for n in sat._main if sat._shards.holds(n))
    assert same, f"rank {par.rank}: the satellite's slices differ from the core's"
    assert all(torch.equal(p, tr._gpt[n]) for n, p in sat._gpt.items()), "GPTModel weights not the loaded ones"
    if got is not None:
        out["satellite_reports"] = [(r.receiver, r.sender_rank, r.nbytes) for r in got[0]]
    # parts of another layout: refused in one line (not raised: a follower that raised would end its process), and
    # no rank loads anything
    with torch.no_grad():
        for p in sat._gpt.values():
            p.add_(1.0)
    other = [h.model_copy(update={"layout": [h.layout[0] * 2, *h.layout[1:]]}) for h in parts]
    refused = sat.load_parts(other, link, "satellite:9")
    if refused is not None:
        assert "comes cut for [tensor, pipeline, data, expert] parallel" in refused[1] and "\n" not in refused[1]
    assert all(not torch.equal(p, tr._gpt[n]) for n, p in sat._gpt.items()), "a refused version was loaded"
    if par.leader:  # another TP: the engine's and the agent's way, full tensors put together from every part
        got = pull_full(WeightPuller(link.agent(0), "engine:9"), parts)
        assert sorted(got.tensors) == sorted(state)
        for n, t in state.items():
            assert torch.equal(got.tensors[n], t), f"assembled {n} differs from the snapshot"
        out["full_reports"] = [(r.sender_rank, r.nbytes) for r in got.reports]
    sat.close_grads()


def _grads(tr, make_trainer, batch, out: dict) -> None:
    """A satellite's gradient rank to rank into the core, against the old by-name sum; a message some rank misses
    (or one whose piece fails its MAC) is added by no rank."""
    from gyre_slurm.train.grad_channel import GradMessage
    from gyre_slurm.train.rank_grads import GradLink, grad_key
    from gyre_slurm.train.shards import split_batch

    par = tr.par
    a, b = split_batch(batch, n_shards=2)
    sat = make_trainer()
    tr.zero_grad()
    sat.zero_grad()
    tr.forward_backward(a)
    sat.forward_backward(b)
    core_g = tr.export_grads()
    sat_g = sat.export_grads()
    full = par.broadcast(gathered(sat, sat_g))  # the old way: the satellite's gradient by name, cut on every rank
    cut = by_name_cut(tr, full)
    want = {n: core_g[n] + cut[n] for n in core_g}
    link = GradLink("127.0.0.1", ("127.0.0.1",) * par.world)
    endpoints = par.broadcast(tr.open_grads(TOKEN, 5, link))
    header = GradMessage(5, 4, (1,), "9", {}, {"loss": 0.5})
    sat.send_grads(header, endpoints, TOKEN, link)
    assert tr.take_grads(grad_key(header)), f"rank {par.rank}: the satellite's gradient was not added"
    got = tr.export_grads()
    out["grad_diff"] = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-30))
                           for n in want)
    if par.world > 1:
        # only the leader's piece comes: nobody adds it
        missing = GradMessage(5, 4, (2,), "9", {}, {})
        if par.leader:
            sat._grads.send(GradMessage(5, 4, (2,), "9", sat.export_grads(), {}), endpoints[0], TOKEN, link, 0)
        assert not tr.take_grads(grad_key(missing), 0.5), "a message one rank missed was added"
        # the last rank's piece signed with another token: refused there (its MAC), so nobody adds it
        forged = GradMessage(5, 4, (3,), "9", {}, {})
        sat.send_grads(forged, endpoints, WRONG if par.rank == par.world - 1 else TOKEN, link)
        assert not tr.take_grads(grad_key(forged), 0.5), "a message with a forged piece was added"
        after = tr.export_grads()
        assert all(torch.equal(after[n], got[n]) for n in got), "a refused message changed the gradient"
    tr.close_grads()
    sat.close_grads(1.0)
    tr.zero_grad()


# --- what the test process asserts on the leader's findings ---------------------------------------------------------
SLACK = 64 << 10  # what else a rank allocates meanwhile: the pickled objects of the cell's gathers, safetensors headers


def assert_slices(got: dict, sizes: dict[str, int]) -> None:
    """`run`'s findings in every rank of the cell (each rank already asserted bit-exact receivers and snapshots): no
    rank allocates more than one split tensor to publish, nor more than one full tensor and that split to write its
    part of a snapshot; rank-to-rank gradients equal the by-name sum (1e-6); every sending rank's part reached the
    engine's way and the satellite's, in the cell's layout."""
    ranks = got["ranks"]
    world = len(ranks)
    for r in ranks:
        print(f"rank {r['rank']}: slices {r['slices_bytes']} B, publish peak {r['publish_peak']} B (largest local "
              f"tensor {r['largest_local']} B), save peak {r['save_peak']} B (largest full tensor {r['largest_full']}"
              f" B), part {r['part_bytes']} B, gradient vs by name {r['grad_diff']:.1e}")
        assert r["publish_peak"] <= r["largest_local"] + SLACK, r
        assert r["save_peak"] <= r["largest_full"] + r["largest_local"] + SLACK, r
        assert r["grad_diff"] <= 1e-6, r
    pulls = ranks[0]["satellite_reports"]
    receivers = {name for name, _, _ in pulls}
    assert receivers == ({"satellite:9"} if world == 1 else {f"satellite:9/rank{k}" for k in range(world)}), receivers
    if sizes.get("data_parallel", 1) == 1:  # each satellite rank pulls the part of its twin only
        assert all(name.endswith(f"rank{rank}") or world == 1 for name, rank, _ in pulls), pulls
    layout = [sizes.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel")]
    senders = [rank for rank, _, _ in got["parts"]]
    assert len(set(senders)) == len(senders) and all(lay == layout for _, lay, _ in got["parts"]), got["parts"]
    assert sorted(s for s, _ in ranks[0]["full_reports"]) == sorted(senders)  # the engine's way: every part once
