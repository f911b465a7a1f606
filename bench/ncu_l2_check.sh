# Nsight Compute on the Hopper W4A16 kernel against cuBLAS on 7168x7168 (thirtieth session, BENCHMARKS.md): is the
# kernel at 256-384 rows bound by L2 bandwidth? Device only; run from the repository root with the extension built.
#   bash bench/ncu_l2_check.sh            (throughput metrics: wgmma at 256 / 384 / 4096 rows, cuBLAS at 384 / 4096)
#   STALLS=1 bash bench/ncu_l2_check.sh   (the tensor pipe and the warp stall reasons of the 384-row kernel)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
M="gpu__time_duration.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,lts__t_sectors.avg.pct_of_peak_sustained_elapsed"
M="$M,lts__t_bytes.sum.per_second,lts__t_sector_hit_rate.pct,dram__bytes_read.sum.per_second"
M="$M,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__cycles_active.avg.pct_of_peak_sustained_elapsed"
M="$M,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second"
run() { name=$1; shift; echo "== $name"; timeout 150 ncu --clock-control none "$@" 2>&1 \
  | grep -E "^\s+(gpu__|sm__|lts__|dram__|l1tex__|smsp__)|^\s+(Warp Cycles|Avg\. Active|Issued|No Eligible|One or More|Active Warps|Eligible)|Stall|==ERR|Error"; }
W384="python3 bench/mma_profile.py --m 384 --shape 7168x7168 --wgmma 192,1,1,8,1"
if [ -n "${STALLS:-}" ]; then
  ncu --query-metrics 2>/dev/null | grep -i "pipe_tensor" | head -12
  T=$(ncu --query-metrics 2>/dev/null | grep -o "sm__pipe_tensor_op_[a-z]*_cycles_active" | sort -u | tr '\n' ' ')
  for t in $T; do run "pipe $t" --metrics "$t.avg.pct_of_peak_sustained_active" -k regex:awq_wgmma_kernel -c 1 $W384; done
  run stalls_384 --section WarpStateStats --section SchedulerStats --metrics \
    "smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_selected" \
    -k regex:awq_wgmma_kernel -c 1 $W384
  exit 0
fi
run wgmma_384_192x1 --metrics "$M" -k regex:awq_wgmma_kernel -c 1 $W384
run wgmma_256_256x1s2 --metrics "$M" -k regex:awq_wgmma_kernel -c 1 \
  python3 bench/mma_profile.py --m 256 --shape 7168x7168 --wgmma 256,1,2,8,1
run wgmma_4096_256x1 --metrics "$M" -k regex:awq_wgmma_kernel -c 1 \
  python3 bench/mma_profile.py --m 4096 --shape 7168x7168 --wgmma 256,1,1,8,1
for m in 384 4096; do run "cublas_$m" --metrics "$M" -k regex:"nvjet|gemm|sm90" -c 1 python3 -c "
import torch; w=torch.randn(7168,7168,device='cuda',dtype=torch.bfloat16); x=torch.randn($m,7168,device='cuda',dtype=torch.bfloat16)
for _ in range(3): torch.nn.functional.linear(x,w)
torch.cuda.synchronize()"; done
