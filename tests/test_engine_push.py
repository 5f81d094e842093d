"""weights.engine_update: push (agent/engine_push.py), with real parts: a WeightLink in this process (the cell's
node agent) pulls each version from a core's publication over the Mooncake Transfer Engine and pushes it into a
running embedded engine (a real process) through /init_weights_update_group and /update_weights_from_distributed
over gloo; what the engine serves is read back over the Transfer Engine, bit for bit. Also: three versions over one
group, the transfer records and their bytes, calls in flight during a push, a restarted engine, a refused push,
and the config's refusals."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from gyre_slurm.agent.weight_link import WeightLink
from gyre_slurm.config import parse_config
from gyre_slurm.engines.client import EngineClient, EngineError, SamplingParams
from gyre_slurm.engines.sglang_weights import load_from_remote_instance
from gyre_slurm.errors import ConfigError, GyreError
from gyre_slurm.model.qwen3 import Qwen3ForCausalLM
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.protocol import WeightsRef
from gyre_slurm.spawn import gyre_argv, spawn, wait_ready_file
from gyre_slurm.transfer.engine import TransferAgent, available
from gyre_slurm.transfer.weights import WeightPublisher
from tests.conftest import until_decoding
from tests.test_engine import PROMPT, REPO, recomputed_logprobs

pytestmark = pytest.mark.skipif(available() is not None, reason=f"Transfer Engine: {available()}")
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """The embedded engine as a process on a fixed port, so a restart answers at the same URL."""

    def __init__(self, model: Path, folder: Path, *flags: str) -> None:
        self.model, self.folder, self.port, self.flags = model, folder, free_port(), flags
        self.proc = None
        self.client: EngineClient | None = None
        self.start()

    def start(self) -> None:
        ready, log = self.folder / "ready.json", self.folder / "engine.log"
        ready.unlink(missing_ok=True)
        self.proc = spawn(gyre_argv("engine", "--model-path", str(self.model), "--port", str(self.port),
                                    "--weight-version", "0", "--seed", "0", "--ready-file", str(ready), *self.flags),
                           log, cwd=REPO)
        try:
            info = wait_ready_file(ready, self.proc, what="the engine", timeout_s=60, log=log)
        except GyreError as exc:
            self.proc.kill()
            pytest.fail(f"{exc}: {log.read_text()}")
        self.url = info["url"]
        self.client = EngineClient(self.url, timeout_s=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("models") / "m0", seed=0)


@pytest.fixture(scope="module")
def engine(base, tmp_path_factory):
    e = Engine(base, tmp_path_factory.mktemp("engine"))
    yield e
    e.stop()


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    """The node agent's side: push mode, 1 MiB buckets (the tiny model, 1.7 MB, takes two)."""
    cfg = parse_config({"run": {"name": "push", "state_dir": str(tmp_path_factory.mktemp("state"))},
                        "cluster": {"cells": 1, "engine": "embedded"},
                        "weights": {"engine_update": "push", "bucket_mb": 1}})
    w = WeightLink(cfg, 0)
    yield w
    w.close()


class Core:
    """What the core does for each version: write its snapshot folder and publish it over the Transfer Engine (its
    own Transfer Engine, as a core in another process has)."""

    def __init__(self, base: Path, root: Path) -> None:
        self.base, self.root = base, root
        self.publisher = WeightPublisher(TransferAgent(), bucket_bytes=256 << 10)
        self.model = Qwen3ForCausalLM.from_pretrained(base)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(version)
        return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in self.model.named_parameters()}

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> WeightsRef:
        folder = self.root / f"v{version:05d}"
        shutil.copytree(self.base, folder)
        save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors")
        return WeightsRef(version=version, path=str(folder), parts=[self.publisher.publish(version, tensors.items())])


@pytest.fixture(scope="module")
def core(base, tmp_path_factory):
    c = Core(base, tmp_path_factory.mktemp("core"))
    yield c
    c.publisher.close()


