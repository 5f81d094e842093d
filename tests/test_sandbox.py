"""The harness sandbox (bubblewrap): a harness that reaches for the run's secrets, the ledger, another workspace or
the evaluator fails at the operating-system level, and its run is scored as usual. Without the sandbox the same
harness gets all of them (the control case: these tests can fail)."""

from __future__ import annotations

import json
import shutil
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gyre_slurm.harness.netrelay import ProxyBridge
from gyre_slurm.harness.sandbox import Limits, Sandbox, evaluator_folders, make_sandbox
from gyre_slurm.protocol import RolloutAssignment
from gyre_slurm.worker.rollout import execute_rollout

# the harness: try each forbidden thing, note what happened, then do the task (answer.txt)
PROBE = """
import json, os, sys
paths = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = type(e).__name__ + ": " + (e.strerror or str(e))
attempt("read control.json", lambda: open(paths["control"]).read())
import subprocess
def umount():  # as root, bwrap would keep its capabilities: the hidden state folder could be unmounted
    if subprocess.run(["umount", paths["run"]], capture_output=True).returncode != 0:
        raise PermissionError(1, "refused")
attempt("umount the hidden run folder", umount)
attempt("read control.json after umount", lambda: open(paths["control"]).read())
attempt("read the ledger", lambda: open(paths["ledger"], "rb").read(16))
attempt("read another workspace", lambda: open(paths["other"]).read())
out["workspaces seen"] = sorted(os.listdir(os.path.dirname(os.getcwd())))
out["run folder holds"] = sorted(os.listdir(paths["run"]))
attempt("read the evaluator", lambda: open(paths["evaluator"]).read())
attempt("write the evaluator", lambda: open(paths["evaluator"], "a").write("print(1.0)"))
attempt("write outside the workspace", lambda: open(paths["outside"], "w").write("x"))
import socket, urllib.request
for host in paths["daemon_hosts"]:  # the daemon's port, on loopback and on the host's address
    attempt("connect to the daemon at " + host, lambda: socket.create_connection((host, paths["daemon_port"]), 3))
try:
    out["proxy says"] = urllib.request.urlopen(os.environ["OPENAI_BASE_URL"] + "/models", timeout=10).read().decode()
except OSError as e:
    out["proxy says"] = type(e).__name__ + ": " + str(e)
open("probe.json", "w").write(json.dumps(out))
open("answer.txt", "w").write("42")
"""
EVAL = """import pathlib, sys
print(1.0 if pathlib.Path(sys.argv[1], "answer.txt").read_text() == "42" else 0.0)
"""
# what only a sandbox has to refuse (without one there is nothing mounted to undo)
ESCAPES = ["umount the hidden run folder", "read control.json after umount"]
FORBIDDEN = ["read control.json", "read the ledger", "read another workspace", "read the evaluator",
             "write the evaluator", "write outside the workspace"]
HOSTS = ["127.0.0.1", socket.gethostbyname(socket.gethostname())]
NETWORK = [f"connect to the daemon at {h}" for h in HOSTS]


class _World:
    """A port standing for the daemon's (listening on every address) and an HTTP server for the proxy."""

    def __init__(self) -> None:
        self.daemon = socket.create_server(("0.0.0.0", 0))
        self.daemon.listen(8)

        class Proxy(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = b"the proxy, at " + self.path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_a) -> None:
                pass

        self.proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        self.proxy_url = f"http://127.0.0.1:{self.proxy.server_address[1]}"
        self.bridge = ProxyBridge(lambda: self.proxy_url)

    def close(self) -> None:
        self.bridge.close()
        self.proxy.shutdown()
        self.daemon.close()


@pytest.fixture
def net():
    w = _World()
    yield w
    w.close()


def _world(tmp_path: Path, net: _World) -> tuple[Path, dict]:
    state = tmp_path / "state"
    run = state / "run-1"
    (run / "workspaces" / "r000002").mkdir(parents=True)
    (run / "control.json").write_text('{"token": "the run token"}')
    (run / "ledger.db").write_bytes(b"SQLite format 3\x00")
    (run / "workspaces" / "r000002" / "secret.txt").write_text("another run's work")
    evaluator = tmp_path / "suite" / "eval.py"
    evaluator.parent.mkdir()
    evaluator.write_text(EVAL)
    paths = {"control": str(run / "control.json"), "ledger": str(run / "ledger.db"), "run": str(run),
             "other": str(run / "workspaces" / "r000002" / "secret.txt"), "evaluator": str(evaluator),
             "outside": str(state / "planted.txt"), "daemon_hosts": HOSTS,
             "daemon_port": net.daemon.getsockname()[1]}
    return run, paths


