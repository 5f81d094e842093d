"""The run configuration: YAML validated by typed pydantic models.

Every field has a type, a unit in its name or doc where it has one, a default where one is sensible, and a
one-line doc (the `description`), which `gyre config-doc` renders into docs/config.md.
A bad config fails in `load_config`, before any process starts, with one message naming the field.
Relative paths are taken from the current working directory (where `gyre` / `sbatch` is run).
"""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from gyre_slurm.config_eval import EvalSection, Section, TrackingSection, check_suite
from gyre_slurm.config_harness import HarnessSection
from gyre_slurm.errors import ConfigError
from gyre_slurm.parallel_sizes import PARALLEL_FIELDS, check_parallel
from gyre_slurm.sglang_gpus import push_gpu, sglang_flags, sglang_node_gpus

_Section = Section


class RunSection(_Section):
    name: str = Field(description="Run name; the run id is the name plus a timestamp or the Slurm job id.")
    id: str | None = Field(
        None, description="Fixed run id: starting the config again resumes that run from its ledger (e.g. the same "
                          "sbatch command after a scancel); null = a new id each start (GYRE_RUN_ID overrides both)."
    )
    state_dir: Path = Field(Path("state"), description="Folder under which each run writes state/<run>/.")
    seed: int = Field(0, ge=0, description="Seed for every random choice the run makes.")
    max_wall_s: float | None = Field(
        None, gt=0, description="Stop the run after this many seconds of wall time (s); null = no limit."
    )
    degrade_after_infra_errors: int = Field(
        32, ge=0, description="The run is DEGRADED (admits only a probe group now and then) when this many "
                              "finished runs in a row were infrastructure errors; 0 = never.")
    degrade_after_dropped_groups: int = Field(
        10, ge=0, description="Likewise when this many groups in a row were dropped (all runs scored alike); 0 = "
                              "never. Past 10·B dropped groups between two steps the run stops FAILED.")
    degraded_probe_s: float = Field(30.0, gt=0, description="While DEGRADED: one probe group every this many "
                                                            "seconds; the first good outcome makes it RUNNING.")

    @field_validator("name", "id")
    @classmethod
    def _name_is_a_path_part(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError("must be 1-64 characters of letters, digits, '_', '.', '-'")
        return v


class ClusterSection(_Section):
    cells: int = Field(2, ge=1, description="Number of identical cells the GPUs are split into.")
    nodes_per_cell: int = Field(1, ge=1, description="Nodes in one cell; one node agent runs per node.")
    gpus_per_cell: int = Field(0, ge=0, description="GPUs in one cell (0 = CPU-only cells, the embedded default).")
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of one GPU (GiB), for the memory plan: `gyre check`, `gyre layout` and a "
        "run's start refuse a config whose trainer rank or SGLang engine does not fit in it (docs/memory.md)."
    )
    core_cell: int = Field(0, ge=0, description="The cell that keeps reference weights and optimizer state.")
    initial_role: Literal["ROLLOUT", "TRAIN"] = Field("ROLLOUT", description="Role every cell starts in.")
    rollouts_per_cell: int = Field(32, ge=1, description="Concurrent agent runs one ROLLOUT cell serves (k).")
    engine: Literal["embedded", "sglang", "none"] = Field(
        "embedded", description="Rollout engine of a cell: embedded (torch, SGLang routes), sglang (a real SGLang "
        "server on the cell's nodes, see sglang.*) or none (control only)."
    )

    @model_validator(mode="after")
    def _core_in_range(self) -> ClusterSection:
        if self.core_cell >= self.cells:
            raise ValueError(f"core_cell must be < cells ({self.cells}), got {self.core_cell}")
        if self.gpus_per_cell % self.nodes_per_cell:
            raise ValueError(f"gpus_per_cell ({self.gpus_per_cell}) must be divisible by nodes_per_cell "
                             f"({self.nodes_per_cell}): every node of a cell has as many GPUs")
        return self

    @property
    def nodes(self) -> int:
        return self.cells * self.nodes_per_cell

    @property
    def gpus_per_node(self) -> int:
        return self.gpus_per_cell // self.nodes_per_cell


