"""The embedded rollout engine as a real process over real HTTP, and EngineClient against it.

Shapes are checked against SGLang's (see engines/__init__.py for where they come from); logprobs are recomputed
with model/qwen3.py's full forward.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from gyre_slurm.engines.client import (
    EngineClient,
    EngineError,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
    parse_weight_version,
)
from gyre_slurm.engines.sglang import sglang_launch_argv, sglang_launch_env
from gyre_slurm.errors import GyreError
from gyre_slurm.model.qwen3 import Qwen3ForCausalLM
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.spawn import gyre_argv, read_ready_file, spawn, wait_ready_file, wait_until

from .conftest import alive, until_decoding

REPO = Path(__file__).resolve().parents[1]
PROMPT = [258, 117, 115, 101, 114, 10, 72, 105, 33, 256, 10, 258, 97, 115, 115, 10]  # "<|im_start|>user\nHi!..."


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return create_tiny_model(root / "m0", seed=0), create_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    """One engine process for the module: {"url", "pid", "proc", "ready"}."""
    folder = tmp_path_factory.mktemp("engine")
    ready, log = folder / "ready.json", folder / "engine.log"
    proc = spawn(gyre_argv("engine", "--model-path", str(models[0]), "--port", "0", "--weight-version", "0",
                           "--seed", "0", "--ready-file", str(ready)), log, cwd=REPO)
    try:
        info = wait_ready_file(ready, proc, what="the engine", timeout_s=60, log=log)
    except GyreError as exc:
        proc.kill()
        pytest.fail(f"{exc}: {log.read_text()}")
    yield {**info, "proc": proc, "ready": ready}
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(engine):
    c = EngineClient(engine["url"], timeout_s=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(models) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(models[0]).eval()


def post(engine, path: str, body=None, content: bytes | None = None) -> httpx.Response:
    return httpx.post(engine["url"] + path, json=body, content=content, timeout=60)


def gen(client: EngineClient, ids, **sampling) -> GenerateResult:
    rid = sampling.pop("rid", None)
    return asyncio.run(client.generate(ids, SamplingParams(**sampling), rid=rid))


def recomputed_logprobs(model: Qwen3ForCausalLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) at temperature 1, from one full forward."""
    seq = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq)[0].double(), dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(output))
    return logp[rows, torch.tensor(output)]


# --- process and wire format --------------------------------------------------------------------------------------

def test_ready_file_and_info(engine, client, models):
    assert engine["url"].startswith("http://127.0.0.1:") and engine["pid"] == engine["proc"].pid
    assert not list(engine["ready"].parent.glob(".*tmp"))  # written atomically
    assert client.health()
    info = client.model_info()
    assert info["model_path"] == str(models[0].resolve()) and info["weight_version"] == "0"
    assert info["is_generation"] is True and info["vocab_size"] == 320
    server = httpx.get(engine["url"] + "/get_server_info").json()
    assert server["internal_states"][0]["torch_threads"] == 1 and server["random_seed"] == 0
    assert httpx.get(engine["url"] + "/health_generate").status_code == 200


def test_generate_has_sglang_shapes(engine):
    r = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0.7},
                                   "return_logprob": True, "rid": "shape-1", "stream": False})
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"} and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "0" and isinstance(meta["cached_tokens"], int)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(len(t) == 3 and isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)
    plain = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).json()
    assert "output_token_logprobs" not in plain["meta_info"] and len(plain["meta_info"]["id"]) > 0
    with_text = post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3},
                                           "return_logprob": True, "return_text_in_logprobs": True}).json()
    assert all(isinstance(t[2], str) for t in with_text["meta_info"]["output_token_logprobs"])


