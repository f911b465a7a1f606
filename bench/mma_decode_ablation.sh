#!/usr/bin/env bash
# Where the decode kernel's time goes: builds bench/mma_decode_ablation.cu (csrc/awq_mma.cu as it is) once per
# setting of TORCHFORGE_MMA_ABLATE in ABLATIONS (awq_mma.cuh: 2 = x not read, 4 = scales and zeros not read,
# 8 = no dequantization nor MMAs, 16 = words not read, 32 = no all-ones MMAs, 64 = one more subtract per A register,
# 128 = half the column tiles' MMAs; sums of these; 0 = the kernel as it is), in parallel, then
# times every configuration of CONFIGS on each build, ROUNDS times in turn (builds interleaved, so that clock drift
# hits them alike). Device only (nvcc, sm_90a), no torch needed; one table on stdout, logs under $OUT.
#   An entry of ABLATIONS may add other macros, comma-separated: "0,NAME=1" (an experiment's switch; the forty-third
#   session timed its TORCHFORGE_MMA_ZA=0 against 1 this way before the switch was removed).
#   CONFIGS: ";"-separated "OC IC M splits item_chunks warps prefetch symmetric" (the launcher's arguments)
#   $OUT/mma_ablate_run.log holds every run's line (us, then the sum and sum of |out| of one launch).
#   device run: ABLATIONS="0 2 4 8 16 6 22" bash bench/mma_decode_ablation.sh
set -uo pipefail
OUT=${OUT:-/tmp/torchforge-out}
mkdir -p "$OUT"
ABLATIONS=${ABLATIONS:-0 2 4 6 8 16 22}
DEFAULT_CONFIGS="18432 7168 1 3 2 4 0 1;18432 7168 1 3 2 4 0 0;18432 7168 1 1 2 4 0 1;7168 7168 1 1 2 8 1 1"
DEFAULT_CONFIGS+=";18432 7168 16 3 2 4 0 1;7168 7168 16 2 2 8 0 1"
CONFIGS=${CONFIGS:-$DEFAULT_CONFIGS}
ROUNDS=${ROUNDS:-2}
tag() { echo "$1" | tr -c 'A-Za-z0-9\n' '_'; }
flags() {  # "8" -> -DTORCHFORGE_MMA_ABLATE=8; "0,NAME=1" -> also -DNAME=1
  local f out=""
  for f in ${1//,/ }; do
    if [[ $f =~ ^[0-9]+$ ]]; then out+=" -DTORCHFORGE_MMA_ABLATE=$f"; else out+=" -D$f"; fi
  done
  echo "$out"
}
declare -A pid=()
for a in $ABLATIONS; do
  rm -f "/tmp/mma_ablate$(tag "$a")"  # a warm machine keeps /tmp: never time an earlier call's binary
  # shellcheck disable=SC2046
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc $(flags "$a") \
    -o "/tmp/mma_ablate$(tag "$a")" bench/mma_decode_ablation.cu > "$OUT/mma_ablate_build$(tag "$a").log" 2>&1 &
  pid[$a]=$!
done
for a in $ABLATIONS; do
  wait "${pid[$a]}" || { echo "build $a failed:"; tail -5 "$OUT/mma_ablate_build$(tag "$a").log"; exit 1; }
done
header="| OC x IC | M | slices | k/item | warps | prefetch | zeros |"
sep="|---|---|---|---|---|---|---|"
for a in $ABLATIONS; do header+=" ablate $a us |"; sep+="---|"; done
echo "$header"
echo "$sep"
IFS=';' read -ra cfgs <<< "$CONFIGS"
for cfg in "${cfgs[@]}"; do
  read -r oc ic m sp ch w pf sym <<< "$cfg"
  row="| ${oc}x${ic} | $m | $sp | $((64 * ch)) | $w | $pf | $([ "$sym" = 1 ] && echo 8 || echo read) |"
  declare -A best=()
  for ((r = 0; r < ROUNDS; ++r)); do
    for a in $ABLATIONS; do
      line=$(timeout 60 "/tmp/mma_ablate$(tag "$a")" $cfg 2>>"$OUT/mma_ablate_run.log" || echo "err")
      echo "$a | $cfg | round $r: $line" >> "$OUT/mma_ablate_run.log"
      t=${line%% *}
      prev=${best[$a]:-}
      if [ -z "$prev" ] || [ "$prev" = err ] || { [ "$t" != err ] && awk "BEGIN{exit !($t < $prev)}"; }; then best[$a]=$t; fi
    done
  done
  for a in $ABLATIONS; do row+=" ${best[$a]} |"; done
  echo "$row"
  unset best
done
