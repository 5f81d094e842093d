"""The ZeroMQ wire protocol between the daemon and its peers: node agents, TITO proxies, harness workers, the CLI.

One frame per message: a msgpack map ``{"v": PROTOCOL_VERSION, "token": <run secret>, "msg": {...}}`` where
``msg`` is one of the typed models below, told apart by its ``type`` field. Every peer encodes and decodes
through this module only. A frame that is not msgpack, has the wrong version or token, or whose ``msg`` does
not validate raises ProtocolError with a short code; the daemon answers it with an ``Error`` and carries on.
"""

from __future__ import annotations

import hmac
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgpack
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from gyre_slurm.errors import ProtocolError
from gyre_slurm.roles import TARGET_ROLES, Role
from gyre_slurm.statuses import ROLLOUT_TERMINAL, RolloutStatus
from gyre_slurm.token_arrays import Ids, Logprobs, packed

PROTOCOL_VERSION = 2  # 2: one message class per control request (was Request with op and args)
MAX_FRAME_BYTES = 16 * 1024 * 1024  # also set as ZMQ_MAXMSGSIZE on the daemon's socket


class WireMessage(BaseModel):
    """Base of every message on the wire: unknown fields are refused, a decoded message is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def wire_body(self) -> dict[str, Any]:
        """The map this message is sent as (msgpack-ready)."""
        return self.model_dump(mode="json")


class SwitchReport(WireMessage):
    """How a role switch went on one node; carried by SwitchDone and, after a daemon restart, by Register."""

    switch_id: int
    role: Role
    ok: bool
    started_at: float
    ended_at: float
    error: str | None = None


class WeightsHandle(WireMessage):
    """Where a version lies in the core's memory, for receivers to pull over the Transfer Engine
    (transfer/weights.py): the core's peer, the slot's address, its layout and, when verified, one SHA-256 per
    bucket (weights.verify). It travels only in token-authenticated messages, so a receiver can trust the digests."""

    peer: str = Field(max_length=256)  # "host:rpc_port" of the core's Transfer Engine
    addr: int = Field(ge=0)
    version: int = Field(ge=0)
    nbytes: int = Field(ge=0)  # payload, after the slot's 64-byte header
    bucket_bytes: int = Field(ge=64)
    tensors: list[tuple[str, str, list[int], int, int]]  # name, dtype, shape, offset, bytes
    digests: list[str] | None = None
    # both of the core's slots (this version's among them): a receiver that finds this version replaced takes the
    # newest one there instead (WeightPuller.pull at_least); None: this slot only
    addrs: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=2)
    # a part of a sliced version (transfer/weight_parts.py): sending rank, [tp, pp, dp, ep], per tensor its cut
    rank: int = Field(default=0, ge=0)
    layout: list[Annotated[int, Field(ge=1)]] | None = Field(default=None, min_length=4, max_length=4)
    cuts: list[tuple[int, int, int]] | None = None  # [dim (-1: whole), TP rank, TP size] per tensor


class WeightsRef(WireMessage):
    """A published policy version: a Hugging Face-format folder on the shared file system (always written: engine
    restarts and daemon recovery read it) and, with weights.transport mooncake, the handles receivers pull it by:
    one part per sending rank of the core's cell (a whole-model version is one part without cuts)."""

    version: int = Field(ge=0)
    path: str
    parts: list[WeightsHandle] = Field(default_factory=list, max_length=65536)


class Register(WireMessage):
    type: Literal["register"] = "register"
    node_index: int = Field(ge=0)
    node_name: str
    host: str
    pid: int
    role: Role | None = None  # None: a fresh agent, the daemon tells it which role to take
    slurm_job_id: str | None = None
    last_switch: SwitchReport | None = None
    engine_url: str | None = None  # the node's rollout engine (SGLang-compatible HTTP), when it serves one


class RegisterAck(WireMessage):
    type: Literal["register_ack"] = "register_ack"
    cell: int
    role: Role
    heartbeat_interval_s: float
    weights: WeightsRef | None = None  # the version to serve when the role is ROLLOUT


class Heartbeat(WireMessage):
    type: Literal["heartbeat"] = "heartbeat"
    node_index: int = Field(ge=0)
    cell: int = Field(ge=0)
    role: Role
    seq: int = Field(ge=0)
    rss_mb: float = 0.0
    engine_url: str | None = None


class Reregister(WireMessage):
    """Daemon → agent: I do not know you (e.g. I restarted); send Register with your current role."""

    type: Literal["reregister"] = "reregister"
    reason: str


