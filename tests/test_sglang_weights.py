"""SGLang's weight routes and reroutes against the embedded engine, as real processes: a trainer-side
DistributedWeightSender (this test process, rank 0) pushing weights over torch.distributed gloo into a running engine
through /init_weights_update_group and /update_weights_from_distributed; the engine's parameters pulled back over the
Mooncake Transfer Engine from /remote_instance_transfer_engine_info, bit for bit; pause in retract mode; a leaving
cell's calls continued on another engine through the proxy's own continuation (Kept)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch

from gyre_slurm.engines.client import EngineClient, EngineError, SamplingParams
from gyre_slurm.engines.sglang import sglang_launch_argv
from gyre_slurm.engines.sglang_weights import (
    DistributedWeightSender,
    buckets,
    evacuate,
    load_from_remote_instance,
    torch_dtype,
)
from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import Qwen3ForCausalLM
from gyre_slurm.proxy.generation import Kept
from gyre_slurm.spawn import gyre_argv, spawn, wait_ready_file
from gyre_slurm.transfer.engine import TransferError, available
from tests import test_engine
from tests.test_engine import PROMPT, REPO, post, recomputed_logprobs

engine, client, models = test_engine.engine, test_engine.client, test_engine.models  # its fixtures: one engine here
pytestmark = pytest.mark.skipif(available() is not None, reason=f"Transfer Engine: {available()}")
GREEDY = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)  # long: still running when paused


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def other(models, tmp_path_factory):
    """A second engine on the same weights: where a leaving cell's calls continue."""
    folder = tmp_path_factory.mktemp("other")
    ready, log = folder / "ready.json", folder / "engine.log"
    proc = spawn(gyre_argv("engine", "--model-path", str(models[0]), "--port", "0", "--ready-file", str(ready)), log,
                 cwd=REPO)
    try:
        url = wait_ready_file(ready, proc, what="the second engine", timeout_s=60, log=log)["url"]
    except GyreError as exc:
        proc.kill()
        pytest.fail(f"{exc}: {log.read_text()}")
    c = EngineClient(url, timeout_s=60)
    yield c
    c.close()
    proc.terminate()
    proc.wait(timeout=20)


def trainer_weights(models) -> dict[str, torch.Tensor]:
    """What a trainer holds: another model's weights, moved off anything that is on disk."""
    model = Qwen3ForCausalLM.from_pretrained(models[1])
    gen = torch.Generator().manual_seed(5)
    return {n: p.detach() + 1e-3 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def pulled(engine_url: str, models) -> Qwen3ForCausalLM:
    """The engine's parameters as they are now, pulled over the Transfer Engine into a local model."""
    local = Qwen3ForCausalLM.from_pretrained(models[1])
    report = load_from_remote_instance(engine_url, local)
    assert report.transport == "remote_instance" and report.ok
    assert report.nbytes == sum(p.numel() * p.element_size() for p in local.parameters())
    return local


# --- pause in retract mode, and a leaving cell ------------------------------------------------------------------

def test_retract_keeps_requests_and_they_complete(engine, client):
    straight = asyncio.run(client.generate(PROMPT, GREEDY))  # the same greedy calls, never interrupted

    async def scenario():
        calls = [asyncio.create_task(client.generate(PROMPT, GREEDY, rid=f"retract-{i}")) for i in range(3)]
        await asyncio.sleep(0.2)
        await asyncio.to_thread(client.pause_generation, "retract")
        try:
            server = httpx.get(engine["url"] + "/get_server_info").json()
            await asyncio.to_thread(client.release_memory)  # allowed: retracted requests hold no KV, they wait
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls) and server["internal_states"][0]["running_requests"] == 3
        finally:
            await asyncio.to_thread(client.resume_memory)  # resumes and continues generation
        return await asyncio.wait_for(asyncio.gather(*calls), 120)

    for res in asyncio.run(scenario()):
        assert res.finish_reason == "length" and res.output_ids == straight.output_ids
        assert res.prompt_tokens == len(PROMPT)
        assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64),
                              torch.tensor(straight.output_logprobs, dtype=torch.float64), atol=1e-4)


