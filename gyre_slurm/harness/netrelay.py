"""A sandboxed harness's one way out: its proxy, over a Unix socket, in a network namespace with nothing else.

With `harness.network: proxy-only` the sandbox (harness/sandbox.py) gives the harness a network namespace of its
own, where only a loopback interface exists: no daemon port, no other host, no other run. Two relays carry its
model calls to the TITO proxy:

  - inside the sandbox, `python -m gyre_slurm.harness.netrelay --port P --socket S -- HARNESS…` listens on
    127.0.0.1:P (the harness's OPENAI_BASE_URL / ANTHROPIC_BASE_URL point there), hands each connection to the
    Unix socket S (bound into the sandbox), then runs the harness and exits with its status;
  - outside, the worker's ProxyBridge accepts on that Unix socket and connects each connection to the proxy's
    current address (a restarted proxy's too).

Bytes pass through unchanged: the per-rollout API key still decides what a harness may do at the proxy. Standard
library only, so the relay starts in a few hundredths of a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

RELAY_PORT = 8642  # inside the sandbox's own network namespace: never taken by anyone else
SOCKET_IN_SANDBOX = "/tmp/.gyre-proxy.sock"  # the private /tmp of the sandbox: the bind's mount point
_CHUNK = 1 << 16


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done, then close both."""
    back = threading.Thread(target=_pump, args=(b, a), daemon=True)
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def serve_relay(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed
        try:
            upstream = connect()
        except OSError:
            conn.close()  # the client sees the connection drop, as with a proxy that is down: it retries
            continue
        threading.Thread(target=_splice, args=(conn, upstream), daemon=True).start()


class ProxyBridge:
    """The worker's side: a Unix socket (in a private temporary folder) whose connections go on to the proxy at
    `url()` (read per connection: a proxy that moved is followed)."""

    def __init__(self, url: Callable[[], str | None]) -> None:
        self._url = url
        self._dir = tempfile.mkdtemp(prefix="gyre-net-")  # short: a Unix socket path has 108 bytes at most
        self.path = Path(self._dir) / "proxy.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        self._listener.listen(256)
        threading.Thread(target=serve_relay, args=(self._listener, self._connect), name="proxy-bridge",
                         daemon=True).start()

    def _connect(self) -> socket.socket:
        url = self._url()
        if url is None:
            raise OSError("no proxy known yet")
        u = urlsplit(url)
        return socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=None)

    def close(self) -> None:
        self._listener.close()
        self.path.unlink(missing_ok=True)
        os.rmdir(self._dir)


def relay_to_socket(port: int, socket_path: str) -> None:
    """Listen on 127.0.0.1:`port` (of this process's network namespace) and hand each connection to the Unix socket
    at `socket_path`, in a background thread: the harness's side of the way out, inside the sandbox (main) or in the
    image jail's network namespace (harness/jail.py)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(256)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(socket_path)
        return s

    threading.Thread(target=serve_relay, args=(listener, connect), name="relay", daemon=True).start()


def url_in_sandbox(base_url: str) -> str:
    """The harness's base URL: the relay's address inside the sandbox, with the proxy URL's path (…/v1)."""
    return f"http://127.0.0.1:{RELAY_PORT}{urlsplit(base_url).path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netrelay", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=RELAY_PORT)
    ap.add_argument("--socket", default=SOCKET_IN_SANDBOX)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("a harness command is needed after --")
    relay_to_socket(a.port, a.socket)
    try:
        child = subprocess.Popen(command)
    except OSError as e:
        print(f"netrelay: cannot start {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
