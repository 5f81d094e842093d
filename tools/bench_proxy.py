"""Benchmark the TITO proxy's added time per call against the history's length (the real Qwen3 tokenizer).

    .venv/bin/python tools/bench_proxy.py [--long 200000] [--short 1000] [--rollouts 5] [--calls 4] [--api anthropic]

A rollout's history is grown to about --short or --long tokens (one untimed call renders it), then each timed
call extends it the way a harness does (the echoed assistant turn plus a ~100-token tool result) over real HTTP
to a real proxy process (`gyre proxy`) with the real Qwen3 tokenizer and chat template. The engine is a stand-in
that answers at once with 8 tokens. Short and long calls are interleaved so machine noise hits both alike.

Added time = what the client waits minus what the engine stand-in spent after it had read the request body. So
everything the proxy does is counted: reading the request, matching it to the rollout's stored ids, the prompt,
sending the whole prompt ids to the engine (which grows with the history) and the engine's reading of them, the
engine's JSON, parsing the reply, journaling the record and sending it to the daemon. The figure that leaves the
engine's body read out (client wait minus the whole engine handler) is printed too; the targets apply to the
first.

The re-tokenising baseline = chat-template render + encode of the whole history only (a lower bound on a
re-tokenising proxy: no HTTP, no engine call). Targets: added time at --long / at --short <= 2, re-tokenising /
added time at --long >= 20; a missed target is named and the exit status is 1. The last line prints both ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre_slurm.errors import GyreError  # noqa: E402
from gyre_slurm.model.qwen3_tokenizer import load_qwen3_tokenizer, qwen3_tokenizer_dir  # noqa: E402
from gyre_slurm.protocol import CallAck, CallRecord, Route, RouteQuery, decode, encode  # noqa: E402
from gyre_slurm.proxy.keys import make_key  # noqa: E402
from gyre_slurm.rundir import ControlInfo, new_token, write_control  # noqa: E402
from gyre_slurm.spawn import gyre_argv, spawn, wait_ready_file, write_ready_file  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
REPLY_TEXT = "Checked it."
WORDS = ["def", "return", "import", "class", "self", "value", "result", "error", "test", "file", "path", "line",
         "module", "config", "data", "index", "None", "True", "False", "for", "while", "if", "else", "try", "except",
         "raise", "with", "open", "read", "write", "print", "assert"]


# --- the engine stand-in (a separate process: run with --serve-engine) --------------------------------------------
def serve_engine(ready: Path) -> None:
    """SGLang's /generate answering at once. GET /times gives, for every generate in order, the handler's whole
    time and its time after the request body was read (the body is the proxy's: its size grows with the history)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route as HttpRoute

    tok = load_qwen3_tokenizer()
    out_ids = tok.encode(REPLY_TEXT) + [tok.convert_tokens_to_ids("<|im_end|>")]
    whole: list[float] = []
    after_body: list[float] = []

    async def generate(request) -> Response:
        t0 = time.perf_counter()
        raw = await request.body()
        t_read = time.perf_counter()
        body = orjson.loads(raw)
        n = len(body["input_ids"])
        out = orjson.dumps({"output_ids": out_ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": out_ids[-1]}, "prompt_tokens": n,
            "completion_tokens": len(out_ids), "cached_tokens": n, "weight_version": "0",
            "output_token_logprobs": [[-0.1, t, None] for t in out_ids]}})
        t1 = time.perf_counter()
        whole.append(t1 - t0)
        after_body.append(t1 - t_read)
        return Response(out, media_type="application/json")

    async def get_times(_request) -> JSONResponse:
        return JSONResponse({"whole": whole, "after_body": after_body})

    app = Starlette(routes=[HttpRoute("/generate", generate, methods=["POST"]), HttpRoute("/times", get_times)])
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP (else Nagle adds ~40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    write_ready_file(ready, {"url": f"http://127.0.0.1:{sock.getsockname()[1]}"})
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


# --- the daemon's part: routes and acks ----------------------------------------------------------------------------
class Daemon(threading.Thread):
    def __init__(self, run_dir: Path, engine_url: str) -> None:
        super().__init__(daemon=True)
        self.token, self.engine_url, self.records = new_token(), engine_url, 0
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        write_control(run_dir, ControlInfo(endpoint=f"tcp://127.0.0.1:{port}", port=port, token=self.token,
                                           daemon_pid=os.getpid(), daemon_host="localhost", started_at=time.time()))

    def run(self) -> None:
        while True:
            ident, frame = self.sock.recv_multipart()
            msg = decode(frame, self.token)
            if isinstance(msg, RouteQuery):
                reply = Route(rollout_id=msg.rollout_id, open=True, cell=1, engine_url=self.engine_url,
                              weight_version=0)
            elif isinstance(msg, CallRecord):
                self.records += 1
                reply = CallAck(rollout_id=msg.rollout_id, call_index=msg.call_index, rollout_open=True)
            else:
                continue
            self.sock.send_multipart([ident, encode(reply, self.token)])


# --- helpers -----------------------------------------------------------------------------------------------------
def start(argv: list[str], ready: Path, log: Path, what: str, procs: list[subprocess.Popen]) -> str:
    """Start a server (added to `procs`, which main stops) and wait for its ready file; its URL."""
    proc = spawn(argv, log, cwd=REPO)
    procs.append(proc)
    try:
        return wait_ready_file(ready, proc, what=what, timeout_s=120, log=log)["url"]
    except GyreError as e:  # the log goes with the temporary folder: show its end now
        sys.exit(f"error: {e}\n{log.read_text()[-2000:]}")


def model_dir(tmp: Path, context: int) -> Path:
    """What the proxy reads of a model: the tokenizer and config.json (no weights: the engine is a stand-in)."""
    d = tmp / "model"
    shutil.copytree(qwen3_tokenizer_dir(), d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": context,
                                               "eos_token_id": 151645}))
    return d


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def history(tok, rng: random.Random, target: int) -> list[dict]:
    """A coding agent's history of about `target` tokens: tool calls and their (long) results."""
    msgs = [{"role": "system", "content": "You are a coding agent. " + words(rng, 60)},
            {"role": "user", "content": "Fix the failing test. " + words(rng, 40)}]
    per_turn = max(60, min(1400, target // 8))

    def n_tokens() -> int:
        return len(tok.encode(tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)))

    n, i = n_tokens(), 0
    while n < target:
        step = max(1, min(64, (target - n) // (per_turn + 20)))  # turns added before counting again
        for _ in range(step):
            call = {"id": f"call_h{i}", "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"cmd": f"cat src/m{i}.py"})}}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_h{i}", "content": words(rng, int(per_turn * 0.9))}]
            i += 1
        n = n_tokens()
    return msgs


def anthropic_body(messages: list[dict]) -> dict:
    """The same history as an Anthropic /v1/messages request (tool calls as tool_use / tool_result blocks)."""
    out: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [{"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                        "input": json.loads(tc["function"]["arguments"])} for tc in m.get("tool_calls") or []]
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": "user", "content": m["content"]})
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    return {"model": "policy", "system": messages[0]["content"], "messages": out, "tools": tools, "max_tokens": 16}


class Rollout:
    def __init__(self, http: httpx.Client, url: str, key: str, messages: list[dict], rng: random.Random,
                 api: str) -> None:
        self.http, self.url, self.key, self.messages, self.rng, self.api = http, url, key, messages, rng, api
        self.turn = 0

    def call(self) -> float:
        """One request (the whole history, as a stateless API wants); returns the client's wait in seconds."""
        if self.api == "anthropic":
            path, body = "/v1/messages", orjson.dumps(anthropic_body(self.messages))
        else:
            path = "/v1/chat/completions"
            body = orjson.dumps({"model": "policy", "messages": self.messages, "tools": TOOLS, "max_tokens": 16})
        t0 = time.perf_counter()
        r = self.http.post(self.url + path, content=body,
                           headers={"authorization": f"Bearer {self.key}", "content-type": "application/json"})
        waited = time.perf_counter() - t0
        if r.status_code != 200:
            sys.exit(f"error: the proxy answered {r.status_code}: {r.text[:500]}")
        if self.api == "anthropic":
            text = "".join(b.get("text", "") for b in r.json()["content"])
        else:
            text = r.json()["choices"][0]["message"]["content"] or ""
        self.turn += 1
        self.messages += [{"role": "assistant", "content": text},
                          {"role": "user", "content": "Tool output:\n" + words(self.rng, 80)}]
        return waited


# --- the benchmark -------------------------------------------------------------------------------------------------
LENGTH_RATIO_TARGET = 2.0  # added time at --long / at --short, at most
RETOKENISE_TARGET = 20.0  # re-tokenising / added time at --long, at least
NAMES = ("short", "long")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=1_000, help="history length of the short rollouts, tokens")
    p.add_argument("--long", type=int, default=200_000, help="history length of the long rollouts, tokens")
    p.add_argument("--rollouts", type=int, default=5, help="rollouts per length")
    p.add_argument("--calls", type=int, default=4, help="timed calls per rollout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=("openai", "anthropic"), default="openai",
                   help="OpenAI /v1/chat/completions or Anthropic /v1/messages")
    p.add_argument("--serve-engine", type=Path, help=argparse.SUPPRESS)
    return p.parse_args()


def start_servers(tmp: Path, context: int, procs: list[subprocess.Popen]) -> tuple[str, Daemon, str]:
    """(engine stand-in URL, the daemon's part, proxy URL)."""
    engine_url = start([sys.executable, __file__, "--serve-engine", str(tmp / "engine.json")], tmp / "engine.json",
                       tmp / "engine.log", "the engine stand-in", procs)
    run_dir = tmp / "run"
    run_dir.mkdir()
    daemon = Daemon(run_dir, engine_url)
    daemon.start()
    url = start(gyre_argv("proxy", "--run-dir", str(run_dir), "--model-path", str(model_dir(tmp, context)),
                          "--port", "0", "--ready-file", str(tmp / "proxy.json"), "--proxy-id", "bench",
                          "--log-level", "WARNING"), tmp / "proxy.json", tmp / "proxy.log", "the proxy", procs)
    print(f"proxy pid {procs[1].pid}, engine stand-in pid {procs[0].pid}", file=sys.stderr)
    return engine_url, daemon, url


def build_rollouts(a: argparse.Namespace, http: httpx.Client, url: str, token: str, tok,
                   rng: random.Random) -> dict[str, list[Rollout]]:
    print(f"building {a.rollouts} rollouts of ~{a.short:,} and {a.rollouts} of ~{a.long:,} history tokens "
          f"(Qwen3 tokenizer)...", file=sys.stderr)
    rollouts: dict[str, list[Rollout]] = {"short": [], "long": []}
    rid = 0
    growth = a.calls * 110  # tokens each rollout gains over its timed calls: centre them on the target
    for name, target in (("short", a.short), ("long", a.long)):
        base = history(tok, rng, max(200, target - growth // 2))
        for _ in range(a.rollouts):
            rid += 1
            ro = Rollout(http, url, make_key(token, rid), json.loads(json.dumps(base)), rng, a.api)
            ro.call()  # untimed: the first call renders the whole history (a new root)
            rollouts[name].append(ro)
    return rollouts


def timed_calls(rollouts: dict[str, list[Rollout]], n_calls: int,
                engine_url: str) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Added time per call, by length: (engine's body read counted as the proxy's, counted as the engine's)."""
    n_setup = len(httpx.get(engine_url + "/times").json()["whole"])
    waits: list[tuple[str, float]] = []
    for _ in range(n_calls):  # interleaved: a short call, a long call, ...
        for pair in zip(rollouts["short"], rollouts["long"], strict=True):
            waits += [(name, ro.call()) for name, ro in zip(NAMES, pair, strict=True)]
        print(f"  {len(waits)} timed calls", file=sys.stderr)
    times = httpx.get(engine_url + "/times").json()
    added: dict[str, list[float]] = {name: [] for name in NAMES}
    added_excl: dict[str, list[float]] = {name: [] for name in NAMES}
    for (name, waited), after_body, whole in zip(waits, times["after_body"][n_setup:], times["whole"][n_setup:],
                                                 strict=True):
        added[name].append(waited - after_body)
        added_excl[name].append(waited - whole)
    return added, added_excl


def history_tokens(tok, ro: Rollout) -> int:
    return len(tok.encode(tok.apply_chat_template(ro.messages, tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=True)))


def retokenise_s(tok, messages: list[dict]) -> float:
    """The baseline: render + encode the whole history with the same tokenizer (median of 3)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        tok.encode(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


def p90_ms(xs: list[float]) -> str:
    return f"{sorted(xs)[int(0.9 * len(xs))] * 1e3:.2f} ms"


def report(a: argparse.Namespace, lengths: dict[str, tuple[int, int]], added: dict[str, list[float]],
           added_excl: dict[str, list[float]], retok: float) -> bool:
    """Print the figures, the missed targets, and last the headline; whether every target was met."""
    print("added time = client wait - the engine stand-in's time after reading the request body (sending the "
          "prompt ids to the engine and the engine's reading of them count as the proxy's); in brackets: client "
          "wait - the engine's whole handler time (that read counted as the engine's)")
    for name in NAMES:
        lo, hi = lengths[name]
        print(f"history {lo:,}-{hi:,} tokens: median added time {median_ms(added[name])} (p90 {p90_ms(added[name])}, "
              f"{len(added[name])} calls) [engine body read excluded: {median_ms(added_excl[name])}]")
    print(f"re-tokenising baseline = chat-template render + encode of the whole history only (a lower bound on a "
          f"re-tokenising proxy: no HTTP, no engine call), {lengths['long'][1]:,} tokens: median "
          f"{retok * 1e3:.1f} ms")
    med_s, med_l = statistics.median(added["short"]), statistics.median(added["long"])
    length_ratio, retok_ratio = med_l / med_s, retok / med_l
    long_k, short_k = f"{a.long // 1000}k", f"{a.short // 1000}k"
    missed = []
    if length_ratio > LENGTH_RATIO_TARGET:
        missed.append(f"added time at {long_k} / at {short_k} tokens: {length_ratio:.2f}x > {LENGTH_RATIO_TARGET:g}")
    if retok_ratio < RETOKENISE_TARGET:
        missed.append(f"re-tokenising / added time at {long_k}: {retok_ratio:.1f}x < {RETOKENISE_TARGET:g}")
    for line in missed:
        print(f"MISSED TARGET: {line}")
    print(f"added time at {long_k} / at {short_k} tokens: {length_ratio:.2f}x (target <= {LENGTH_RATIO_TARGET:g}); "
          f"re-tokenising baseline / added time at {long_k}: {retok_ratio:.1f}x (target >= {RETOKENISE_TARGET:g})")
    return not missed


def run(a: argparse.Namespace, tmp: Path, procs: list[subprocess.Popen]) -> bool:
    rng = random.Random(a.seed)
    tok = load_qwen3_tokenizer()
    engine_url, daemon, url = start_servers(tmp, a.long + 65_536, procs)
    with httpx.Client(timeout=600) as http:
        rollouts = build_rollouts(a, http, url, daemon.token, tok, rng)
        before = {name: history_tokens(tok, rollouts[name][0]) for name in NAMES}
        added, added_excl = timed_calls(rollouts, a.calls, engine_url)
        lengths = {name: (before[name], history_tokens(tok, rollouts[name][0])) for name in NAMES}
        health = http.get(url + "/health").json()
    print(f"proxy calls: {health['calls']}, reused prompt tokens {health['reused_tokens']:,} of "
          f"{health['prompt_tokens']:,}, branches {health['branches']}, records acked {daemon.records}")
    return report(a, lengths, added, added_excl, retokenise_s(tok, rollouts["long"][0].messages))


def main() -> None:
    a = parse_args()
    if a.serve_engine:
        serve_engine(a.serve_engine)
        return
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    procs: list[subprocess.Popen] = []
    try:
        met = run(a, tmp, procs)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if not met:
        sys.exit(1)


if __name__ == "__main__":
    main()
