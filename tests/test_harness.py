"""Task suites, workspaces, the harness runner, evaluators and the reference agent, with real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre_slurm.errors import ConfigError
from gyre_slurm.harness import agent_spec
from gyre_slurm.harness.runner import HarnessError, run_harness
from gyre_slurm.harness.tasks import TaskSpec, load_suite
from gyre_slurm.harness.workspace import WorkspaceError, lay_out
from gyre_slurm.scoring.evaluator import parse_score, run_evaluator

from .conftest import alive

PY = sys.executable



def py(code: str) -> list[str]:
    return [PY, "-c", code]




def wait_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def task(**kw) -> TaskSpec:
    return TaskSpec(**{"id": "t", "prompt": "do it", "evaluator": py("print(1)"), **kw})


# --- suites ---------------------------------------------------------------------------------------------------
def test_builtin_digits_suite_loads() -> None:
    tasks = load_suite("builtin:digits")
    assert len(tasks) == 50 and len({t.id for t in tasks}) == 50
    t = next(t for t in tasks if t.id == "digits-7x4")
    assert t.prompt == "Write the digit 7 four times to answer.txt."
    assert t.evaluator_argv(Path("/ws"))[:3] == [PY, "-m", "gyre_slurm.scoring.builtin_eval"]
    with pytest.raises(ConfigError, match="unknown built-in suite 'nope' \\(known: digits, longtail, sevens, "
                       "sevens-reworded, six-sevens\\)"):
        load_suite("builtin:nope")
    reworded = load_suite("builtin:sevens-reworded")  # the sevens asked three ways, the first as `sevens` asks
    assert [t.id for t in reworded[:5]] == [t.id for t in load_suite("builtin:sevens")]
    assert len(reworded) == 15 and next(t for t in reworded if t.id == "digits-7x5-c").prompt == \
        "answer.txt must hold the digit 7, written five times."
    assert [(t.id, t.prompt) for t in load_suite("builtin:six-sevens")] == [
        ("digits-7x6", "Write the digit 7 six times to answer.txt.")]
    assert [t.id for t in load_suite("builtin:sevens")] == [f"digits-7x{n}" for n in range(4, 9)]


def test_jsonl_suite_good(tmp_path: Path) -> None:
    (tmp_path / "tpl").mkdir()
    lines = [
        {"id": "a", "prompt": "p", "evaluator": ["{python}", "eval.py", "--ws={workspace}"], "timeout_s": 5},
        {},  # replaced by a blank line below
        {"id": "b.2", "prompt": "q", "files": {"src/x.py": "x = 1\n"}, "template_dir": "tpl", "evaluator": ["e"]},
    ]
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join("" if not d else json.dumps(d) for d in lines) + "\n")
    a, b = load_suite(str(f))
    assert a.evaluator_argv(Path("/w")) == [PY, "eval.py", "--ws=/w"] and a.timeout_s == 5
    assert a.eval_timeout_s == 60 and b.timeout_s is None
    assert b.template_dir == (tmp_path / "tpl").resolve()  # relative to the suite file, not to the cwd


@pytest.mark.parametrize("lines, message", [
    (['{"id": "a", "prompt": "p", "evaluator": ["e"]}', "", '{"id": "b", "prompt": "p", "evaluator": []}'],
     ":3: evaluator: List should have at least 1 item"),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"]', ], ":1: not valid JSON"),
    (['[1, 2]'], ":1: expected a JSON object"),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"], "shell": "rm -rf /"}'], ":1: shell: Extra inputs"),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"]}', '{"id": "a", "prompt": "q", "evaluator": ["e"]}'],
     ":2: id: duplicate task id 'a' (first at "),
    (['{"id": "../a", "prompt": "p", "evaluator": ["e"]}'], ":1: id: Value error, must be"),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"], "files": {"../up.txt": ""}}'], ":1: files: Value error"),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"], "template_dir": "missing"}'], ":1: template_dir: "),
    (['{"id": "a", "prompt": "p", "evaluator": ["e"], "timeout_s": 0}'], ":1: timeout_s: Input should be greater"),
    (["", "  "], ": the task suite has no tasks"),
])
def test_jsonl_suite_errors_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_suite(str(f))
    assert str(e.value).startswith(str(f)) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_missing_suite_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_suite(str(tmp_path / "none.jsonl"))


# --- workspaces -----------------------------------------------------------------------------------------------
def test_lay_out_writes_template_files_and_prompt(tmp_path: Path) -> None:
    tpl = tmp_path / "tpl"
    (tpl / "pkg").mkdir(parents=True)
    (tpl / "pkg" / "mod.py").write_text("old\n")
    (tpl / "keep.txt").write_text("kept\n")
    ws = tmp_path / "runs" / "r1"
    lay_out(task(prompt="Fix it.", template_dir=tpl, files={"pkg/mod.py": "new\n", "a/b/c.txt": "c"}), ws)
    assert (ws / "TASK.md").read_text() == "Fix it."
    assert (ws / "pkg" / "mod.py").read_text() == "new\n"  # task files win over the template
    assert (ws / "keep.txt").read_text() == "kept\n" and (ws / "a" / "b" / "c.txt").read_text() == "c"
    with pytest.raises(WorkspaceError, match="already exists and is not an empty folder"):
        lay_out(task(), ws)  # a workspace belongs to one rollout
    assert (ws / "TASK.md").read_text() == "Fix it."  # and is never wiped


@pytest.mark.parametrize("name", ["/etc/evil", "../evil", "a/../../evil", "", "TASK.md", ".gyre/harness.log"])
def test_file_names_must_stay_inside_the_workspace(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValidationError, match="file name"):
        task(files={name: "x"})
    # lay_out checks again: an assignment's task may not have gone through a suite file
    bad = TaskSpec.model_construct(id="t", prompt="p", files={name: "x"}, template_dir=None, evaluator=["e"])
    with pytest.raises(WorkspaceError, match="file name"):
        lay_out(bad, tmp_path / "ws")
    assert not (tmp_path / "evil").exists()


def test_symlink_in_template_cannot_lead_files_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tpl = tmp_path / "tpl"
    tpl.mkdir()
    (tpl / "link").symlink_to(outside)
    with pytest.raises(WorkspaceError, match="leads outside the workspace"):
        lay_out(task(template_dir=tpl, files={"link/x.txt": "x"}), tmp_path / "ws")
    assert list(outside.iterdir()) == []
    assert (tmp_path / "ws" / "link").is_symlink()  # copied as a link, not as what it points to


# --- the harness runner ---------------------------------------------------------------------------------------
SPAWNS_GRANDCHILD = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open("pids", "w").write(f"{__import__('os').getpid()} {g.pid}")
print("started", flush=True)
time.sleep(120)
"""


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    log = tmp_path / "ws" / ".gyre" / "harness.log"
    (tmp_path / "ws").mkdir()
    r = run_harness(py(SPAWNS_GRANDCHILD), tmp_path / "ws", {}, 1.5, log)
    assert r.timed_out and r.exit_code is None and not r.cancelled
    assert 1.5 <= r.duration_s < 5
    pids = [int(p) for p in (tmp_path / "ws" / "pids").read_text().split()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not any(alive(p) for p in pids), "the harness or its grandchild survived the timeout"
    assert "started" in log.read_text()


def test_sigterm_ignored_is_followed_by_sigkill(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', flush=True); " \
           "time.sleep(60)"
    t0 = time.monotonic()
    r = run_harness(py(code), tmp_path, {}, 0.5, tmp_path / "h.log", grace_s=0.3)
    assert r.timed_out and time.monotonic() - t0 < 3


def test_crash_keeps_exit_code_and_output_env_and_cwd(tmp_path: Path) -> None:
    code = ("import os, sys; print(os.getcwd(), os.environ['GYRE_ROLLOUT_ID'], os.environ['PATH'] != ''); "
            "sys.stderr.write('kaboom\\n'); sys.exit(7)")
    log = tmp_path / "h.log"
    r = run_harness(py(code), tmp_path, {"GYRE_ROLLOUT_ID": "42"}, 10, log)
    assert (r.exit_code, r.timed_out) == (7, False) and r.duration_s < 5
    assert log.read_text().splitlines() == [f"{tmp_path} 42 True", "kaboom"]


def test_leftover_background_process_is_killed_after_a_normal_exit(tmp_path: Path) -> None:
    code = ("import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "open('pid', 'w').write(str(g.pid))")
    r = run_harness(py(code), tmp_path, {}, 10, tmp_path / "h.log")
    assert r.exit_code == 0 and not r.timed_out
    time.sleep(0.2)
    assert not alive(int((tmp_path / "pid").read_text()))


def test_cancel_kills_the_harness(tmp_path: Path) -> None:
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    r = run_harness(py(SPAWNS_GRANDCHILD), tmp_path, {}, 60, tmp_path / "h.log", cancel=cancel)
    assert r.cancelled and not r.timed_out and r.exit_code is None and r.duration_s < 5


def test_missing_program_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="cannot start '/no/such/agent'"):
        run_harness(["/no/such/agent"], tmp_path, {}, 5, tmp_path / "h.log")


# --- evaluators -----------------------------------------------------------------------------------------------
def evaluate(tmp_path: Path, code: str, retries: int = 0, eval_timeout_s: float = 10):
    return run_evaluator(task(evaluator=py(code), eval_timeout_s=eval_timeout_s), tmp_path, retries=retries)


@pytest.mark.parametrize("code, error", [
    ("import sys; sys.stderr.write('Traceback: boom\\n'); sys.exit(2)", "exit code 2): Traceback: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
    ("print('0.9'); raise SystemExit(1)", "exit code 1"),
    ("print('all good')", "last line is not a number: 'all good'"),
    ("pass", "nothing on stdout"),
    ("print('1.5')", "score 1.5 is not a number in [0, 1]"),
    ("print('-0.1')", "score -0.1 is not"),
    ("print('nan')", "score nan is not"),
    ("print('inf')", "score inf is not"),
    ("print('{\"score\": 2}')", "score 2.0 is not"),
    ("print('{\"score\": true}')", "'score' is not a number"),
    ("print('{\"points\": 1}')", "JSON without a 'score'"),
])
def test_evaluator_failures_are_errors_never_zero(tmp_path: Path, code: str, error: str) -> None:
    r = evaluate(tmp_path, code)
    assert r.score is None and r.error is not None and error in r.error, r.error
    assert r.attempts == 1


def test_evaluator_timeout_kills_it(tmp_path: Path) -> None:
    r = evaluate(tmp_path, SPAWNS_GRANDCHILD, eval_timeout_s=0.5)
    assert r.score is None and r.error == "evaluator timed out after 0.5 s"
    assert r.duration_s < 4
    time.sleep(0.2)
    assert not any(alive(int(p)) for p in (tmp_path / "pids").read_text().split())


@pytest.mark.parametrize("out, score", [("0.25", 0.25), ("log line\\n1", 1.0), ('{"score": 0.5}', 0.5),
                                        ("0", 0.0), ("  0.75  \\n\\n", 0.75)])
def test_evaluator_scores(tmp_path: Path, out: str, score: float) -> None:
    r = evaluate(tmp_path, f"print('{out}')")
    assert (r.score, r.error, r.attempts) == (score, None, 1)
    assert parse_score(out.replace("\\n", "\n")) == score


def test_evaluator_error_is_retried_on_the_same_workspace(tmp_path: Path) -> None:
    flaky = ("import pathlib, sys; p = pathlib.Path('tries'); n = int(p.read_text()) if p.exists() else 0; "
             "p.write_text(str(n + 1)); print('0.5') if n >= 1 else sys.exit(1)")
    r = evaluate(tmp_path, flaky, retries=1)
    assert (r.score, r.error, r.attempts) == (0.5, None, 2)
    assert (tmp_path / "tries").read_text() == "2"
    r = evaluate(tmp_path, "raise SystemExit(1)", retries=2)
    assert r.score is None and r.attempts == 3 and r.error.endswith("(after 3 attempts)")
    r = evaluate(tmp_path, "raise SystemExit(1)", retries=0)
    assert r.attempts == 1


def test_builtin_digits_evaluator_gives_partial_credit(tmp_path: Path) -> None:
    spec = next(t for t in load_suite("builtin:digits") if t.id == "digits-7x4")
    for answer, score in [("7777", 1.0), ("77", 0.5), ("777777", 0.5), ("7177", 0.75), ("77777777", 0.0),
                          (None, 0.0)]:
        ws = tmp_path / f"ws-{answer}"
        lay_out(spec, ws)
        if answer is not None:
            (ws / "answer.txt").write_text(answer + "\n")
        r = run_evaluator(spec, ws)
        assert r.error is None and r.score == pytest.approx(score, abs=1e-6), (answer, r)


# --- the reference agent --------------------------------------------------------------------------------------
class ScriptedAPI:
    """A test-side OpenAI-compatible endpoint that answers from a script and records what it was sent."""

    def __init__(self, replies: list[tuple[int, dict]], port: int = 0) -> None:
        self.replies, self.requests = list(replies), []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                api.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = api.replies.pop(0)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_a) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def completion(content: str | None, calls: list[tuple[str, str]] = ()) -> tuple[int, dict]:
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "write_file", "arguments": a}}
                  for i, (_, a) in enumerate(calls)]
    msg = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
                 "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}]}