def test_evacuate_hands_calls_to_another_engine(client, other):
    """The proxy's path (Kept): the abort answer's ids continue on another engine, and the whole equals one
    uninterrupted greedy generation."""
    straight = asyncio.run(other.generate(PROMPT, GREEDY))

    async def scenario():
        kept = Kept()
        ids, attempt = kept.attempt(PROMPT, GREEDY)
        call = asyncio.create_task(client.generate(ids, attempt))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(evacuate, client)
        first = await asyncio.wait_for(call, 20)
        assert first.finish_reason == "abort" and 0 < len(first.output_ids) < GREEDY.max_new_tokens
        kept.take(first, 0)
        assert not kept.finished(first, attempt, GREEDY)
        held = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=4)))
        ids, attempt = kept.attempt(PROMPT, GREEDY)
        assert attempt.max_new_tokens == GREEDY.max_new_tokens - len(first.output_ids)
        second = await other.generate(ids, attempt)
        kept.take(second, 0)
        assert kept.finished(second, attempt, GREEDY) and not held.done()  # the evacuated engine stays paused
        await asyncio.to_thread(client.continue_generation)
        assert len((await asyncio.wait_for(held, 20)).output_ids) == 4
        return kept.result(second, attempt, 0, len(PROMPT)), len(first.output_ids)

    try:
        res, n_first = asyncio.run(scenario())
    finally:
        client.continue_generation()  # whatever failed: the engine serves the next tests
    assert res.finish_reason == "length" and res.output_ids == straight.output_ids and n_first > 0
    assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64),
                          torch.tensor(straight.output_logprobs, dtype=torch.float64), atol=1e-4)


# --- the distributed update ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sender(engine):
    s = DistributedWeightSender(engine["url"], "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    with s:
        yield s


def test_bad_weight_requests_are_400_and_the_engine_keeps_serving(engine, client, sender, models):
    assert sender.group is not None
    refused = [
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                                        "world_size": 2, "backend": "nccl"}, "needs CUDA"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2,
                                        "world_size": 2, "backend": "gloo"}, "outside world_size"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                                        "world_size": 2, "group_name": "gyre_weights", "backend": "gloo"},
         "already exists"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                              "shapes": [[128]], "group_name": "nope"}, "no weight update group"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                              "shapes": [[3, 3]], "group_name": "gyre_weights"}, "shape [3, 3]"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float128"],
                                              "shapes": [[128]], "group_name": "gyre_weights"}, "unknown dtype"),
        ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["int32"],
                                              "shapes": [[128]], "group_name": "gyre_weights"}, "cannot be loaded"),
        ("/update_weights_from_distributed", {"names": ["no.such.weight"], "dtypes": ["float32"], "shapes": [[1]],
                                              "group_name": "gyre_weights"}, "not a parameter"),
        ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]},
         "differ in length"),
        ("/destroy_weights_update_group", {"group_name": "nope"}, "no weight update group"),
    ]
    assert post(engine, "/begin_weight_update", {}).status_code == 200  # the checks behind the session rule
    try:
        for path, body, fragment in refused:
            assert_refused(engine, path, body, fragment)
    finally:
        assert post(engine, "/end_weight_update", {}).status_code == 200
    with pytest.raises(EngineError, match="needs CUDA"):
        client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "other", "nccl")
    assert asyncio.run(client.generate(PROMPT, SamplingParams(max_new_tokens=3))).finish_reason == "length"
    assert client.model_info()["weight_version"] == "0"  # nothing was loaded


def assert_refused(engine, path: str, body: dict, fragment: str) -> None:
    r = post(engine, path, body)
    assert r.status_code == 400, (path, body, r.text)
    answer = r.json()
    message = answer.get("message") or answer["error"]["message"]
    assert fragment in message and "\n" not in message, (fragment, message)


def test_the_distributed_update_is_refused_outside_a_weight_update_session(engine, client, sender):
    """SGLang's session rule (managers/scheduler_components/weight_updater.py), which the embedded engine follows:
    no update outside /begin_weight_update ... /end_weight_update, no session inside another, no end without a
    begin. A refused update receives nothing: the engine serves on."""
    bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "group_name": "gyre_weights"}
    assert_refused(engine, "/update_weights_from_distributed", bucket,
                   "update_weights_from_distributed requires an open begin_weight_update session")
    assert_refused(engine, "/end_weight_update", {}, "end_weight_update called without begin_weight_update")
    assert_refused(engine, "/begin_weight_update", {"selector": "both"}, "selector")
    assert post(engine, "/begin_weight_update", {"selector": "target"}).json() == {"success": True,
                                                                                   "message": "Success"}
    assert_refused(engine, "/begin_weight_update", {},
                   "begin_weight_update called while a weight-update session is already open")
    assert post(engine, "/end_weight_update", {}).json() == {"success": True, "message": "Success"}
    assert asyncio.run(client.generate(PROMPT, SamplingParams(max_new_tokens=3))).finish_reason == "length"
    assert client.model_info()["weight_version"] == "0"  # nothing was loaded


