"""SGLang rollout cells (cluster.engine: sglang): what the node agent launches on each node of a cell, the config
checks that refuse what is not built, and a contract test where SGLang itself is a stand-in.

SGLang cannot run here (GPU-only; it never goes into the CPU environment). The only fake is SGLang: a wrapper
named as `sglang.python` runs tests/fixtures/sglang_shim.py, which accepts exactly the launcher's flags and becomes
the embedded engine (SGLang's routes) on node rank 0. Everything else — agents, launcher, daemon, proxy, trainer —
is the project's own code in real processes. Where SGLang is importable, its own parser reads the argv too.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gyre_slurm.agent.engine_launch import SGLangLauncher, launcher_for
from gyre_slurm.config import parse_config
from gyre_slurm.engines.client import EngineClient, SamplingParams
from gyre_slurm.engines.sglang import MEMORY_SAVER_FLAG, SEED_FLAG, sglang_launch_argv
from gyre_slurm.errors import ConfigError
from gyre_slurm.protocol import WeightsRef

from .conftest import REPO, embedded_config, q, run_to_the_end

SHIM = REPO / "tests" / "fixtures" / "sglang_shim.py"
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def _shim_python(tmp_path: Path) -> Path:
    """An executable named like SGLang's venv interpreter that runs the stand-in."""
    path = tmp_path / "sglang-venv" / "bin" / "python"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SHIM}" "$@"\n')
    path.chmod(0o755)
    return path


def _cfg(tmp_path: Path, nodes_per_cell: int = 1, **sglang):
    return parse_config({
        "run": {"name": "sg", "state_dir": str(tmp_path / "state"), "seed": 3},
        "cluster": {"cells": 2, "nodes_per_cell": nodes_per_cell, "engine": "sglang"},
        "weights": {"transport": "file"},
        "sglang": {"python": sys.executable, **sglang},
    })