def _rollout(run: Path, paths: dict, sandbox: Sandbox | None, net: _World):
    task = {"id": "probe", "prompt": "answer 42", "evaluator": ["{python}", paths["evaluator"], "{workspace}"]}
    a = RolloutAssignment(rollout_id=1, task=task, api_key="sk-1", base_url=f"{net.proxy_url}/v1",
                          workspace=str(run / "workspaces" / "r000001"), timeout_s=60,
                          harness=[sys.executable, "-c", PROBE, json.dumps(paths)])
    done = execute_rollout(a, "w1", state_dir=run.parent, sandbox=sandbox, limits=Limits(open_files=256),
                           proxy_socket=net.bridge.path)
    probe = json.loads((run / "workspaces" / "r000001" / "probe.json").read_text())
    return done, probe


@pytest.fixture(scope="module")
def bwrap() -> Sandbox:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed (tools/setup_env.sh installs it: apt-get install bubblewrap)")
    return make_sandbox("bwrap")


def test_a_sandboxed_harness_reaches_nothing_of_the_run_and_is_scored_normally(tmp_path, bwrap, net) -> None:
    run, paths = _world(tmp_path, net)
    done, probe = _rollout(run, paths, bwrap, net)
    assert done.status == "COMPLETED" and done.reward == 1.0, done
    assert bwrap.own_network and "reach nothing but their proxy" in bwrap.why
    for what in NETWORK:  # its own network namespace: loopback only, nobody listening there
        assert probe[what].split(":")[0] in ("ConnectionRefusedError", "OSError"), (what, probe)
    assert probe["proxy says"] == "the proxy, at /v1/models", probe  # through the relay and the worker's bridge
    for what in FORBIDDEN + ESCAPES:
        assert probe[what] != "ok", (what, probe)
        assert probe[what].split(":")[0] in ("FileNotFoundError", "OSError", "PermissionError"), (what, probe)
    assert "Read-only file system" in probe["write the evaluator"] + probe["write outside the workspace"]
    assert probe["workspaces seen"] == ["r000001"] and probe["run folder holds"] == ["workspaces"]
    assert Path(paths["evaluator"]).read_text() == EVAL and not Path(paths["outside"]).exists()
    assert (run / "control.json").read_text() == '{"token": "the run token"}'  # the run folder itself untouched


def test_without_the_sandbox_the_same_harness_gets_everything(tmp_path, net) -> None:
    run, paths = _world(tmp_path, net)
    done, probe = _rollout(run, paths, make_sandbox("none"), net)
    assert [probe[w] for w in FORBIDDEN + NETWORK] == ["ok"] * len(FORBIDDEN + NETWORK)
    assert probe["proxy says"] == "the proxy, at /v1/models"
    assert probe["workspaces seen"] == ["r000001", "r000002"] and "control.json" in probe["run folder holds"]
    assert done.status == "COMPLETED" and Path(paths["evaluator"]).read_text() != EVAL  # the evaluator was edited


def test_what_the_sandbox_hides_of_an_evaluator(tmp_path) -> None:
    ws, state = tmp_path / "state" / "run" / "workspaces" / "r1", tmp_path / "state"
    ws.mkdir(parents=True)
    suite = tmp_path / "suite"
    (suite / "tests").mkdir(parents=True)
    (suite / "tests" / "check.py").write_text("")
    argv = [sys.executable, "-m", "gyre_slurm.scoring.builtin_eval", str(suite / "tests" / "check.py"),
            str(suite), "{workspace}", str(ws), "/usr/bin/env"]
    # the suite's folders, once each; never the interpreter, the system, the workspace or what holds it
    assert evaluator_folders(argv, ws, state) == [suite / "tests", suite]


def test_bwrap_that_cannot_be_had_is_refused_and_auto_says_so(monkeypatch) -> None:
    from gyre_slurm.errors import GyreError

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(GyreError, match="harness.sandbox is bwrap, but bwrap is not installed"):
        make_sandbox("bwrap")
    sb = make_sandbox("auto")
    assert sb.kind == "none" and sb.why.startswith("NO SANDBOX: bwrap is not installed")
    assert sb.wrap(["x"], Path("/w"), Path("/s"), []) == ["x"]


def test_the_hosts_network_when_asked(bwrap) -> None:
    sb = make_sandbox("bwrap", "host")
    assert not sb.own_network and "the network is the host's" in sb.why
    assert "--unshare-net" not in sb.wrap(["x"], Path("/w"), Path("/s"), [])
    with pytest.raises(Exception, match="needs the proxy bridge's socket"):
        bwrap.wrap(["x"], Path("/w"), Path("/s"), [])
