"""The ZeroMQ wire protocol between the daemon and its peers (node agents, CLI; later proxies and workers).

One frame per message: a msgpack map ``{"v": PROTOCOL_VERSION, "token": <run secret>, "msg": {...}}`` where
``msg`` is one of the typed models below, told apart by its ``type`` field. Every peer encodes and decodes
through this module only. A frame that is not msgpack, has the wrong version or token, or whose ``msg`` does
not validate raises ProtocolError with a short code; the daemon answers it with an ``Error`` and carries on.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from gyre_slurm.errors import ProtocolError
from gyre_slurm.roles import Role

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024  # also set as ZMQ_MAXMSGSIZE on the daemon's socket


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SwitchReport(_Msg):
    """How a role switch went on one node; carried by SwitchDone and, after a daemon restart, by Register."""

    switch_id: int
    role: Role
    ok: bool
    started_at: float
    ended_at: float
    error: str | None = None


class Register(_Msg):
    type: Literal["register"] = "register"
    node_index: int = Field(ge=0)
    node_name: str
    host: str
    pid: int
    role: Role | None = None  # None: a fresh agent, the daemon tells it which role to take
    slurm_job_id: str | None = None
    last_switch: SwitchReport | None = None


class RegisterAck(_Msg):
    type: Literal["register_ack"] = "register_ack"
    cell: int
    role: Role
    heartbeat_interval_s: float


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    node_index: int = Field(ge=0)
    cell: int = Field(ge=0)
    role: Role
    seq: int = Field(ge=0)
    rss_mb: float = 0.0


class Reregister(_Msg):
    """Daemon → agent: I do not know you (e.g. I restarted); send Register with your current role."""

    type: Literal["reregister"] = "reregister"
    reason: str


class SwitchRole(_Msg):
    type: Literal["switch_role"] = "switch_role"
    switch_id: int
    cell: int
    target: Role


class SwitchDone(_Msg):
    type: Literal["switch_done"] = "switch_done"
    node_index: int
    cell: int
    report: SwitchReport


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


Op = Literal["ping", "status", "reassign", "shutdown"]


class Request(_Msg):
    """CLI → daemon control request; answered by a Reply with the same req_id."""

    type: Literal["request"] = "request"
    req_id: str
    op: Op
    args: dict[str, Any] = Field(default_factory=dict)


class Reply(_Msg):
    type: Literal["reply"] = "reply"
    req_id: str
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None


class Error(_Msg):
    """Answer to a frame the daemon could not accept; the connection stays usable."""

    type: Literal["error"] = "error"
    code: str
    message: str


Message = Annotated[
    Register | RegisterAck | Heartbeat | Reregister | SwitchRole | SwitchDone | Shutdown | Request | Reply | Error,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: _Msg, token: str) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "token": token, "msg": msg.model_dump(mode="json")})


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
        raise ProtocolError(f"version: peer speaks protocol {env.get('v')!r}, this daemon {PROTOCOL_VERSION}")
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
        raise ProtocolError(f"{kind}: {where}: {first['msg']}") from None


def error_code(err: ProtocolError) -> str:
    return str(err).split(":", 1)[0]