def test_distributed_update_then_pull_bit_for_bit(engine, client, sender, models):
    weights = trainer_weights(models)
    parts = buckets(weights.items(), 256 << 10)
    assert len(parts) > 2  # several /update_weights_from_distributed calls
    report = sender.send(weights.items(), 11, bucket_bytes=256 << 10)
    assert sender.client.weight_sessions is True  # the buckets went inside a session, closed after the last
    assert_refused(engine, "/end_weight_update", {}, "end_weight_update called without begin_weight_update")
    assert report.transport == "nccl" and report.version == 11 and report.ok and report.seconds > 0
    assert report.nbytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert httpx.get(engine["url"] + "/get_weight_version").json() == {"weight_version": "11"}
    assert client.model_info()["weight_version"] == "11"

    local = pulled(engine["url"], models)  # the engine's parameters, over the Transfer Engine
    for name, p in local.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name
    res = asyncio.run(client.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, seed=3)))
    assert res.weight_version == 11
    assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64),
                          recomputed_logprobs(local.eval(), PROMPT, res.output_ids), atol=1e-4)

    # a second version through the same group; the version changes only with the last bucket
    again = {n: t * 0.5 for n, t in weights.items()}
    assert sender.send(again.items(), "12").version == 12
    for name, p in pulled(engine["url"], models).named_parameters():
        assert torch.equal(p.detach(), again[name]), name


def test_remote_instance_info_has_sglang_shape(engine, models):
    r = httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params={"rank": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rank"] == 0
    session_id, weights = body["remote_instance_transfer_engine_info"]
    host, port = session_id.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    local = dict(Qwen3ForCausalLM.from_pretrained(models[0]).named_parameters())
    assert set(weights) == set(local) and "lm_head.weight" not in weights  # tied: listed once, as SGLang does
    for name, (addr, numel, size) in weights.items():
        assert addr > 0 and (numel, size) == (local[name].numel(), local[name].element_size())
    old = httpx.get(engine["url"] + "/get_remote_instance_transfer_engine_info", params={"rank": 0}).json()
    assert old == body  # SGLang's older name, the one its loader calls
    for params in ({}, {"rank": -1}, {"rank": "x"}):
        bad = httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "Missing or invalid rank parameter"
    assert httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params={"rank": 1}).status_code == 400


def test_remote_instance_loader_refuses_another_model(engine):
    with pytest.raises(TransferError, match="does not match"):
        load_from_remote_instance(engine["url"], torch.nn.Linear(3, 3))


def test_weights_survive_release_and_resume_of_the_seed(engine, client, models):
    """Released weights are unregistered (their memory freed); after a resume the info names the new tensors."""
    client.update_weights_from_disk(str(models[0]), 13)  # what a resume reloads: the model folder
    before = httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params={"rank": 0}).json()
    client.release_memory(abort_first=True)
    r = httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params={"rank": 0})
    assert r.status_code == 503  # no weights to serve
    client.resume_memory()
    after = httpx.get(engine["url"] + "/remote_instance_transfer_engine_info", params={"rank": 0}).json()
    assert set(after["remote_instance_transfer_engine_info"][1]) == set(
        before["remote_instance_transfer_engine_info"][1])
    assert client.model_info()["weight_version"] == "13"
    disk = Qwen3ForCausalLM.from_pretrained(models[0])
    for (name, p), (_, q) in zip(pulled(engine["url"], models).named_parameters(), disk.named_parameters(),
                                 strict=True):
        assert torch.equal(p.detach(), q.detach()), name


# --- pieces ---------------------------------------------------------------------------------------------------------

def test_buckets_and_dtypes():
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 100, 1, 1])]
    assert [[n for n, _ in b] for b in buckets(ts, 80)] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("torch.float32") is torch.float32
    for bad in ("float128", "Tensor", ""):
        with pytest.raises(ValueError):
            torch_dtype(bad)


def test_sglang_remote_instance_argv():
    argv = sglang_launch_argv("/ckpt", "0.0.0.0", 30002, weights_from=("10.0.0.7", 30000), python="python3")
    flags = argv[3:]

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert value("--load-format") == "remote_instance"
    assert value("--remote-instance-weight-loader-backend") == "transfer_engine"
    assert value("--remote-instance-weight-loader-seed-instance-ip") == "10.0.0.7"
    assert value("--remote-instance-weight-loader-seed-instance-service-port") == "30000"
    assert "--remote-instance-weight-loader-send-weights-group-ports" not in flags  # the nccl backend's
    assert value("--model-path") == "/ckpt"  # config and tokenizer still come from the folder
    seed = sglang_launch_argv("/ckpt", weights_seed=True, extra={"engine_info_bootstrap_port": 6790})
    assert "--remote-instance-weight-loader-start-seed-via-transfer-engine" in seed
    assert seed[seed.index("--engine-info-bootstrap-port") + 1] == "6790" and "--load-format" not in seed