def test_logprobs_are_the_models_at_temperature_one(client, model):
    for sampling in ({"temperature": 1.0}, {"temperature": 0.6, "top_p": 0.8, "top_k": 40}, {"temperature": 0}):
        res = gen(client, PROMPT, max_new_tokens=24, ignore_eos=True, seed=11, **sampling)
        ref = recomputed_logprobs(model, PROMPT, res.output_ids)
        assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64), ref, atol=1e-4), sampling
    # greedy takes the argmax at every step
    seq = torch.tensor([PROMPT + res.output_ids])
    with torch.no_grad():
        logits = model(seq)[0, len(PROMPT) - 1 : -1]
    assert logits.argmax(-1).tolist() == res.output_ids


def test_seeded_sampling_is_reproducible(client):
    a = gen(client, PROMPT, max_new_tokens=32, ignore_eos=True, seed=5)
    b = gen(client, PROMPT, max_new_tokens=32, ignore_eos=True, seed=5)
    c = gen(client, PROMPT, max_new_tokens=32, ignore_eos=True, seed=6)
    assert a.output_ids == b.output_ids and a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert a.output_ids != c.output_ids


def test_max_new_tokens(client):
    res = gen(client, PROMPT, max_new_tokens=5, ignore_eos=True)
    assert len(res.output_ids) == 5 and res.finish_reason == "length" and res.meta_info["finish_reason"]["length"] == 5
    zero = gen(client, PROMPT, max_new_tokens=0)
    assert zero.output_ids == [] and zero.finish_reason == "length" and zero.output_logprobs == []


def test_stop_token_ids_include_the_stop_token(client):
    full = gen(client, PROMPT, max_new_tokens=40, ignore_eos=True, seed=3)
    out, eos = full.output_ids, 256
    k = next(i for i in range(3, 40) if out[i] not in out[:i] and eos not in out[: i + 1])
    stop = full.output_ids[k]
    res = gen(client, PROMPT, max_new_tokens=40, seed=3, stop_token_ids=(stop,))
    assert res.finish_reason == "stop" and res.matched == stop
    assert res.meta_info["finish_reason"] == {"type": "stop", "matched": stop}
    assert res.output_ids == full.output_ids[: k + 1]  # the stop token is in output_ids, with its logprob
    assert res.output_logprobs == pytest.approx(full.output_logprobs[: k + 1], abs=1e-5)
    assert len(res.output_logprobs) == k + 1
    ignored = gen(client, PROMPT, max_new_tokens=40, seed=3, stop_token_ids=(stop,), ignore_eos=True)
    assert ignored.finish_reason == "length" and ignored.output_ids == full.output_ids  # SGLang: ignore_eos wins


def test_stop_strings_cut_the_text(client):
    full = gen(client, PROMPT, max_new_tokens=60, ignore_eos=True, seed=4)
    # an uppercase letter or digit: no special token's text contains one (tails are decoded with special tokens)
    k = next(i for i, t in enumerate(full.output_ids) if i >= 2 and (65 <= t <= 90 or 48 <= t <= 57))
    stop = chr(full.output_ids[k])
    k = full.output_ids.index(full.output_ids[k])  # its first occurrence ends generation
    res = gen(client, PROMPT, max_new_tokens=60, seed=4, stop=(stop,), ignore_eos=True)
    assert res.finish_reason == "stop" and res.matched == stop
    assert res.output_ids == full.output_ids[: k + 1]  # the tokens that produced the stop string stay
    assert stop not in res.text


