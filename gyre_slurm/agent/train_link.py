"""A training job's own channel to the daemon.

The agent's main thread owns the agent's socket, so a training job (the core's step, a satellite's part in it)
talks to the daemon on a DEALER of its own, identity train:<node>:…; the daemon answers by identity and checks
the run token as for any peer. What the job reports travels in order on this one socket, so the core's last
ShardDone reaches the daemon before its TrainDone.

A TakeShard is never repeated before its answer: a second ask could take a second shard that nobody would
compute. The job waits for the answer as long as its `stop` is clear; whoever makes a job void (a newer step, a
role switch) sets it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from gyre_slurm.errors import GyreError, ProtocolError
from gyre_slurm.peer import connect_to_daemon
from gyre_slurm.protocol import (
    Error,
    NoShard,
    ShardAssignment,
    TakeShard,
    WireMessage,
    decode,
    encode,
)
from gyre_slurm.rundir import ControlInfo

log = logging.getLogger("gyre.agent")

ERROR_RETRY_S = 1.0  # the daemon answered an Error: ask again after this


class StepStopped(GyreError):
    """A training job's step is void: a newer command replaced it, or the daemon closed it (e.g. a restarted
    daemon runs it again as a new attempt)."""


class TrainLink:
    def __init__(self, info: ControlInfo, node_index: int, stop: threading.Event) -> None:
        self.token = info.token
        self.node_index = node_index
        self.stop = stop
        # not `immediate`: the first report may leave before the connection is up, and must not be dropped
        self.sock = connect_to_daemon(info, f"train:{node_index}", linger_ms=2000, immediate=False)

    def send(self, msg: WireMessage) -> None:
        self.sock.send(encode(msg, self.token))

    def take(self, step: int, attempt: int, idle: Callable[[float], object]) \
            -> ShardAssignment | NoShard | None:
        """Ask for a shard of the step and wait for the answer, calling idle(seconds) while it has not come (the
        core collects gradients there). None when the job was told to stop first."""
        self.send(TakeShard(step=step, attempt=attempt, node_index=self.node_index))
        while not self.stop.is_set():
            if not self.sock.poll(0, zmq.POLLIN):
                idle(0.05)
                continue
            try:
                answer = decode(self.sock.recv(), self.token)
            except ProtocolError as e:
                log.warning("dropped a frame from the daemon: %s", e)
                continue
            if isinstance(answer, ShardAssignment | NoShard) and answer.step == step:
                return answer
            if isinstance(answer, Error):  # refused: nothing else will answer this ask
                log.warning("daemon refused a TakeShard: %s: %s", answer.code, answer.message)
                return NoShard(step=step, retry_after_s=ERROR_RETRY_S)
            log.warning("unexpected %s on a training job's channel ignored", type(answer).__name__)
        return None

    def close(self) -> None:
        self.sock.close()  # lingers up to 2 s: the last reports still go out
