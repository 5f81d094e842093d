"""The node agent: one per node. Registers with the daemon, heartbeats, and carries out role switches.

A switch runs in a worker thread (leave the old role, enter the new one through the RoleBackend) so that
heartbeats keep flowing while an engine stops or a trainer loads; meanwhile the agent reports SWITCHING.
The last switch's report is kept and sent with every Register, so a daemon that restarted mid-switch can
close it from what the node did.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import zmq

from gyre_slurm.agent.backend import RoleBackend, backend_for
from gyre_slurm.errors import GyreError, ProtocolError
from gyre_slurm.protocol import (
    Error,
    Heartbeat,
    Register,
    RegisterAck,
    Reregister,
    Shutdown,
    SwitchDone,
    SwitchReport,
    SwitchRole,
    _Msg,
    decode,
    encode,
)
from gyre_slurm.roles import Role
from gyre_slurm.rundir import read_control

log = logging.getLogger("gyre.agent")


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


class NodeAgent:
    def __init__(self, run_dir: Path, node_index: int, backend: RoleBackend | None = None,
                 connect_wait_s: float = 120.0) -> None:
        self.run_dir = Path(run_dir)
        self.node_index = node_index
        self.backend = backend or backend_for(self.run_dir)
        info = read_control(self.run_dir, wait_s=connect_wait_s)
        self.endpoint, self.token = info.endpoint, info.token
        self.role: Role | None = None  # None until the daemon's first RegisterAck
        self.cell: int | None = None
        self.heartbeat_interval_s = 1.0
        self.last_switch: SwitchReport | None = None
        self._switch_thread: threading.Thread | None = None
        self._switch_result: SwitchDone | None = None
        self._lock = threading.Lock()
        self._stop: str | None = None
        self._seq = 0
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"agent:{node_index}:{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 500)
        # Never queue for a daemon that is not there: stale heartbeats are useless, and what matters of a
        # switch that finished meanwhile travels with the next Register (last_switch).
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.connect(self.endpoint)
        self._last_register = 0.0

    def _send(self, msg: _Msg) -> None:
        try:
            self.sock.send(encode(msg, self.token), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("daemon not connected: %s dropped", msg.__class__.__name__)

    def _register(self) -> None:
        self._last_register = time.monotonic()
        with self._lock:
            role = Role.SWITCHING if self._switch_thread else self.role
            last = self.last_switch
        self._send(Register(node_index=self.node_index, node_name=os.environ.get("SLURMD_NODENAME",
                            socket.gethostname()), host=socket.gethostname(), pid=os.getpid(),
                            role=None if role is None else role, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                            last_switch=last))

    # --- switching ----------------------------------------------------------------------------------------
    def _do_switch(self, cmd: SwitchRole) -> None:
        started = time.time()
        old = self.role
        try:
            if old is not None:
                self.backend.leave(old)
            self.backend.enter(cmd.target)
            role, ok, err = cmd.target, True, None
        except Exception as e:  # the backend's failure is reported, the agent lives on
            log.exception("switch %d to %s failed", cmd.switch_id, cmd.target.value)
            role, ok, err = (old or Role.DOWN), False, f"{type(e).__name__}: {e}"
        report = SwitchReport(switch_id=cmd.switch_id, role=role, ok=ok, started_at=started,
                              ended_at=time.time(), error=err)
        with self._lock:
            self.role = role
            self.last_switch = report
            self._switch_result = SwitchDone(node_index=self.node_index, cell=cmd.cell, report=report)

    def _on_switch(self, cmd: SwitchRole) -> None:
        with self._lock:
            busy = self._switch_thread is not None
            repeat = self.last_switch is not None and self.last_switch.switch_id == cmd.switch_id
        if repeat:  # resent after a daemon restart: answer with what we already did
            self._send(SwitchDone(node_index=self.node_index, cell=cmd.cell, report=self.last_switch))
            return
        if busy:
            log.warning("switch %d ignored: a switch is already running", cmd.switch_id)
            return
        log.info("switch %d: %s → %s", cmd.switch_id, self.role, cmd.target.value)
        t = threading.Thread(target=self._do_switch, args=(cmd,), name=f"switch-{cmd.switch_id}", daemon=True)
        with self._lock:
            self._switch_thread = t
        t.start()

    def _collect_switch(self) -> None:
        with self._lock:
            done, self._switch_result = self._switch_result, None
            if done is not None:
                self._switch_thread = None
        if done is not None:
            self._send(done)

    # --- loop ---------------------------------------------------------------------------------------------
    def _on_message(self, msg: _Msg) -> None:
        if isinstance(msg, RegisterAck):
            first = self.role is None
            self.cell, self.heartbeat_interval_s = msg.cell, msg.heartbeat_interval_s
            if first:
                self.backend.enter(msg.role)
                self.role = msg.role
            log.info("registered: node %d in cell %d as %s", self.node_index, msg.cell, self.role.value)
        elif isinstance(msg, Reregister):
            # several heartbeats may be answered so before our Register lands: register once per interval
            if time.monotonic() - self._last_register >= self.heartbeat_interval_s:
                log.info("daemon asks to register again: %s", msg.reason)
                self._register()
        elif isinstance(msg, SwitchRole):
            self._on_switch(msg)
        elif isinstance(msg, Shutdown):
            self.stop(f"daemon shutdown: {msg.reason}")
        elif isinstance(msg, Error):
            log.warning("daemon error: %s: %s", msg.code, msg.message)

    def stop(self, reason: str) -> None:
        if self._stop is None:
            self._stop = reason

    def serve(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: self.stop(f"signal {signal.Signals(s).name}"))
        self._register()
        next_hb = time.monotonic() + self.heartbeat_interval_s
        while self._stop is None:
            if self.sock.poll(timeout=50):
                try:
                    self._on_message(decode(self.sock.recv(), self.token))
                except ProtocolError as e:
                    log.warning("dropped a frame from the daemon: %s", e)
            self._collect_switch()
            if time.monotonic() >= next_hb and self.cell is not None:
                with self._lock:
                    role = Role.SWITCHING if self._switch_thread else self.role
                self._seq += 1
                self._send(Heartbeat(node_index=self.node_index, cell=self.cell, role=role, seq=self._seq,
                                     rss_mb=_rss_mb()))
                next_hb = time.monotonic() + self.heartbeat_interval_s
            elif time.monotonic() >= next_hb:  # not registered yet: keep asking (the daemon may be restarting)
                self._register()
                next_hb = time.monotonic() + self.heartbeat_interval_s
        log.info("agent stopping: %s", self._stop)
        if self.role is not None:
            self.backend.leave(self.role)
        self.sock.close()


def node_index_from_env(cell: int | None, nodes_per_cell: int) -> int:
    """Node index from Slurm: SLURM_NODEID inside the job (plus the cell's offset for one-job-per-cell)."""
    nid = os.environ.get("SLURM_NODEID")
    if nid is None:
        raise GyreError("--node-index is required outside a Slurm step (SLURM_NODEID is not set)")
    return int(nid) + (cell or 0) * nodes_per_cell