def test_concurrent_requests_and_abort(client):
    async def scenario():
        long = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=3500, ignore_eos=True),
                                                   rid="long-1"))
        await until_decoding(client)
        shorts = [client.generate(PROMPT + [i], SamplingParams(max_new_tokens=16, ignore_eos=True), rid=f"s{i}")
                  for i in range(6)]
        done = await asyncio.gather(*shorts)
        assert not long.done()  # the short ones were not queued behind the long one
        await asyncio.to_thread(client.abort, "long-1")
        return done, await asyncio.wait_for(long, 30)

    shorts, long = asyncio.run(scenario())
    assert all(r.finish_reason == "length" and len(r.output_ids) == 16 for r in shorts)
    assert long.finish_reason == "abort" and long.meta_info["finish_reason"]["type"] == "abort"
    assert 0 < len(long.output_ids) < 3500 and len(long.output_logprobs) == len(long.output_ids)

    async def abort_all():
        tasks = [asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=3000, ignore_eos=True)))
                 for _ in range(3)]
        await until_decoding(client, 3)
        await asyncio.to_thread(client.abort, None, True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert {r.finish_reason for r in asyncio.run(abort_all())} == {"abort"}
    client.abort("no-such-request")  # unknown rid: a no-op, as in SGLang


def test_prefix_reuse(engine, client):
    post(engine, "/flush_cache")
    context = [(7 * i) % 256 for i in range(300)]
    turn1 = gen(client, context, max_new_tokens=20, ignore_eos=True, temperature=0)
    turn2 = context + turn1.output_ids + [10, 97, 98, 99]
    warm = gen(client, turn2, max_new_tokens=12, ignore_eos=True, temperature=0)
    assert warm.cached_tokens == len(context) + len(turn1.output_ids) - 1  # the last output token had no KV yet
    assert warm.prompt_tokens == len(turn2)
    assert post(engine, "/flush_cache").status_code == 200
    cold = gen(client, turn2, max_new_tokens=12, ignore_eos=True, temperature=0)
    assert cold.cached_tokens == 0
    assert cold.output_ids == warm.output_ids
    assert cold.output_logprobs == pytest.approx(warm.output_logprobs, abs=1e-4)
    # a request sharing only part of a cached sequence reuses that part and leaves the entry in place
    branch = context[:150] + [1, 2, 3]
    assert gen(client, branch, max_new_tokens=2).cached_tokens == 150
    assert gen(client, context[:150] + [4], max_new_tokens=2).cached_tokens == 150


def test_rollouts_started_together_compute_a_shared_prefix_once(engine, client, model):
    """A group's rollouts arrive together with the same system prompt: the first prefills it, the others copy its
    KV while it is still running (not only from the LRU of finished ones), and their logprobs stay the model's."""
    post(engine, "/flush_cache")
    system = [(11 * i + 3) % 256 for i in range(1100)]  # > 2 prefill chunks
    prompts = [system + [10, 97 + k, 98, 99] for k in range(3)]

    async def group():
        return await asyncio.gather(*(client.generate(p, SamplingParams(max_new_tokens=40, ignore_eos=True, seed=k))
                                      for k, p in enumerate(prompts)))

    results = asyncio.run(group())
    assert sorted(r.cached_tokens for r in results) == [0] + [len(system) + 1] * 2  # "\n" too
    for prompt, res in zip(prompts, results, strict=True):
        ref = recomputed_logprobs(model, prompt, res.output_ids)
        assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64), ref, atol=1e-4)
    info = httpx.get(engine["url"] + "/get_server_info").json()["internal_states"][0]
    assert 0 < info["prefix_cache_bytes"] <= info["prefix_cache_max_bytes"]


def test_update_weights_from_disk(engine, client, models):
    m0, m1 = models
    before = gen(client, PROMPT, max_new_tokens=16, ignore_eos=True, temperature=0)
    assert before.weight_version == 0
    msg = client.update_weights_from_disk(str(m1), weight_version=1)
    assert "Weight version updated to 1" in msg
    after = gen(client, PROMPT, max_new_tokens=16, ignore_eos=True, temperature=0)
    assert after.weight_version == 1 and after.output_ids != before.output_ids
    assert client.model_info()["weight_version"] == "1"
    with pytest.raises(EngineError, match="update_weights_from_disk.*400.*Failed to update weights"):
        client.update_weights_from_disk(str(m1 / "missing"), weight_version=9)
    raw = post(engine, "/update_weights_from_disk", {"model_path": str(m1 / "missing")})
    assert raw.status_code == 400 and raw.json()["success"] is False and "message" in raw.json()
    client.update_weights_from_disk(str(m0), weight_version=2, abort_all_requests=True)
    again = gen(client, PROMPT, max_new_tokens=16, ignore_eos=True, temperature=0)
    assert again.weight_version == 2 and again.output_ids == before.output_ids


