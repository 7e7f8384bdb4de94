#!/usr/bin/env bash
# One batched job on a lent GPU (device tool, repo root; carry .whl for bitsandbytes): install, warm the
# kernel cache in parallel, then each "name: command" step given as an argument, each under its own time
# limit, its output in $OUT/<name>.txt; a table of the steps' exit codes and times last.
#   bash scripts/gpu_job.sh "tests: pytest -m gpu -q tests/test_user_loops.py" "bench: tilefish bench e2e ..."
# Env: STEP_LIMIT_S (default 480) per step; TILEFISH_COMMIT labels the results: set it to the local HEAD when
# composing the device command, since the copy's .git can stand at an older commit (it read 91eb0b3-dirty under
# bf48fb2's tree once); WARM=0 skips the parallel warm-up.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TILEFISH_CACHE_DIR=${TILEFISH_CACHE_DIR:-/tmp/tfcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${WARM:-1}" = 1 ]; then  # WARM=0: kernels compile on first use instead
  t0=$SECONDS
  tilefish compile --arch sm_90 -j 16 > "$OUT/compile.txt" 2>&1
  echo "kernel cache warmed in $((SECONDS - t0)) s: $(tail -1 "$OUT/compile.txt")"
fi
summary=()
for step in "$@"; do
  name=${step%%:*}; cmd=${step#*:}
  t0=$SECONDS
  timeout "${STEP_LIMIT_S:-480}" bash -c "$cmd" > "$OUT/$name.txt" 2>&1
  rc=$?
  summary+=("$(printf '%-12s rc %-4s %5d s' "$name" "$rc" $((SECONDS - t0)))")
  echo "== $name (rc $rc) =="; tail -25 "$OUT/$name.txt"
done
echo "== steps =="; printf '%s\n' "${summary[@]}"