def served(engine: Engine, base: Path) -> dict[str, torch.Tensor]:
    """The engine's parameters as they are now, pulled over the Transfer Engine."""
    local = Qwen3ForCausalLM.from_pretrained(base)
    load_from_remote_instance(engine.url, local)
    return {n: p.detach().clone() for n, p in local.named_parameters()}


def assert_serves(engine: Engine, base: Path, version: int, tensors: dict[str, torch.Tensor]) -> None:
    got = served(engine, base)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(got[name], t), name
    assert engine.client.model_info()["weight_version"] == str(version)
    res = asyncio.run(engine.client.generate(PROMPT, GREEDY))
    assert res.weight_version == version
    model = Qwen3ForCausalLM.from_pretrained(base)
    model.load_state(tensors)
    assert torch.allclose(torch.tensor(res.output_logprobs, dtype=torch.float64),
                          recomputed_logprobs(model.eval(), PROMPT, res.output_ids), atol=1e-4)


def rows(link: WeightLink) -> list[tuple]:
    return [(t.receiver, t.transport, t.version, t.nbytes, t.ok) for t in link.drain()]


# --- the push path ----------------------------------------------------------------------------------------------

def test_three_versions_are_pushed_over_one_group(engine, link, core, base):
    before = asyncio.run(engine.client.generate(PROMPT, GREEDY))
    assert before.weight_version == 0
    first_sender = None
    for version in (1, 2, 3):
        tensors = core.weights(version)
        link.update_engine(engine.client, core.publish(version, tensors), server=engine.proc)
        assert_serves(engine, base, version, tensors)
        # two hops, each with the whole model's bytes: the Transfer Engine into the agent, gloo into the engine
        assert rows(link) == [("agent:0", "mooncake", version, core.nbytes, True),
                              ("engine:0", "nccl", version, core.nbytes, True)]
        first_sender = first_sender or link._pusher.sender
        assert link._pusher.sender is first_sender  # the group formed at the first push serves them all
    assert link._pusher.groups_formed == 1
    after = asyncio.run(engine.client.generate(PROMPT, GREEDY))
    assert after.output_logprobs != before.output_logprobs


def check_update_during_a_call(engine, link, core, base, transport: str) -> None:
    """Version 4 reaches the engine while a long call decodes: the call comes back aborted with what it sampled (the
    proxy continues it), the next call gets version 4, and the link recorded the pull and the `transport` hop."""
    long = SamplingParams(max_new_tokens=3000, temperature=0, ignore_eos=True)
    tensors = core.weights(4)
    ref = core.publish(4, tensors)

    async def scenario():
        call = asyncio.create_task(engine.client.generate(PROMPT, long, rid="in-flight"))
        await until_decoding(engine.client)
        await asyncio.to_thread(link.update_engine, engine.client, ref, engine.proc)
        return await asyncio.wait_for(call, 60), await engine.client.generate(PROMPT, GREEDY)

    first, second = asyncio.run(scenario())
    assert first.finish_reason == "abort" and 0 < len(first.output_ids) < long.max_new_tokens
    assert first.weight_version == 3 and second.weight_version == 4
    assert_serves(engine, base, 4, tensors)
    assert [r[:3] for r in rows(link)] == [("agent:0", "mooncake", 4), ("engine:0", transport, 4)]


def test_calls_in_flight_come_back_aborted_and_new_ones_get_the_new_version(engine, link, core, base):
    """The push pauses generation in abort mode: a call in flight returns what it sampled (the proxy continues
    it); nothing is sampled while the buckets arrive; after the push the engine serves the new version."""
    check_update_during_a_call(engine, link, core, base, "nccl")


