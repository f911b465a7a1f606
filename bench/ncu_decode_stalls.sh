# Nsight Compute's warp stall samples, by SASS instruction, of the decode kernel (csrc/awq_mma.cu) as modules dispatch
# it (symmetric codes), at boost clocks. Device only; run from the repository root with the extension built:
#   CASES="1:18432x7168 16:18432x7168" bash bench/ncu_decode_stalls.sh
# Writes $OUT/stalls_<M>_<shape>.csv (ncu's source page); summarize it with python3 bench/ncu_source_top.py FILE.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/torchforge-out}
mkdir -p "$OUT"
for case in ${CASES:-1:18432x7168 16:18432x7168}; do
  m=${case%%:*}; shape=${case#*:}
  rep=/tmp/stalls_${m}_${shape}
  timeout 240 ncu --clock-control none --section SourceCounters --section WarpStateStats --section LaunchStats \
    --section Occupancy -k regex:awq_mma_kernel -s 2 -c 1 -f -o "$rep" \
    python3 bench/mma_profile.py --m "$m" --shape "$shape" --symmetric --iters 4 > "$OUT/ncu_${m}_${shape}.log" 2>&1
  echo "== M=$m $shape: rc=$?"
  ncu -i "$rep.ncu-rep" --page details 2>&1 | grep -E "Duration|Registers|Grid Size|Block Size|Achieved Occupancy|Warp Cycles|Stall|Theoretical Occ|Issued Warp" | head -30
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/stalls_${m}_${shape}.csv" 2>&1
  wc -c "$OUT/stalls_${m}_${shape}.csv"
done