class SwitchRole(WireMessage):
    type: Literal["switch_role"] = "switch_role"
    switch_id: int
    cell: int
    target: Role
    weights: WeightsRef | None = None  # entering ROLLOUT: serve this version


class SwitchDone(WireMessage):
    type: Literal["switch_done"] = "switch_done"
    node_index: int
    cell: int
    report: SwitchReport


class LoadWeights(WireMessage):
    """Daemon → the agents of a ROLLOUT cell: serve this version from now on (async, elastic: the cells that kept
    rolling out during the step). Calls in flight finish on the version they started with."""

    type: Literal["load_weights"] = "load_weights"
    weights: WeightsRef


class Shutdown(WireMessage):
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


# --- control requests (CLI, launchers → daemon): one class per operation, each answered by a Reply -------------
Op = Literal["ping", "status", "reassign", "release", "shutdown", "add_cells", "cell_jobs", "event", "eval"]
CellId = Annotated[int, Field(strict=True, ge=0)]  # strict: "1" or True is no cell
SlurmJobId = Annotated[str, Field(pattern=r"^[0-9]{1,20}$")]


class ControlRequest(WireMessage):
    """A control request (`op` names it); the daemon answers a Reply with the same req_id, or an Error naming the
    field when it does not validate."""

    op: ClassVar[Op]
    req_id: str = Field(default_factory=lambda: uuid.uuid4().hex, max_length=64)


class PingRequest(ControlRequest):
    op: ClassVar[Op] = "ping"
    type: Literal["ping_request"] = "ping_request"


class StatusRequest(ControlRequest):
    op: ClassVar[Op] = "status"
    type: Literal["status_request"] = "status_request"


class ReassignRequest(ControlRequest):
    """`gyre cells reassign`: move the cell to `role` and pin it there."""

    op: ClassVar[Op] = "reassign"
    type: Literal["reassign_request"] = "reassign_request"
    cell: CellId
    role: Role

    @field_validator("role")
    @classmethod
    def _target(cls, v: Role) -> Role:
        if v not in TARGET_ROLES:
            raise ValueError(f"a cell can be reassigned to ROLLOUT or TRAIN, not {v.value}")
        return v


class ReleaseRequest(ControlRequest):
    """`gyre cells release`: the policy may move the cell again."""

    op: ClassVar[Op] = "release"
    type: Literal["release_request"] = "release_request"
    cell: CellId


class ShutdownRequest(ControlRequest):
    op: ClassVar[Op] = "shutdown"
    type: Literal["shutdown_request"] = "shutdown_request"


class AddCellsRequest(ControlRequest):
    """`gyre cells add`: name n cells for new Slurm jobs."""

    op: ClassVar[Op] = "add_cells"
    type: Literal["add_cells_request"] = "add_cells_request"
    n: int = Field(strict=True, ge=1)


class CellJobsRequest(ControlRequest):
    """The Slurm job just submitted for each cell (gyre submit)."""

    op: ClassVar[Op] = "cell_jobs"
    type: Literal["cell_jobs_request"] = "cell_jobs_request"
    jobs: dict[Annotated[int, Field(ge=0)], SlurmJobId]  # map keys travel as strings


class EventRequest(ControlRequest):
    """A launcher's word for the ledger (the daemon is its one writer)."""

    op: ClassVar[Op] = "event"
    type: Literal["event_request"] = "event_request"
    kind: Literal["process_restarted", "process_stalled", "process_hung"]  # from the supervisors (launch/supervise.py)
    message: str = Field(min_length=1, max_length=1000)


class EvalRequest(ControlRequest):
    """`gyre eval` during the run: evaluate `version` (None: the one served now)."""

    op: ClassVar[Op] = "eval"
    type: Literal["eval_request"] = "eval_request"
    version: Annotated[int, Field(strict=True, ge=0)] | None = None


class Reply(WireMessage):
    type: Literal["reply"] = "reply"
    req_id: str
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None


class Error(WireMessage):
    """Answer to a frame the daemon could not accept; the connection stays usable."""

    type: Literal["error"] = "error"
    code: str
    message: str


# --- training (daemon ↔ the training cells' agents; gradients go core ← satellites directly, never through here) ---
# A step started again by a restarted daemon is a new `attempt` (the daemon's start number): what a training job
# of the old attempt still sends is refused, so it can never take or report a shard of the new one.
class ShardRef(WireMessage):
    shard: int = Field(ge=0)  # index within the step
    path: str  # its batch file


