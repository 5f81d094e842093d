"""The OpenAI chat-completions call of the reference agent, over the standard library's http.client.

Why not the official `openai` package: importing it costs ~0.65 s of CPU, and a worker starts `harness.
concurrency` agents at once (32 in the embedded default, every step): on 2 cores that was ~11 s of each step
before the first model call. What this sends is what the official client sends for the same call (a JSON body
to POST {OPENAI_BASE_URL}/chat/completions with a bearer key); the proxy is tested against the official clients
themselves in tests/test_proxy_apis.py.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlsplit


class ChatAPIError(Exception):
    """A call that got no usable answer: the message is one line saying why."""


class ChatClient:
    def __init__(self, base_url: str, api_key: str, timeout_s: float = 600.0, reconnect_s: float = 60.0) -> None:
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ChatAPIError(f"OPENAI_BASE_URL {base_url!r} is not an http(s) URL")
        self._conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._path = url.hostname, url.port, url.path + "/chat/completions"
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
        self._timeout = timeout_s
        self._reconnect_s = reconnect_s  # how long a proxy that cannot be reached is tried again (it restarts)
        self._conn: http.client.HTTPConnection | None = None  # kept alive across the turns of one run

    def create(self, **body: Any) -> dict[str, Any]:
        """POST one chat completion; the answer's first choice's message (a dict as the API sent it). A proxy that
        cannot be reached, drops the connection or answers 503 (no route yet: its daemon is restarting) is tried again
        for up to reconnect_s (a supervised process is back within seconds, and the real CLIs retry alike); any other
        error answer is not. A call the proxy had recorded before it died is, retried, a retry of that prompt: the
        tree keeps both, nothing is counted twice."""
        deadline, wait = time.monotonic() + self._reconnect_s, 0.5
        while True:
            try:
                resp, data = self._post(body)
            except TimeoutError as e:
                raise ChatAPIError(f"no answer from {self._host}:{self._port} in {self._timeout:g} s: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                if time.monotonic() + wait > deadline:
                    raise ChatAPIError(f"cannot reach {self._host}:{self._port}: {type(e).__name__}: {e}") from None
            else:  # 503: the proxy has no route yet (its daemon restarting) and ran nothing: tried again alike
                if resp.status != 503 or time.monotonic() + wait > deadline:
                    break
            time.sleep(wait)
            wait = min(2 * wait, 4.0)
        if resp.status != 200:
            raise ChatAPIError(f"HTTP {resp.status}: {_error_message(data)}")
        try:
            return json.loads(data)["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ChatAPIError(f"not a chat completion: {data[:200]!r}") from None

    def _post(self, body: dict[str, Any]) -> tuple[http.client.HTTPResponse, bytes]:
        try:
            if self._conn is None:
                self._conn = self._conn_cls(self._host, self._port, timeout=self._timeout)
            self._conn.request("POST", self._path, json.dumps(body), self._headers)
            resp = self._conn.getresponse()
            return resp, resp.read()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _error_message(data: bytes) -> str:
    try:
        err = json.loads(data).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return data[:300].decode(errors="replace")
