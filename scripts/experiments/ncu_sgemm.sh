#!/usr/bin/env bash
# ncu counters of the SGEMM ladder (one launch per step, 2048^3) -> $OUT/ncu_sgemm.csv
set -u
OUT=${OUT:-/tmp/out}
M=gpu__time_duration.sum
M+=,smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct
M+=,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
M+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
M+=,sm__warps_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
M+=,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum
M+=,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
ncu --clock-control none --csv -k regex:sgemm --launch-skip 9 --metrics "$M" python3 scripts/experiments/ncu_sgemm.py > "$OUT/ncu_sgemm.csv" 2> "$OUT/ncu_sgemm.err"
python3 - "$OUT/ncu_sgemm.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
table = {}
for r in body:
    table.setdefault(r[ki].split("(")[0].split("<")[0], {})[r[mi]] = r[vi]
short = {"gpu__time_duration.sum": "time", "smsp__sass_average_data_bytes_per_sector_mem_global_op_ld.pct": "gld eff%",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": "smem ld confl",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": "smem st confl",
         "sm__warps_active.avg.pct_of_peak_sustained_active": "occup%",
         "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma pipe%",
         "dram__bytes_read.sum": "dram rd", "lts__t_sectors_srcunit_tex_op_read.sum": "L2->L1 sect"}
print("kernel".ljust(22), *[v.rjust(14) for v in short.values()])
for k, m in table.items():
    print(k.ljust(22), *[m.get(key, "-").rjust(14) for key in short])
PY
