"""Control requests to a run's daemon (used by the CLI and the launchers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_slurm.errors import ControlError
from gyre_slurm.peer import connect_to_daemon
from gyre_slurm.protocol import ControlRequest, Error, Reply, decode, encode
from gyre_slurm.rundir import load_run_config, read_control


def request(run_dir: Path, req: ControlRequest, timeout_s: float | None = None) -> dict[str, Any]:
    """Send one control request; return the result, or raise ControlError with the daemon's reason."""
    info = read_control(run_dir)
    if timeout_s is None:
        timeout_s = load_run_config(run_dir).control.request_timeout_s
    sock = connect_to_daemon(info, "cli", linger_ms=0, immediate=False)  # queue until connected
    try:
        sock.send(encode(req, info.token))
        if not sock.poll(timeout=int(timeout_s * 1000)):
            raise ControlError(f"the daemon at {info.endpoint} did not answer within {timeout_s:g} s "
                               "(is the run still going? `gyre status` reads the ledger without it)")
        msg = decode(sock.recv(), info.token)
    finally:
        sock.close()
    if isinstance(msg, Error):
        raise ControlError(f"daemon refused the request: {msg.message}")
    if not isinstance(msg, Reply) or msg.req_id != req.req_id:
        raise ControlError("unexpected answer from the daemon")
    if not msg.ok:
        raise ControlError(msg.error or "refused")
    return msg.result or {}