def test_a_refused_push_is_recorded_and_the_engine_keeps_serving_its_version(engine, link, core, base):
    """A version whose last tensor has a wrong shape: the first bucket is loaded, the second refused. The engine
    gets its old version back (from that version's folder) before it serves again; the next push forms a new
    group and succeeds."""
    old = core.weights(4)
    bad = {n: -t for n, t in core.weights(5).items()}
    bad["model.norm.weight"] = torch.ones(129)
    groups = link._pusher.groups_formed
    with pytest.raises(GyreError, match=r"version 5 .*failed.*shape \[129\].*serves version 4"):
        link.update_engine(engine.client, core.publish(5, bad), server=engine.proc)
    got = link.drain()
    assert [(t.receiver, t.transport, t.version, t.ok) for t in got] == [
        ("agent:0", "mooncake", 5, True), ("engine:0", "nccl", 5, False), ("engine:0", "file", 4, True)]
    assert "shape [129]" in got[1].error and got[1].nbytes == 0 and got[2].nbytes > 0
    assert link._pusher.sender is None  # that group is done for
    assert_serves(engine, base, 4, old)  # not a mix: every parameter is version 4's again, and it generates

    tensors = core.weights(6)
    link.update_engine(engine.client, core.publish(6, tensors), server=engine.proc)
    assert_serves(engine, base, 6, tensors)
    assert link._pusher.groups_formed == groups + 1
    assert [r[:3] + (r[4],) for r in rows(link)] == [("agent:0", "mooncake", 6, True), ("engine:0", "nccl", 6, True)]


def test_a_version_without_its_handle_is_refused(engine, link, core):
    ref = core.publish(7, core.weights(7)).model_copy(update={"parts": []})
    with pytest.raises(GyreError, match="without its Transfer Engine handle"):
        link.update_engine(engine.client, ref, server=engine.proc)
    assert rows(link) == [("agent:0", "mooncake", 7, 0, False)]
    assert engine.client.model_info()["weight_version"] == "6"


def test_a_restarted_engine_gets_a_new_group(engine, link, core, base):
    """Killed with -9 and started again at the same address (from the base model, version 0): the agent knows the
    new start by its process and forms a new group; the old one is gone here too."""
    old_sender = link._pusher.sender
    groups = link._pusher.groups_formed
    engine.kill()
    engine.start()
    assert engine.client.model_info()["weight_version"] == "0"
    tensors = core.weights(8)
    link.update_engine(engine.client, core.publish(8, tensors), server=engine.proc)
    assert_serves(engine, base, 8, tensors)
    assert link._pusher.groups_formed == groups + 1 and link._pusher.sender is not old_sender
    assert old_sender.group is None  # destroyed here
    # the same version again (a resume after a memory release pushes it again): no second pull
    engine.client.release_memory(abort_first=True)
    engine.client.resume_memory()
    link.update_engine(engine.client, WeightsRef(version=8, path=str(core.root / "v00008"),
                                                 parts=[core.publisher.last]), server=engine.proc)
    assert_serves(engine, base, 8, tensors)
    assert [r[:3] for r in rows(link)] == [("agent:0", "mooncake", 8), ("engine:0", "nccl", 8), ("engine:0", "nccl", 8)]


def test_close_destroys_the_group_on_the_engine(engine, base, core, tmp_path):
    cfg = parse_config({"run": {"name": "push", "state_dir": str(tmp_path)}, "cluster": {"engine": "embedded"},
                        "weights": {"engine_update": "push"}})
    w = WeightLink(cfg, 3)
    w.update_engine(engine.client, core.publish(9, core.weights(9)), server=engine.proc)
    name = w._pusher.sender.group_name
    w.close()
    with pytest.raises(EngineError, match=f"no weight update group '{name}'"):
        engine.client.destroy_weights_update_group(name)  # already destroyed by close


@pytest.mark.parametrize("sessions", [True, False], ids=["session-api", "older-build"])
def test_both_sglang_generations_take_the_push(base, core, tmp_path_factory, sessions):
    """An engine of SGLang's session generation (refuses a bare /update_weights_from_distributed) and one of a build
    from before it (--no-weight-sessions: /begin_weight_update answers 404): the push probes which, brackets its
    buckets in a session where there is one and closes it, and either engine serves the version bit for bit."""
    folder = tmp_path_factory.mktemp("generation")
    e = Engine(base, folder, *(() if sessions else ("--no-weight-sessions",)))
    cfg = parse_config({"run": {"name": "gen", "state_dir": str(folder)}, "cluster": {"engine": "embedded"},
                        "weights": {"engine_update": "push", "bucket_mb": 1}})
    w = WeightLink(cfg, 0)
    try:
        for version in (21, 22) if sessions else (23, 24):  # the second: the probe's answer kept, a new session
            tensors = core.weights(version)
            w.update_engine(e.client, core.publish(version, tensors), server=e.proc)
            assert_serves(e, base, version, tensors)
            assert w._pusher.sender.client.weight_sessions is sessions
        end = httpx.post(e.url + "/end_weight_update", json={}, timeout=30)
        assert end.status_code == (400 if sessions else 404), end.text  # no session left open
    finally:
        w.close()
        e.stop()


