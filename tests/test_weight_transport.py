"""Weights over the Mooncake Transfer Engine (transfer/weights.py), with real engines in real processes: what a
receiver gets equals the core's bytes bit for bit; a receiver killed mid-transfer harms neither the core nor the
other receivers; a replaced, corrupted or vanished version is refused, never loaded; the embedded rollout engine
serves a version pulled over its route; gradients come back over the Transfer Engine with their MAC checked. A
receiver that asks for the newest version at least (a rollout engine, the stage and push paths) gets, where its
version was replaced, the newest one published after it, bit for bit, and says which (the daemon records that one);
a satellite's exact pull refuses a replaced version."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gyre_slurm.protocol import Transfer, WeightsHandle, WeightsReceived
from gyre_slurm.train.grad_channel import GradMessage, GradReceiver, GradSender
from gyre_slurm.transfer.engine import TransferAgent, TransferError
from gyre_slurm.transfer.weights import (
    ALIGN,
    WRITING,
    WeightPublisher,
    WeightPuller,
    bucket_ranges,
    load_into,
    plan_layout,
)

from .conftest import q
from .test_shard_queue import loop_with_cells
from .weight_receiver import tensor_digests

HERE = Path(__file__).resolve().parent
TOKEN = "t" * 32


def state(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(97 * scale, 33, generator=g),
            "layers.0.norm": torch.randn(33, generator=g).to(torch.bfloat16),
            "layers.0.proj": torch.randn(33, 65 * scale, generator=g).to(torch.float16),
            "empty": torch.zeros(0, 3), "steps": torch.arange(5, dtype=torch.int64)}


def start_receivers(handle: WeightsHandle, n: int = 1) -> list[subprocess.Popen]:
    """n receiver processes, returned once every one of them is pulling (they start at about the same time)."""
    procs = [subprocess.Popen([sys.executable, str(HERE / "weight_receiver.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "PYTHONPATH": str(HERE.parent)}) for _ in range(n)]
    for p in procs:
        p.stdin.write(handle.model_dump_json() + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().strip() == "pulling"
    return procs


def result(proc: subprocess.Popen, timeout: float = 120) -> dict:
    proc.stdin.close()
    out = proc.stdout.read()  # not communicate(): it would skip what readline() already buffered
    proc.wait(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def test_layout_is_aligned_and_buckets_cover_the_payload():
    layout, total = plan_layout(state(0).items())
    assert [s.offset % ALIGN for s in layout] == [0] * len(layout) and total % ALIGN == 0
    ends = [s.offset + s.nbytes for s in layout]
    assert all(e <= s.offset for e, s in zip(ends, layout[1:], strict=False))  # no overlap
    assert bucket_ranges(1000, 300) == [(0, 300), (300, 300), (600, 300), (900, 100)]
    assert bucket_ranges(0, 64) == []
    with pytest.raises(TransferError, match="complex"):
        plan_layout([("z", torch.zeros(2, dtype=torch.complex64))])


@pytest.mark.parametrize("verify", [False, True])
def test_receivers_in_other_processes_get_the_cores_bytes_bit_for_bit(verify: bool):
    pub = WeightPublisher(TransferAgent(), bucket_bytes=4096, verify=verify)
    for version in (1, 2, 3):  # both slots, then the first again: each version exactly
        s = state(version)
        handle = pub.publish(version, s.items())
        assert (handle.digests is not None) == verify
        procs = start_receivers(handle, 2)
        for p in procs:
            got = result(p)
            assert got["digests"] == tensor_digests(s), got
            assert got["bytes"] == handle.nbytes
    pub.close()


def test_a_receiver_killed_mid_transfer_harms_neither_the_core_nor_the_others():
    big = {f"w{i}": torch.randn(16 << 20) for i in range(12)}  # 768 MiB: a pull takes a good part of a second
    pub = WeightPublisher(TransferAgent(), bucket_bytes=8 << 20)
    handle = pub.publish(7, big.items())
    want = tensor_digests(big)
    victim, *others = start_receivers(handle, 3)
    time.sleep(0.05)  # all three are reading now
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL
    for p in others:
        assert result(p)["digests"] == want
    # the core publishes on, and a new receiver pulls the next version as if nothing happened
    small = state(8)
    handle = pub.publish(8, small.items())
    assert result(start_receivers(handle)[0])["digests"] == tensor_digests(small)
    pub.close()


def test_a_replaced_corrupted_or_vanished_version_is_refused():
    agent = TransferAgent()
    pub = WeightPublisher(agent, bucket_bytes=1024, verify=True)
    puller = WeightPuller(TransferAgent(), "test")
    v1 = pub.publish(1, state(1).items())
    tensors, report = puller.pull(v1)
    assert report.ok and report.transport == "mooncake" and report.nbytes == v1.nbytes
    assert tensor_digests(tensors) == tensor_digests(state(1))
    assert puller.pull(v1, at_least=True)[1].version == 1  # not replaced: its own version
    pub.publish(2, state(2).items(), source="/v2")
    pub.publish(3, state(3).items(), source="/v3")  # slot 1 % 2 now holds version 3
    with pytest.raises(TransferError, match="version 1 is no longer published"):
        puller.pull(v1)  # a satellite: exactly the step's version, or the shard fails
    tensors, report = puller.pull(v1, at_least=True)  # a cell slow to come back: the newest there is
    assert (report.version, report.source) == (3, "/v3") and tensor_digests(tensors) == tensor_digests(state(3))
    pub._header(pub._slots[1], 5, WRITING, v1.nbytes, 0)  # version 5 being written where 3 was
    tensors, report = puller.pull(v1, at_least=True)
    assert (report.version, report.source) == (2, "/v2") and tensor_digests(tensors) == tensor_digests(state(2))
    pub._slots[0][64 + 100] ^= 0xFF  # one byte flipped in version 2: the digests of its slot's table catch it
    with pytest.raises(TransferError, match=r"version 2: bucket\(s\) \[0\] do not match their digest"):
        puller.pull(v1, at_least=True)
    pub._slots[0][64 + 100] ^= 0xFF
    later = v1.model_copy(update={"version": 9})
    with pytest.raises(TransferError, match=r"version 9 .*only older versions \(2\) are published"):
        puller.pull(later, at_least=True)
    other = v1.model_copy(update={"tensors": [["renamed" if i == 0 else t[0], *t[1:]]
                                              for i, t in enumerate(v1.tensors)]})
    with pytest.raises(TransferError, match="no slot holds a version of its layout"):
        puller.pull(other, at_least=True)
    v4 = pub.publish(4, state(4).items())
    pub._slots[0][64 + 100] ^= 0xFF  # one byte flipped in the core's memory after publishing
    with pytest.raises(TransferError, match=r"bucket\(s\) \[0\] do not match their digest"):
        puller.pull(v4)
    gone = v4.model_copy(update={"peer": "127.0.0.1:1"})
    with pytest.raises(TransferError, match="127.0.0.1:1 failed"):
        puller.pull(gone)
    bad = v4.model_copy(update={"tensors": [["x", "float32", [10**6], 0, 4 * 10**6]]})
    with pytest.raises(TransferError, match="bad entry"):
        puller.pull(bad)
    pub.close()


def test_load_into_copies_in_place_and_refuses_what_does_not_fit():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ptrs = [p.data_ptr() for p in model.parameters()]
    load_into(model, dict(other.named_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # the optimizer's parameters stay the same objects
    with pytest.raises(TransferError, match="missing"):
        load_into(model, {"0.weight": torch.zeros(3, 4)})
    with pytest.raises(TransferError, match="shape"):
        load_into(model, {**dict(other.named_parameters()), "1.bias": torch.zeros(5)})


@contextlib.contextmanager
def embedded_engine(model: Path, tmp_path: Path):
    """A `gyre engine` process serving `model`, as a ready EngineClient; stopped on exit."""
    from gyre_slurm.engines.client import EngineClient
    from gyre_slurm.spawn import gyre_argv, spawn, wait_ready_file

    ready, log = tmp_path / "engine.json", tmp_path / "engine.log"
    proc = spawn(gyre_argv("engine", "--model-path", str(model), "--port", "0", "--ready-file", str(ready)), log)
    try:
        client = EngineClient(wait_ready_file(ready, proc, what="engine", timeout_s=120, log=log)["url"])
        client.wait_ready(60)
        yield client
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_rollout_engine_serves_a_version_pulled_over_its_route(warm_model: Path, tmp_path: Path):
    """The embedded engine pulls a version the 'core' published and answers as that version; a version that does
    not fit its model is refused with a clear 400 and it keeps serving what it had; asked for a version that was
    replaced meanwhile, it serves the newest one, bit for bit, and says so."""
    from gyre_slurm.engines.client import EngineError, SamplingParams
    from gyre_slurm.model.qwen3 import Qwen3ForCausalLM
    from gyre_slurm.transfer.weights import named_weights

    with embedded_engine(warm_model, tmp_path) as client:
        prompt = list(range(40, 80))
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

        def generate():
            return asyncio.run(client.generate(prompt, greedy))

        before = generate()
        trained = Qwen3ForCausalLM.from_pretrained(warm_model)
        with torch.no_grad():
            for p in trained.parameters():
                p.mul_(-1.0)  # a visibly different policy
        pub = WeightPublisher(TransferAgent())
        v5 = pub.publish(5, named_weights(trained))
        (report,) = client.update_weights_from_transfer_engine([v5], 5)  # a whole-model version: one part
        assert report.nbytes == pub.last.nbytes and report.seconds > 0
        after = generate()
        assert after.weight_version == 5 and after.output_ids != before.output_ids
        # the engine's log-probs are the published weights' own
        ids = torch.tensor([prompt + after.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(trained(ids)[0, len(prompt) - 1:-1].float(), -1)
        want = logp.gather(-1, torch.tensor(after.output_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(after.output_logprobs), want, atol=1e-3)
        other = WeightPublisher(TransferAgent())  # kept alive: its memory must stay registered
        with pytest.raises(EngineError, match="missing weights"):
            client.update_weights_from_transfer_engine([other.publish(6, state(6).items())], 6)
        assert generate().weight_version == 5
        pub.publish(6, named_weights(trained))
        with torch.no_grad():
            for p in trained.parameters():
                p.mul_(-1.0)  # the base weights again
        pub.publish(7, named_weights(trained), source=str(warm_model))
        (report,) = client.update_weights_from_transfer_engine([v5], 5)  # a cell slow to come back: 5 is gone
        assert (report.version, report.source) == (7, str(warm_model.resolve()))
        again = generate()
        assert again.weight_version == 7 and again.output_ids == before.output_ids
        assert again.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)


def test_gradients_come_back_over_the_transfer_engine_and_are_acknowledged():
    agent_core, agent_sat = TransferAgent(), TransferAgent()
    grads = {"a": torch.randn(300, 7), "b": torch.randn(11).to(torch.bfloat16)}
    rx = GradReceiver(TOKEN, agent=agent_core, max_bytes=1 << 20)
    tx = GradSender(rx.endpoint, TOKEN, name="1", agent=agent_sat)
    try:
        for shard in (0, 1):
            tx.send(GradMessage(3, 2, (shard,), "1", grads, {"loss": 0.5}))
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += rx.poll(1.0)
        assert [m.shard_ids for m in got] == [(0,), (1,)]
        assert all(torch.equal(m.grads[k], v) for m in got for k, v in grads.items())
        assert rx.pulled_bytes == 2 * (300 * 7 * 4 + 11 * 2)
        tx._reap(5.0)
        assert tx.unacknowledged == 0  # the core acknowledged both: the satellite freed their buffers
        # a forged message whose locator points at other bytes fails the MAC, and the receiver goes on
        forged = GradSender(rx.endpoint, "wrong-token" * 3, name="1", agent=agent_sat)
        forged.send(GradMessage(3, 2, (2,), "1", grads))
        assert rx.poll(2.0) == [] and rx.rejections[-1].startswith("auth")
        forged.close(0)
    finally:
        tx.close(0)
        rx.close()


def free_ports(n: int) -> int:
    """The first of n consecutive ports free on loopback now, outside Mooncake's own range (15000-17000)."""
    for base in range(20000 + os.getpid() % 1000 * 8, 40000, n):
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base
    raise AssertionError("no free ports")