def run_agent(ws: Path, base_url: str, key: str = "sk-rollout-1",
              reconnect_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": key, "GYRE_MODEL": "policy-v0",
           "GYRE_RECONNECT_S": str(reconnect_s)}
    return subprocess.run([PY, "-m", "gyre_slurm.harness.reference_agent"], cwd=ws, env=env, capture_output=True,
                          text=True, timeout=30)


def test_reference_agent_conversation(tmp_path: Path) -> None:
    spec = next(t for t in load_suite("builtin:digits") if t.id == "digits-3x5")
    ws = tmp_path / "ws"
    lay_out(spec, ws)
    good = json.dumps({"path": "answer.txt", "content": "33333"})
    api = ScriptedAPI([
        completion("", [("write_file", good)]),
        completion(None, [("write_file", "{not json"), ("write_file", json.dumps({"path": "../x", "content": "1"}))]),
        completion("done"),
    ])
    try:
        r = run_agent(ws, api.base_url)
    finally:
        api.close()
    assert r.returncode == 0, r.stderr
    assert (ws / "answer.txt").read_text() == "33333" and not (tmp_path / "x").exists()
    assert run_evaluator(spec, ws).score == 1.0
    assert len(api.requests) == 3
    first, third = api.requests[0], api.requests[2]
    assert first["model"] == "policy-v0" and first["tools"] == agent_spec.TOOLS
    assert first["temperature"] == 1.0 and first["max_tokens"] == 128
    assert first["messages"] == [{"role": "system", "content": agent_spec.SYSTEM_PROMPT},
                                 {"role": "user", "content": spec.prompt}]
    m = third["messages"]
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool", "assistant", "tool", "tool"]
    # the assistant turns go back exactly as they came, arguments as the model's JSON strings
    assert m[2] == {"role": "assistant", "content": "",
                    "tool_calls": [{"id": "call_0", "type": "function",
                                    "function": {"name": "write_file", "arguments": good}}]}
    assert m[4]["tool_calls"][0]["function"]["arguments"] == "{not json"
    assert m[3] == {"role": "tool", "tool_call_id": "call_0", "content": agent_spec.tool_result("answer.txt", 5)}
    assert m[5]["tool_call_id"] == "call_0" and "not valid JSON" in m[5]["content"]
    assert m[6]["tool_call_id"] == "call_1" and "'..'" in m[6]["content"]