class ControlSection(_Section):
    bind_host: str = Field("127.0.0.1", description="Address the daemon's ZeroMQ socket binds (0.0.0.0 on clusters).")
    advertise_host: str | None = Field(
        None, description="Host name peers use to reach the daemon; null = this machine's host name."
    )
    port: int = Field(0, ge=0, le=65535, description="Daemon TCP port; 0 = pick a free one (kept across restarts).")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="How often an agent sends a heartbeat (s).")
    heartbeat_timeout_s: float = Field(5.0, gt=0, description="Silence after which a cell is marked DOWN (s).")
    switch_timeout_s: float = Field(300.0, gt=0, description="A role switch not finished within this fails (s).")
    request_timeout_s: float = Field(10.0, gt=0, description="How long the CLI waits for the daemon to answer (s).")
    hang_timeout_s: float = Field(300.0, ge=0, description="A process hung this long is restarted (s; 0: never).")
    encrypt: bool = Field(False, description="CURVE-encrypt the daemon's channel (keys in control.json); only the "
                                             "run's peers complete the handshake. Use it on a shared network.")

    @model_validator(mode="after")
    def _timeout_above_interval(self) -> ControlSection:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        return self

    def advertised(self) -> str:
        return self.advertise_host or socket.gethostname()

    def reachable(self, bound_host: str) -> str:
        """The host peers use for a socket this node bound at `bound_host` (an engine, a gradient receiver)."""
        return self.advertised() if bound_host == "0.0.0.0" else bound_host


class LedgerSection(_Section):
    flush_interval_s: float = Field(0.05, gt=0, le=10, description="Longest a write waits in the batch (s).")
    max_batch_rows: int = Field(20_000, ge=1, description="Rows that force a flush of the write batch.")


POLICIES = ("colocate", "async", "elastic")  # docs/algorithms.md §5.1; scheduler/ holds each as a pure object


