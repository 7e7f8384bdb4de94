#!/usr/bin/env bash
# The rope_attention kernel's launch choices in the model (device; edits this copy of the tree in place, so run it
# on the device's copy only): each variant patched in, then scripts/profile_e2e.py's 8-layer step against the
# rope_cache + attention-function path in the same process.
#   base       the committed kernel and plan
#   notrigger  no launch_dependent_grids: the o projection starts only once the kernel has ended
#   waittrigger  launch_dependent_grids right after grid_dependency_wait (o's launch overlaps the products)
#   fewer      plan_chunk aims at one CTA every other SM instead of two an SM (fewer splits to combine)
#   latekv     early_kv off: the first K/V copies issued after grid_dependency_wait
set -u
KERNEL=src/tilefish/kernels/attention/rope_attention.cu
PLAN=src/tilefish/ops/rope_attention.py
FUSED=src/tilefish/decoder.py
run() { IMPLS=w4a16-ropecache,w4a16 python scripts/profile_e2e.py 8 ${BATCHES:-1 16} | grep -E "step" | sed "s/^/$1: /"; }
for f in $KERNEL $PLAN $FUSED; do cp "$f" "$f.orig"; done
restore() { for f in $KERNEL $PLAN $FUSED; do cp "$f.orig" "$f"; done; }
run base
sed -i '/^    launch_dependent_grids();$/d' $KERNEL; run notrigger; restore
sed -i '/^    launch_dependent_grids();$/d; s/^    TF_STAMP_IF(tid == 0, 1);$/&\n    launch_dependent_grids();/' $KERNEL
run waittrigger; restore
sed -i 's/(2 \* sm_count)/(sm_count \/\/ 2)/' $PLAN; run fewer; restore
[ -n "${LATEKV:-}" ] && { sed -i 's/early_kv=True)/early_kv=False)/' $FUSED; run latekv; restore; }
for f in $KERNEL $PLAN $FUSED; do rm "$f.orig"; done