class StepSeal(WireMessage):
    """A sharded step's last groups are in: it has `n_shards` shards (0 … n − 1), and its loss averages over
    `n_valid_runs` runs. Shards carry unnormalised per-run losses (a streaming step's runs are only counted once its
    last group is in): the core scales the gradient sum by 1 / n_valid_runs before its optimizer step."""

    n_shards: int = Field(ge=1)
    n_valid_runs: int = Field(ge=0)


class TrainStep(WireMessage):
    """Daemon → the core: run one optimizer step and publish version_in + 1. With `sharded`, take shards one at a
    time (TakeShard) and add the satellites' gradients until the step is sealed and every shard is in (the
    seal comes here when the step's groups were all ready at its start, else with a later answer to
    TakeShard: a streaming step); without, train the whole batch file here."""

    type: Literal["train_step"] = "train_step"
    step: int = Field(ge=0)
    version_in: int = Field(ge=0)
    batch_path: str  # the whole batch (a streaming step writes it when sealed)
    out_dir: str  # write the new weights here (a Hugging Face-format folder)
    attempt: int = Field(0, ge=0)
    shards: list[ShardRef] = Field(default_factory=list)  # the shards queued so far
    sharded: bool = False
    seal: StepSeal | None = None


class TrainDone(WireMessage):
    type: Literal["train_done"] = "train_done"
    step: int
    ok: bool
    weights: WeightsRef | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    error: str | None = None
    attempt: int = 0
    retry: bool = False  # failed for a reason that running it again mends (the core's trainer lost a rank)


class StepOpen(WireMessage):
    """Core → daemon: the step runs; satellites send their gradients to `grad_endpoint` (the core's receiver)."""

    type: Literal["step_open"] = "step_open"
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    grad_endpoint: str
    weights: WeightsRef | None = None  # version_in as the core published it (satellites pull it by its handle)
    grad_endpoints: list[str] = Field(default_factory=list, max_length=65536)  # every core rank's receiver, by rank


class Transfer(WireMessage):
    """One receiver's account of one weight transfer (a weight_transfers row)."""

    transport: Literal["mooncake", "file", "nccl", "remote_instance"]
    version: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    receiver: str = Field(max_length=64)  # engine:<cell>, satellite:<cell>
    ok: bool = True
    error: str | None = Field(default=None, max_length=2000)
    asked: int | None = Field(default=None, ge=0)  # set when `version` (the one received) is newer: it was replaced
    sender_rank: int | None = Field(default=None, ge=0)  # the core's rank whose part this was (sliced versions)


class WeightsReceived(WireMessage):
    """Agent → daemon: the weight transfers this node made since its last report."""

    type: Literal["weights_received"] = "weights_received"
    node_index: int = Field(ge=0)
    cell: int = Field(ge=0)
    transfers: list[Transfer] = Field(max_length=64)


class JoinStep(WireMessage):
    """Daemon → a satellite's lead node: help with the step in flight, from the weights it started at."""

    type: Literal["join_step"] = "join_step"
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    version_in: int = Field(ge=0)
    weights: WeightsRef  # version_in's weights
    grad_endpoint: str
    grad_endpoints: list[str] = Field(default_factory=list, max_length=65536)  # as StepOpen's: rank r sends to [r]


class TakeShard(WireMessage):
    """A training job (core or satellite) → daemon: give me a shard of this step."""

    type: Literal["take_shard"] = "take_shard"
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    node_index: int = Field(ge=0)


class ShardAssignment(WireMessage):
    type: Literal["shard_assignment"] = "shard_assignment"
    step: int
    shard: int
    path: str
    seal: StepSeal | None = None  # to the core, once the step is sealed


class NoShard(WireMessage):
    """No shard now: ask again after retry_after_s (a shard may be requeued, a group may join the step), or never
    (step_over)."""

    type: Literal["no_shard"] = "no_shard"
    step: int
    retry_after_s: float = 0.2
    step_over: bool = False
    seal: StepSeal | None = None  # to the core, once the step is sealed


class ShardFailed(WireMessage):
    """A satellite → daemon: the shard it took cannot be done here (e.g. its gradient could not be sent); the
    daemon queues it again, and the satellite takes no more shards of this step."""

    type: Literal["shard_failed"] = "shard_failed"
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    shard: int = Field(ge=0)
    node_index: int = Field(ge=0)
    error: str


