"""Bad input at the proxy, fuzzed: every malformed request gets its API's own error shape and a 4xx status,
reaches neither the engine nor the daemon, and the proxy goes on serving.

Schema-driven: each API's request is described once as a tree of `Node`s (the JSON types a value may have, its
required fields, values of the right type that are still wrong). Hypothesis draws valid requests, then applies
exactly one mutation that the schema says makes it invalid: a value replaced by one of another JSON type, a
required field dropped, an out-of-range number or unknown enum string, an unknown model, a broken tool, a message
that breaks a role's rule. Arbitrary bytes, non-JSON and JSON that is not an object are thrown in too. All of it
goes over real HTTP to a real proxy process (the world of tests/test_proxy.py: a test-played daemon collecting
CallRecords, the scripted engine over the tiny model) with a valid key of a rollout that nothing else uses.

The proxy here answers only some model names (--served-model, repeated), so that unknown names exist.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gyre_slurm import cli
from gyre_slurm.model.tiny import create_tiny_model
from gyre_slurm.proxy import app as proxy_app
from gyre_slurm.proxy.apierrors import DEFAULT_SERVED_MODELS, ServedModels
from gyre_slurm.proxy.keys import make_key
from gyre_slurm.rundir import ControlInfo, write_control
from tests.proxy_requests import CONTEXT, SERVED, bad_requests, garbage, truncated
from tests.proxy_world import FakeDaemon, ProxyProc, TinyEngine, wait_for

FUZZ_RID = 60  # the rollout of every bad request; valid traffic never uses it
GOOD_RID = 61  # valid traffic between and after the bad requests
ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}
EXAMPLES = int(os.environ.get("GYRE_FUZZ_EXAMPLES", "300"))  # per API and test; raise it to fuzz longer
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


# --- the world: tests/test_proxy.py's pieces, the proxy started with a narrowed --served-model list -------------
class ServedProxy(ProxyProc):
    options = ("--proxy-id", "fz", *(arg for name in SERVED for arg in ("--served-model", name)))


@dataclass
class World:
    engine: TinyEngine
    daemon: FakeDaemon
    proxy: ServedProxy
    http: httpx.Client
    log_path: Any

    def headers(self, api: str, rollout_id: int = FUZZ_RID) -> dict[str, str]:
        key = make_key(self.daemon.token, rollout_id)
        if api == "messages":
            return {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
        return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def post(self, api: str, content: bytes, rollout_id: int = FUZZ_RID) -> httpx.Response:
        return self.http.post(self.proxy.url + PATHS[api], content=content, headers=self.headers(api, rollout_id))

    def fuzz_receipts(self) -> list[tuple[int, int]]:
        return [k for k in list(self.daemon.receipts) if k[0] == FUZZ_RID]


@pytest.fixture(scope="module")
def fz(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model_dir = create_tiny_model(tmp / "model", seed=0)
    engine = TinyEngine(model_dir)
    engine_url, server = engine.serve()
    run_dir = tmp / "run"
    run_dir.mkdir()
    daemon = FakeDaemon(run_dir, engine_url)
    proxy = ServedProxy(run_dir, model_dir, tmp / "proxy.log")
    http = httpx.Client(timeout=30)
    try:
        proxy.start()
        yield World(engine, daemon, proxy, http, tmp / "proxy.log")
    finally:
        http.close()
        proxy.kill(signal.SIGTERM)
        daemon.stop()
        server.should_exit = True


# --- checks ------------------------------------------------------------------------------------------------------
def error_of(api: str, r: httpx.Response, status: int) -> dict[str, Any]:
    """The error in the API's own shape (asserted), as {message, type, param, code}."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    body = r.json()
    if api == "messages":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert set(err) == {"type", "message"} and err["type"] == ANTHROPIC_TYPES[status], body
        assert isinstance(err["message"], str) and err["message"], body
        return {**err, "param": None, "code": None}
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", body
    assert isinstance(err["message"], str) and err["message"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], str), body
    return err


def good_request(world: World, api: str) -> None:
    """A valid request on another rollout: the proxy still serves."""
    body: dict[str, Any] = {"model": "policy", "max_tokens": 3}
    if api == "completions":
        body["prompt"] = "ok"
    else:
        body["messages"] = [{"role": "user", "content": "still there?"}]
    r = world.post(api, json.dumps(body).encode(), GOOD_RID)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]


# --- the fuzz tests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", list(PATHS))
@FUZZ
@given(data=st.data())
def test_bad_requests_get_the_apis_error_and_change_nothing(fz, api, data):
    n_seen = len(fz.engine.seen)
    case = data.draw(bad_requests(api), label="case")
    event(case.kind)
    r = fz.post(api, json.dumps(case.body).encode())
    err = error_of(api, r, case.status)
    if case.status == 404:
        assert err["code"] in ("model_not_found", None) and err["param"] in ("model", None)
    if api != "messages" and case.where is not None:  # param names the place, or a place inside/around it
        param = err["param"] or ""
        assert param == case.where or param.startswith(case.where + ".") or case.where.startswith(param + "."), (
            case.what, err)
    assert len(fz.engine.seen) == n_seen, f"{case.what} reached the engine"
    assert not fz.fuzz_receipts()


