"""The real CLIs inside tasks' images: Claude Code (npm, its Node bound in read-only) and mini-swe-agent (PyPI, its
virtual environment and the worker's Python bound in read-only) run a demonstration — the scripted proxy answers
with their own tool calls (proxy/scripted.py) — through the worker's rollout path: their tool calls run inside the
image, they reach the proxy only through the run's relay, and the run is scored in a fresh copy of the image.

A demonstration that calls lua5.4, which the image has and this machine lacks, solves its task in the image and
fails the same task on the host's files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gyre_slurm.bootstrap.demos import MODEL_NAME, SIDE_REPLY, shell_call
from gyre_slurm.harness.cli_spec import CliSpec, shipped
from gyre_slurm.harness.install import find_binary
from gyre_slurm.harness.netrelay import ProxyBridge
from gyre_slurm.harness.presets import command
from gyre_slurm.harness.sandbox import make_sandbox
from gyre_slurm.harness.tasks import TaskSpec, load_suite
from gyre_slurm.protocol import RolloutAssignment, RolloutDone
from gyre_slurm.worker.rollout import execute_rollout

from .images import FIXTURES, REPO, fixture_images_built, runtime

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STATE = REPO / "state"  # the CLIs, installed by tools/test.sh (`gyre harness install all`)
LUA = "lua5.4 -e 'local s = 0 for l in io.lines(\"numbers.txt\") do s = s + tonumber(l) end print(s)' | tee sum.txt"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The long model's tokenizer and chat template (the scripted proxy renders with them; it generates nothing)."""
    from gyre_slurm.model.long import create_long_model

    fixture_images_built()
    return create_long_model(tmp_path_factory.mktemp("model") / "long", seed=0)


def _demo(model: Path, task: TaskSpec, ws: Path, preset: str, replies: list[str], rt=None, sandbox=None,
          spec: CliSpec | None = None) -> tuple[RolloutDone, list]:
    """One rollout of the CLI whose model replies are `replies` (then "OK" to any side call)."""
    from gyre_slurm.proxy.scripted import ScriptedServer

    server = ScriptedServer(model, lambda _rid, turn, kind: replies[min(turn, len(replies) - 1)]
                            if kind == "main" else SIDE_REPLY)
    with server.serving() as url:
        bridge = ProxyBridge(lambda: f"{url}/v1")
        try:
            a = RolloutAssignment(rollout_id=1, task=task.model_dump(mode="json"), api_key=server.key(1),
                                  base_url=f"{url}/v1", workspace=str(ws), timeout_s=240, preset=preset,
                                  harness=command(preset, MODEL_NAME, max_turns=4, cli=spec), max_tokens=256,
                                  model_name=MODEL_NAME, cli=spec.model_dump(mode="json") if spec else None)
            done = execute_rollout(a, "w", state_dir=STATE, sandbox=sandbox, images=rt, proxy_socket=bridge.path)
        finally:
            bridge.close()
    return done, server.rollouts[1].calls if 1 in server.rollouts else []


def _decoded(model: Path, calls: list) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(c.prompt_ids) for c in calls if c.kind == "main"]


@pytest.mark.parametrize("rt_name", ["image", "podman"])
def test_claude_code_runs_its_tool_calls_inside_the_image(tmp_path: Path, model: Path, rt_name: str) -> None:
    find_binary("claude-code", STATE)
    rt = runtime("podman" if rt_name == "podman" else "bwrap")
    task = {t.id: t for t in load_suite(f"harbor:{FIXTURES / 'harbor-images'}")}["lua-sum"]
    done, calls = _demo(model, task, tmp_path / "ws", "claude-code", [shell_call("claude-code", LUA), "Done."], rt)
    assert (done.status, done.reward) == ("COMPLETED", 1.0), (done.error, done.harness_log)
    prompts = _decoded(model, calls)
    assert len(prompts) == 2 and "189" in prompts[1].split("<tool_response>")[-1], prompts[-1][-1500:]
    assert "/app" in prompts[0]  # its working folder is the image's (Claude Code names it in its prompt)
    assert (tmp_path / "ws" / "changes" / "sum.txt").read_text().strip() == "189"


def test_the_same_demonstration_fails_on_the_host(tmp_path: Path, model: Path) -> None:
    """The lua-sum task on the host's files (its numbers as starting files, the same check): lua5.4 is not there."""
    assert shutil.which("lua5.4") is None
    env = FIXTURES / "harbor-images" / "lua-sum" / "environment"
    check = "import pathlib; p = pathlib.Path('sum.txt'); print(1.0 if p.exists() and p.read_text().strip() == '189' " \
            "else 0.0)"
    task = TaskSpec(id="lua-sum-host", prompt="Sum numbers.txt with lua5.4 into sum.txt.",
                    files={"numbers.txt": (env / "numbers.txt").read_text()}, evaluator=["{python}", "-c", check])
    done, calls = _demo(model, task, tmp_path / "ws", "claude-code", [shell_call("claude-code", LUA), "Done."],
                        sandbox=make_sandbox("bwrap"))
    assert (done.status, done.reward) == ("COMPLETED", 0.0), done.error
    assert "lua5.4: not found" in _decoded(model, calls)[1] or "command not found" in _decoded(model, calls)[1]


def test_mini_swe_agent_solves_the_swe_fixture_inside_the_image(tmp_path: Path, model: Path) -> None:
    """(In bubblewrap: podman runs the same jail, which Claude Code's test shows in both.)"""
    spec = shipped()["mini-swe-agent"]
    find_binary(spec, STATE)
    rt = runtime("bwrap")
    task = {t.id: t for t in load_suite(f"swe:{FIXTURES / 'swe' / 'tasks.jsonl'}")}["gyre__sevens-1"]
    replies = [shell_call(spec, "printf 7777777 > answer.txt && cat /etc/debian_version && pwd"),
               shell_call(spec, spec.finish or "")]
    done, calls = _demo(model, task, tmp_path / "ws", "cli", replies, rt, spec=spec)
    assert (done.status, done.reward) == ("COMPLETED", 1.0), (done.error, done.harness_log)
    prompts = _decoded(model, calls)
    result = prompts[1].split("<tool_response>")[-1]
    assert "/testbed" in result and "12." in result, result  # it ran in the repository, in the image's Debian 12
    assert (tmp_path / "ws" / "changes" / "answer.txt").read_text() == "7777777"
