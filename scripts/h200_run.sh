#!/usr/bin/env bash
# One batched job on the lent H200: install, warm the kernel cache, GPU tests, benchmarks; results
# under $OUT. Usage (device tool, repo root, carry .whl): bash scripts/h200_run.sh [pytest-args...]
# Env: BENCH="nf4 sgemm ..." families to bench (default nf4; empty: none); VARIANTS=1 also sweeps
#      the nf4 design space; SKIP_TESTS=1; TILEFISH_COMMIT=<hash> labels the results (no .git there).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TILEFISH_CACHE_DIR=${TILEFISH_CACHE_DIR:-/tmp/tfcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
tilefish info 2>&1 | tee "$OUT/info.txt"
tilefish compile --arch sm_90 --all -j 16 > "$OUT/compile_sm90.txt" 2>&1; tail -1 "$OUT/compile_sm90.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
fi
for fam in ${BENCH-nf4}; do
  tilefish bench "$fam" --json "$OUT/$fam.json" --plot "$OUT/$fam.png" 2>&1 | tee "$OUT/bench_$fam.txt"
done
if [ "${VARIANTS:-0}" = 1 ]; then
  tilefish bench nf4 --variants --shapes 16384x16384 --reps 30 --json "$OUT/nf4_variants.json" 2>&1 | tee "$OUT/nf4_variants.txt"
fi
