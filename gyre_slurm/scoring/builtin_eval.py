"""Evaluators of the built-in suites, run as `python -m gyre_slurm.scoring.builtin_eval SUITE ...` in the
rollout's workspace. Contract of every evaluator: exit 0 and print the score in [0, 1] as the last line of
stdout; anything else (a crash, no number, a number out of range) is an evaluator error, never a 0."""

from __future__ import annotations

import argparse
from pathlib import Path

from gyre_slurm.harness import builtin_suite


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="suite", required=True)
    d = sub.add_parser("digits")
    d.add_argument("--digit", type=int, required=True)
    d.add_argument("--count", type=int, required=True)
    a = ap.parse_args()
    answer = Path(builtin_suite.ANSWER_FILE)
    text = answer.read_text(errors="replace") if answer.is_file() else ""
    print(f"{builtin_suite.score(text, a.digit, a.count):.6f}")


if __name__ == "__main__":
    main()