def test_update_waits_for_running_requests_or_aborts_them(client, models):
    async def scenario(abort: bool):
        task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=1000, ignore_eos=True)))
        await until_decoding(client)
        version = 3 if abort else 4
        await asyncio.to_thread(client.update_weights_from_disk, str(models[0]), version, abort)
        return await task

    waited = asyncio.run(scenario(False))  # SGLang's writer lock: the running request finishes on the old weights
    assert waited.finish_reason == "length" and waited.weight_version == 2
    aborted = asyncio.run(scenario(True))
    assert aborted.finish_reason == "abort"
    assert client.model_info()["weight_version"] == "3"


def test_release_and_resume_memory(engine, client):
    before = gen(client, PROMPT, max_new_tokens=8, ignore_eos=True, temperature=0)
    client.release_memory()
    info = httpx.get(engine["url"] + "/get_server_info").json()
    assert info["memory_released"] == ["kv_cache", "weights"]
    with pytest.raises(EngineUnavailable, match="503.*released"):
        gen(client, PROMPT, max_new_tokens=8)
    assert httpx.get(engine["url"] + "/health_generate").status_code == 503
    assert client.health()  # the process is up; only generation needs the memory
    client.resume_memory()
    after = gen(client, PROMPT, max_new_tokens=8, ignore_eos=True, temperature=0)
    assert after.output_ids == before.output_ids and after.cached_tokens == 0  # KV was dropped
    client.release_memory(tags=["kv_cache"])
    with pytest.raises(EngineUnavailable):
        gen(client, PROMPT, max_new_tokens=2)
    client.resume_memory(tags=["kv_cache"])

    async def busy_release():  # SGLang requires an idle engine
        task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=2000, ignore_eos=True)))
        await until_decoding(client)
        with pytest.raises(EngineError, match="idle"):
            await asyncio.to_thread(client.release_memory)
        await asyncio.to_thread(client.abort, None, True)
        return await task

    assert asyncio.run(busy_release()).finish_reason == "abort"
    assert gen(client, PROMPT, max_new_tokens=2).finish_reason == "length"


def test_pause_and_continue_generation(client, models):
    async def scenario():
        running = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=3000, ignore_eos=True)))
        await until_decoding(client)
        await asyncio.to_thread(client.pause_generation, "abort")
        aborted = await asyncio.wait_for(running, 10)
        held = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True)))
        await asyncio.sleep(0.3)
        assert not held.done()  # new requests wait while paused
        await asyncio.to_thread(client.continue_generation)
        return aborted, await asyncio.wait_for(held, 10)

    aborted, held = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and len(held.output_ids) == 8

    async def in_place():  # frozen requests keep their KV and continue, here on weights updated meanwhile
        frozen = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=1200, ignore_eos=True)))
        await until_decoding(client)
        await asyncio.to_thread(client.pause_generation, "in_place")
        await asyncio.to_thread(client.update_weights_from_disk, str(models[0]), 5)
        await asyncio.sleep(0.2)
        assert not frozen.done()
        await asyncio.to_thread(client.continue_generation)
        return await asyncio.wait_for(frozen, 20)

    res = asyncio.run(in_place())
    assert res.finish_reason == "length" and res.weight_version == 5


def test_release_with_abort_first(client):
    async def scenario():
        running = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=3000, ignore_eos=True)))
        await until_decoding(client)
        await asyncio.to_thread(client.release_memory, None, True)
        result = await asyncio.wait_for(running, 10)
        with pytest.raises(EngineUnavailable):
            await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
        await asyncio.to_thread(client.resume_memory)  # resumes and continues generation
        return result, await client.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))

    aborted, after = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 3000
    assert after.finish_reason == "length" and len(after.output_ids) == 4