@pytest.mark.parametrize("api", list(PATHS))
@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(data=st.data())
def test_garbage_bodies_get_the_apis_error(fz, api, data):
    n_seen = len(fz.engine.seen)
    body = data.draw(garbage | truncated(api), label="body")
    error_of(api, fz.post(api, body), 400)
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


def test_still_serving_after_the_fuzz(fz):
    for api in PATHS:
        good_request(fz, api)
    time.sleep(0.3)  # a stray record would have arrived by now
    assert not fz.fuzz_receipts()
    assert fz.proxy.health()["ok"]


# --- explicit cases ------------------------------------------------------------------------------------------------
def test_unknown_model_is_404_in_each_api_shape(fz):
    key, url = make_key(fz.daemon.token, FUZZ_RID), fz.proxy.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    user = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as e:
            oai.chat.completions.create(model="gpt-4o", messages=user, max_tokens=4, stream=stream)
        assert e.value.code == "model_not_found" and e.value.param == "model" and e.value.type == \
            "invalid_request_error"
        with pytest.raises(openai.NotFoundError) as e:
            oai.completions.create(model="Policy", prompt="x", max_tokens=4, stream=stream)  # names are case-sensitive
        assert e.value.code == "model_not_found"
        with pytest.raises(anthropic.NotFoundError) as e:
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30).messages.create(
                model="m", max_tokens=4, messages=user, stream=stream)
        assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                           "message": e.value.body["error"]["message"]}}
    # the served names and patterns: /v1/models lists the plain ones; a harness's own name matches a pattern
    assert [m.id for m in oai.models.list().data] == ["policy"]
    good = anthropic.Anthropic(base_url=url, api_key=make_key(fz.daemon.token, GOOD_RID), max_retries=0, timeout=30)
    reply = good.messages.create(model="claude-harness-default", max_tokens=3, messages=user)
    assert reply.model == "claude-harness-default" and reply.usage.output_tokens > 0
    time.sleep(0.2)
    assert not fz.fuzz_receipts()


def test_served_models_option_and_flag(monkeypatch, tmp_path):
    assert DEFAULT_SERVED_MODELS == ("policy", "*")
    default = ServedModels(None)
    assert default.names == ["policy"] and "claude-sonnet-4-5" in default and "gpt-5-codex" in default
    narrow = ServedModels(["policy", "policy-*", "policy"])
    assert narrow.patterns == ("policy", "policy-*") and "policy-v3" in narrow and "m" not in narrow
    assert ServedModels("only").names == ["only"] and "other" not in ServedModels("only")
    with pytest.raises(ValueError):
        ServedModels([])
    # `gyre proxy --served-model`, repeatable; a run folder with control.json and no config.yaml
    write_control(tmp_path, ControlInfo(endpoint="tcp://127.0.0.1:1", port=1, token="t", daemon_pid=0,
                                        daemon_host="localhost", started_at=0.0))
    seen = []
    monkeypatch.setattr(proxy_app, "run_proxy", lambda *a, **kw: seen.append(kw["served_models"]))
    monkeypatch.setattr(logging, "basicConfig", lambda **_kw: None)  # keep pytest's handlers
    root_level = logging.getLogger().level
    base = ["proxy", "--run-dir", str(tmp_path), "--model-path", "m"]
    try:
        for extra in ([], ["--served-model", "policy"], ["--served-model", "policy", "--served-model", "claude-*"]):
            result = CliRunner().invoke(cli.app, [*base, *extra])
            assert result.exit_code == 0, result.output
    finally:
        logging.getLogger().setLevel(root_level)
    assert seen == [None, ["policy"], ["policy", "claude-*"]]


@pytest.mark.parametrize("api", list(PATHS))
@pytest.mark.parametrize("stream", [False, True])
def test_oversized_context_is_400_before_the_engine(fz, api, stream):
    n_seen = len(fz.engine.seen)
    long_text = "x" * (CONTEXT + 500)  # the tiny tokenizer is byte-level: one token per byte
    if api == "completions":
        bodies = [{"prompt": long_text, "max_tokens": 1}, {"prompt": [1] * CONTEXT, "max_tokens": 1},
                  {"prompt": "hi", "max_tokens": CONTEXT}]
    else:
        bodies = [{"messages": [{"role": "user", "content": long_text}], "max_tokens": 1},
                  {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT}]
    for body in bodies:
        r = fz.post(api, json.dumps({"model": "policy", "stream": stream, **body}).encode())
        err = error_of(api, r, 400)  # JSON, also for a streamed request: nothing was streamed yet
        if api != "messages":
            assert err["code"] == "context_length_exceeded", err
            assert err["param"] == ("prompt" if api == "completions" else "messages"), err
        assert "maximum context length" in err["message"]
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