class ShardDone(WireMessage):
    """Core → daemon: the shard's gradient is in the step, computed by cell `by_cell` (the core's word is the
    only one the daemon takes: a satellite's gradient counts once the core added it)."""

    type: Literal["shard_done"] = "shard_done"
    step: int = Field(ge=0)
    attempt: int = Field(ge=0)
    shard: int = Field(ge=0)
    by_cell: int = Field(ge=0)


# --- harness workers (worker ↔ daemon) ------------------------------------------------------------------------
class TakeRollout(WireMessage):
    """Worker → daemon: I can run `free_slots` more rollouts."""

    type: Literal["take_rollout"] = "take_rollout"
    worker_id: str
    free_slots: int = Field(ge=1)
    # when this worker process started (wall clock): runs its id was given before then died with an earlier
    # process of the same worker (kill -9, a crash), so the daemon closes them at once instead of timing them out
    worker_started_at: float | None = None
    sandbox: str | None = Field(None, max_length=1000)  # the first one: how this worker's harnesses run


class WorkerHello(WireMessage):
    """Worker → daemon, every few seconds: I am here, running `running` rollouts (a worker whose slots are all busy
    asks for nothing for as long as its harnesses run: this is how the daemon tells it silent, cut off or hung)."""

    type: Literal["worker_hello"] = "worker_hello"
    worker_id: str = Field(min_length=1, max_length=200)
    running: int = Field(ge=0)


class RolloutAssignment(WireMessage):
    type: Literal["rollout_assignment"] = "rollout_assignment"
    rollout_id: int
    task: dict[str, Any]  # a TaskSpec (gyre_slurm.harness.tasks) as JSON
    api_key: str  # per-rollout key: the proxy identifies the rollout by it
    base_url: str  # the proxy's OpenAI-compatible base URL (…/v1)
    workspace: str  # folder to lay the task out in (kept after the run)
    timeout_s: float
    harness: list[str]  # argv of the harness program (never a shell string)
    preset: Literal["reference", "claude-code", "codex", "cli"] = "reference"  # harness/presets.py: how to start it
    max_tokens: int | None = None  # the output-token limit per call a preset tells its CLI (claude-code, cli)
    model_name: str = Field("gyre-policy", max_length=200)  # the model name its CLI is told to ask for
    cli: dict[str, Any] | None = None  # preset cli: its spec (harness/cli_spec.py CliSpec as JSON)


class NoWork(WireMessage):
    type: Literal["no_work"] = "no_work"
    retry_after_s: float = 0.5


class RolloutDone(WireMessage):
    type: Literal["rollout_done"] = "rollout_done"
    rollout_id: int
    worker_id: str
    status: RolloutStatus  # a terminal one: what the run came to
    reward: float | None = None
    harness_exit: int | None = None
    timed_out: bool = False
    error: str | None = None
    started_at: float
    harness_s: float
    eval_s: float = 0.0
    score: float | None = None  # the evaluator's score whatever the status (the daemon may re-classify the run)
    harness_log: str | None = None  # the last lines of the harness's log, when it ran (the daemon may quote them)

    @field_validator("status")
    @classmethod
    def _terminal(cls, v: RolloutStatus) -> RolloutStatus:
        if v not in ROLLOUT_TERMINAL:
            raise ValueError(f"a finished rollout's status is one of {sorted(s.value for s in ROLLOUT_TERMINAL)}")
        return v


class DoneAck(WireMessage):
    """Daemon → worker: the RolloutDone for this rollout is in the ledger; the worker stops re-sending it."""

    type: Literal["done_ack"] = "done_ack"
    rollout_id: int


# --- proxy (proxy ↔ daemon) -----------------------------------------------------------------------------------
class ProxyHello(WireMessage):
    """Proxy → daemon, every few seconds: I serve the OpenAI/Anthropic APIs at `url` (e.g. http://host:port)."""

    type: Literal["proxy_hello"] = "proxy_hello"
    proxy_id: str
    url: str
    # rollouts with journaled records the daemon has not acked yet: their runs are not trained until they are in
    owed: list[int] = Field(default_factory=list, max_length=1_000_000)


class RouteQuery(WireMessage):
    """Proxy → daemon: which rollout cell serves this rollout (and is the rollout still open)?"""

    type: Literal["route_query"] = "route_query"
    rollout_id: int


class Route(WireMessage):
    type: Literal["route"] = "route"
    rollout_id: int
    open: bool  # False: unknown or finished rollout, its key no longer works
    cell: int | None = None
    engine_url: str | None = None
    weight_version: int | None = None
    temperature: float | None = None  # set: the proxy samples every call of the run at it (evaluation runs)


