"""The proxy's test world, shared by the proxy tests: the real tiny model behind SGLang's /generate (scripted or
sampled), the daemon played by the test over real ZeroMQ, and the proxy as a real `gyre proxy` process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

import httpx
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gyre_slurm import spawn as spawning
from gyre_slurm.protocol import CallAck, CallRecord, ProxyHello, Route, RouteQuery, decode, encode
from gyre_slurm.rundir import ControlInfo, new_token, write_control
from gyre_slurm.trajectory.segments import whole_prompts

REPO = Path(__file__).resolve().parents[1]
WEIGHT_VERSION = 7


# --- the engine: SGLang's /generate over the real tiny model ---------------------------------------------------
class TinyEngine:
    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.script: deque[str | list[int]] = deque()  # replies (text or ids) to force, in order; empty: sample
        self.fail_next = 0  # answer 503 this many times (an engine going away)
        # abort the next scripted replies after this many tokens (a cell leaving the rollout pool), as SGLang does:
        # the ids so far with their logprobs, finish_reason abort, here by the previous weight version; the rest
        # of the reply is what the next generate samples
        self.abort_after: deque[int] = deque()
        self.seen: list[list[int]] = []  # input_ids of every generate that answered 200
        self.lock = threading.Lock()

    def _logprobs(self, prompt: list[int], out: list[int]) -> list[float]:
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        lp = self.torch.log_softmax(logits.float(), -1)
        return [float(lp[i, t]) for i, t in enumerate(out)]

    def _sample(self, prompt: list[int], n: int, temperature: float, stop: set[int], seed: int) -> list[int]:
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        past, ids = None, torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(n):
                res = self.model(ids, cache=past, use_cache=True)
                past, logits = res.cache, res.logits[0, -1].float()
                if temperature == 0:
                    t = int(logits.argmax())
                else:
                    t = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
                out.append(t)
                if t in stop:
                    break
                ids = torch.tensor([[t]])
        return out

    def generate(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            if self.fail_next:
                self.fail_next -= 1
                return 503, {"error": "engine going away"}
            prompt, sp = body["input_ids"], body["sampling_params"]
            n, stop = sp["max_new_tokens"], set(sp.get("stop_token_ids") or [])
            version = WEIGHT_VERSION
            if self.script:
                out = self.script.popleft()
                if isinstance(out, str):
                    out = self.tok.encode(out, add_special_tokens=False) + [self.tok.eos_token_id]
            else:
                out = self._sample(prompt, n, sp.get("temperature", 1.0), stop, seed=len(self.seen))
            out = out[:n]
            finish = {"type": "stop", "matched": out[-1]} if out and out[-1] in stop else {"type": "length",
                                                                                            "length": len(out)}
            if self.abort_after and self.abort_after[0] < len(out):
                k = self.abort_after.popleft()
                self.script.appendleft(out[k:])
                out, finish, version = out[:k], {"type": "abort", "message": "Aborted"}, version - 1
            self.seen.append(list(prompt))
            lps = self._logprobs(prompt, out)
        return 200, {"output_ids": out, "meta_info": {
            "id": body.get("rid"), "finish_reason": finish, "prompt_tokens": len(prompt), "cached_tokens": 0,
            "completion_tokens": len(out), "weight_version": str(version),
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out, strict=True)]}}

    def serve(self) -> tuple[str, object]:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request):
            status, out = self.generate(await request.json())
            return JSONResponse(out, status_code=status)

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", server


# --- the daemon, played by the test ---------------------------------------------------------------------------
class FakeDaemon:
    def __init__(self, run_dir: Path, engine_url: str) -> None:
        self.token, self.engine_url = new_token(), engine_url
        self.engines: dict[int, list[str]] = {}  # rollout -> engine urls to hand out in turn (the last one stays)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        write_control(run_dir, ControlInfo(endpoint=f"tcp://127.0.0.1:{port}", port=port, token=self.token,
                                           daemon_pid=os.getpid(), daemon_host="localhost", started_at=time.time()))
        self.records: dict[tuple[int, int], CallRecord] = {}  # with whole prompts
        self.deltas: dict[tuple[int, int], CallRecord] = {}  # as received
        self.receipts: list[tuple[int, int]] = []  # every CallRecord frame, replays included
        self.hellos: list[ProxyHello] = []
        self.route_queries: list[int] = []
        self.closed: set[int] = set()  # Route(open=False) and CallAck(rollout_open=False) for these
        self.close_after_next_call: set[int] = set()
        self.acking = True
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = decode(frame, self.token)
            if isinstance(msg, ProxyHello):
                self.hellos.append(msg)
            elif isinstance(msg, RouteQuery):
                self.route_queries.append(msg.rollout_id)
                ok = msg.rollout_id not in self.closed
                urls = self.engines.get(msg.rollout_id) or [self.engine_url]
                url = urls.pop(0) if len(urls) > 1 else urls[0]
                reply = Route(rollout_id=msg.rollout_id, open=ok, cell=1 if ok else None,
                              engine_url=url if ok else None, weight_version=WEIGHT_VERSION)
                self.sock.send_multipart([ident, encode(reply, self.token)])
            elif isinstance(msg, CallRecord):
                key = (msg.rollout_id, msg.call_index)
                self.receipts.append(key)
                if key not in self.records:  # a replay of a known record is ignored
                    self.deltas[key] = msg
                    # the record carries the prompt after its parent's reused ids: keep the whole prompt, and the
                    # ids as lists (they arrive as arrays) for the tests to compare
                    calls = [r for (rid, _), r in sorted(self.deltas.items()) if rid == msg.rollout_id]
                    whole = whole_prompts(calls)[msg.call_index]
                    self.records[key] = msg.model_copy(update={
                        "prompt_ids": whole, "output_ids": msg.output_ids.tolist(),
                        "output_logprobs": msg.output_logprobs.tolist()})
                if self.acking:
                    if msg.rollout_id in self.close_after_next_call:
                        self.closed.add(msg.rollout_id)
                    ack = CallAck(rollout_id=msg.rollout_id, call_index=msg.call_index,
                                  rollout_open=msg.rollout_id not in self.closed)
                    self.sock.send_multipart([ident, encode(ack, self.token)])

    def calls(self, rollout_id: int) -> list[CallRecord]:
        return [r for (rid, _), r in sorted(self.records.items()) if rid == rollout_id]

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


# --- the proxy process ----------------------------------------------------------------------------------------
class ProxyProc:
    options: tuple[str, ...] = ("--proxy-id", "p0", "--check-canonical", "--idle-check-s", "1")  # `gyre proxy`'s

    def __init__(self, run_dir: Path, model_dir: Path, log_path: Path) -> None:
        self.run_dir, self.model_dir, self.log_path = run_dir, model_dir, log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        ready = self.run_dir / "proxy-ready.json"  # an earlier proxy's stays: a restart takes its port again
        before = ready.stat().st_mtime_ns if ready.exists() else None
        argv = spawning.gyre_argv("proxy", "--run-dir", str(self.run_dir), "--model-path", str(self.model_dir),
                                  "--port", "0", "--ready-file", str(ready), *self.options)
        self.proc = spawning.spawn(argv, self.log_path, cwd=REPO)
        fresh = lambda: ready.exists() and ready.stat().st_mtime_ns != before and spawning.read_ready_file(ready)  # noqa: E731
        self.url = spawning.wait_until(fresh, what="the proxy", timeout_s=60, procs=self.proc,
                                       log=self.log_path)["url"]
        return self.url

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


def start_embedded_engine(model_dir: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / "engine-ready.json"
    argv = spawning.gyre_argv("engine", "--model-path", str(model_dir), "--port", "0", "--ready-file", str(ready),
                              "--weight-version", str(WEIGHT_VERSION))
    proc = spawning.spawn(argv, tmp / "engine.log", cwd=REPO)
    return proc, str(ready)




def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
