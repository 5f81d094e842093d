#!/bin/sh
# gyre's SWE-bench evaluation, run by `sh` in a fresh copy of the task's image (scoring/image_eval.py), in the
# repository: SWE-bench's order (swebench/harness/test_spec): the files the test patch touches back to the base
# commit, the test patch applied, then the tests. Task data arrive as arguments and files, never as shell text.
# usage: sh /tests/run-swe.sh BASE_COMMIT TEST_COMMAND... TEST_ID...    (the patch's files: /tests/test-files.txt)
base=$1
shift
git config --global --add safe.directory '*' 2>/dev/null  # the repository may belong to another uid here
while IFS= read -r f; do
  [ -n "$f" ] || continue
  git checkout -q "$base" -- "$f" 2>/dev/null || rm -rf -- "$f"
done < /tests/test-files.txt
if ! git apply --whitespace=nowarn /tests/test.patch; then
  echo GYRE_SWE_PATCH_FAILED: the test patch does not apply
  exit 0
fi
exec "$@"
