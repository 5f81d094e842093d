"""Demonstrations in a harness's own conversation format, for the warm-up of a policy that will run under it.

The real CLI (Claude Code, Codex, one a CLI spec describes) runs on a built-in task in a workspace laid out like
a rollout's, against the scripted proxy (proxy/scripted.py): its requests go through the proxy's own parsing and
TITO prompt building, and the "model" answers with a short script — a tool call that writes a (noisy) answer
with the CLI's shell tool, one that reads it back, then a final message. The CLI really runs the tools. What
comes back is the main line's token ids exactly as a rollout of that harness would present them to the policy,
with the replies marked as targets: a supervised warm-up on these teaches well-formed tool calls in that
harness's format and a run that makes several calls.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import GyreError
from gyre_slurm.harness import agent_spec, builtin_suite
from gyre_slurm.harness.cli_spec import CliSpec
from gyre_slurm.harness.presets import command, launch
from gyre_slurm.harness.runner import describe_exit, log_tail, run_harness
from gyre_slurm.harness.tasks import TaskSpec
from gyre_slurm.harness.workspace import lay_out

MODEL_NAME = "gyre-policy"
DEMO_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Demo:
    ids: list[int]  # the main line's last call: prompt ∥ output
    mask: list[int]  # 1 on every reply token of the main line (the targets)
    harness: str
    task_id: str
    answer: str
    context: int = 0  # the workspace path it was recorded at: demonstrations of one share their whole context


def _tool_call(name: str, arguments: dict) -> str:
    """A reply in the Qwen3 chat format the proxy parses."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def shell_call(harness: str | CliSpec, cmd: str) -> str:
    """A call of the harness's own shell tool (the names and arguments its tool schemas give)."""
    if isinstance(harness, CliSpec):
        return _tool_call(harness.shell_tool.name, {harness.shell_tool.argument: cmd})
    if harness == "claude-code":  # its optional "description" left out: the shorter the reply, the fewer slips
        return _tool_call("Bash", {"command": cmd})
    if harness == "codex":
        return _tool_call("exec_command", {"cmd": cmd})
    raise ValueError(f"no shell tool known for harness {harness!r}")


def demo_replies(harness: str | CliSpec, answer: str) -> list[str]:
    """The main line of a demonstration: write the answer, read it back, say done — or, for a CLI that ends on a
    command, run it (its spec's `finish`) (the reference agent has one tool, write_file: it writes, then says done)."""
    if harness == "reference":
        return [_tool_call("write_file", {"path": builtin_suite.ANSWER_FILE, "content": answer}),
                agent_spec.FINAL_MESSAGE]
    finish = harness.finish if isinstance(harness, CliSpec) else None
    return [shell_call(harness, f"printf {answer} > {builtin_suite.ANSWER_FILE}"),
            shell_call(harness, f"cat {builtin_suite.ANSWER_FILE}"),
            shell_call(harness, finish) if finish else "Done."]


SIDE_REPLY = "OK"  # a side conversation (title, summary, a sub-agent) the script does not cover


def _main_line(calls) -> tuple[list[int], list[int]]:
    """prompt ∥ output of the last main-line call, and the mask of every main-line reply along its chain."""
    by_index = {c.index: c for c in calls}
    last = max((c for c in calls if c.kind == "main"), key=lambda c: c.index)
    ids = last.prompt_ids + last.output_ids
    mask = [0] * len(last.prompt_ids) + [1] * len(last.output_ids)
    c = last
    while c.parent_call is not None:
        p = by_index[c.parent_call]
        start = len(p.prompt_ids)
        if ids[start:start + len(p.output_ids)] != p.output_ids:
            raise GyreError(f"demonstration: call {c.index} does not extend call {p.index} token for token")
        mask[start:start + len(p.output_ids)] = [1] * len(p.output_ids)
        c = p
    return ids, mask


