"""The node agent: one per node. Registers with the daemon, heartbeats, and carries out role switches.

A switch runs in a worker thread (leave the old role, enter the new one through the RoleBackend) so that
heartbeats keep flowing while an engine stops or a trainer loads; meanwhile the agent reports SWITCHING.
The last switch's report is kept and sent with every Register, so a daemon that restarted mid-switch can
close it from what the node did.

Training runs in the same job thread, one job at a time: the core's step (TrainStep) or a satellite's part in
one (JoinStep), each talking to the daemon on a socket of its own (train_link.py). A command that arrives while
the node is busy waits for the job to end; a newer step makes a training job in progress void, and a role
switch stops a satellite's job after the shard in hand (the core's step always runs to its end).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from gyre_slurm.agent.backend import RoleBackend
from gyre_slurm.agent.engine_watch import EngineWatch
from gyre_slurm.agent.train_link import StepStopped, TrainLink
from gyre_slurm.beacon import Beacon
from gyre_slurm.errors import DISK_FULL, GyreError, TrainerRanksLost, disk_full
from gyre_slurm.peer import connect_to_daemon, dispatcher, drain
from gyre_slurm.protocol import (
    Error,
    EventRequest,
    Heartbeat,
    JoinStep,
    LoadWeights,
    Register,
    RegisterAck,
    Reregister,
    Shutdown,
    SwitchDone,
    SwitchReport,
    SwitchRole,
    TrainDone,
    TrainStep,
    WeightsReceived,
    WireMessage,
    encode,
)
from gyre_slurm.roles import Role
from gyre_slurm.rundir import read_control
from gyre_slurm.slurm_jobs import ENDED, job_states

log = logging.getLogger("gyre.agent")
DAEMON_CHECK_S = 10.0  # how often control.json is read again: a daemon restarted elsewhere has a new endpoint
DAEMON_JOB_CHECK_S = 60.0  # how often Slurm is asked whether the daemon's own job still exists (gyre submit)
JOB_STOP_WAIT_S = 20.0  # at a stop, how long the job in progress (a switch, a step, a trainer being built) may take
ENTRY_ATTEMPTS, ENTRY_RETRY_S = 3, 10.0  # a role a node cannot enter at its start is tried again this often


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


class NodeAgent:
    def __init__(self, run_dir: Path, node_index: int, backend: RoleBackend, connect_wait_s: float = 120.0) -> None:
        self.run_dir = Path(run_dir)
        self.node_index = node_index
        info = read_control(self.run_dir, wait_s=connect_wait_s)  # also: the daemon wrote config.yaml before it
        self.backend = backend
        self.info = info  # control.json as last read: endpoint, token, keys, the daemon's job
        self.role: Role | None = None  # None until the daemon's first RegisterAck
        self.cell: int | None = None
        self.heartbeat_interval_s = 1.0
        self.last_switch: SwitchReport | None = None
        self._job: threading.Thread | None = None  # a switch, the first role entry or a training step
        self._job_result: WireMessage | None = None
        self._job_step: tuple[str, int, int] | None = None  # a training job's (kind, step, attempt)
        self._job_stop = threading.Event()  # set: the training job in progress stops at its next shard
        self._switching = False
        self._next_switch: SwitchRole | None = None  # arrived while the node was busy: runs when the job ends
        self._next_weights: LoadWeights | None = None  # likewise; only the newest version matters
        self._next_step: TrainStep | JoinStep | None = None  # likewise; only the newest step matters
        self._lock = threading.Lock()
        self._stop: str | None = None
        self._seq = 0
        # what matters of a switch that finished while the daemon was away travels with the next Register
        self.sock = connect_to_daemon(info, f"agent:{node_index}", linger_ms=500)
        self._last_register = 0.0
        self._next_daemon_check = time.monotonic() + DAEMON_CHECK_S
        self._next_job_check = time.monotonic() + DAEMON_JOB_CHECK_S
        self._handlers: dict[type[WireMessage], Callable[[Any], None]] = {  # what else the daemon sends is ignored
            RegisterAck: self._on_register_ack, Reregister: self._on_reregister, SwitchRole: self._on_switch,
            LoadWeights: self._on_load_weights, TrainStep: self._on_step, JoinStep: self._on_step,
            Shutdown: self._on_shutdown, Error: self._on_error,
        }
        self._dispatch = dispatcher(self._handlers, log)
        cfg = getattr(backend, "cfg", None)
        self.engine_watch = EngineWatch(backend, cfg.control.hang_timeout_s if cfg is not None else 0.0, self._report)

    def _report(self, kind: str, message: str) -> None:
        """An events row (the daemon writes it; its Reply is not waited for): lost if the daemon is away."""
        self._send(EventRequest(kind=kind, message=message[:1000]))

    def _revive_engine(self, why: str) -> None:
        try:
            self.backend.revive_engine()
        except Exception:  # the next turn of the loop tries again
            log.exception("%s; starting it again failed", why)
            return
        msg = (f"{why} and was started again by agent-{self.node_index} (serving version {self.backend.serving} "
               f"at {self.backend.engine_url})")
        log.warning("%s", msg)
        self._report("process_restarted", msg)

    def _send(self, msg: WireMessage) -> None:
        try:
            self.sock.send(encode(msg, self.info.token), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("daemon not connected: %s dropped", msg.__class__.__name__)

    def _register(self) -> None:
        self._last_register = time.monotonic()
        with self._lock:
            role = Role.SWITCHING if self._switching else self.role
            last = self.last_switch
        self._send(Register(node_index=self.node_index, node_name=os.environ.get("SLURMD_NODENAME",
                            socket.gethostname()), host=socket.gethostname(), pid=os.getpid(),
                            role=None if role is None else role, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                            last_switch=last, engine_url=self.backend.engine_url))

    # --- background jobs: switches, the first role entry, training steps ---------------------------------------
    def _start_job(self, name: str, fn, switching: bool = False, step: tuple[str, int, int] | None = None,
                   stop: threading.Event | None = None) -> bool:
        with self._lock:
            if self._job is not None:
                return False
            self._switching = switching
            self._job_step, self._job_stop = step, stop or threading.Event()

            def run() -> None:
                result = fn()
                with self._lock:
                    self._job_result = result

            self._job = threading.Thread(target=run, name=name, daemon=True)
            self._job.start()
        return True

    def _collect_job(self) -> None:
        with self._lock:
            if self._job is None or self._job.is_alive():
                return
            done, self._job_result, self._job, self._switching = self._job_result, None, None, False
            self._job_step = None
        if done is not None:
            self._send(done)
        pending, self._next_switch = self._next_switch, None
        if pending is not None:
            self._on_switch(pending)
            return
        step, self._next_step = self._next_step, None
        if isinstance(step, JoinStep) and self.role != Role.TRAIN:
            log.info("step %d: not joined, this cell left TRAIN meanwhile", step.step)
        elif step is not None:
            self._on_step(step)
            return
        weights, self._next_weights = self._next_weights, None
        if weights is not None:
            self._on_load_weights(weights)
        elif isinstance(done, SwitchDone) and done.report.ok and done.report.role == Role.TRAIN:
            self._start_job("prepare", lambda: self._prepare(Role.TRAIN))  # reported first: the switch stays quick

    def _report_transfers(self) -> None:
        """The weight transfers made since the last look (a job's, while it runs), for the ledger (kept until the
        daemon has told the node its cell)."""
        if self.cell is None:
            return
        transfers = self.backend.drain_transfers()
        for i in range(0, len(transfers), 64):
            self._send(WeightsReceived(node_index=self.node_index, cell=self.cell, transfers=transfers[i:i + 64]))

    def _do_switch(self, cmd: SwitchRole) -> SwitchDone:
        started = time.time()
        old = self.role
        try:
            if old is not None:
                self.backend.leave(old)
            self.backend.enter(cmd.target, cmd.weights)
            role, ok, err = cmd.target, True, None
        except Exception as e:  # the backend's failure is reported, the agent lives on
            log.exception("switch %d to %s failed", cmd.switch_id, cmd.target.value)
            role, ok, err = (old or Role.DOWN), False, f"{type(e).__name__}: {e}"
        report = SwitchReport(switch_id=cmd.switch_id, role=role, ok=ok, started_at=started,
                              ended_at=time.time(), error=err)
        with self._lock:
            self.role = role
            self.last_switch = report
        return SwitchDone(node_index=self.node_index, cell=cmd.cell, report=report)

    def _on_switch(self, cmd: SwitchRole) -> None:
        if self.last_switch is not None and self.last_switch.switch_id == cmd.switch_id:
            # resent after a daemon restart: answer with what we already did
            self._send(SwitchDone(node_index=self.node_index, cell=cmd.cell, report=self.last_switch))
            return
        log.info("switch %d: %s → %s", cmd.switch_id, self.role, cmd.target.value)
        if not self._start_job(f"switch-{cmd.switch_id}", lambda: self._do_switch(cmd), switching=True):
            log.info("switch %d waits: the node is busy (starting its role or training)", cmd.switch_id)
            self._next_switch = cmd
            with self._lock:
                if self._job_step is not None and self._job_step[0] == "join_step":
                    self._job_stop.set()  # a satellite leaves after the shard in hand (its others are requeued)

    def _on_load_weights(self, msg: LoadWeights) -> None:
        if not self._start_job(f"weights-{msg.weights.version}", lambda: self._load_weights(msg)):
            self._next_weights = msg  # after the switch or first entry in progress (which may bring ROLLOUT)

    def _load_weights(self, msg: LoadWeights) -> None:
        if self.role != Role.ROLLOUT:
            return  # a cell that left ROLLOUT meanwhile gets its weights with its next switch
        try:
            self.backend.load_weights(msg.weights)
            log.info("serving weights version %d", msg.weights.version)
        except Exception:  # the engine keeps serving the version it has; the next version is tried again
            log.exception("loading weights version %d failed", msg.weights.version)

    def _on_step(self, msg: TrainStep | JoinStep) -> None:
        key = (msg.type, msg.step, msg.attempt)
        with self._lock:
            running = self._job_step
        if running == key:
            return  # sent again (a cell back in TRAIN is asked to join the step it still works on)
        stop = threading.Event()
        job = self._do_train if isinstance(msg, TrainStep) else self._do_join
        if self._start_job(f"{msg.type}-{msg.step}", lambda: job(msg, stop), step=key, stop=stop):
            return
        if running is not None:  # a training job for a step that is over, or an earlier daemon's: void now
            self._job_stop.set()
        self._next_step = msg

    def _do_train(self, cmd: TrainStep, stop: threading.Event) -> None:
        link = TrainLink(self.info, self.node_index, stop)
        try:
            done = self.backend.train(cmd, link)
        except Exception as e:
            if stop.is_set() or isinstance(e, StepStopped):
                log.info("training step %d stopped: %s", cmd.step, e)
            else:
                log.exception("training step %d failed", cmd.step)
            # a full disk (the version's save): run again once the daemon sees room
            done = TrainDone(step=cmd.step, ok=False, error=(DISK_FULL if disk_full(e) else "")
                             + f"{type(e).__name__}: {e}", attempt=cmd.attempt,
                             retry=isinstance(e, TrainerRanksLost) or disk_full(e))
        try:
            link.send(done)  # behind the step's ShardDone reports, on the same socket
        finally:
            link.close()

    def _do_join(self, cmd: JoinStep, stop: threading.Event) -> None:
        link = TrainLink(self.info, self.node_index, stop)
        try:
            n = self.backend.join(cmd, link)
            log.info("step %d: %d shard gradient(s) sent to the core", cmd.step, n)
        except Exception:
            log.exception("satellite work on step %d failed", cmd.step)
        finally:
            link.close()

    def _first_entry(self, role: Role, weights) -> None:
        for attempt in range(1, ENTRY_ATTEMPTS + 1):  # an engine that cannot start now (a full disk) may later
            try:
                self.backend.enter(role, weights)
                break
            except Exception:
                log.exception("entering %s failed (attempt %d of %d)", role.value, attempt, ENTRY_ATTEMPTS)
                if attempt == ENTRY_ATTEMPTS or self._stop is not None:
                    return
                time.sleep(ENTRY_RETRY_S)
        self._prepare(role)

    def _prepare(self, role: Role) -> None:
        try:
            self.backend.prepare(role)
        except Exception:  # not fatal: what it prepares is made again when it is needed
            log.exception("preparing %s failed", role.value)

    # --- loop ---------------------------------------------------------------------------------------------
    def _on_register_ack(self, msg: RegisterAck) -> None:
        first = self.role is None
        self.cell, self.heartbeat_interval_s = msg.cell, msg.heartbeat_interval_s
        if first:
            self.role = msg.role
            self._start_job("enter", lambda: self._first_entry(msg.role, msg.weights))
        log.info("registered: node %d in cell %d as %s", self.node_index, msg.cell, self.role.value)

    def _on_reregister(self, msg: Reregister) -> None:
        # several heartbeats may be answered so before our Register lands: register once per interval
        if time.monotonic() - self._last_register >= self.heartbeat_interval_s:
            log.info("daemon asks to register again: %s", msg.reason)
            self._register()

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.stop(f"daemon shutdown: {msg.reason}")

    @staticmethod
    def _on_error(msg: Error) -> None:
        log.warning("daemon error: %s: %s", msg.code, msg.message)

    def stop(self, reason: str) -> None:
        if self._stop is None:
            self._stop = reason

    def _check_daemon(self) -> None:
        """A daemon that came back with another endpoint (a requeued job on another node) is followed at once; one
        whose Slurm job ended for good (cancelled, failed) is not waited for: the agent stops and frees its job."""
        now = time.monotonic()
        if now >= self._next_daemon_check:
            self._next_daemon_check = now + DAEMON_CHECK_S
            try:
                info = read_control(self.run_dir)
            except GyreError:
                info = self.info
            moved = (info.endpoint, info.token, info.curve) != (self.info.endpoint, self.info.token, self.info.curve)
            self.info = info  # also the daemon's job: a resumed daemon writes its own
            if moved:
                log.info("the daemon moved to %s: connecting there", info.endpoint)
                self.sock.close(linger=0)
                self.sock = connect_to_daemon(info, f"agent:{self.node_index}", linger_ms=500)
                self._register()
        job = self.info.slurm_job_id  # watched when it is another job than ours (gyre submit)
        if job and job != os.environ.get("SLURM_JOB_ID") and now >= self._next_job_check:
            self._next_job_check = now + DAEMON_JOB_CHECK_S
            state = job_states([job]).get(job)
            if state in ENDED:
                self.stop(f"the daemon's Slurm job {job} is {state}")

    def serve(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: self.stop(f"signal {signal.Signals(s).name}"))
        self._register()
        next_hb = time.monotonic() + self.heartbeat_interval_s
        beacon = Beacon()  # its supervisor's sign that this loop turns
        while self._stop is None:
            beacon.beat()
            if self.sock.poll(timeout=50):
                drain(self.sock, self.info.token, self._dispatch, log)
            self._collect_job()
            self._report_transfers()  # as they happen: a satellite's pull of a run's last step, before the run ends
            why = self.engine_watch.gone()
            if why is not None:  # a job: the restart takes seconds (a busy node tries again after its job)
                self._start_job("engine-restart", lambda why=why: self._revive_engine(why))
            if time.monotonic() >= next_hb and self.cell is not None:
                with self._lock:
                    role = Role.SWITCHING if self._switching else self.role
                self._seq += 1
                self._send(Heartbeat(node_index=self.node_index, cell=self.cell, role=role, seq=self._seq,
                                     rss_mb=_rss_mb(), engine_url=self.backend.engine_url))
                next_hb = time.monotonic() + self.heartbeat_interval_s
            elif time.monotonic() >= next_hb:  # not registered yet: keep asking (the daemon may be restarting)
                self._register()
                next_hb = time.monotonic() + self.heartbeat_interval_s
            self._check_daemon()
        log.info("agent stopping: %s", self._stop)
        self._finish_job(JOB_STOP_WAIT_S)
        self.backend.close()
        self.sock.close()

    def _finish_job(self, wait_s: float) -> None:
        """Let the job in progress end (a training job stops at its next shard) before the backend closes: one still
        building a trainer would leave it, and its ranks' threads, to die with the interpreter (an abort)."""
        with self._lock:
            job = self._job
            self._job_stop.set()
        if job is not None and job.is_alive():
            job.join(wait_s)
            if job.is_alive():
                log.warning("the %s job did not end within %.0f s; stopping without it", job.name, wait_s)


def node_index_from_env(cell: int | None, nodes_per_cell: int) -> int:
    """Node index from Slurm: SLURM_NODEID inside the job (plus the cell's offset for one-job-per-cell)."""
    nid = os.environ.get("SLURM_NODEID")
    if nid is None:
        raise GyreError("--node-index is required outside a Slurm step (SLURM_NODEID is not set)")
    return int(nid) + (cell or 0) * nodes_per_cell
