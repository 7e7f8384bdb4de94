#!/usr/bin/env bash
# ncu: step 07 against cuBLAS at 4096^3 / 8192^3 (tensor-pipe use, clocks, L2, stores, stall reasons)
# -> $OUT/ncu7.csv and a side-by-side table on stdout (bench/results/h200/ab/ncu_hgemm7_vs_cublas.txt).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TILEFISH_CACHE_DIR=/tmp/tfcache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
M+=,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed
M+=,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__cluster_dim_x
M+=,smsp__inst_executed.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,smsp__inst_executed_op_global_st.sum
for s in barrier long_scoreboard wait math_pipe_throttle lg_throttle membar sleeping dispatch_stall selected; do M+=,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio; done
ncu --clock-control none --csv --profile-from-start off --metrics "$M" python3 scripts/experiments/ncu_hgemm7_vs_cublas.py > $OUT/ncu7.csv 2> $OUT/ncu7.err
python3 - $OUT/ncu7.csv <<'PY'
import csv,sys
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>10]
h=rows[0]; ii,ki,mi,vi=(h.index(c) for c in ("ID","Kernel Name","Metric Name","Metric Value"))
by={};names={}
for r in rows[1:]:
    names[r[ii]]=r[ki][:60]; by.setdefault(r[ii],{})[r[mi]]=r[vi]
keys=sorted({k for d in by.values() for k in d})
print("metric".ljust(70)+"".join(f"{i:>16}" for i in by))
for i in by: print(i,names[i])
for k in keys: print(k[:70].ljust(70)+"".join(f"{by[i].get(k,'-')[:15]:>16}" for i in by))
PY
tail -3 $OUT/ncu7.err
