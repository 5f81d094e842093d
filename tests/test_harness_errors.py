"""A failing harness is reported where users look: API errors in the log of a harness that exited 0, a harness
that never called the model (INFRA_ERROR, decided by the daemon), and the "harness errors" block of `gyre status`.
The log lines are the ones Claude Code 2.1.197 and Codex CLI 0.171.0 print against a server answering 400, 404,
500 or cutting its event stream short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from gyre_slurm.config import parse_config
from gyre_slurm.coordinator.rollouts import CellSlot, RolloutBook
from gyre_slurm.harness.api_errors import (
    api_error_lines,
    api_error_reason,
    length_limit_line,
    match_api_error,
    policy_stop_line,
)
from gyre_slurm.harness.cli_spec import shipped
from gyre_slurm.harness.runner import HarnessResult
from gyre_slurm.ledger import queries
from gyre_slurm.ledger.readonly import connect_readonly
from gyre_slurm.ledger.records import Ledger
from gyre_slurm.protocol import CallRecord, ContextLimit, RolloutDone
from gyre_slurm.scoring.evaluator import EvalResult
from gyre_slurm.status_view import harness_errors_text, render_status
from gyre_slurm.statuses import RolloutStatus
from gyre_slurm.worker.rollout import classify

CLAUDE_400 = "API Error: 400 tools: unsupported tool type web_search_20250305"
CLAUDE_500 = ("API Error: 500 tools: unsupported tool type web_search_20250305. This is a server-side issue, usually "
              "temporary — try again in a moment. If it persists, check your inference gateway (127.0.0.1:18402).")
CLAUDE_RESET = "API Error: Connection to the API was lost (ECONNRESET). This is usually temporary — try again."
CLAUDE_JSON = json.dumps({"type": "result", "subtype": "success", "is_error": True, "api_error_status": 400,
                          "duration_ms": 118, "num_turns": 1, "result": CLAUDE_400, "stop_reason": "stop_sequence",
                          "session_id": "9b940588-74d2-4fe9-b797-a688cc7a4161"}, separators=(",", ":"))
CODEX_BODY = 'ERROR: {"error": {"message": "tools: unsupported tool type x", "type": "invalid_request_error"}}'
CODEX_404 = ("ERROR: unexpected status 404 Not Found: tools: unsupported tool type x, "
             "url: http://127.0.0.1:18405/v1/responses")
CODEX_CUT = ("ERROR: stream disconnected before completion: Transport error: network error: error decoding "
             "response body")
CODEX_500 = "ERROR: We’re currently experiencing high demand, which may cause temporary errors."
CODEX_CONTEXT = ("ERROR: Codex ran out of room in the model's context window. Start a new thread or clear earlier "
                 "history before retrying.")
CLAUDE_OWN_LIMIT = ("API Error: Claude's response exceeded the 256 output token maximum. To configure this behavior, "
                    "set the CLAUDE_CODE_MAX_OUTPUT_TOKENS environment variable.")
CLAUDE_CONTEXT = "API Error: The model has reached its context window limit."
CODEX_JSON_ERROR = '{"type":"error","message":"stream disconnected before completion: Transport error"}'
CODEX_JSON_FAILED = '{"type":"turn.failed","error":{"message":"unexpected status 400 Bad Request: bad"}}'

NOT_ERRORS = [
    "ERROR: Reconnecting... 2/5",  # Codex's retry notice
    '{"type":"error","message":"Reconnecting... 1/5 (stream disconnected before completion: Transport error)"}',
    "2026-12-01T19:38:36.078440Z ERROR codex_api::endpoint::responses_websocket: failed to connect to Responses "
    "WebSocket stage=Unknown",  # a tracing line
    '{"type":"item.completed","item":{"id":"item_0","type":"error","message":"Model metadata for `policy` not '
    'found. Defaulting to fallback metadata; this can degrade performance and cause issues."}}',
    "warning: Model metadata for `policy` not found. Defaulting to fallback metadata",
    "ERROR: test_parse.py::test_empty - AssertionError",  # a task's own test output, echoed by Codex
    "ERROR: Could not find a version that satisfies the requirement numpy",
    "FAILED tests/test_x.py::test_api - RuntimeError: API Error: 500",  # not at the start of the line
    "print('API Error: 400')",  # code the agent wrote, shown in a diff
    '{"type":"result","subtype":"success","is_error":false,"result":"Done: wrote answer.txt"}',
    '{"type":"assistant","message":{"content":[{"type":"text","text":"API Error: 400 tools: x"}]},"error":"unknown"}',
    "Prompt is too long · the request is ~9000 tokens (limit 4096)",  # the daemon's context limit says it
    "",
]


@pytest.mark.parametrize("line, want", [
    (CLAUDE_400, CLAUDE_400), (CLAUDE_500, CLAUDE_500[:300]), (CLAUDE_RESET, CLAUDE_RESET),
    (CLAUDE_JSON, CLAUDE_400), (CODEX_BODY, CODEX_BODY), (CODEX_404, CODEX_404), (CODEX_CUT, CODEX_CUT),
    (CODEX_500, CODEX_500), (CODEX_CONTEXT, CODEX_CONTEXT),
    (CODEX_JSON_ERROR, "stream disconnected before completion: Transport error"),
    (CODEX_JSON_FAILED, "unexpected status 400 Bad Request: bad"), ("  " + CLAUDE_400 + "\r", CLAUDE_400),
])
def test_the_api_errors_the_clis_print_are_matched(line: str, want: str) -> None:
    assert match_api_error(line) == want


@pytest.mark.parametrize("line", NOT_ERRORS)
def test_other_lines_are_not(line: str) -> None:
    assert match_api_error(line) is None


def test_a_log_gives_each_error_once_the_last_ones_kept() -> None:
    log = "\n".join(["user", "write hello to a.txt", "ERROR: Reconnecting... 1/5", CODEX_404, CODEX_404, CODEX_CUT,
                     "ERROR: Reconnecting... 1/5", CODEX_500, CODEX_CUT, "tokens used", "0"])
    assert api_error_lines(log) == [CODEX_404, CODEX_500, CODEX_CUT]
    assert api_error_lines(log, max_lines=1) == [CODEX_CUT]
    assert api_error_reason(log) == ("harness exited 0 but its log shows API errors from the proxy:\n"
                                     f"{CODEX_404}\n{CODEX_500}\n{CODEX_CUT}")
    assert api_error_reason("\n".join(NOT_ERRORS)) is None


def test_classify_keeps_the_evaluators_status_and_fills_the_error() -> None:
    ok, timed_out, crashed = HarnessResult(0, False, 1.0), HarnessResult(None, True, 9.0), HarnessResult(1, False, 1.0)
    scored, broken = EvalResult(0.5, None, 0.1, 1), EvalResult(None, "evaluator exit code 2", 0.1, 1)
    why = api_error_reason(CLAUDE_400)
    assert classify(ok, scored, CLAUDE_400, why) == (RolloutStatus.COMPLETED, 0.5, why)
    assert classify(timed_out, scored, CLAUDE_400, why) == (RolloutStatus.TIMEOUT_SCORED, 0.5, why)
    assert classify(ok, broken, CLAUDE_400, why) == (RolloutStatus.EVAL_ERROR, None, f"evaluator exit code 2\n{why}")
    assert classify(ok, scored, "fine") == (RolloutStatus.COMPLETED, 0.5, None)
    status, reward, error = classify(crashed, scored, CLAUDE_400, why)  # a crash says it as before: its log's end
    assert (status, reward) == (RolloutStatus.INFRA_ERROR, None) and error.startswith("harness exit code 1")
    assert error.endswith(CLAUDE_400) and "shows API errors" not in error


def test_a_cli_stopped_by_the_policys_overlong_reply_is_scored_not_excluded() -> None:
    """Claude Code exits 1 after a reply cut at its own output-token limit (or at the model's context): the policy's
    doing, so the run is scored from its workspace as TRUNCATED_CONTEXT; any other API error of a crash is not."""
    crashed, timed_out = HarnessResult(1, False, 1.0), HarnessResult(None, True, 9.0)
    scored, broken = EvalResult(0.25, None, 0.1, 1), EvalResult(None, "evaluator exit code 2", 0.1, 1)
    as_json = json.dumps({"type": "result", "is_error": True, "result": CLAUDE_OWN_LIMIT})
    for log, line in [(f"{CLAUDE_400}\n{CLAUDE_OWN_LIMIT}\n", CLAUDE_OWN_LIMIT), (as_json, CLAUDE_OWN_LIMIT),
                      (f"thinking...\n{CLAUDE_CONTEXT}", CLAUDE_CONTEXT)]:
        assert length_limit_line(log) == line
        status, reward, error = classify(crashed, scored, log, api_error_reason(log), length_limit_line(log))
        assert (status, reward) == (RolloutStatus.TRUNCATED_CONTEXT, 0.25)
        assert error.startswith("harness exit code 1: the policy's reply ran into a length limit") and line in error
    log = CLAUDE_OWN_LIMIT
    status, reward, error = classify(crashed, broken, log, None, length_limit_line(log))  # its evaluator broke
    assert (status, reward) == (RolloutStatus.EVAL_ERROR, None) and CLAUDE_OWN_LIMIT in error
    assert classify(timed_out, scored, log, None, length_limit_line(log))[:2] == (RolloutStatus.TIMEOUT_SCORED, 0.25)
    for other in (CLAUDE_400, CLAUDE_RESET, CODEX_CONTEXT, "Error: Claude's response exceeded the 256 output token "
                  "maximum", "print(\"API Error: The model has reached its context window limit.\")"):
        assert length_limit_line(other) is None
        assert classify(crashed, scored, other, None, length_limit_line(other))[:2] == (RolloutStatus.INFRA_ERROR,
                                                                                       None)


QWEN_LOOP = ("Loop detection halted the run (consecutive_identical_tool_calls: the model repeated the same tool call "
             "with identical arguments). This is an always-on guard and cannot be disabled via "
             "`model.skipLoopDetection`.")  # Qwen Code 0.24.4, as a bench run's log had it
CLAUDE_TURNS = "Error: Reached max turns (6)"


def test_a_cli_stopped_by_its_guard_against_the_policy_is_scored_not_excluded() -> None:
    """Qwen Code exits 1 when the policy repeats a tool call; Claude Code when its turn budget is spent: the
    policy's doing, so the run is scored (COMPLETED, the line in its error), not excluded as INFRA_ERROR."""
    crashed, broken = HarnessResult(1, False, 1.0), EvalResult(None, "evaluator exit code 2", 0.1, 1)
    scored = EvalResult(0.75, None, 0.1, 1)
    qwen = shipped()["qwen-code"]
    for log, stops in [(f"Ripgrep not available: spawn rg EACCES.\n{QWEN_LOOP}\n", qwen.policy_stops),
                       (f"thinking\n{CLAUDE_TURNS}\n", ())]:
        line = policy_stop_line(log, stops)
        assert line is not None and line == log.strip().splitlines()[-1]
        status, reward, error = classify(crashed, scored, log, api_error_reason(log), length_limit_line(log), line)
        assert (status, reward) == (RolloutStatus.COMPLETED, 0.75)
        assert error.startswith("harness exit code 1: the CLI stopped the run for the policy's behaviour")
        assert line in error
        assert classify(crashed, broken, log, None, None, line)[:2] == (RolloutStatus.EVAL_ERROR, None)
    assert policy_stop_line(QWEN_LOOP) is None  # a spec's own lines count only for its own runs
    assert policy_stop_line(f"  echo '{CLAUDE_TURNS}'") is None  # a line that only quotes it
    assert classify(crashed, scored, "Segmentation fault", None, None, policy_stop_line("Segmentation fault"))[:2] == (
        RolloutStatus.INFRA_ERROR, None)


# --- the daemon's part: RolloutBook.done on a real ledger ------------------------------------------------------
@pytest.fixture
def book(tmp_path: Path) -> RolloutBook:
    cfg = parse_config({"run": {"name": "t", "state_dir": str(tmp_path)}, "cluster": {"cells": 1},
                        "tasks": {"suite": "builtin:sevens", "group_size": 4}})
    b = RolloutBook(cfg, Ledger(tmp_path / "ledger.db"), tmp_path, "tok")
    b.create()
    b.admit(1, version=0, now=1.0)
    got = b.take("w1", 4, [CellSlot(0, "http://engine")], "http://proxy", version=0, now=2.0)
    assert [a.rollout_id for a in got] == [1, 2, 3, 4]
    return b


def call(rid: int) -> CallRecord:
    return CallRecord(rollout_id=rid, call_index=0, api="openai-chat", prompt_ids=[1, 2, 3], output_ids=[4, 5],
                      output_logprobs=[-0.1, -0.2], weight_version=0, cell=0, finish_reason="stop", started_at=2.5,
                      latency_s=0.1)


def report(rid: int, status: RolloutStatus = RolloutStatus.COMPLETED, exit_code: int | None = 0,
           timed_out: bool = False, error: str | None = None) -> RolloutDone:
    return RolloutDone(rollout_id=rid, worker_id="w1", status=status, reward=None if error and status ==
                       RolloutStatus.EVAL_ERROR else 0.75, harness_exit=exit_code, timed_out=timed_out, error=error,
                       started_at=2.0, harness_s=1.0, score=0.75, harness_log="Error: connect ECONNREFUSED 127.0.0.1:9")


def test_a_run_that_never_called_the_model_is_an_infra_error(book: RolloutBook) -> None:
    assert book.record_call(call(1), 3.0).rollout_open
    book.done(report(1), 4.0)  # called the model: as the worker said
    book.done(report(2), 4.0)  # never did: excluded, with the end of its log
    book.done(report(3, RolloutStatus.TIMEOUT_SCORED, exit_code=None, timed_out=True), 4.0)  # a timeout: scored
    g = book.done(report(4, RolloutStatus.EVAL_ERROR, error="evaluator exit code 2"), 4.0)
    assert g is not None and g.status == "DROPPED"  # one valid run left in the group
    book.ledger.flush()
    rows = book.ledger.rows("SELECT id, status, reward, error FROM rollouts ORDER BY id")
    assert [(r["status"], r["reward"]) for r in rows] == [("COMPLETED", 0.75), ("INFRA_ERROR", None),
                                                          ("TIMEOUT_SCORED", 0.75), ("INFRA_ERROR", None)]
    assert rows[0]["error"] is None and rows[2]["error"] is None
    assert rows[1]["error"] == ("harness never called the model; last lines of its log:\n"
                                "Error: connect ECONNREFUSED 127.0.0.1:9")
    assert rows[3]["error"] == ("harness never called the model; last lines of its log:\n"
                                "Error: connect ECONNREFUSED 127.0.0.1:9\nevaluator exit code 2")


def test_a_run_refused_for_its_context_is_not_one_that_never_called(book: RolloutBook) -> None:
    book.context_limit(ContextLimit(rollout_id=1, prompt_tokens=9000, limit=4096), 3.0)
    book.done(report(1), 4.0)
    book.done(report(2, exit_code=None), 4.0)  # no exit status known (an older worker): as reported
    book.ledger.flush()
    rows = book.ledger.rows("SELECT status, reward, error FROM rollouts WHERE id IN (1, 2) ORDER BY id")
    assert (rows[0]["status"], rows[0]["reward"]) == ("TRUNCATED_CONTEXT", 0.75)
    assert rows[0]["error"] == "the rollout hit the model's context length"
    assert (rows[1]["status"], rows[1]["error"]) == ("COMPLETED", None)


def test_a_run_cut_by_its_clis_own_limit_counts_in_its_group(book: RolloutBook) -> None:
    """The worker's TRUNCATED_CONTEXT (the CLI stopped after a reply cut at its output-token limit) is kept as
    reported: scored, and one of the group's valid runs."""
    for rid in (1, 2, 3, 4):
        book.record_call(call(rid), 3.0)
    cut = f"harness exit code 1: the policy's reply ran into a length limit (scored from the workspace):\n" \
          f"{CLAUDE_OWN_LIMIT}"
    book.done(report(1, RolloutStatus.TRUNCATED_CONTEXT, exit_code=1, error=cut), 4.0)
    book.done(report(2, RolloutStatus.INFRA_ERROR, exit_code=1, error="harness exit code 1"), 4.0)
    for rid in (3, 4):
        book.done(report(rid), 4.0)
    book.ledger.flush()
    rows = book.ledger.rows("SELECT status, reward, error FROM rollouts WHERE id = 1")
    assert rows == [{"status": "TRUNCATED_CONTEXT", "reward": 0.75, "error": cut}]
    assert book.ledger.rows("SELECT n_valid FROM groups") == [{"n_valid": 3}]


# --- `gyre status`: the harness errors block -------------------------------------------------------------------
def _text(renderable) -> str:
    c = Console(width=200, record=True, color_system=None)
    c.print(renderable)
    return c.export_text()


def test_gyre_status_shows_the_harness_errors_at_a_glance(book: RolloutBook, tmp_path: Path) -> None:
    for rid in (1, 3):
        book.record_call(call(rid), 3.0)
    book.done(report(1), 4.0)
    book.done(report(2), 4.0)  # never called the model
    book.done(report(3, error=api_error_reason(CODEX_404)), 5.0)  # exited 0 with an API error
    book.ledger.flush()
    conn = connect_readonly(tmp_path / "ledger.db")
    try:
        he = queries.harness_errors(conn)
        view = conn.execute("SELECT rollout, status, calls, first_line FROM v_harness_errors "
                            "ORDER BY rollout").fetchall()
        view = [tuple(r) for r in view]
        s = queries.status_summary(conn)
    finally:
        conn.close()
    assert he == {"finished": 3, "count": 2, "latest": {"id": 3, "status": "COMPLETED",
                                                       "error": api_error_reason(CODEX_404)}}
    assert s["harness_errors"] == he
    assert view == [(2, "INFRA_ERROR", 0, "harness never called the model; last lines of its log:"),
                    (3, "COMPLETED", 1, "harness exited 0 but its log shows API errors from the proxy:")]
    text = _text(harness_errors_text(he, "t-1"))
    assert text.splitlines() == [
        'harness errors 2 of the last 3 finished runs   (gyre sql t-1 "select * from v_harness_errors")',
        "  rollout 3 COMPLETED: harness exited 0 but its log shows API errors from the proxy:",
        f"    … {CODEX_404}"]
    s["run"] = {"id": "t-1", "status": "RUNNING", "created_at": s["now"], "policy": "colocate"}
    assert "harness errors 2 of the last 3" in _text(render_status(s, "up"))
    # nothing when there are none
    assert harness_errors_text({"finished": 3, "count": 0, "latest": None}, "t-1") is None
    s["harness_errors"] = {"finished": 0, "count": 0, "latest": None}
    assert "harness errors" not in _text(render_status(s, "up"))


def test_runs_of_a_worker_that_died_close_when_its_next_process_asks_for_work(book: RolloutBook) -> None:
    book.admit(1, version=0, now=5.0)
    later = book.take("w2", 2, [CellSlot(0, "http://engine")], "http://proxy", version=0, now=6.0)
    book.record_call(call(1), 6.5)
    book.done(report(1), 7.0)
    assert book.worker_restarted("w1", started_at=1.5, now=8.0) == []  # started before its runs: they are its own
    closed = book.worker_restarted("w1", started_at=9.0, now=9.5)  # 2-4 closed: the group has 1 valid run left
    assert [(g.id, g.status) for g in closed] == [(1, "DROPPED")]
    book.ledger.flush()
    rows = book.ledger.rows("SELECT id, status, error FROM rollouts ORDER BY id")
    assert [r["status"] for r in rows[:4]] == ["COMPLETED", "INFRA_ERROR", "INFRA_ERROR", "INFRA_ERROR"]
    assert "its worker died" in rows[1]["error"]
    assert [r["status"] for r in rows if r["id"] in {a.rollout_id for a in later}] == ["RUNNING"] * 2  # w2's
    assert book.health.reason() is None  # a crash is not a failing run: the streak did not count them


def test_a_late_model_call_joins_its_run_until_the_run_is_batched_then_the_ledger_alone(book: RolloutBook) -> None:
    for rid in (1, 2, 3, 4):
        assert book.record_call(call(rid), 3.0).rollout_open
        book.done(report(rid).model_copy(update={"reward": rid % 2, "score": rid % 2}), 4.0 + rid)
    assert book.groups[1].status == "READY"
    late = call(1).model_copy(update={"call_index": 1, "parent_call": 0, "reused_tokens": 5, "prompt_ids": [6]})
    ack = book.record_call(late, 9.0)  # its proxy re-sent it after the run ended (a restart): still its own
    assert not ack.rollout_open and book.rollouts[1].n_calls == 2 and book.rollouts[1].tree.n_calls == 2
    book.build_batch([1], step=0, version=0)
    later = late.model_copy(update={"call_index": 2, "reused_tokens": 6})
    assert not book.record_call(later, 10.0).rollout_open  # batched: the ledger keeps it, training does not
    assert not book.record_call(later, 10.5).rollout_open  # a replay: still once
    assert book.rollouts[1].tree.n_calls == 2
    book.ledger.flush()
    assert book.ledger.rows("SELECT call_index FROM model_calls WHERE rollout_id = 1 ORDER BY 1") == [
        {"call_index": 0}, {"call_index": 1}, {"call_index": 2}]
    assert book.ledger.rows("SELECT n_calls FROM rollouts WHERE id = 1") == [{"n_calls": 3}]
    assert len(book.ledger.rows("SELECT 1 FROM events WHERE kind = 'call_after_training'")) == 1