def _flags(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else "--"
            out[a] = True if nxt.startswith("--") else nxt
    return out


def _shim_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("sglang_shim", SHIM)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parser()


W = WeightsRef(version=4, path="/ckpt/v00004")


# --- (a) the launch: argv and environment --------------------------------------------------------------------------

def test_a_one_node_cell_launches_sglang_with_what_the_rl_loop_needs(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, tp_size=2, dp_size=2, mem_fraction_static=0.7, port=31000,
               extra_args={"context_length": 65536, "--attention-backend": "fa3", "disable_radix_cache": True})
    launcher = launcher_for(cfg, tmp_path, node_index=1)  # cell 1
    assert isinstance(launcher, SGLangLauncher) and launcher.runs_here and not launcher.kv_export
    argv, env, locate = launcher._command(W)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    f = _flags(argv[3:])
    assert f == {"--model-path": "/ckpt/v00004", "--host": "127.0.0.1", "--port": "31000", "--tp-size": "2",
                 "--dp-size": "2", "--mem-fraction-static": "0.7", "--enable-memory-saver": True,
                 "--weight-version": "4", "--random-seed": "3001", "--context-length": "65536",
                 "--attention-backend": "fa3", "--disable-radix-cache": True}
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and env["PATH"] == os.environ["PATH"]
    assert locate() == "http://127.0.0.1:31000"
    assert not (tmp_path / "engines").exists()  # a one-node cell publishes no rendezvous


def test_a_two_node_cell_runs_the_server_on_both_nodes_with_the_first_as_rank_0(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, nodes_per_cell=2, tp_size=16)
    first, second = SGLangLauncher(cfg, tmp_path, 2), SGLangLauncher(cfg, tmp_path, 3)  # cell 1's nodes
    assert first.runs_here and second.runs_here
    a_argv, a_env, a_locate = first._command(W)
    b_argv, b_env, _ = second._command(W)  # reads the address the first node published
    a, b = _flags(a_argv[3:]), _flags(b_argv[3:])
    assert a["--nnodes"] == b["--nnodes"] == "2" and (a["--node-rank"], b["--node-rank"]) == ("0", "1")
    host, port = str(a["--dist-init-addr"]).rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0 and b["--dist-init-addr"] == a["--dist-init-addr"]
    assert a["--random-seed"] == b["--random-seed"] == "3002"  # one seed for the cell's ranks
    assert a["--tp-size"] == b["--tp-size"] == "16" and a["--weight-version"] == b["--weight-version"] == "4"
    assert {k: v for k, v in a.items() if k not in ("--node-rank", "--port")} == \
           {k: v for k, v in b.items() if k not in ("--node-rank", "--port")}
    assert a_env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == b_env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert a_locate().startswith("http://127.0.0.1:")
    info = json.loads((tmp_path / "engines" / "cell1-sglang.json").read_text())
    assert info["dist_init_addr"] == a["--dist-init-addr"] and second.current()
    first._command(W)  # the first node starts again: a new address, which the second node's server must follow
    assert not second.current()
    fixed = SGLangLauncher(_cfg(tmp_path, nodes_per_cell=2, dist_port=29500), tmp_path, 0)._command(W)[0]
    assert _flags(fixed)["--dist-init-addr"] == "127.0.0.1:29500"


def test_the_stand_in_accepts_exactly_the_launchers_flags(tmp_path: Path) -> None:
    shim = _shim_parser()
    for nodes in (1, 2):
        argv = SGLangLauncher(_cfg(tmp_path, nodes_per_cell=nodes), tmp_path, 0)._command(W)[0]
        ns = shim.parse_args(argv[3:])
        assert ns.enable_memory_saver and ns.weight_version == "4" and ns.nnodes == nodes
    argv = SGLangLauncher(_cfg(tmp_path), tmp_path, 0)._command(W)[0]
    env = {**os.environ, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    unknown = subprocess.run([sys.executable, str(SHIM), *argv[1:], "--context-length", "8"], env=env,
                             capture_output=True, text=True, timeout=30)
    assert unknown.returncode == 2 and "unrecognized arguments: --context-length" in unknown.stderr
    no_env = subprocess.run([sys.executable, str(SHIM), *argv[1:]], capture_output=True, text=True, timeout=30,
                            env={k: v for k, v in os.environ.items() if k != "SGLANG_RETURN_ORIGINAL_LOGPROB"})
    assert no_env.returncode == 1 and "SGLANG_RETURN_ORIGINAL_LOGPROB" in no_env.stderr


def test_a_transfer_engine_seed_starts_without_the_memory_saver() -> None:
    """SGLang turns its Transfer Engine seed off when --enable-memory-saver is on (server_args.py): a seed starts
    without the saver (so its memory cannot be released), and asking for both is refused in one line."""
    plain = sglang_launch_argv("/ckpt")
    assert MEMORY_SAVER_FLAG in plain and SEED_FLAG not in plain
    for seed in (sglang_launch_argv("/ckpt", weights_seed=True),
                 sglang_launch_argv("/ckpt", extra={SEED_FLAG: True}),
                 sglang_launch_argv("/ckpt", weights_seed=True, extra={"enable_memory_saver": False})):
        assert SEED_FLAG in seed and MEMORY_SAVER_FLAG not in seed
    for extra in ({"enable_memory_saver": True}, {"--enable-memory-saver": True}):
        with pytest.raises(ValueError, match="exclude each other") as e:
            sglang_launch_argv("/ckpt", weights_seed=True, extra=extra)
        assert "\n" not in str(e.value)


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not importable here (GPU-only; never in the CPU venv)")
def test_sglangs_own_parser_reads_the_launch_argv(tmp_path: Path) -> None:
    from sglang.srt.server_args import ServerArgs

    for nodes in (1, 2):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        launcher = SGLangLauncher(_cfg(tmp_path, nodes_per_cell=nodes, tp_size=2, extra_args={"context_length": 4096}),
                                  tmp_path, 0)
        ns = parser.parse_args(launcher._command(W)[0][3:])
        assert (ns.model_path, ns.tp_size, ns.dp_size, ns.nnodes, ns.node_rank) == ("/ckpt/v00004", 2, 1, nodes, 0)
        assert ns.enable_memory_saver and ns.weight_version == "4" and ns.random_seed == 3000
        assert ns.mem_fraction_static == 0.85 and ns.context_length == 4096
        assert (ns.dist_init_addr is not None) == (nodes > 1)


# --- config: what is not built is refused at load, in one line -------------------------------------------------------

def _refusal(tmp_path: Path, **over) -> str:
    data = {"run": {"name": "sg", "state_dir": str(tmp_path)}, "cluster": {"engine": "sglang"},
            "weights": {"transport": "file"}, "sglang": {"python": sys.executable}}
    for k, v in over.items():
        data[k] = v
    with pytest.raises(ConfigError) as e:
        parse_config(data, "sg.yaml")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_the_config_refuses_an_sglang_cell_it_cannot_start(tmp_path: Path) -> None:
    msg = _refusal(tmp_path, weights={"transport": "mooncake", "engine_update": "pull"})
    assert "weights.engine_update: pull is not built for cluster.engine: sglang" in msg and "use stage" in msg
    assert "no such interpreter: /nowhere/python" in _refusal(tmp_path, sglang={"python": "/nowhere/python"})
    msg = _refusal(tmp_path, sglang={"python": sys.executable, "extra_args": {"tp-size": 2, "--port": 1}})
    assert "sglang.extra_args: tp-size, --port: set by the node agent" in msg
    if not HAVE_SGLANG:
        msg = _refusal(tmp_path, sglang={})
        assert f"SGLang does not import in {sys.executable}" in msg and "sglang.python" in msg
    assert parse_config({"run": {"name": "sg", "state_dir": str(tmp_path)}, "cluster": {"engine": "sglang"},
                         "weights": {"transport": "file"},
                         "sglang": {"python": str(_shim_python(tmp_path))}}).cluster.engine == "sglang"


# --- (b) the contract: the agent's launcher and a real run through the stand-in -----------------------------------

@pytest.mark.slow
def test_a_two_node_cell_starts_serves_and_stops_through_the_launcher(tmp_path: Path, warm_model: Path) -> None:
    cfg = parse_config({
        "run": {"name": "sg", "state_dir": str(tmp_path / "state")},
        "cluster": {"cells": 1, "nodes_per_cell": 2, "engine": "sglang"}, "weights": {"transport": "file"},
        "sglang": {"python": str(_shim_python(tmp_path)), "start_timeout_s": 120}})
    run_dir = tmp_path / "run"
    first, second = SGLangLauncher(cfg, run_dir, 0), SGLangLauncher(cfg, run_dir, 1)
    w0 = WeightsRef(version=0, path=str(warm_model))
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(b=second.start(w0)))
    t.start()  # the second node waits for the first one's address
    a = first.start(w0)
    t.join(timeout=120)
    b = got["b"]
    try:
        assert a.url is not None and b.url is None and b.proc.poll() is None
        client = EngineClient(a.url)
        out = asyncio.run(client.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0)))
        assert out.weight_version == 0 and len(out.output_logprobs) == len(out.output_ids) > 0
        client.release_memory(abort_first=True)
        client.resume_memory()
        client.update_weights_from_disk(str(warm_model), 1)
        assert client.model_info()["weight_version"] == "1"
        client.close()
    finally:
        first.stop(a.proc)
        second.stop(b.proc)
    assert a.proc.poll() is not None and b.proc.poll() is not None
    log = (run_dir / "logs" / "engine-1.log").read_text()
    assert "Traceback" not in log


