"""The reference harness: a minimal coding agent, run as `python -m gyre_slurm.harness.reference_agent`.

It reads TASK.md in the current folder (the workspace) and talks to an OpenAI-compatible endpoint (OPENAI_BASE_URL
and OPENAI_API_KEY from the environment; the model name from GYRE_MODEL, default "policy") in the conversation
shape of harness/agent_spec.py: it carries out write_file calls until the model answers without a tool call or
MAX_TURNS calls are used. Exit codes: 0 done (also when the turn budget is used up: the evaluator scores what is
there), 2 no TASK.md, 3 the API failed (one line on stderr). An endpoint it cannot reach is tried again for
GYRE_RECONNECT_S seconds (default 60: a restarted proxy is back by then). Standard library only (chat_client.py
says why), so a worker's dozens of agents start in a few hundredths of a second each.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from gyre_slurm.harness import agent_spec
from gyre_slurm.harness.chat_client import ChatAPIError, ChatClient
from gyre_slurm.harness.paths import TASK_FILE, check_relpath

EXIT_NO_TASK = 2
EXIT_API_ERROR = 3


def write_file(root: Path, arguments: str) -> str:
    """Carry out one write_file call; the tool result (an error string when the call is refused)."""
    try:
        args = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return f"error: write_file arguments are not valid JSON: {str(arguments)[:200]!r}"
    if not isinstance(args, dict) or not isinstance(args.get("path"), str) or not isinstance(args.get("content"),
                                                                                            str):
        return "error: write_file needs a JSON object with string fields 'path' and 'content'"
    path, content = args["path"], args["content"]
    try:
        rel = check_relpath(path)
    except ValueError as e:
        return f"error: {e}"
    target = (root / rel).resolve()
    if not target.is_relative_to(root):
        return f"error: file name {path!r} leads outside the workspace"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        data = content.encode()
        target.write_bytes(data)
    except OSError as e:
        return f"error: cannot write {path!r}: {e.strerror or e}"
    return agent_spec.tool_result(path, len(data))


def tool_latency(root: Path) -> float:
    """Seconds the tool takes in this run: 0, or a log-normal draw seeded by the workspace's name (the rollout id),
    so the same rollout waits as long under every policy compared."""
    try:
        median_s, sigma = (float(x) for x in (root / agent_spec.LATENCY_FILE).read_text().split())
    except (OSError, ValueError):
        return 0.0
    z = random.Random(root.name).gauss(0.0, 1.0)
    return max(0.0, median_s * math.exp(sigma * z))


def _assistant_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The reply as the model gave it, so the next prompt extends the previous one token for token."""
    calls = [{k: v for k, v in tc.items() if v is not None} for tc in msg["tool_calls"]]
    return {"role": "assistant", "content": msg.get("content"), "tool_calls": calls}


def _tool_result(root: Path, tc: dict[str, Any]) -> str:
    fn = tc.get("function") or {}
    if tc.get("type") != "function" or fn.get("name") != agent_spec.WRITE_FILE_TOOL["function"]["name"]:
        name = fn.get("name") if tc.get("type") == "function" else tc.get("type")
        return f"error: unknown tool {name!r}; the only tool is write_file"
    return write_file(root, fn.get("arguments"))


def converse(client: ChatClient, model: str, task: str, root: Path) -> int:
    """Run the conversation; the number of model calls made."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": agent_spec.SYSTEM_PROMPT},
                                      {"role": "user", "content": task}]
    slow = tool_latency(root)  # paid once, after the first tool call: like running the tests after an edit
    for turn in range(1, agent_spec.MAX_TURNS + 1):
        msg = client.create(model=model, messages=messages, tools=agent_spec.TOOLS, temperature=1.0, max_tokens=128)
        if not msg.get("tool_calls"):
            print(f"turn {turn}: done: {(msg.get('content') or '')[:200]!r}", flush=True)
            return turn
        messages.append(_assistant_message(msg))
        for tc in msg["tool_calls"]:
            result = _tool_result(root, tc)
            print(f"turn {turn}: {result}", flush=True)
            messages.append({"role": "tool", "tool_call_id": tc.get("id"), "content": result})
            time.sleep(slow)
            slow = 0.0
    print(f"turn budget of {agent_spec.MAX_TURNS} model calls used up", flush=True)
    return agent_spec.MAX_TURNS


def main() -> int:
    root = Path.cwd().resolve()
    try:
        task = (root / TASK_FILE).read_text()
    except OSError as e:
        print(f"reference_agent: cannot read {TASK_FILE} in {root}: {e.strerror or e}", file=sys.stderr)
        return EXIT_NO_TASK
    try:
        client = ChatClient(os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1"),
                            os.environ.get("OPENAI_API_KEY", ""),
                            reconnect_s=float(os.environ.get("GYRE_RECONNECT_S", "60")))
        converse(client, os.environ.get("GYRE_MODEL", "policy"), task, root)
    except ChatAPIError as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"reference_agent: model API error: {first}", file=sys.stderr)
        return EXIT_API_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