TOOL_CASES = {
    "chat": [
        ({"type": "function", "function": {"name": "read file"}}, "tools.0.function.name"),
        ({"type": "function", "function": {"name": "x" * 65}}, "tools.0.function.name"),
        ({"type": "function", "function": {"description": "no name"}}, "tools.0.function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
         "tools.0.function.parameters.type"),
        ({"type": "function", "function": {"name": "f", "parameters": "{}"}}, "tools.0.function.parameters"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}},
         "tools.0.function.parameters.properties"),
        ({"type": "function", "function": {"name": "f", "description": 3}}, "tools.0.function.description"),
        ({"type": "code_interpreter", "function": {"name": "f"}}, "tools.0.type"),
        ({"name": "f", "parameters": {"type": "object"}}, "tools.0.type"),  # Anthropic's shape sent to OpenAI
    ],
    "messages": [
        ({"name": "read file", "input_schema": {"type": "object"}}, None),
        ({"name": "f", "input_schema": {"properties": {}}}, None),  # Anthropic requires type: object
        ({"name": "f", "input_schema": {"type": "string"}}, None),
        ({"name": "f"}, None),
        ({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}, None),  # a server tool
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, None),  # OpenAI's shape
    ],
}


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_invalid_tool_schemas(fz, api):
    n_seen = len(fz.engine.seen)
    base = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for tool, param in TOOL_CASES[api]:
        err = error_of(api, fz.post(api, json.dumps({**base, "tools": [tool]}).encode()), 400)
        if param is not None:
            assert err["param"] == param, (tool, err)
    ok = {"type": "function", "function": {"name": "f"}} if api == "chat" else {
        "name": "f", "input_schema": {"type": "object"}}
    err = error_of(api, fz.post(api, json.dumps({**base, "tools": [ok, ok]}).encode()), 400)
    assert "unique" in err["message"]
    assert len(fz.engine.seen) == n_seen and not fz.fuzz_receipts()


# --- clients that leave -----------------------------------------------------------------------------------------
def test_clients_leaving_mid_stream_or_mid_request(fz):
    """tests/test_proxy_apis.py covers a chat stream left after its first chunk; here: the other two APIs' streams,
    a client that gives up while the engine generates, and one that leaves halfway through sending its body."""
    engine, daemon = fz.engine, fz.daemon
    rid = 62
    key = make_key(daemon.token, rid)
    engine.script.extend(["y" * 1200, "z" * 1200])
    streams = [("messages", {"model": "policy", "max_tokens": 1500, "stream": True,
                             "messages": [{"role": "user", "content": "go"}]}),
               ("completions", {"model": "policy", "max_tokens": 1500, "stream": True, "prompt": "go"})]
    for n, (api, body) in enumerate(streams, start=1):
        with fz.http.stream("POST", fz.proxy.url + PATHS[api], json=body, headers=fz.headers(api, rid)) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            next(r.iter_lines())
        wait_for(lambda n=n: len(daemon.calls(rid)) == n, what="the streamed call's record")
    # a client that gives up while the engine is still generating
    engine.script.append("w" * 2000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fz.proxy.url + PATHS["chat"], headers=fz.headers("chat", rid), timeout=httpx.Timeout(30, read=0.05),
                   json={"model": "policy", "max_tokens": 2500, "messages": [{"role": "user", "content": "slow"}]})
    # a client that leaves halfway through its body
    host, port = httpx.URL(fz.proxy.url).host, httpx.URL(fz.proxy.url).port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 500\r\n\r\n{\"model\": \"pol")
    # the proxy goes on: the rollout's next call works, and its records are one per finished generation, in order
    wait_for(lambda: len(daemon.calls(rid)) == 3, what="the abandoned generation's record")
    oai = openai.OpenAI(base_url=fz.proxy.url + "/v1", api_key=key, max_retries=0, timeout=30)
    reply = oai.chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}], max_tokens=3)
    assert reply.usage.completion_tokens > 0
    wait_for(lambda: len(daemon.calls(rid)) == 4, what="the next call's record")
    assert [r.call_index for r in daemon.calls(rid)] == [0, 1, 2, 3]
    assert [r.api for r in daemon.calls(rid)] == ["anthropic-messages", "openai-completions", "openai-chat",
                                                  "openai-chat"]
    good_request(fz, "chat")


def crashes(log: str) -> list[str]:
    """The exception line of every traceback in the proxy's log (the 500 handler logs one for every crash)."""
    out, lines = [], log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            out.append(next((x for x in lines[i + 1:] if x and not x[0].isspace()), "?"))
    return out


def test_no_request_crashed_the_proxy(fz):
    """Last: nothing above made the proxy crash, not even the client that left mid-body."""
    good_request(fz, "messages")
    assert crashes(fz.log_path.read_text()) == [], fz.log_path.read_text()[-3000:]
