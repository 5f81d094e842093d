#!/usr/bin/env bash
# The test command (README, CI): environment, the harness CLIs (Claude Code, Codex CLI, Qwen Code, opencode, with
# npm; mini-swe-agent with pip), the fixture tasks' images, a real local Slurm cluster, lint, then the whole suite.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not slow"` or `bash tools/test.sh -k ledger`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# The fixture tasks' images (tools/fixture_images.py: about a minute the first time, most of it debootstrap's
# downloads) are built in the background while the CLIs and Slurm install; the image tests wait for its lock.
fixtures=
if [ $# -eq 0 ]; then
  mkdir -p state
  .venv/bin/python tools/fixture_images.py > state/fixture-images.log 2>&1 &
  fixtures=$!
fi
.venv/bin/gyre harness install all
bash tools/slurm/local_cluster.sh up
.venv/bin/ruff check gyre_slurm tests tools

# The whole suite (no arguments): the real-CLI tests' models (tests/test_real_harnesses.py: demonstrations recorded
# with each CLI, then a warm-up: ~17 min each here beside the suite, most of it the warm-up; mini-swe-agent's, for
# tests/test_real_harnesses_images.py, 5 min alone: its prompts are short) are built in the background, all at once,
# one thread each, while the other tests run, exactly as `gyre model create` builds them. They start first: the
# real-CLI tests, last in the suite, wait for them. The tests wait for a build in progress (its lock) and find the
# model built; should a build fail, they build it again themselves and fail with its error. The builds' output:
# state/models/prebuild-<cli>.log.
prebuild=()
if [ $# -eq 0 ]; then
  mkdir -p state/models
  for c in claude-code codex mini-swe-agent; do
    OMP_NUM_THREADS=1 .venv/bin/gyre model create "configs/$c.yaml" > "state/models/prebuild-$c.log" 2>&1 &
    prebuild+=($!)
  done
fi
# Two pytest-xdist workers by default, a test module per worker unit (tests/conftest.py), below the builds' priority
# (nice 5: they are the run's longest chain); GYRE_TEST_WORKERS=0 runs one pytest process. A fresh clone took 38 min
# in all here this way against 58 one process at a time. The suite's processes take one thread each unless
# OMP_NUM_THREADS says otherwise: on 2 cores the builds and the suite already keep both busy, and more threads per
# process only spin and switch.
workers="${GYRE_TEST_WORKERS:-2}"
niceness=0
[ "$workers" = 0 ] || niceness=5
status=0
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" nice -n "$niceness" \
  .venv/bin/python -m pytest -n "$workers" --dist loadgroup "$@" || status=$?
for pid in "${prebuild[@]}" $fixtures; do kill "$pid" 2>/dev/null || true; done
exit "$status"
