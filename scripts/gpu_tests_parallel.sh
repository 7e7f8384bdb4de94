#!/usr/bin/env bash
# pytest -m gpu over groups of test files at once on the lent GPU, one process a group (most GPU tests are
# bound by the host and kernel launches, so groups overlap well), each group's log in $OUT/gpu_tests_<i>.txt;
# prints each group's files and summary line. GROUP_LIMIT_S (optional) stops a group's pytest after that many
# seconds, so one slow group cannot take the whole device call (its log then ends where it stopped).
#   bash scripts/gpu_tests_parallel.sh "tests/test_a.py tests/test_b.py" "tests/test_c.py" ...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
i=0; pids=()
for group in "$@"; do
  i=$((i + 1))
  timeout "${GROUP_LIMIT_S:-1000000}" python -m pytest -q -m gpu -p no:randomly $group > "$OUT/gpu_tests_$i.txt" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
i=0
for group in "$@"; do i=$((i + 1)); echo "[$group] $(tail -1 "$OUT/gpu_tests_$i.txt")"; done
exit $rc
