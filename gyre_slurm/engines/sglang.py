"""The argv and environment of a real SGLang server (GPU clusters), for it to behave like the embedded engine.

A cell with `cluster.engine: sglang` runs one: its node agents start `sglang_launch_argv(...)` with
`sglang_launch_env()` (agent/engine_launch.py; every node of the cell runs the server, the first one as node rank 0
serves HTTP) and drive it with `engines.client.EngineClient`, the client the proxy and the agents use for the
embedded engine too, which speaks the SGLang routes below (tested against the embedded engine's SGLang-compatible
routes). SGLang does not install beside the CPU stack (it pins its own CUDA torch): `sglang.python` names the
interpreter of its own environment.

Routes gyre uses (SGLang's native API, python/sglang/srt/entrypoints/http_server.py):

- POST /generate (proxy): {input_ids, sampling_params, return_logprob, rid, stream: false}
  -> {text, output_ids, meta_info{id, finish_reason{type, matched|length|message}, prompt_tokens,
  completion_tokens, cached_tokens, output_token_logprobs [[logprob, token_id, null], ...], weight_version}}
- POST /update_weights_from_disk (node agent): {model_path, weight_version, abort_all_requests, flush_cache}
  -> {success, message, num_paused_requests}; 400 with success false when the load fails
- POST /release_memory_occupation, /resume_memory_occupation (node agent): {tags?: [weights, kv_cache]};
  release needs --enable-memory-saver and an idle server: POST /pause_generation {mode: abort} first (it returns
  every in-flight request as aborted), POST /continue_generation after resuming
- POST /abort_request (agent, proxy): {rid} or {abort_all: true}
- GET /health, /get_model_info (agent): 200 when serving; {model_path, weight_version, ...}
- POST /pause_generation {mode: retract}, then /abort_request {abort_all: true} (agent, sglang_weights.evacuate): a
  cell leaving the pool returns every call with what it sampled; the proxy continues them on another cell
- POST /init_weights_update_group (trainer): {master_address, master_port, rank_offset, world_size, group_name,
  backend: nccl} -> {success, message}; the engine joins a process group whose rank 0 (the trainer) hosts the store
- POST /update_weights_from_distributed (trainer): {names, dtypes, shapes, group_name, flush_cache, weight_version}
  -> {success, message}, answered after rank 0's broadcast of those tensors (sglang_weights.DistributedWeightSender)
- POST /begin_weight_update {selector?}, /end_weight_update {} (trainer, around the buckets of one version): SGLang
  since its session API (managers/scheduler_components/weight_updater.py) refuses /update_weights_from_distributed
  outside a session; older builds 404 here and load directly (EngineClient.begin_weight_update probes which)
- POST /destroy_weights_update_group (trainer): {group_name} -> {success, message}
- GET /remote_instance_transfer_engine_info?rank=R (a new engine): {rank, remote_instance_transfer_engine_info:
  [session_id, {name: [address, numel, element_size]}]}, on a seed started with `weights_seed`

Flags that matter here: `--enable-memory-saver` (release/resume actually free GPU memory; never on a Transfer
Engine seed, which SGLang turns off when the saver is on: server_args.py), `--weight-version`
(SGLang's default label is "default"; gyre starts at "0"), `--random-seed` (reproducible sampling). A new cell can
load its weights from a running one over the Mooncake Transfer Engine instead of from disk (`weights_from`:
`--load-format remote_instance --remote-instance-weight-loader-backend transfer_engine` with the seed's IP and HTTP
port; the send-weights-group ports are the nccl backend's only); the seed must have been started with `weights_seed`
(`--remote-instance-weight-loader-start-seed-via-transfer-engine`, which registers its weights and serves their
addresses from a bootstrap server on `--engine-info-bootstrap-port`, 6789 by default: one per node). Environment:
SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes SGLang return logprobs at temperature 1, as the embedded engine does and as
the trainer computes them (by default SGLang returns log_softmax(logits / temperature)).
"""

from __future__ import annotations

import sys
from typing import Any

SEED_FLAG = "--remote-instance-weight-loader-start-seed-via-transfer-engine"
MEMORY_SAVER_FLAG = "--enable-memory-saver"


def _flag(name: str) -> str:
    name = name.strip()
    return name if name.startswith("--") else "--" + name.replace("_", "-")