def test_reference_agent_stops_after_max_turns(tmp_path: Path) -> None:
    (tmp_path / "TASK.md").write_text("loop")
    call = json.dumps({"path": "a.txt", "content": "a"})
    api = ScriptedAPI([completion("", [("write_file", call)]) for _ in range(agent_spec.MAX_TURNS)])
    try:
        r = run_agent(tmp_path, api.base_url)
    finally:
        api.close()
    assert r.returncode == 0 and len(api.requests) == agent_spec.MAX_TURNS
    assert "turn budget" in r.stdout


def test_reference_agent_waits_for_a_proxy_that_comes_back(tmp_path: Path) -> None:
    (tmp_path / "TASK.md").write_text("anything")
    with socket.socket() as s:  # a port nobody listens on yet: the proxy is restarting
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "k"}
    agent = subprocess.Popen([PY, "-m", "gyre_slurm.harness.reference_agent"], cwd=tmp_path, env=env,
                             stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    api = ScriptedAPI([completion("done")], port=port)
    try:
        assert agent.wait(timeout=30) == 0, agent.stderr.read()
    finally:
        api.close()
    assert len(api.requests) == 1


def test_reference_agent_retries_a_503_and_no_other_error(tmp_path: Path) -> None:
    (tmp_path / "TASK.md").write_text("anything")
    busy = (503, {"error": {"message": "no route to a rollout engine: the daemon did not answer"}})
    api = ScriptedAPI([busy, busy, completion("done")])  # the proxy's daemon restarting, then back
    try:
        r = run_agent(tmp_path, api.base_url)
    finally:
        api.close()
    assert r.returncode == 0 and len(api.requests) == 3, r.stderr
    api = ScriptedAPI([(500, {"error": {"message": "boom"}})])  # any other error answer ends the run at once
    try:
        r = run_agent(tmp_path, api.base_url)
    finally:
        api.close()
    assert r.returncode == 3 and len(api.requests) == 1 and "HTTP 500: boom" in r.stderr


def test_reference_agent_api_errors_exit_3_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "TASK.md").write_text("anything")
    r = run_agent(tmp_path, "http://127.0.0.1:1/v1", reconnect_s=1)  # nothing listens there (tried for 1 s)
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "cannot reach 127.0.0.1:1: ConnectionRefusedError" in r.stderr, r.stderr
    api = ScriptedAPI([(401, {"error": {"message": "unknown rollout key", "type": "invalid_request_error"}})])
    try:
        r = run_agent(tmp_path, api.base_url, key="sk-wrong")
    finally:
        api.close()
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "HTTP 401: unknown rollout key" in r.stderr, r.stderr
    (tmp_path / "TASK.md").unlink()
    r = run_agent(tmp_path, "http://127.0.0.1:1/v1")
    assert r.returncode == 2 and "cannot read TASK.md" in r.stderr
