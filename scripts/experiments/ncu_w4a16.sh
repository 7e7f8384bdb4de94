#!/usr/bin/env bash
# ncu counters of the W4A16 kernel (default: m = 1 on 2 shapes; env NCU_CASES="m,k,n[,group[,plan]];..."; default dispatch)
# -> stdout and $OUT/ncu_w4a16.csv (launches 2 .. of each case's 3; SKIP / COUNT for ncu)
set -u
OUT=${OUT:-/tmp/out}
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
M+=,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active
M+=,sm__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
M+=,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio
M+=,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
M+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum
M+=,sm__cycles_elapsed.avg.per_second,lts__t_sectors_srcunit_tex_op_read.sum,smsp__inst_executed_op_global_ld.sum
M+=,launch__grid_size,launch__occupancy_limit_shared_mem,launch__registers_per_thread
M+=${NCU_EXTRA:+,$NCU_EXTRA}  # more metrics, comma-separated
ncu --clock-control none --csv -k regex:w4a16 --launch-skip ${SKIP:-2} --launch-count ${COUNT:-4} --metrics "$M" \
    python3 scripts/experiments/profile_w4a16.py --ncu > "$OUT/ncu_w4a16.csv" 2> "$OUT/ncu_w4a16.err"
python3 - "$OUT/ncu_w4a16.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, body = rows[0], rows[1:]
ii, mi, vi = head.index("ID"), head.index("Metric Name"), head.index("Metric Value")
by = {}
for r in body:
    by.setdefault(r[ii], {})[r[mi]] = r[vi]
for i, m in by.items():
    print(f"--- launch {i}")
    for k, v in m.items():
        print(f"  {k.replace('smsp__average_warps_issue_stalled_', 'stall ').replace('_per_issue_active.ratio', ''):60s} {v}")
PY