def _seed_without_memory_saver(flags: dict[str, Any], extra: dict[str, Any]) -> None:
    """A Transfer Engine seed runs without the memory saver: SGLang turns the seed off when the saver is on
    (python/sglang/srt/server_args.py), and a new cell's remote_instance load then answers 400. So a seed server
    cannot release its memory (its weights and KV cache stay on the GPU while its cell trains). Asking for both is
    refused."""
    if not flags.get(SEED_FLAG):
        return
    if any(_flag(k) == MEMORY_SAVER_FLAG and v not in (None, False) for k, v in extra.items()):
        raise ValueError(f"{MEMORY_SAVER_FLAG} and {SEED_FLAG} (weights_seed) exclude each other: SGLang turns the "
                         "seed off when the memory saver is on")
    flags[MEMORY_SAVER_FLAG] = None


def remote_instance_flags(seed_ip: str, seed_port: int) -> dict[str, Any]:
    """SGLang's flags to load the weights from a running seed over the Transfer Engine (the model path still gives
    the config and tokenizer); the seed's parallelism must be the same."""
    return {"--load-format": "remote_instance", "--remote-instance-weight-loader-backend": "transfer_engine",
            "--remote-instance-weight-loader-seed-instance-ip": seed_ip,
            "--remote-instance-weight-loader-seed-instance-service-port": int(seed_port)}


def sglang_launch_argv(model_path: str, host: str = "127.0.0.1", port: int = 30000, tp_size: int = 1,
                       mem_fraction: float = 0.85, extra: dict[str, Any] | None = None,
                       python: str = sys.executable, *, weights_from: tuple[str, int] | None = None,
                       weights_seed: bool = False, dp_size: int = 1, weight_version: int | str = "0",
                       seed: int | None = None, nnodes: int = 1, node_rank: int = 0,
                       dist_init_addr: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for one rollout cell (one node of it).

    A cell of several nodes: every node runs this with the same `dist_init_addr` ("host:port" on the first node,
    node rank 0, the only one that serves HTTP) and its own `node_rank` < `nnodes`.

    `weights_from` (seed IP, seed HTTP port): load the weights from that running server over the Transfer Engine
    (`remote_instance_flags`). `weights_seed`: register this server's weights with the Transfer Engine, so that
    others can load from it; it starts without --enable-memory-saver (`_seed_without_memory_saver`: its memory
    cannot be released), and ValueError refuses an `extra` that asks for the saver beside it.

    `extra` adds or overrides flags: keys are flag names with or without `--` (underscores become dashes); True
    adds a bare flag, False or None removes the flag, a list repeats values after one flag
    (e.g. {"context_length": 65536, "enable_memory_saver": False, "cuda_graph_bs": [1, 2, 4]}).
    """
    if tp_size < 1 or dp_size < 1:
        raise ValueError(f"tp_size and dp_size must be at least 1, got {tp_size} and {dp_size}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank}")
    if nnodes > 1 and not dist_init_addr:
        raise ValueError("a server on several nodes needs dist_init_addr (host:port of node rank 0)")
    if not 0.0 < mem_fraction < 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1), got {mem_fraction}")
    flags: dict[str, Any] = {
        "--model-path": str(model_path),
        "--host": host,
        "--port": int(port),
        "--tp-size": int(tp_size),
        "--dp-size": int(dp_size),
        "--mem-fraction-static": mem_fraction,
        MEMORY_SAVER_FLAG: True,
        "--weight-version": str(weight_version),
        "--random-seed": None if seed is None else int(seed),
    }
    if nnodes > 1:
        flags.update({"--nnodes": int(nnodes), "--node-rank": int(node_rank), "--dist-init-addr": dist_init_addr})
    if weights_from is not None:
        flags.update(remote_instance_flags(*weights_from))
    if weights_seed:
        flags[SEED_FLAG] = True
    for key, value in (extra or {}).items():
        flags[_flag(key)] = value  # later keys win; a dict keeps the first position of a flag
    _seed_without_memory_saver(flags, extra or {})
    argv = [python, "-m", "sglang.launch_server"]
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(name)
        elif isinstance(value, (list, tuple)):
            argv += [name, *map(str, value)]
        else:
            argv += [name, str(value)]
    return argv


def sglang_launch_env() -> dict[str, str]:
    """Environment additions for the SGLang process (merge into os.environ)."""
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


__all__ = ["MEMORY_SAVER_FLAG", "SEED_FLAG", "remote_instance_flags", "sglang_launch_argv", "sglang_launch_env"]
