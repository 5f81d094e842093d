"""Benchmark the TITO proxy's added time per call against the history's length (the real Qwen3 tokenizer).

    .venv/bin/python tools/bench_proxy.py [--long 200000] [--short 1000] [--rollouts 5] [--calls 4] [--api anthropic]

A rollout's history is grown to about --short or --long tokens (one untimed call renders it), then each timed
call extends it the way a harness does (the echoed assistant turn plus a ~100-token tool result) over real HTTP
to a real proxy process with the real Qwen3 tokenizer and chat template. Added time = what the client waits minus
what the engine spent in its handler (the engine is a stand-in that answers at once with 8 tokens, so what is
timed is the proxy: reading the request, matching it to the rollout's stored ids, the prompt, the engine call
and its JSON, parsing the reply, journaling the record and sending it to the daemon). Short and long calls are
interleaved so machine noise hits both alike. The baseline is what a re-tokenising proxy would pay: rendering
and tokenising the whole long history with the same tokenizer. The last line prints both ratios.
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

from gyre_slurm.model.qwen3_tokenizer import load_qwen3_tokenizer, qwen3_tokenizer_dir  # noqa: E402
from gyre_slurm.protocol import CallAck, CallRecord, Route, RouteQuery, decode, encode  # noqa: E402
from gyre_slurm.proxy.keys import make_key  # noqa: E402
from gyre_slurm.rundir import ControlInfo, new_token, write_control  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                          "required": ["cmd"]}}}]
REPLY_TEXT = "Checked it."
WORDS = ["def", "return", "import", "class", "self", "value", "result", "error", "test", "file", "path", "line",
         "module", "config", "data", "index", "None", "True", "False", "for", "while", "if", "else", "try", "except",
         "raise", "with", "open", "read", "write", "print", "assert"]


# --- the engine stand-in (a separate process: run with --serve-engine) --------------------------------------------
def serve_engine(ready: Path) -> None:
    """SGLang's /generate answering at once; GET /times gives the handler time of every generate, in order."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route as HttpRoute

    tok = load_qwen3_tokenizer()
    out_ids = tok.encode(REPLY_TEXT) + [tok.convert_tokens_to_ids("<|im_end|>")]
    times: list[float] = []

    async def generate(request) -> Response:
        t0 = time.perf_counter()
        body = orjson.loads(await request.body())
        n = len(body["input_ids"])
        out = orjson.dumps({"output_ids": out_ids, "meta_info": {
            "id": body.get("rid"), "finish_reason": {"type": "stop", "matched": out_ids[-1]}, "prompt_tokens": n,
            "completion_tokens": len(out_ids), "cached_tokens": n, "weight_version": "0",
            "output_token_logprobs": [[-0.1, t, None] for t in out_ids]}})
        times.append(time.perf_counter() - t0)
        return Response(out, media_type="application/json")

    async def get_times(_request) -> JSONResponse:
        return JSONResponse({"times": times})

    app = Starlette(routes=[HttpRoute("/generate", generate, methods=["POST"]), HttpRoute("/times", get_times)])
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP (else Nagle adds ~40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    ready.write_text(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}))
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
def start(args: list[str], ready: Path, log: Path, what: str) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"error: the {what} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    time.sleep(0.05)
    return proc, json.loads(ready.read_text())["url"]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", type=int, default=1_000, help="history length of the short rollouts, tokens")
    p.add_argument("--long", type=int, default=200_000, help="history length of the long rollouts, tokens")
    p.add_argument("--rollouts", type=int, default=5, help="rollouts per length")
    p.add_argument("--calls", type=int, default=4, help="timed calls per rollout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api", choices=("openai", "anthropic"), default="openai",
                   help="OpenAI /v1/chat/completions or Anthropic /v1/messages")
    p.add_argument("--serve-engine", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_engine:
        serve_engine(a.serve_engine)
        return
    rng = random.Random(a.seed)
    tok = load_qwen3_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    procs: list[subprocess.Popen] = []
    try:
        engine, engine_url = start([sys.executable, __file__, "--serve-engine", str(tmp / "engine.json")],
                                   tmp / "engine.json", tmp / "engine.log", "engine stand-in")
        procs.append(engine)
        run_dir = tmp / "run"
        run_dir.mkdir()
        daemon = Daemon(run_dir, engine_url)
        daemon.start()
        model = model_dir(tmp, a.long + 65_536)
        proxy, url = start([sys.executable, "-m", "gyre_slurm.proxy.app", "--run-dir", str(run_dir), "--model-path",
                            str(model), "--port", "0", "--ready-file", str(tmp / "proxy.json"), "--proxy-id", "bench",
                            "--log-level", "WARNING"], tmp / "proxy.json", tmp / "proxy.log", "proxy")
        procs.append(proxy)
        print(f"proxy pid {proxy.pid}, engine stand-in pid {engine.pid}", file=sys.stderr)
        http = httpx.Client(timeout=600)
        print(f"building {a.rollouts} rollouts of ~{a.short:,} and {a.rollouts} of ~{a.long:,} history tokens "
              f"(Qwen3 tokenizer)...", file=sys.stderr)
        rollouts: dict[str, list[Rollout]] = {"short": [], "long": []}
        lengths: dict[str, list[int]] = {"short": [], "long": []}
        rid = 0
        growth = a.calls * 110  # tokens each rollout gains over its timed calls: centre them on the target
        for name, target in (("short", a.short), ("long", a.long)):
            base = history(tok, rng, max(200, target - growth // 2))
            for _ in range(a.rollouts):
                rid += 1
                ro = Rollout(http, url, make_key(daemon.token, rid), json.loads(json.dumps(base)), rng, a.api)
                ro.call()  # untimed: the first call renders the whole history (a new root)
                rollouts[name].append(ro)
        def n_tokens(ro: Rollout) -> int:
            return len(tok.encode(tok.apply_chat_template(ro.messages, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True)))

        for name in ("short", "long"):
            lengths[name].append(n_tokens(rollouts[name][0]))
        times = httpx.get(engine_url + "/times").json()["times"]
        n_setup = len(times)
        waits: list[tuple[str, float]] = []
        for _ in range(a.calls):  # interleaved: a short call, a long call, ...
            for i in range(a.rollouts):
                for name in ("short", "long"):
                    waits.append((name, rollouts[name][i].call()))
            print(f"  {len(waits)} timed calls", file=sys.stderr)
        engine_times = httpx.get(engine_url + "/times").json()["times"][n_setup:]
        added: dict[str, list[float]] = {"short": [], "long": []}
        for (name, waited), spent in zip(waits, engine_times, strict=True):
            added[name].append(waited - spent)
        for name in ("short", "long"):
            lengths[name].append(n_tokens(rollouts[name][0]))
        health = http.get(url + "/health").json()
        # the baseline: a proxy that re-renders and re-tokenises the whole long history on every call
        long_msgs = rollouts["long"][0].messages
        retok = []
        for _ in range(3):
            t0 = time.perf_counter()
            tok.encode(tok.apply_chat_template(long_msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True))
            retok.append(time.perf_counter() - t0)
        med_s, med_l, med_r = (statistics.median(added["short"]), statistics.median(added["long"]),
                               statistics.median(retok))
        print(f"proxy calls: {health['calls']}, reused prompt tokens {health['reused_tokens']:,} of "
              f"{health['prompt_tokens']:,}, branches {health['branches']}, records acked {daemon.records}")
        print(f"history {lengths['short'][0]:,}-{lengths['short'][1]:,} tokens: median added time {med_s * 1e3:.2f} ms "
              f"(p90 {sorted(added['short'])[int(0.9 * len(added['short']))] * 1e3:.2f} ms, "
              f"{len(added['short'])} calls)")
        print(f"history {lengths['long'][0]:,}-{lengths['long'][1]:,} tokens: median added time {med_l * 1e3:.2f} ms "
              f"(p90 {sorted(added['long'])[int(0.9 * len(added['long']))] * 1e3:.2f} ms, {len(added['long'])} calls)")
        print(f"re-tokenising the long history (render + encode, same tokenizer): median {med_r * 1e3:.1f} ms")
        print(f"added time at {a.long // 1000}k / at {a.short // 1000}k tokens: {med_l / med_s:.2f}x (target <= 2); "
              f"re-tokenising / added time at {a.long // 1000}k: {med_r / med_l:.1f}x (target >= 20)")
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