@pytest.mark.parametrize("body, fragment", [
    (b'{"input_ids": [1, 2', "malformed JSON"),
    (b"[1, 2, 3]", "JSON object"),
    ({"input_ids": "hello"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids.1: Input should be a valid integer"),
    ({"input_ids": [[1, 2], [3]]}, "batched"),
    ({"input_ids": [1, 320]}, "vocabulary"),
    ({"input_ids": [1, -1]}, "vocabulary"),
    ({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}}, "maximum context length of 4096"),
    ({"input_ids": [1] * 5000}, "longer than the model's context length"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": "x"}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"max_new_token": 5}}, "sampling_params.max_new_token: unknown field"),
    ({"input_ids": [1], "stream": True}, "not supported"),
    ({"input_ids": [1], "return_logprobs": True}, "return_logprobs: unknown field"),
    ({"input_ids": [1], "rid": 7}, "rid"),
])
def test_bad_requests_are_400_and_the_server_keeps_serving(engine, body, fragment):
    r = post(engine, "/generate", content=body) if isinstance(body, bytes) else post(engine, "/generate", body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    ok = post(engine, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200


def test_bad_control_requests(engine, client):
    assert post(engine, "/update_weights_from_disk", {"weight_version": "1"}).status_code == 400
    assert post(engine, "/release_memory_occupation", {"tags": ["gpu"]}).status_code == 400
    assert post(engine, "/abort_request", content=b"{oops").status_code == 400
    with pytest.raises(EngineError, match="400"):
        asyncio.run(client.generate([999], SamplingParams()))
    assert client.health()


def test_duplicate_rid_is_refused(client):
    async def scenario():
        first = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_new_tokens=1500, ignore_eos=True),
                                                    rid="dup"))
        await until_decoding(client)
        with pytest.raises(EngineError, match="Duplicate request ID"):
            await client.generate(PROMPT, SamplingParams(max_new_tokens=2), rid="dup")
        await asyncio.to_thread(client.abort, "dup")
        return await first

    assert asyncio.run(scenario()).finish_reason == "abort"


def test_client_against_a_dead_address():
    dead = EngineClient("http://127.0.0.1:9", timeout_s=2)
    assert not dead.health()
    with pytest.raises(EngineUnavailable) as err:
        asyncio.run(dead.generate([1], SamplingParams(max_new_tokens=1)))
    assert isinstance(err.value, GyreError) and "\n" not in str(err.value) and "127.0.0.1:9" in str(err.value)
    with pytest.raises(EngineUnavailable, match="not ready"):
        dead.wait_ready(timeout_s=0.3)
    with pytest.raises(ValueError):
        dead.abort()


def test_client_helpers(client):
    assert parse_weight_version("12") == 12 and parse_weight_version(3) == 3
    assert parse_weight_version("default") is None and parse_weight_version(None) is None
    client.wait_ready(timeout_s=5)
    body = client.generate_call([1, 2], SamplingParams(max_new_tokens=3, stop=("x",), seed=1), rid="r").body
    assert body == {"input_ids": [1, 2], "return_logprob": True, "stream": False, "rid": "r",
                    "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                        "stop": ["x"], "sampling_seed": 1}}


def test_sigterm_stops_the_engine(models, tmp_path):
    ready = tmp_path / "ready.json"
    proc = spawn(gyre_argv("engine", "--model-path", str(models[0]), "--ready-file", str(ready)), cwd=REPO)
    try:
        assert EngineClient(wait_ready_file(ready, proc, what="the engine", timeout_s=60)["url"]).health()
        proc.terminate()
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_engine_outlives_no_parent_killed_hard(models, tmp_path):
    """A node agent starts its engine from a job thread (no parent-death signal): --exit-with-parent makes the
    engine stop when the agent is killed with -9, holding a connection open, so no orphan keeps the CPU."""
    ready = tmp_path / "ready.json"
    starter = ("import os, subprocess, sys, time; subprocess.Popen(sys.argv[1:] + [str(os.getpid())]); "
               "time.sleep(float(os.environ['HOLD_S']))")
    engine = gyre_argv("engine", "--model-path", str(models[0]), "--ready-file", str(ready), "--parent-pid")
    gone = spawn([sys.executable, "-c", starter, *engine], env={**os.environ, "HOLD_S": "0"}, cwd=REPO)
    gone.wait()  # a parent that died while its engine was still starting (loading torch and the model)
    assert gone.returncode == 0
    wait_until(lambda: ready.is_file() or not _engines_of(gone.pid), what="the early orphan", timeout_s=60)
    wait_until(lambda: not _engines_of(gone.pid), what="the early orphan to stop", timeout_s=30)
    ready.unlink(missing_ok=True)
    parent = spawn([sys.executable, "-c", starter, *engine], env={**os.environ, "HOLD_S": "600"}, cwd=REPO)
    try:
        info = wait_until(lambda: read_ready_file(ready), what="the engine", timeout_s=60, procs=parent)
        held = httpx.Client(base_url=info["url"])  # a keep-alive connection, as the proxy holds one
        assert held.get("/health").status_code == 200
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(info["pid"]), what="the orphaned engine to stop", timeout_s=30)
        held.close()
    finally:
        if parent.poll() is None:
            parent.kill()
        pid = (read_ready_file(ready) or {}).get("pid")
        if pid is not None and alive(pid):  # the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


def _engines_of(parent: int) -> list[int]:
    """Engines started with --parent-pid parent that still run."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        mine = b"--parent-pid" in argv and argv[argv.index(b"--parent-pid") + 1] == str(parent).encode()
        if b"engine" in argv and mine and alive(int(d.name)):
            out.append(int(d.name))
    return out


def test_missing_model_is_a_one_line_error(tmp_path):
    r = subprocess.run(gyre_argv("engine", "--model-path", str(tmp_path)), cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={**os.environ})
    assert r.returncode == 1 and r.stderr.startswith("error: cannot load model") and r.stderr.count("\n") == 1


# --- SGLang launch (argv only: SGLang does not run here) ------------------------------------------------------------

def test_sglang_launch_argv():
    argv = sglang_launch_argv("/ckpt/v3", "0.0.0.0", 30001, tp_size=4, mem_fraction=0.8,
                              extra={"context_length": 65536, "--random-seed": 1, "cuda_graph_bs": [1, 2, 4],
                                     "disable_radix_cache": True, "weight_version": "7"}, python="python3")
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    flags = argv[3:]

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert value("--model-path") == "/ckpt/v3" and value("--host") == "0.0.0.0" and value("--port") == "30001"
    assert value("--tp-size") == "4" and value("--mem-fraction-static") == "0.8"
    assert value("--context-length") == "65536" and value("--random-seed") == "1"
    assert value("--weight-version") == "7" and flags.count("--weight-version") == 1
    assert "--enable-memory-saver" in flags and "--disable-radix-cache" in flags
    assert flags[flags.index("--cuda-graph-bs") + 1 : flags.index("--cuda-graph-bs") + 4] == ["1", "2", "4"]
    default = sglang_launch_argv("/m", "127.0.0.1", 30000, 1, 0.85, {})
    assert default[default.index("--weight-version") + 1] == "0"
    off = sglang_launch_argv("/m", "127.0.0.1", 30000, 1, 0.85, {"enable_memory_saver": False})
    assert "--enable-memory-saver" not in off
    with pytest.raises(ValueError):
        sglang_launch_argv("/m", "h", 1, tp_size=0, mem_fraction=0.5, extra={})
    assert sglang_launch_env() == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
