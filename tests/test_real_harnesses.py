"""The real coding-agent CLIs as harnesses, unmodified: Claude Code and Codex CLI (from npm, installed by the test
command with `gyre harness install all`) on a built-in task, through a real proxy, engines and daemon, with the
built-in long-context model (the real Qwen3 tokenizer) warmed up on each CLI's own conversations.

The models are built through the same code and config as `gyre run configs/<cli>.yaml` and cached under the
repository's state/models/ (where `gyre run` finds them too).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import msgpack
import pytest
import yaml

from gyre_slurm.config import load_config
from gyre_slurm.harness.install import find_binary
from gyre_slurm.launch.local import start_local_run
from gyre_slurm.proxy.journal import journal_path
from gyre_slurm.rundir import new_run_id
from gyre_slurm.trajectory.segments import read_record, whole_prompts

from .conftest import REPO, q

# building a harness's model the first time (its demonstrations and warm-up: ~24 min each beside the rest of the suite
# under tools/test.sh) is part of the first test's setup, unless tools/test.sh's background build made it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

STATE = REPO / "state"
# an HTTP error from the proxy, as each CLI prints it (Claude Code: "API Error: 400 {…}"; Codex: "unexpected status
# 400 Bad Request: …")
PROXY_ERROR = re.compile(r"API Error: [45]\d\d|unexpected status [45]\d\d|\b[45]\d\d (?:Bad Request|Unauthorized|"
                         r"Not Found|Internal Server Error)")
# the one way a run may end non-zero here: the policy's reply ran into the CLI's own output-token limit (a loop)
OWN_LIMIT = "output token maximum"


@pytest.fixture(scope="module", params=["claude-code", "codex"])
def harness_model(request) -> tuple[str, Path]:
    """(preset, the warmed-up long-context model for it), built as `gyre run configs/<preset>.yaml` builds it."""
    from gyre_slurm.bootstrap.base_model import ensure_model

    preset = request.param
    find_binary(preset, STATE)  # installed by tools/test.sh; a missing CLI fails here, with how to install it
    data = yaml.safe_load((REPO / "configs" / f"{preset}.yaml").read_text())
    data["run"]["state_dir"] = str(STATE)
    path = Path(request.config.cache.mkdir("gyre")) / f"{preset}.yaml"
    path.write_text(yaml.safe_dump(data))
    return preset, ensure_model(load_config(path), print)


def _run_config(tmp_path: Path, preset: str, model: Path) -> Path:
    """The preset's own config, one short step. Its runs live where `gyre run` puts them (state/<preset>-<date>-
    <time>/workspaces/r<id>): the CLIs write the workspace path into their prompts (Codex ten times), and the tiny
    warmed-up policy has seen paths of that shape only; under pytest's tmp folders it may fail every first call."""
    data = yaml.safe_load((REPO / "configs" / f"{preset}.yaml").read_text())
    data["run"].update(state_dir=str(STATE), max_wall_s=900)
    data["model"] = {"path": str(model)}
    data["tasks"].update(group_size=4, groups_per_step=1)
    data["train"]["steps"] = 1
    path = tmp_path / f"{preset}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _journal_calls(run_dir: Path) -> set[tuple[int, int]]:
    out = set()
    for p in journal_path(run_dir, "x").parent.glob("journal-*.bin"):
        with open(p, "rb") as f:
            for entry in msgpack.Unpacker(f, raw=False, strict_map_key=False):
                if entry.get("k") == "rec":
                    out.add((entry["rec"]["rollout_id"], entry["rec"]["call_index"]))
    return out


def test_a_real_cli_runs_through_the_proxy_token_exact(tmp_path: Path, harness_model: tuple[str, Path]) -> None:
    from transformers import AutoTokenizer

    preset, model = harness_model
    config = _run_config(tmp_path, preset, model)
    run = start_local_run(load_config(config), new_run_id(preset))
    try:
        assert run.daemon.wait(timeout=800) == 0
        run.wait(timeout_s=30)
    finally:
        run.kill()
    db = run.run_dir / "ledger.db"
    logs = run.run_dir / "logs"
    rollouts = q(db, "SELECT id, status, n_calls, workspace, error FROM rollouts ORDER BY id")
    assert rollouts, "no rollout ran"
    for rid, status, _n_calls, ws, error in rollouts:
        log = (Path(ws) / ".gyre" / "harness.log").read_text(errors="replace")
        # the CLI ran to its end (COMPLETED: exit 0 within the time limit), or stopped at its own output limit (the
        # policy's doing: scored as TRUNCATED_CONTEXT); the proxy never refused it
        assert status == "COMPLETED" or (status == "TRUNCATED_CONTEXT" and OWN_LIMIT in error), (rid, status, error)
        assert not PROXY_ERROR.search(log), log[-2000:]
    # the warmed-up policy writes well-formed tool calls in the CLI's format, so runs go on for several calls (a
    # sampled reply that does not parse is the CLI's final answer: such a run ends early, and RL learns from it)
    assert max(n for _r, st, n, _w, _e in rollouts if st == "COMPLETED") >= 3, rollouts
    assert "answered 4" not in (logs / "proxy.log").read_text() and "answered 5" not in (logs / "proxy.log").read_text()
    # every call the proxy answered (its journal) is in the ledger, once
    calls = q(db, "SELECT rollout_id, call_index, segment_offset, segment_length FROM model_calls")
    assert {(r, c) for r, c, *_ in calls} == _journal_calls(run.run_dir) and len(calls) == len(set(calls))
    # each main-line call's prompt is the previous call's prompt + output + the new messages' own ids
    tok = AutoTokenizer.from_pretrained(model)
    with open(run.run_dir / "segments" / "calls.seg", "rb") as f:  # ids come back as arrays (packed in the file)
        recs = {(r, c): read_record(f, o, n) for r, c, o, n in calls}
    chained = 0
    for rid, *_ in rollouts:
        mine = [v for (r, _c), v in sorted(recs.items()) if r == rid]
        whole = whole_prompts(mine)
        for rec in mine:
            p = rec["parent_call"]
            if rec["kind"] != "main" or p is None:
                continue
            prev = whole[p] + recs[(rid, p)]["output_ids"].tolist()
            assert whole[rec["call_index"]][:len(prev)] == prev  # token for token, sampled ids never re-encoded
            suffix = whole[rec["call_index"]][len(prev):]
            text = tok.decode(suffix)
            assert suffix == tok.encode(text, add_special_tokens=False)  # the new messages, tokenised alone
            assert text.startswith("\n<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n"), text[-300:]
            chained += 1
    assert chained >= 2
    # the run trained on what it recorded
    assert q(db, "SELECT step, status FROM train_steps") == [(0, "DONE")]
    shutil.rmtree(run.run_dir)  # kept for a look when an assertion above failed