class CallRecord(WireMessage):
    """Proxy → daemon: one model call, with the exact ids the engine saw and sampled.

    The engine's prompt is the first `reused_tokens` ids of call `parent_call` (its prompt ∥ output, or its
    prompt alone for a retry) followed by `prompt_ids`: a long rollout's record carries only what is new."""

    type: Literal["call_record"] = "call_record"
    rollout_id: int
    call_index: int = Field(ge=0)  # per rollout, from the proxy: a replay of the same record is ignored
    api: str  # openai-chat, openai-completions, anthropic-messages
    prompt_ids: Ids  # the prompt after the reused ids
    output_ids: Ids
    output_logprobs: Logprobs  # behaviour log-probabilities, one per output id
    weight_version: int
    cell: int | None = None
    finish_reason: str  # stop, length, abort, tool_calls
    started_at: float
    latency_s: float
    reused_tokens: int = Field(default=0, ge=0)  # prompt ids taken from call parent_call as they were
    parent_call: int | None = Field(default=None, ge=0)  # None: prompt_ids is the whole prompt
    branch_reason: str | None = None  # set when the call did not extend a conversation (proxy/conversations.py)
    kind: Literal["main", "main_summary", "subagent", "subagent_summary"] = "main"

    @model_validator(mode="after")
    def _lineage(self) -> CallRecord:
        if (self.parent_call is None) != (self.reused_tokens == 0):
            raise ValueError("reused_tokens > 0 needs a parent_call, and a parent_call needs reused_tokens > 0")
        if self.parent_call is not None and self.parent_call >= self.call_index:
            raise ValueError("parent_call must be an earlier call")
        return self

    def wire_body(self) -> dict[str, Any]:
        return packed(dict(self))  # every field is a plain value or a token array


class ContextLimit(WireMessage):
    """Proxy → daemon: the rollout asked for more than the model's context (the harness got a 400). Its run ends
    TRUNCATED_CONTEXT (docs/algorithms.md §4.2). Best effort: not journaled."""

    type: Literal["context_limit"] = "context_limit"
    rollout_id: int
    prompt_tokens: int
    limit: int


class CallAck(WireMessage):
    type: Literal["call_ack"] = "call_ack"
    rollout_id: int
    call_index: int
    rollout_open: bool


Message = Annotated[
    Register | RegisterAck | Heartbeat | Reregister | SwitchRole | SwitchDone | LoadWeights | Shutdown
    | PingRequest | StatusRequest | ReassignRequest | ReleaseRequest | ShutdownRequest | AddCellsRequest
    | CellJobsRequest | EventRequest | EvalRequest | Reply | Error
    | TrainStep | TrainDone | StepOpen | JoinStep | TakeShard | ShardAssignment | NoShard
    | ShardFailed | ShardDone | TakeRollout | WorkerHello | RolloutAssignment | NoWork | RolloutDone | DoneAck
    | RouteQuery
    | Route | ProxyHello | CallRecord | CallAck | ContextLimit | WeightsReceived,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: WireMessage, token: str) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "token": token, "msg": msg.wire_body()})


def decode(frame: bytes, token: str) -> Message:
    """Decode and authenticate one frame. Raises ProtocolError(code: message)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"too_large: frame of {len(frame)} bytes")
    try:
        env = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"malformed: not a msgpack frame ({type(e).__name__})") from None
    if not isinstance(env, dict) or "msg" not in env:
        raise ProtocolError("malformed: expected a map with 'v', 'token' and 'msg'")
    if env.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(_clip(f"version: peer speaks protocol {env.get('v')!r}, this daemon {PROTOCOL_VERSION}"))
    peer_token = env.get("token")
    if not isinstance(peer_token, str) or not hmac.compare_digest(peer_token.encode(), token.encode()):
        raise ProtocolError("auth: wrong or missing run token")
    body = env["msg"]
    if not isinstance(body, dict):
        raise ProtocolError("malformed: 'msg' must be a map")
    try:
        return _adapter.validate_python(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        kind = "unknown_type" if first["type"] in ("union_tag_invalid", "union_tag_not_found") else "invalid"
        raise ProtocolError(_clip(f"{kind}: {where}: {first['msg']}")) from None


def _clip(text: str, limit: int = 300) -> str:
    """An error about a frame, short whatever the frame held: pydantic quotes the offending value (a 4 MB string
    in a tag would be a 4 MB log line and events row)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def error_code(err: ProtocolError) -> str:
    return str(err).split(":", 1)[0]