# --- config ---------------------------------------------------------------------------------------------------------

def _config(tmp_path: Path, **sections):
    return parse_config({"run": {"name": "c", "state_dir": str(tmp_path)}, **sections}, "c.yaml")


def _refused(tmp_path: Path, **sections) -> str:
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, **sections)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_engine_update_resolves_and_refuses_what_cannot_work(tmp_path: Path):
    sglang = {"python": sys.executable}  # an interpreter that exists: _sglang_can_start's own check passes
    for engine, weights, want in [("embedded", {}, "pull"), ("sglang", {}, "stage"),
                                  ("embedded", {"transport": "file"}, "disk"),
                                  ("sglang", {"transport": "file"}, "disk"),
                                  ("embedded", {"engine_update": "push"}, "push"),
                                  ("sglang", {"engine_update": "disk"}, "disk"),
                                  ("embedded", {"engine_update": "disk"}, "disk")]:
        cfg = _config(tmp_path, cluster={"engine": engine}, weights=weights, sglang=sglang)
        assert cfg.weights.engine_update_for(cfg.cluster.engine) == want, (engine, weights)
    # SGLang cells under transport mooncake validate now (the agent stages each version on a RAM disk)
    assert _config(tmp_path, cluster={"engine": "sglang"}, sglang=sglang).weights.transport == "mooncake"
    for update in ("pull", "push"):
        msg = _refused(tmp_path, weights={"transport": "file", "engine_update": update})
        assert f"weights: engine_update: {update} needs transport: mooncake" in msg
    msg = _refused(tmp_path, cluster={"engine": "sglang"}, weights={"engine_update": "pull"}, sglang=sglang)
    assert "weights.engine_update: pull is not built for cluster.engine: sglang" in msg and "use stage" in msg
    push, free = {"engine_update": "push"}, {"engine": "sglang", "gpus_per_cell": 2}  # a GPU left for the agent
    msg = _refused(tmp_path, cluster=free, weights=push, sglang={**sglang, "dp_size": 2})
    assert "push with sglang.dp_size > 1 needs enable_dp_attention" in msg
    assert _config(tmp_path, cluster=free, weights=push,
                   sglang={**sglang, "dp_size": 2, "extra_args": {"enable-dp-attention": True}}).sglang.dp_size == 2
    msg = _refused(tmp_path, cluster=free, weights=push, sglang={**sglang, "extra_args": {"pp_size": 2}})
    assert "not built for a pipeline-parallel SGLang server" in msg
    msg = _refused(tmp_path, weights={"engine_update": "rsync"})
    assert "weights.engine_update" in msg and "'push'" in msg


def test_link_modes_follow_the_config(tmp_path: Path):
    sglang = {"python": sys.executable, "tp_size": 4}
    w = WeightLink(_config(tmp_path, cluster={"engine": "sglang", "gpus_per_cell": 8},
                           weights={"engine_update": "push"}, sglang=sglang), 1)
    assert w.pushes and w._engine_ranks == 4  # world size 1 + tp_size: SGLang's ranks are rank_offset + tp_rank
    assert w._push_gpu == 4  # the first GPU SGLang's ranks (0-3) leave free
    w = WeightLink(_config(tmp_path, cluster={"engine": "sglang"}, sglang=sglang), 1)
    assert not w.pushes and w.engine_update == "stage"
    w = WeightLink(_config(tmp_path, cluster={"engine": "embedded"}), 1)
    assert not w.pushes and w.engine_update == "pull" and w._engine_ranks == 1