PEER = """
import sys, time
from gyre_slurm.transfer.engine import TransferAgent, TransferError
for _ in range(150):  # a dead peer's ports stay in TIME_WAIT for a minute
    try:
        agent = TransferAgent()
        break
    except TransferError:
        time.sleep(1)
buf = agent.allocate(1 << 16)
buf.fill_(int(sys.argv[1]))
print(agent.peer, buf.data_ptr(), flush=True)
sys.stdin.read()
"""


def _peer(fill: int, ports: tuple[int, int]) -> tuple[subprocess.Popen, str, int]:
    """A serving engine in a process of its own, on two given ports (Mooncake draws its RPC and data ports from
    that range): its process, its peer name and the address of its buffer (filled with `fill`)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "MC_MIN_RPC_PORT": str(ports[0]),
           "MC_MAX_RPC_PORT": str(ports[1])}
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(fill)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    peer, addr = proc.stdout.readline().split()
    return proc, peer, int(addr)


@pytest.mark.slow
def test_a_peer_that_came_up_on_a_dead_peers_port_is_reached():
    """Mooncake remembers a peer's data port by its name ("host:rpc_port") for the engine's life: a new process on a
    dead peer's RPC port, with another data port, was unreachable from a process that had read from the dead one
    (seen in the suite: engines come and go, the test process stays). The agent reads it through a fresh engine.
    Up to a minute: the dead peer's port may be free again only after TCP's TIME_WAIT."""
    client = TransferAgent()
    local = client.allocate(1 << 16)
    base = free_ports(4)
    old, peer, addr = _peer(7, (base + 1, base + 2))
    client.read(peer, [local.data_ptr()], [addr], [1 << 16])
    assert int(local[0]) == 7 and client.renewals == 0
    old.kill()
    old.wait()
    rpc = int(peer.rsplit(":", 1)[1])
    data = base if rpc == base + 1 else base + 3  # the new peer's data port: not the dead one's
    procs = []
    try:
        for _ in range(20):  # which of its two ports Mooncake takes for RPC is drawn: until it is the dead peer's
            procs.append(_peer(9, tuple(sorted((rpc, data)))))
            if procs[-1][1] == peer:
                break
            procs[-1][0].kill()
        _, new_peer, new_addr = procs[-1]
        assert new_peer == peer
        client.read(peer, [local.data_ptr()], [new_addr], [1 << 16])
        assert int(local[-1]) == 9 and client.renewals == 1
        client.read(peer, [local.data_ptr()], [new_addr], [1 << 16])  # the fresh engine is kept
        with pytest.raises(TransferError, match="the peer is gone"):  # never reached: nothing to forget
            client.read("127.0.0.1:1", [local.data_ptr()], [new_addr], [1 << 16])
        assert client.renewals == 1
    finally:
        for p, _, _ in procs:
            p.kill()


def test_the_daemon_records_the_version_a_receiver_really_loaded(tmp_path: Path):
    sent: list = []
    loop, _ = loop_with_cells(tmp_path, sent)
    loop.weights_received(WeightsReceived(node_index=1, cell=1, transfers=[
        Transfer(transport="mooncake", version=7, nbytes=10, seconds=0.1, receiver="engine:1", asked=5),
        Transfer(transport="mooncake", version=8, nbytes=10, seconds=0.1, receiver="engine:2")]), 1.0)
    loop.ledger.flush()
    db = tmp_path / "ledger.db"
    assert q(db, "SELECT receiver, version, ok FROM weight_transfers ORDER BY id") == [("engine:1", 7, 1),
                                                                                       ("engine:2", 8, 1)]
    assert q(db, "SELECT message FROM events WHERE kind = 'weights_newer'") == [
        ("engine:1 was sent version 5, which was replaced before it read it: it loaded version 7",)]
