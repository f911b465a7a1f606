# Nsight Compute: the one-row decode kernel (csrc/awq_mma.cu, as dispatched, symmetric codes) against
# bench/decode_read_ceiling.py's read of the same words in the same order (no arithmetic; the K slices, warps and
# item size mma_cuda_launch_config dispatches at one row: 3 slices of 4-warp blocks on 18432x7168), with occupancy,
# DRAM and L2 traffic, at boost clocks. Device only, extension built:
#   SHAPE=18432x7168 bash bench/ncu_read_vs_decode.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SHAPE=${SHAPE:-18432x7168}
M="gpu__time_duration.sum,sm__warps_active.avg.per_cycle_active,sm__maximum_warps_per_active_cycle_pct"
M="$M,launch__occupancy_limit_registers,launch__registers_per_thread,launch__grid_size"
M="$M,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct"
M="$M,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
M="$M,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active"
run() { name=$1; shift; echo "== $name"; timeout 200 ncu --clock-control none --metrics "$M" "$@" 2>&1 \
  | grep -E "^\s+(gpu__|sm__|lts__|dram__|l1tex__|smsp__|launch__)|^dispatch:|==ERR|Error"; }
run decode -k regex:awq_mma_kernel -s 2 -c 1 python3 bench/mma_profile.py --m 1 --shape "$SHAPE" --symmetric --iters 4
run read_decode_order -k regex:_read_decode_order -s 1 -c 1 python3 -c "
import sys; sys.path.insert(0, 'bench')
import torch
from decode_read_ceiling import read_decode_order_us
from torchforge.ops.awq_mma_cuda import mma_cuda_launch_config
oc, ic = map(int, '$SHAPE'.split('x'))
splits, chunks, warps, _ = mma_cuda_launch_config(1, ic, oc, 128, torch.cuda.get_device_properties(0).multi_processor_count)
w = torch.randint(-2**31, 2**31 - 1, (oc // 64, ic * 8), dtype=torch.int32, device='cuda')
print('dispatch: slices', splits, 'warps', warps, 'chunks', chunks, 'us',
      read_decode_order_us(w, splits, warps, 1, chunks))"