@pytest.mark.slow
# mooncake: each cell's agent pulls every version, stages it on a RAM disk and its server loads it (auto = stage)
@pytest.mark.parametrize("transport", ["file", "mooncake"])
def test_an_rl_run_trains_through_sglang_cells(tmp_path: Path, warm_model: Path, monkeypatch, transport: str) -> None:
    record = tmp_path / "shim.jsonl"
    monkeypatch.setenv("GYRE_SGLANG_SHIM_LOG", str(record))
    path = embedded_config(
        tmp_path, warm_model, "sgrun", cluster={"cells": 2, "engine": "sglang", "rollouts_per_cell": 8},
        weights={"transport": transport}, sglang={"python": str(_shim_python(tmp_path)), "start_timeout_s": 120},
        tasks={"suite": "builtin:sevens", "group_size": 4, "groups_per_step": 1},
        harness={"timeout_s": 30, "concurrency": 8}, train={"steps": 2, "lr": 3e-4})
    db = run_to_the_end(path, "sg1").run_dir
    assert q(db, "SELECT step, status, version_out FROM train_steps ORDER BY step") == [(0, "DONE", 1), (1, "DONE", 2)]
    # both cells served through "SGLang"; after the first step they served version 1, loaded from its folder (file)
    # or from the RAM disk their agent staged it on after it pulled it over the Transfer Engine (mooncake)
    assert {v for (v,) in q(db, "SELECT DISTINCT weight_version FROM model_calls")} >= {0, 1}
    hop = "file"  # /update_weights_from_disk: of the snapshot folder (file) or of the staged one (mooncake)
    transfers = q(db, "SELECT DISTINCT receiver, transport, ok FROM weight_transfers WHERE receiver LIKE 'engine:%'")
    assert {(r, t) for r, t, _ in transfers} >= {("engine:0", hop), ("engine:1", hop)}
    assert {t for _, t, _ in transfers} == {hop} and all(ok for _, _, ok in transfers)
    pulls = set(q(db, "SELECT DISTINCT receiver, transport, ok FROM weight_transfers WHERE receiver LIKE 'agent:%'"))
    assert pulls == (set() if transport == "file" else
                     {(r.replace("engine", "agent"), "mooncake", 1) for r, _, _ in transfers})
    starts = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(starts) == 2  # one server per cell for the whole run: released and resumed, never restarted
    for s in starts:
        assert s["argv"][:2] == ["-m", "sglang.launch_server"] and "--enable-memory-saver" in s["argv"]