def _run_shaped_paths(harness: str, state_dir: Path, rng: random.Random, n: int) -> list[Path]:
    """n workspace paths shaped like a run's, state/<preset>-<date>-<time>/workspaces/r<id>, each in a run folder
    that does not exist yet (it holds no ledger, so nothing takes it for a run; record_demos removes it)."""
    out: list[Path] = []
    while len(out) < n:
        run = state_dir / (f"{harness}-2026{rng.randrange(1, 13):02d}{rng.randrange(1, 29):02d}-"
                           f"{rng.randrange(24):02d}{rng.randrange(60):02d}{rng.randrange(60):02d}")
        if not run.exists() and run not in [p.parents[1] for p in out]:
            out.append(run / "workspaces" / f"r{rng.randrange(1, 200):06d}")
    return out


def record_demos(harness: str | CliSpec, model_path: Path, state_dir: Path, n: int, *, seed: int,
                 digits: tuple[int, ...], p_right: float, contexts: int = 6, held_out: int = 0,
                 max_tokens: int | None = None,
                 echo: Callable[[str], None] = lambda _m: None) -> tuple[list[Demo], list[Demo]]:
    """Run the harness's real CLI (a preset's name, or a spec) n times on built-in tasks against the scripted proxy,
    then `held_out` times more, each of those at a workspace path of its own; (the n demonstrations, the held-out
    ones)."""
    from gyre_slurm.proxy.scripted import ScriptedServer

    spec = harness if isinstance(harness, CliSpec) else None
    preset, name = ("cli", harness.name) if isinstance(harness, CliSpec) else (harness, harness)

    rng = random.Random(seed)
    answers: dict[int, str] = {}

    def script(rollout_id: int, turn: int, kind: str) -> str:
        if kind != "main":
            return SIDE_REPLY
        replies = demo_replies(harness, answers[rollout_id])
        return replies[min(turn, len(replies) - 1)]

    server = ScriptedServer(model_path, script)
    # workspace paths shaped like a run's, where the runs' own are: the CLIs write the path into their prompts (Codex
    # ten times), so demonstrations recorded at one path share their whole context up to the task (the warm-up
    # prefills it once per step), and several paths keep the policy from hanging on one path's tokens; every real
    # run's path is new to it, as each held-out demonstration's is
    paths = _run_shaped_paths(name, state_dir, rng, contexts + held_out)
    out: list[Demo] = []
    argv = command(preset, MODEL_NAME, max_turns=8, cli=spec)
    try:
        with server.serving() as url:
            for i in range(n + held_out):
                digit, count = rng.choice(digits), rng.choice(sorted(builtin_suite.WORDS))
                task = TaskSpec.model_validate(builtin_suite.tasks((digit,))[sorted(builtin_suite.WORDS).index(count)])
                answers[i] = builtin_suite.noisy_answer(digit, count, rng, p_right)
                ctx = i % contexts if i < n else contexts + i - n
                ws = paths[ctx]
                shutil.rmtree(ws, ignore_errors=True)
                lay_out(task, ws)
                run = launch(preset, argv, ws, f"{url}/v1", server.key(i), task.prompt, state_dir, MODEL_NAME,
                             max_tokens, cli=spec)
                log = ws / ".gyre" / "harness.log"
                h = run_harness(run.argv, ws, run.env, DEMO_TIMEOUT_S, log)
                calls = server.rollouts.get(i)
                if h.exit_code != 0 or calls is None or not any(c.kind == "main" for c in calls.calls):
                    how = ("timed out" if h.timed_out else describe_exit(h.exit_code) if h.exit_code is not None
                           else "?")
                    raise GyreError(f"demonstration {i} with {name}: the CLI {how} after "
                                    f"{len(calls.calls) if calls else 0} calls; last lines of {log}:\n{log_tail(log)}")
                ids, mask = _main_line(calls.calls)
                out.append(Demo(ids, mask, name, task.id, answers[i], ctx))
                kind = f"{i + 1}/{n}" if i < n else f"held out {i - n + 1}/{held_out}"
                echo(f"demonstration {kind} with {name}: {task.id}, {len(calls.calls)} calls, {len(ids)} tokens")
    finally:
        for ws in paths:
            shutil.rmtree(ws.parents[1], ignore_errors=True)
    return out[:n], out[n:]
