"""The built-in task suites, small enough that the tiny model improves on them with RL within minutes on CPU.

`digits`: "write the digit D, N times, to answer.txt" for every digit D and N in 4..8; `sevens`: the same with
D = 7 only (the embedded default: learnable from a biased start without first learning to read the digit);
`six-sevens`: the one task "write the digit 7 six times" (what a policy that cannot yet read the count from a long
prompt can still get better at: the right answer is one string, as for a 2-layer policy under a CLI's 7-18k-token
prompt); `longtail`: `sevens` where the tool is slow, as in real coding agents whose time goes mostly to tools (tests,
builds): after writing the answer the reference agent waits a log-normal time (median LONGTAIL_MEDIAN_S, the
task's scale times exp(σZ), σ = LONGTAIL_SIGMA) drawn from the run's workspace name, so one seed gives every policy
the same durations; some runs reach the harness timeout and are scored from their workspace (TIMEOUT_SCORED).

The evaluator gives partial credit: (D among the first N characters − characters beyond N) / N, at least 0 —
every extra character costs as much as a right one, so writing more than asked never pays. The warm-up
demonstrations write a noisy answer (each character is D with probability p), so the starting policy is right
only part of the time and RL has room to climb.
"""

from __future__ import annotations

import random
from typing import Any

from gyre_slurm.harness import agent_spec

WORDS = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
ANSWER_FILE = "answer.txt"


# the ways a task is asked: "" (every suite), and in `sevens-reworded` two more, so that a task asked in a way
# training never sees can be held out for evaluation while the warm-up has seen every way
PHRASINGS = {"": "Write the digit {d} {w} times to {f}.", "b": "Put the digit {d} into {f}, {w} times.",
             "c": "{f} must hold the digit {d}, written {w} times."}


def task_id(digit: int, count: int, phrasing: str = "") -> str:
    return f"digits-{digit}x{count}" + (f"-{phrasing}" if phrasing else "")


def prompt(digit: int, count: int, phrasing: str = "") -> str:
    return PHRASINGS[phrasing].format(d=digit, w=WORDS[count], f=ANSWER_FILE)


SUITES = {"digits": tuple(range(10)), "sevens": (7,), "longtail": (7,), "six-sevens": (7,), "sevens-reworded": (7,)}
REWORDED = {"sevens-reworded": tuple(PHRASINGS)}  # the suites asked in several ways; the others in "" only
SLOW_SUITES = {"longtail"}
ALL_COUNTS = tuple(sorted(WORDS))
COUNTS = {"six-sevens": (6,)}  # the suites of one count; the others ask for ALL_COUNTS
LONGTAIL_MEDIAN_S = 2.0
LONGTAIL_SIGMA = 1.0


def tasks(digits: tuple[int, ...] = SUITES["digits"], slow_tools: bool = False,
          counts: tuple[int, ...] = ALL_COUNTS, phrasings: tuple[str, ...] = ("",)) -> list[dict[str, Any]]:
    """A suite as TaskSpec dicts (see harness/tasks.py): the given digits × counts × phrasings."""
    out = []
    for ph in phrasings:
        for d in digits:
            for n in counts:
                files = {"README.md": "Put your answer in answer.txt.\n"}
                if slow_tools:  # a per-task scale (tasks of one kind take alike long), then the run's own draw
                    files[agent_spec.LATENCY_FILE] = f"{LONGTAIL_MEDIAN_S * (0.5 + n / 8):.3f} {LONGTAIL_SIGMA}\n"
                out.append({
                    "id": task_id(d, n, ph),
                    "prompt": prompt(d, n, ph),
                    "files": files,
                    "evaluator": ["{python}", "-m", "gyre_slurm.scoring.builtin_eval", "digits", "--digit", str(d),
                                  "--count", str(n)],
                })
    return out


def score(answer: str, digit: int, count: int) -> float:
    """Partial credit in [0, 1]: right characters among the first `count`, less one per extra character."""
    answer = answer.strip()
    right = sum(1 for c in answer[:count] if c == str(digit))
    return max(0, right - max(0, len(answer) - count)) / count


def noisy_answer(digit: int, count: int, rng: random.Random, p_right: float) -> str:
    n = max(1, count + rng.randint(-2, 2))
    return "".join(str(digit) if rng.random() < p_right else str(rng.randrange(10)) for _ in range(n))


def demo_conversation(digit: int, count: int, rng: random.Random, p_right: float,
                      phrasing: str = "") -> list[dict[str, Any]]:
    """One full reference-harness conversation (OpenAI message dicts) with a noisy answer, for the warm-up."""
    content = noisy_answer(digit, count, rng, p_right)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "write_file", "arguments": {"path": ANSWER_FILE, "content": content}}}
    return [
        {"role": "system", "content": agent_spec.SYSTEM_PROMPT},
        {"role": "user", "content": prompt(digit, count, phrasing)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": agent_spec.tool_result(ANSWER_FILE, len(content))},
        {"role": "assistant", "content": agent_spec.FINAL_MESSAGE},
    ]
