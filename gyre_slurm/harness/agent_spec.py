"""What the reference harness says to the model: its system prompt and its one tool.

Shared by the reference agent (harness/reference_agent.py) and the tiny model's warm-up (demonstrations in
the same format), so both speak exactly the same conversation shape.
"""

from __future__ import annotations

SYSTEM_PROMPT = "You are a coding agent. Use write_file to write files. Then say done."

WRITE_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write text to a file in the workspace.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}
TOOLS = [WRITE_FILE_TOOL]
FINAL_MESSAGE = "done"
MAX_TURNS = 4  # model calls per run before the harness gives up
# "median_s sigma" in a task's workspace: the tool is slow (builtin:longtail); absent: instant
LATENCY_FILE = ".tool_latency"


def tool_result(path: str, n_bytes: int) -> str:
    return f"wrote {n_bytes} bytes to {path}"