class SchedulerSection(_Section):
    policy: Literal["colocate", "async", "elastic"] = Field(
        "colocate", description="Scheduling policy: colocate (every cell rolls out, then every cell trains), async (a "
                                "fixed split: train_cells train while the rest roll out) or elastic (cells move to "
                                "training one at a time while the rest can serve every queued and running run)."
    )
    max_staleness: int = Field(
        1, ge=0, description="η: no run is trained more than η versions after the version it was admitted at "
                             "(async, elastic; colocate is always 0). 0 makes elastic behave as colocate."
    )
    train_cells: int = Field(1, ge=1, description="async: cells that train (the core first); the rest roll out.")
    max_train_cells: int | None = Field(
        None, ge=1, description="elastic: most cells in TRAIN at once (the core and its satellites); null = all "
        "(1 with train.satellites: false: a cell in TRAIN besides the core would only idle there)."
    )
    release: Literal["migrate", "drain"] = Field(
        "migrate", description="How a rollout cell leaves for training: migrate (its runs' calls continue on another "
                               "cell from their exact ids) or drain (no new runs; it switches when its runs end)."
    )

    @field_validator("policy", mode="before")
    @classmethod
    def _known(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in POLICIES:
            raise ValueError(f"unknown policy (available: {', '.join(POLICIES)})")
        return v


class ModelSection(_Section):
    path: Path | None = Field(
        None, description="Checkpoint folder (Hugging Face format); null = the built-in model (model.builtin)."
    )
    builtin: Literal["tiny", "long"] = Field(
        "tiny", description="The built-in model when path is null: tiny (byte tokens, 4,096-token context, the "
        "reference harness) or long (the real Qwen3 tokenizer and chat template, 65,536-token context, for Claude "
        "Code and Codex). Both are Qwen3-architecture, made and warmed up locally, cached in state/models/."
    )
    seed: int = Field(0, ge=0, description="Seed of the built-in model's initialisation and warm-up.")
    warmup_steps: int = Field(150, ge=0, description="Supervised warm-up steps of the built-in model.")
    warmup_demos: int = Field(
        12, ge=1, description="long: demonstrations recorded by running the run's harness (harness.preset) on "
        "built-in tasks against a scripted proxy, in its own conversation format, for the warm-up."
    )

    @field_validator("path")
    @classmethod
    def _exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_dir():
            raise ValueError(f"no such folder: {v}")
        return v


class TasksSection(_Section):
    suite: str = Field("builtin:digits", description="Task suite: builtin:<name>, harbor:<folder of Harbor tasks> "
                       "or a JSONL file of tasks.")
    group_size: int = Field(16, ge=2, description="Runs per task in one group (G); advantages are within a group.")
    groups_per_step: int = Field(2, ge=1, description="Valid groups trained per step (B).")

    @field_validator("suite")
    @classmethod
    def _suite_exists(cls, v: str) -> str:
        return check_suite(v)


class TrainSection(_Section):
    steps: int = Field(20, ge=1, description="Training steps of the run; the run stops after the last one.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up: optimizer step n (from 1) takes lr·n/lr_warmup_steps "
        "until n reaches it (AdamW's first steps move every weight by about lr, whatever the gradient). Counted by "
        "the core's optimizer state, so a resumed run goes on where it was. 0 = none."
    )
    embedding_lr: float | None = Field(
        None, gt=0, description="AdamW learning rate of the token embeddings (with a tied output head); null = lr. "
        "Torch backend only. The CLI configs set it above lr (docs/benchmarks.md).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    micro_batch_tokens: int = Field(8192, ge=64, description="Tokens per micro-batch (padded) in one forward.")
    eps_low: float = Field(3e-4, gt=0, description="GSPO clip range below 1 (the paper: 3e-4).")
    eps_high: float = Field(4e-4, gt=0, description="GSPO clip range above 1 (the paper: 4e-4).")
    kl_coef: float = Field(0.0, ge=0, description="β of a KL anchor to version 0 (k3 per trained token, averaged per "
                           "run like the loss; the trainer keeps a frozen copy of version 0). 0 = none (the paper); "
                           "torch backend only.")
    max_paths_per_run: int | None = Field(
        5, ge=1, description="Jmax: trajectory paths trained per run (by branch kind, then new targets); null = all."
    )
    max_targets_per_run: int | None = Field(
        None, ge=1, description="Most trained tokens per run (the rest stay context); null = no limit."
    )
    mode: Literal["bypass", "decoupled"] = Field(
        "bypass", description="GSPO's old policy: the proxy's behaviour log-probs (bypass) or a proximal forward."
    )
    shard_runs: int = Field(
        2, ge=1, description="Runs per shard of a step (whole runs, balanced by tokens): the core and satellites "
        "each take a shard at a time, and a cell that leaves loses at most its shard."
    )
    satellites: bool = Field(
        True, description="Cells in TRAIN besides the core join its steps. false: the core trains alone (on one "
        "CPU machine the cells share its cores, and a satellite only adds a weight load per step)."
    )
    minibatches: int = Field(
        1, ge=1, description="Optimizer mini-batches per rollout batch (docs/algorithms.md §1.5, §6; the paper uses "
        "4). Above 1 a step runs on the core alone (satellites' gradients add up to one optimizer step, not several)."
    )
    streaming: bool | None = Field(
        None, description="Streaming steps (docs/algorithms.md §8): a step opens with its first ready group and trains "
        "each group as it becomes ready, the core and satellites pulling its shards, until B groups are in; then "
        "one optimizer step, equal to training the B groups at once. null = on for async and elastic, off for "
        "colocate (which trains only after its last run) and with minibatches > 1 (π_prox of every mini-batch is "
        "taken at the step's starting weights, before the first group could be trained). At η = 0 a streaming "
        "step still waits for all B groups (the synchronous reference)."
    )
    exclude_truncated: bool = Field(
        False, description="Exclude TRUNCATED_CONTEXT runs (the policy's reply ran into a length limit: the model's "
        "context, or a harness CLI's own output-token limit) instead of scoring them like a timeout from their "
        "workspace."
    )
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="Trainer backend: torch (the Hugging Face model as it is) or megatron (Megatron-Core's "
        "GPTModel, local TE-free layer spec, weights converted from and saved as Hugging Face folders; needs "
        "megatron-core, the `megatron` extra)."
    )
    tensor_parallel: int = Field(
        1, ge=1, strict=True, description="Megatron tensor-parallel size: ranks of a layer's split, inside one node "
        "(it divides the GPUs of a node)."
    )
    pipeline_parallel: int = Field(1, ge=1, strict=True, description="Megatron pipeline-parallel size: stages the "
                                   "layers are cut into.")
    data_parallel: int = Field(
        1, ge=1, strict=True, description="Megatron data-parallel ranks inside one cell (cells also share a step as "
        "core and satellites). Above one rank, tensor_parallel·pipeline_parallel·data_parallel = "
        "cluster.gpus_per_cell (at most 64 CPU ranks when it is 0)."
    )
    expert_parallel: int = Field(
        1, ge=1, strict=True, description="Megatron expert-parallel size (expert_model_parallel_size) for MoE "
        "models: it divides data_parallel and the model's num_experts."
    )
    rank_timeout_s: float = Field(
        600.0, gt=0, description="How long a collective among a multi-rank cell's trainer ranks waits for a peer "
        "before the step fails and the cell's ranks are started again from the last version (a rank killed with -9)."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Megatron backend's training precision: bf16 (Megatron's mixed precision: bf16 weights "
        "and activations, fp32 master weights, main gradients and AdamW state; what GPUs train in, and what lets "
        "attention use the flash kernel), fp32, or auto = bf16 on CUDA, fp32 on the CPU (exact, and bf16 matmuls "
        "are slow there). The torch backend trains in fp32."
    )
    distributed_optimizer: bool = Field(
        True, description="Megatron backend with data_parallel > 1: the fp32 master weights and AdamW moments are "
        "split over the cell's data-parallel replicas (Megatron's distributed optimizer: 1/data_parallel of the "
        "elements each, cut at row starts; experts over their expert-data-parallel replicas), each stepping its share "
        "and sending the updated weights to the others: per parameter 2 B bf16 weight + 4 B fp32 gradient + 12 B / "
        "data_parallel in bf16. false: every replica keeps all of it (18 B). The optimizer state is saved by Hugging "
        "Face tensor name either way, so a cell of any shape resumes from it (docs/cells.md)."
    )
    recompute: Literal["none", "full"] = Field(
        "none", description="Megatron backend's activation recomputation: full = Megatron's full, uniform, one-layer "
        "recompute (each layer keeps only its input for the backward and runs its forward again there: about one "
        "more forward per step, activations of one layer instead of all); none = keep every layer's activations."
    )

    @model_validator(mode="after")
    def _parallel_sizes_need_megatron(self) -> TrainSection:
        sizes = [getattr(self, f) for f in PARALLEL_FIELDS]
        if self.backend != "megatron" and any(n > 1 for n in sizes):
            name = next(f for f, n in zip(PARALLEL_FIELDS, sizes, strict=True) if n > 1)
            raise ValueError(f"train.{name} > 1 needs train.backend: megatron")
        if self.precision == "bf16" and self.backend != "megatron":
            raise ValueError("train.precision: bf16 needs train.backend: megatron (the torch backend trains in fp32)")
        if self.recompute == "full" and self.backend != "megatron":
            raise ValueError("train.recompute: full needs train.backend: megatron (the torch backend keeps every "
                             "activation)")
        for name, on in (("kl_coef > 0", self.kl_coef > 0), ("embedding_lr", self.embedding_lr is not None)):
            if on and self.backend != "torch":
                raise ValueError(f"train.{name} needs train.backend: torch (the megatron trainer has none yet)")
        check_parallel(*sizes)
        return self


class WeightsSection(_Section):
    transport: Literal["mooncake", "file"] = Field(
        "mooncake", description="How a new version reaches rollout engines and satellites: mooncake (the core "
        "publishes it in memory, receivers pull it over the Mooncake Transfer Engine; gradients go back the same "
        "way) or file (each receiver reads the snapshot folder). Never one for the other silently: mooncake fails "
        "at start when the Transfer Engine does not import."
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Transfer Engine transport: tcp (even where "
                                             "InfiniBand adapters are found: MC_FORCE_TCP is set while the engine "
                                             "starts), or rdma on InfiniBand/RoCE.")
    device: str = Field("", description="With protocol rdma: the RDMA devices the Transfer Engine may use, "
                        "comma-separated (e.g. mlx5_0,mlx5_1); empty = every one Mooncake finds.")
    bucket_mb: int = Field(64, ge=1, le=4096, description="Bytes of one transfer bucket (MiB); each bucket "
                           "carries its own digest.")
    verify: bool = Field(False, description="Check every bucket of a version against its SHA-256 digest, which "
                         "travels in the token-authenticated control message: for a fabric you do not trust (the "
                         "Transfer Engine, like RDMA, authenticates nobody). Costs CPU at ~1.5 GiB/s per core; the "
                         "version is checked at both ends either way.")
    engine_update: Literal["auto", "pull", "push", "stage", "disk"] = Field(
        "auto", description="How a rollout engine takes a new version: pull (the engine pulls it from the Transfer "
        "Engine itself, POST /update_weights_from_transfer_engine: the embedded engine only), stage (the cell's node "
        "agent pulls it from the Transfer Engine into host memory, writes it as safetensors into weights.stage_dir "
        "on its node and has its server load that folder, /update_weights_from_disk: no NCCL, no GPU for the agent; "
        "one-node SGLang cells or the embedded engine), push (the agent pushes it from host memory into its server "
        "over /update_weights_from_distributed: NCCL on a GPU the server leaves free, in SGLang's environment; gloo "
        "on CPU), disk (/update_weights_from_disk of the shared snapshot folder); auto = pull for the embedded "
        "engine, stage for one-node SGLang cells and disk for SGLang cells of several nodes under transport "
        "mooncake, disk under file. pull, push and stage need transport mooncake."
    )
    stage_dir: Path = Field(
        Path("/dev/shm/gyre"), description="engine_update: stage: the node-local folder (a RAM disk: /dev/shm holds "
        "up to half the node's memory by default) each version is written to, in <run>/cell<N>/v<version>/; at most "
        "the version served and the one being loaded are kept."
    )

    @model_validator(mode="after")
    def _update_fits_transport(self) -> WeightsSection:
        if self.transport == "file" and self.engine_update in ("pull", "push", "stage"):
            raise ValueError(f"engine_update: {self.engine_update} needs transport: mooncake (with file no "
                             "version is published to pull); use engine_update: disk or auto")
        return self

    def engine_update_for(self, engine: str, nodes_per_cell: int = 1) -> Literal["pull", "push", "stage", "disk"]:
        """engine_update with auto resolved for cluster.engine (embedded or sglang) and the cells' nodes."""
        if self.engine_update != "auto":
            return self.engine_update
        if self.transport == "file":
            return "disk"
        if engine != "sglang":
            return "pull"
        # several nodes: each node's ranks read the files themselves, and only the shared folder is on all nodes
        return "stage" if nodes_per_cell == 1 else "disk"


# flags the node agent sets itself (or through their own sglang.* fields): never in sglang.extra_args
SGLANG_OWN_FLAGS = ("model_path", "model", "host", "port", "tp_size", "tensor_parallel_size", "dp_size",
                    "data_parallel_size", "mem_fraction_static", "enable_memory_saver", "weight_version", "random_seed",
                    "nnodes", "node_rank", "dist_init_addr", "nccl_init_addr")


class SGLangSection(_Section):
    python: str | None = Field(
        None, description="Interpreter that runs `python -m sglang.launch_server` on the cells' nodes (e.g. SGLang's "
        "own venv's bin/python); null = this one, and then SGLang must import here (checked at start)."
    )
    tp_size: int = Field(1, ge=1, description="SGLang --tp-size: tensor-parallel GPUs of a cell's server (across "
                         "its nodes).")
    dp_size: int = Field(1, ge=1, description="SGLang --dp-size: data-parallel replicas inside a cell's server.")
    mem_fraction_static: float = Field(
        0.85, gt=0, lt=1, description="SGLang --mem-fraction-static: GPU memory for weights and KV cache (fraction)."
    )
    port: int = Field(0, ge=0, le=65535, description="HTTP port of a cell's server on its first node; 0 = a free "
                      "one, picked by the node agent at each start.")
    dist_port: int = Field(0, ge=0, le=65535, description="Cells of several nodes: the port of --dist-init-addr on "
                           "the first node; 0 = a free one (the other nodes read it from the run folder).")
    start_timeout_s: float = Field(900.0, gt=0, description="A server not answering /health_generate within this "
                                   "fails its cell's switch to ROLLOUT (s).")
    extra_args: dict[str, Any] = Field(
        default_factory=dict, description="Further launch_server flags, {flag: value} (dashes or underscores; true = a "
        "bare flag, a list repeats values), e.g. {context_length: 65536, attention_backend: fa3}. Not the flags the "
        "agent sets (model path, host, port, parallel sizes, memory saver, weight version, seed, nodes)."
    )

    @field_validator("extra_args")
    @classmethod
    def _not_own_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        own = [k for k in v if k.strip().lstrip("-").replace("-", "_") in SGLANG_OWN_FLAGS]
        if own:
            raise ValueError(f"{', '.join(map(str, own))}: set by the node agent (parallel sizes and memory: "
                             "sglang.tp_size, dp_size, mem_fraction_static, port)")
        return v


class ProxySection(_Section):
    host: str = Field("127.0.0.1", description="Address the TITO proxy listens on (0.0.0.0 on clusters).")
    port: int = Field(0, ge=0, le=65535, description="Proxy TCP port; 0 = pick a free one.")


class SlurmSection(_Section):
    partition: str | None = Field(None, description="Partition to submit to; null = the cluster's default.")
    account: str | None = Field(None, description="Account to charge; null = the user's default.")
    time_limit_min: int = Field(60, ge=1, description="Wall-clock limit of each Slurm job (minutes).")
    cpus_per_task: int = Field(1, ge=1, description="CPUs per node agent / daemon task.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs to request per node (0 = none).")
    mem_gb: float | None = Field(None, gt=0, description="Memory per node (GB); null = the partition's default.")
    python: str | None = Field(
        None, description="Python interpreter the jobs run; null = the one running `gyre submit`."
    )
    extra_args: dict[str, str] = Field(
        default_factory=dict, description="Further sbatch options for submitit, e.g. {constraint: h100}."
    )
    poll_s: float = Field(5.0, gt=0, description="gyre submit: how often the daemon reads its cell jobs' states "
                                                  "from Slurm (s); a job that stops running makes its cell DOWN.")
    max_requeues: int = Field(
        10, ge=0, description="gyre submit: times a daemon or cell job that reaches its time limit requeues itself "
                              "(signalled 90 s before it); preempted jobs always requeue."
    )


class RunConfig(_Section):
    run: RunSection
    cluster: ClusterSection = Field(default_factory=ClusterSection, description="Cells and nodes.")
    control: ControlSection = Field(default_factory=ControlSection, description="Daemon ↔ peers channel.")
    ledger: LedgerSection = Field(default_factory=LedgerSection, description="Run ledger writes.")
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection, description="Cell scheduling.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model.")
    tasks: TasksSection = Field(default_factory=TasksSection, description="Task suite and grouping.")
    harness: HarnessSection = Field(default_factory=HarnessSection, description="Agent runs and their scoring.")
    train: TrainSection = Field(default_factory=TrainSection, description="GSPO training.")
    weights: WeightsSection = Field(default_factory=WeightsSection, description="Weight and gradient transport.")
    sglang: SGLangSection = Field(default_factory=SGLangSection, description="SGLang cells (cluster.engine: sglang).")
    proxy: ProxySection = Field(default_factory=ProxySection, description="TITO proxy.")
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="Slurm submission (gyre submit).")
    eval: EvalSection = Field(default_factory=EvalSection, description="Evaluation on held-out tasks.")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="Experiment tracking.")

    @model_validator(mode="after")
    def _split_fits_the_cells(self) -> RunConfig:
        s, cells = self.scheduler, self.cluster.cells
        if s.policy == "async" and s.train_cells >= cells:
            raise ValueError(f"scheduler.train_cells ({s.train_cells}) must leave a rollout cell: async needs "
                             f"train_cells < cluster.cells ({cells})")
        if s.max_train_cells is not None and s.max_train_cells > cells:
            raise ValueError(f"scheduler.max_train_cells ({s.max_train_cells}) is more than cluster.cells ({cells})")
        if self.train.streaming and s.policy == "colocate":
            raise ValueError("train.streaming: true does not go with scheduler.policy: colocate (colocate trains only "
                             "after the step's last run); use async or elastic, or leave train.streaming unset")
        if self.train.streaming and self.train.minibatches > 1:
            raise ValueError(f"train.streaming: true does not go with train.minibatches: {self.train.minibatches} "
                             "(every mini-batch's π_prox is taken at the step's starting weights, so no group can be "
                             "trained before all have arrived); set one of them back")
        if self.harness.preset != "reference" and self.model.path is None and self.model.builtin == "tiny":
            raise ValueError(f"harness.preset {self.harness.preset} needs a long-context model: the built-in tiny "
                             "model's 4,096-token context is shorter than the CLI's first prompt (set model.builtin: "
                             "long, or model.path)")
        t, c = self.train, self.cluster
        check_parallel(*(getattr(t, f) for f in PARALLEL_FIELDS), gpus_per_cell=c.gpus_per_cell,
                       nodes_per_cell=c.nodes_per_cell)
        if self.cluster.engine == "sglang":
            self._sglang_can_start()
        if self.cluster.engine == "embedded" and self.weights.protocol == "rdma" \
                and self.weights.engine_update_for("embedded") == "pull":
            raise ValueError("weights.engine_update: pull does not go with weights.protocol: rdma (the embedded "
                             "engine's own Transfer Engine speaks tcp, and a peer is reached only over a transport "
                             "both ends installed); use engine_update: push or stage")
        if self.weights.transport == "mooncake" and self.cluster.engine != "none":
            from gyre_slurm.transfer.engine import available

            why = available()
            if why is not None:
                raise ValueError(why)
        return self


    @property
    def streaming(self) -> bool:
        """train.streaming as it applies to this run (its null default resolved)."""
        if self.train.streaming is not None:
            return self.train.streaming
        return self.scheduler.policy != "colocate" and self.train.minibatches == 1

    def _sglang_can_start(self) -> None:
        nodes = self.cluster.nodes_per_cell
        update = self.weights.engine_update_for("sglang", nodes)
        if update == "pull":
            raise ValueError("weights.engine_update: pull is not built for cluster.engine: sglang (SGLang has no "
                             "route that pulls a version from the Transfer Engine); use stage (the node agent "
                             "pulls it and its server loads it from a RAM disk) or disk")
        if update == "stage" and nodes > 1:
            raise ValueError(f"weights.engine_update: stage is for one-node SGLang cells (nodes_per_cell is {nodes}: "
                             "every node's ranks would need the files on their own node); use disk (the shared "
                             "snapshot folder) or auto")
        extra = sglang_flags(self.sglang.extra_args)
        if update == "push" and self.sglang.dp_size > 1 and not extra.get("enable_dp_attention"):
            raise ValueError("weights.engine_update: push with sglang.dp_size > 1 needs enable_dp_attention in "
                             "sglang.extra_args (SGLang's /update_weights_from_distributed refuses dp_size > 1 "
                             "otherwise); or use weights.engine_update: disk")
        if update == "push" and int(extra.get("pp_size") or extra.get("pipeline_parallel_size") or 1) > 1:
            raise ValueError("weights.engine_update: push is not built for a pipeline-parallel SGLang server "
                             "(its weight-update ranks are rank_offset + tp_rank: the stages would collide); use "
                             "weights.engine_update: disk")
        python = self.sglang.python
        if python is None:
            import importlib.util
            import sys

            if importlib.util.find_spec("sglang") is None:
                raise ValueError(f"cluster.engine: sglang, but SGLang does not import in {sys.executable}: install "
                                 "it there, or name the interpreter of its own environment in sglang.python")
        elif shutil.which(python) is None:
            raise ValueError(f"sglang.python: no such interpreter: {python}")
        if update == "push":
            self._sglang_push_fits()

    def _sglang_push_fits(self) -> None:
        """The agent's push rank joins SGLang's NCCL group: it needs a GPU of its own and the same NCCL build."""
        import os
        import sys

        c, sg = self.cluster, self.sglang
        if push_gpu(c.gpus_per_node, sg.tp_size, c.nodes_per_cell, sg.extra_args) is None:
            used = sglang_node_gpus(sg.tp_size, c.nodes_per_cell, sg.extra_args)
            raise ValueError(f"weights.engine_update: push needs a GPU SGLang leaves free on each node (its ranks "
                             f"take GPU {', '.join(map(str, used))} of the node's {c.gpus_per_node}; NCCL refuses two "
                             "ranks on one GPU); use engine_update: stage")
        agent = self.slurm.python or sys.executable
        if sg.python is not None and os.path.abspath(shutil.which(sg.python) or sg.python) != \
                os.path.abspath(shutil.which(agent) or agent):
            raise ValueError(f"weights.engine_update: push needs SGLang in the node agent's environment (sglang.python "
                             f"{sg.python} is not {agent}: NCCL refuses ranks of two builds); use engine_update: stage")


def _format_error(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and not isinstance(e["input"], dict | list):
            msg = f"{msg} (got {e['input']!r})"
        parts.append(f"{where}: {msg}")
    return f"{source}: " + "; ".join(parts)


def parse_config(data: Any, source: str = "config") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(source, e)) from None


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    return parse_config(data, str(p))


def dump_config(cfg: RunConfig) -> dict:
    return cfg.model_dump(mode="json")
