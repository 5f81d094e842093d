#!/usr/bin/env bash
# The test command (README, CI): environment, the harness CLIs (Claude Code, Codex CLI, with npm), a real local
# Slurm cluster, lint, then the whole suite.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not slow"` or `bash tools/test.sh -k ledger`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
.venv/bin/gyre harness install all
bash tools/slurm/local_cluster.sh up
.venv/bin/ruff check gyre_slurm tests tools
exec .venv/bin/python -m pytest "$@"
