"""KV-cache migration (transfer/kv.py): a call aborted on one engine continues on another from its KV cache,
moved over the Mooncake Transfer Engine (TCP on loopback), instead of computing its prefill again.

Pure packing and the exporter's bounds in process; the rest with real `gyre engine` processes over HTTP, and the
proxy (a real `gyre proxy`, the daemon played by the test) continuing a call across them.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from gyre_slurm import spawn as spawning
from gyre_slurm.engines.client import EngineClient, EngineError, EngineUnavailable, GenerateResult, SamplingParams
from gyre_slurm.model.qwen3 import Qwen3ForCausalLM
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.proxy.keys import make_key
from gyre_slurm.transfer import engine as te
from gyre_slurm.transfer.kv import (
    KVExports,
    KVHandle,
    KVLayout,
    KVMigrationError,
    crc32,
    fetch,
    pack,
    refusal,
    token_digest,
    unpack,
    weights_digest,
)

from .proxy_world import WEIGHT_VERSION, FakeDaemon, ProxyProc, wait_for

pytestmark = pytest.mark.skipif(te.available() is not None, reason="the Mooncake Transfer Engine does not import")

REPO = Path(__file__).resolve().parents[1]
PROMPT = [258, 117, 115, 101, 114, 10, 72, 105, 33, 256, 10, 258, 97, 115, 115, 10] * 8  # 128 tokens
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return create_tiny_model(root / "m0", seed=0), create_tiny_model(root / "m1", seed=1)


@pytest.fixture(scope="module")
def model(models) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(models[0]).eval()


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    """Engines A and B: the same model and weight version, each its own process (two cells)."""
    folder = tmp_path_factory.mktemp("engines")
    procs, urls = [], []
    for name in "ab":
        ready = folder / f"{name}.json"
        procs.append(spawning.spawn(spawning.gyre_argv(
            "engine", "--model-path", str(models[0]), "--port", "0", "--weight-version", str(WEIGHT_VERSION),
            "--ready-file", str(ready)), folder / f"{name}.log", cwd=REPO))
    try:
        for name, proc in zip("ab", procs, strict=True):
            urls.append(spawning.wait_ready_file(folder / f"{name}.json", proc, what="an engine", timeout_s=90,
                                                 log=folder / f"{name}.log")["url"])
        yield [EngineClient(u, timeout_s=60) for u in urls]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)


def state(client: EngineClient) -> dict:
    return httpx.get(client.base_url + "/get_server_info", timeout=10).json()["internal_states"][0]


async def aborted_on(a: EngineClient, min_tokens: int = 6, release: bool = False) -> GenerateResult:
    """A greedy call running on `a`, aborted (with its KV exported) once it has generated min_tokens."""
    start = state(a)["generated_tokens"]
    running = asyncio.create_task(a.generate(PROMPT, SamplingParams(max_new_tokens=3000, **GREEDY), rid="mig"))
    await asyncio.to_thread(wait_for, lambda: state(a)["generated_tokens"] >= start + min_tokens, 20, "tokens")
    if release:
        await asyncio.to_thread(a.release_memory, None, True, True)
    else:
        await asyncio.to_thread(a.abort, "mig", False, True)
    return await asyncio.wait_for(running, 20)


# --- pure packing, the exporter's bounds ----------------------------------------------------------------------
def test_packed_kv_moved_over_the_transfer_engine_gives_the_same_logits(model):
    ids = torch.tensor([PROMPT[:100]])
    with torch.inference_mode():
        cache = model.new_cache(64)  # grown while prefilling: capacity > length, as in the engine
        model(ids[:, :-1], cache)
        layout = KVLayout.of(cache)
        sender, receiver = te.TransferAgent(), te.TransferAgent()
        src = sender.allocate(cache.length * layout.token_bytes)
        pack(cache, cache.length, src)
        handle = KVHandle(id="x", peer=sender.peer, addr=src.data_ptr(), nbytes=src.numel(), tokens=cache.length,
                          token_digest=token_digest(PROMPT[:99]), crc32=crc32(src),
                          layout=layout, weight_version="0", weights_digest=weights_digest(model),
                          expires_at=time.time() + 60)
        moved = unpack(fetch(receiver, handle), layout, handle.tokens)
        for a, b in zip(cache.keys + cache.values, moved.keys + moved.values, strict=True):
            assert torch.equal(a[:, :, :cache.length], b)
        after_import = model(ids[:, -1:], moved)[0, -1]
        fresh = model(ids)[0, -1]
    assert torch.allclose(after_import, fresh, atol=1e-5, rtol=0)
    sender.release(src)
    with pytest.raises(te.TransferError):  # a freed export cannot be read
        fetch(receiver, handle)


def test_exports_are_capped_expire_and_are_released(model):
    with torch.inference_mode():
        cache = model.new_cache(32)
        model(torch.tensor([PROMPT[:32]]), cache)
    per = 32 * KVLayout.of(cache).token_bytes
    exports = KVExports(te.TransferAgent, max_bytes=2 * per, ttl_s=0.5)
    one = exports.export(cache, PROMPT, "0", "w", None)
    two = exports.export(cache, PROMPT, "0", "w", None)
    with pytest.raises(KVMigrationError, match="exceed the cap"):
        exports.export(cache, PROMPT, "0", "w", None)
    assert exports.release(one.id) and not exports.release(one.id)
    assert exports.export(cache, PROMPT, "0", "w", None).tokens == 32  # room again
    reader = te.TransferAgent()
    assert fetch(reader, two).numel() == per  # still there
    wait_for(lambda: exports.held() == 0, 5, "the exports to expire")
    assert exports.bytes == 0 and exports.stats["kv_exports_expired"] == 2 and exports.stats["kv_exports_refused"] == 1
    with pytest.raises(te.TransferError):
        fetch(reader, two)
    exports.close()


def test_refusal_reasons():
    layout = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float32")
    h = KVHandle(id="x", peer="p:1", addr=1, nbytes=10 * layout.token_bytes, tokens=10, crc32=0, layout=layout,
                 token_digest=token_digest(range(10)), weight_version="3", weights_digest="d",
                 expires_at=time.time() + 60)
    ids, room = list(range(12)), 1 << 20
    assert refusal(h, ids, layout, "3", "d", room) is None
    assert "layout differs" in refusal(h, ids, layout.model_copy(update={"dtype": "bfloat16"}), "3", "d", room)
    assert "weight version '3'" in refusal(h, ids, layout, "4", "d", room)
    assert "weights differ" in refusal(h, ids, layout, "3", "e", room)
    assert "expired" in refusal(h, ids, layout, "3", "d", room, now=time.time() + 61)
    assert "do not start with" in refusal(h, [1] + ids[1:], layout, "3", "d", room)
    assert "do not start with" in refusal(h, ids[:9], layout, "3", "d", room)
    assert "no room" in refusal(h, ids, layout, "3", "d", 100)


# --- engines over HTTP ----------------------------------------------------------------------------------------
def test_aborted_call_continues_token_exact_on_another_engine_without_prefill(engines, models):
    a, b = engines
    aborted = asyncio.run(aborted_on(a))
    meta = aborted.meta_info
    assert aborted.finish_reason == "abort" and "kv_handle" in meta, meta.get("kv_export_error")
    kept = aborted.output_ids
    handle = meta["kv_handle"]
    ids = PROMPT + kept
    assert handle["tokens"] == len(ids) - 1  # the last sampled id is not fed yet
    assert handle["layout"] == KVLayout.of(Qwen3ForCausalLM.from_pretrained(models[0]).new_cache(1)).model_dump()
    n_rest = 24

    async def scenario():
        httpx.post(b.base_url + "/flush_cache", timeout=10)
        before = state(b)
        imported = await b.import_kv(handle, ids)
        cont = await b.generate(ids, SamplingParams(max_new_tokens=n_rest, **GREEDY))
        httpx.post(b.base_url + "/flush_cache", timeout=10)
        fresh = await b.generate(ids, SamplingParams(max_new_tokens=n_rest, **GREEDY))  # a full prefill
        httpx.post(b.base_url + "/flush_cache", timeout=10)
        whole = await b.generate(PROMPT, SamplingParams(max_new_tokens=len(kept) + n_rest, **GREEDY))
        return before, imported, cont, fresh, whole

    before, imported, cont, fresh, whole = asyncio.run(scenario())
    assert imported["success"] and imported["imported_tokens"] == len(ids) - 1
    assert cont.cached_tokens == len(ids) - 1  # prefilled only the last kept id
    assert fresh.cached_tokens == 0
    assert kept + cont.output_ids == whole.output_ids  # token-exact with the uninterrupted call
    assert cont.output_ids == fresh.output_ids
    assert torch.allclose(torch.tensor(cont.output_logprobs), torch.tensor(fresh.output_logprobs), atol=1e-5, rtol=0)
    after = state(b)
    assert after["kv_imports"] == before["kv_imports"] + 1
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == 1 + len(ids) + len(PROMPT)
    wait_for(lambda: state(a)["kv_exports_held"] == 0, 10, "the importer to release the export")
    assert state(a)["kv_exports_released"] >= 1 and state(a)["kv_export_bytes"] == 0


def test_exports_outlive_the_release_of_memory(engines):
    """release_memory(abort_first, export_kv), what a cell leaving the rollout pool does: the KV outlives it."""
    a, b = engines
    try:
        aborted = asyncio.run(aborted_on(a, release=True))
        handle = aborted.meta_info["kv_handle"]
        assert state(a)["prefix_cache_entries"] == 0  # the engine's own KV cache is gone
        ids = PROMPT + aborted.output_ids
        res = asyncio.run(b.import_kv(handle, ids))
        assert res["imported_tokens"] == len(ids) - 1
        cont = asyncio.run(b.generate(ids, SamplingParams(max_new_tokens=4, **GREEDY)))
        assert cont.cached_tokens == len(ids) - 1
    finally:
        a.resume_memory()


def test_failed_imports_are_clear_errors_and_leave_the_cache_alone(engines, models):
    a, b = engines
    aborted = asyncio.run(aborted_on(a))
    handle, ids = aborted.meta_info["kv_handle"], PROMPT + aborted.output_ids
    httpx.post(b.base_url + "/flush_cache", timeout=10)

    def refused(h: dict, ids: list[int], cls: type[EngineError], fragment: str) -> None:
        with pytest.raises(cls, match=fragment):
            asyncio.run(b.import_kv(h, ids))
        assert state(b)["prefix_cache_entries"] == 0

    refused(handle, ids[:5] + [0] + ids[6:], EngineError, "do not start with")
    refused({**handle, "expires_at": time.time() - 1}, ids, EngineError, "expired")
    refused({**handle, "peer": "127.0.0.1:1"}, ids, EngineUnavailable, "transfer failed|failed")  # the peer is gone
    refused({**handle, "layout": {**handle["layout"], "kv_heads": 1}}, ids, EngineError, "layout differs")
    httpx.post(b.base_url + "/update_weight_version", json={"new_version": "99"}, timeout=10)
    try:
        refused(handle, ids, EngineError, "weight version")
    finally:
        httpx.post(b.base_url + "/update_weight_version", json={"new_version": str(WEIGHT_VERSION)}, timeout=10)
    b.update_weights_from_disk(str(models[1]), WEIGHT_VERSION)  # other weights under the same label
    try:
        refused(handle, ids, EngineError, "weights differ")
    finally:
        b.update_weights_from_disk(str(models[0]), WEIGHT_VERSION)
    asyncio.run(a.release_kv_export(handle["id"]))  # freed: as after its TTL
    refused(handle, ids, EngineUnavailable, "not registered")
    res = asyncio.run(b.generate(ids, SamplingParams(max_new_tokens=2, **GREEDY)))  # still serves, from scratch
    assert res.cached_tokens == 0 and len(res.output_ids) == 2


def test_export_is_refused_beyond_the_cap(models, tmp_path):
    ready = tmp_path / "c.json"
    proc = spawning.spawn(spawning.gyre_argv("engine", "--model-path", str(models[0]), "--port", "0",
                                             "--ready-file", str(ready), "--kv-export-mb", "0"),
                          tmp_path / "c.log", cwd=REPO)
    try:
        c = EngineClient(spawning.wait_ready_file(ready, proc, what="an engine", timeout_s=90,
                                                  log=tmp_path / "c.log")["url"])
        aborted = asyncio.run(aborted_on(c, 2))
        assert aborted.finish_reason == "abort" and "kv_handle" not in aborted.meta_info
        assert "off" in aborted.meta_info["kv_export_error"]
    finally:
        proc.terminate()
        proc.wait(20)


# --- the proxy ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def proxy_world(engines, models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    daemon = FakeDaemon(run_dir, engines[1].base_url)
    proxy = ProxyProc(run_dir, models[0], run_dir / "proxy.log")
    try:
        proxy.start()
        yield daemon, proxy
    finally:
        proxy.kill(signal.SIGTERM)
        daemon.stop()


def test_proxy_continues_on_the_migrated_kv_or_falls_back(engines, proxy_world, model):
    a, b = engines
    daemon, proxy = proxy_world

    def call(rollout: int, release_a: bool) -> tuple[openai.types.chat.ChatCompletion, dict, dict]:
        daemon.engines[rollout] = [a.base_url, b.base_url]  # then B stays
        c = openai.OpenAI(base_url=proxy.url + "/v1", api_key=make_key(daemon.token, rollout), max_retries=0,
                          timeout=120)
        before, b_before = proxy.health(), state(b)

        async def scenario():
            start = state(a)["generated_tokens"]
            reply = asyncio.create_task(asyncio.to_thread(
                c.chat.completions.create, model="m", messages=[{"role": "user", "content": "go on"}],
                temperature=0, max_tokens=600))
            await asyncio.to_thread(wait_for, lambda: state(a)["generated_tokens"] >= start + 8, 30, "tokens")
            if release_a:  # the cell leaves the rollout pool
                await asyncio.to_thread(a.release_memory, None, True, True)
            return await reply

        try:
            r = asyncio.run(scenario())
        finally:
            if release_a:
                a.resume_memory()
        return r, before, b_before

    r, before, b_before = call(40, True)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 600
    after = proxy.health()
    assert after["continued_generations"] == before["continued_generations"] + 1
    assert after["kv_migrations"] == before["kv_migrations"] + 1
    assert after["kv_migration_fallbacks"] == before["kv_migration_fallbacks"]
    assert state(b)["kv_imports"] == b_before["kv_imports"] + 1
    assert state(b)["cached_tokens"] - b_before["cached_tokens"] >= r.usage.prompt_tokens  # no re-prefill
    wait_for(lambda: len(daemon.calls(40)) == 1, what="the record")
    rec = daemon.calls(40)[0]
    seq = torch.tensor([rec.prompt_ids + rec.output_ids])
    with torch.no_grad():  # each part scored in the context it was sampled in: one whole reply
        logp = torch.log_softmax(model(seq)[0].double(), -1)[len(rec.prompt_ids) - 1:-1]
    want = logp[torch.arange(len(rec.output_ids)), torch.tensor(rec.output_ids)]
    assert torch.allclose(torch.tensor(rec.output_logprobs, dtype=torch.float64), want, atol=1e-4)

    # B now serves another weight version: the KV of A's must not be imported; the call re-prefills and completes
    httpx.post(b.base_url + "/update_weight_version", json={"new_version": str(WEIGHT_VERSION + 1)}, timeout=10)
    try:
        r, before, _ = call(41, True)
    finally:
        httpx.post(b.base_url + "/update_weight_version", json={"new_version": str(WEIGHT_VERSION)}, timeout=10)
    assert r.usage.completion_tokens == 600
    after = proxy.health()
    assert after["kv_migration_fallbacks"] == before["kv_migration_fallbacks"] + 1
    assert after["kv_migrations"] == before["kv_migrations"]
    assert "KV migration failed" in (proxy.run_dir / "proxy.log").read_text()
