#!/usr/bin/env bash
# Where the Hopper W4A16 kernel's time goes: builds the extension with each TORCHFORGE_WGMMA_ABLATE setting in
# ABLATIONS (csrc/awq_wgmma.cu: 1 = no bf16x2 dequantization arithmetic, 2 = no bulk copies nor waits for them,
# 16 = no stream-K / K-slice partials, 32 = no x tile copies, 64 = no weight word copies, 128 = no dequantization
# nor wgmmas (the copies alone); sums of these; the results are wrong and only the times mean anything; 0 = this
# tree as it is) in parallel copies of the tree, then runs the same w4a16_linear.py arguments (SWEEP_ARGS) on each
# build and on the "base" one: the extension already in torchforge/ (carried from an earlier build), so a change to
# csrc/ is timed against the build before it in one call. Logs under $OUT.
#   An entry of ABLATIONS may also be other build flags, comma-separated: a number is an ablation setting, anything
#   else a macro, e.g. "TORCHFORGE_WGMMA_MAX_STAGES=4" or "TORCHFORGE_WGMMA_MAX_STAGES=4,128".
#   BENCH: another script than bench/w4a16_linear.py (e.g. bench/wgmma_sk_grid.py).
#   TESTS: pytest arguments run in each build's tree before its bench (e.g. "tests/ops/test_awq_wgmma_cuda.py").
#   STEP_TIMEOUT: seconds for each test run and bench (a hung kernel ends the step, not the call).
#   ABLATION_JOBS: parallel compile jobs per build (default 6; 16 for a single build).
#   device run: ABLATIONS="1 2 3" SWEEP_ARGS="--shapes 18432x7168 --wgmma-sweep 16,64,256 --wgmma-ws
#               --wgmma-only 64x2,128x2 --wgmma-splits 1" bash bench/wgmma_ablation.sh
set -uo pipefail
OUT=${OUT:-/tmp/torchforge-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
ARCH="-gencode=arch=compute_90a,code=sm_90a"
tag() { echo "$1" | tr -c 'A-Za-z0-9\n' '_'; }
flags() {
  local f out=""
  for f in ${1//,/ }; do
    if [[ $f =~ ^[0-9]+$ ]]; then out+=" -DTORCHFORGE_WGMMA_ABLATE=$f"; else out+=" -D$f"; fi
  done
  echo "$out"
}
for a in ${ABLATIONS:-1 2 3}; do
  d=/tmp/ablate$(tag "$a")
  rm -rf "$d" && mkdir -p "$d"
  cp -r setup.py pyproject.toml csrc torchforge bench tests "$d/"
  rm -f $d/torchforge/_C*.so
  (cd "$d" && MAX_JOBS=${ABLATION_JOBS:-6} TORCHFORGE_CUDA_ARCH="$ARCH$(flags "$a")" \
     python3 setup.py build_ext --inplace > "$OUT/build_ablate$(tag "$a").log" 2>&1) &
done
wait
for a in base ${ABLATIONS:-1 2 3}; do
  dir=$PWD
  t=$(tag "$a")
  [ "$a" != base ] && dir=/tmp/ablate$t
  ls $dir/torchforge/_C*.so >/dev/null 2>&1 || { echo "ablation $a: no build"; tail -5 "$OUT/build_ablate$t.log"; continue; }
  if [ -n "${TESTS:-}" ] && [ "$a" != base ]; then
    (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout ${STEP_TIMEOUT:-0} \
       python3 -m pytest -q -x -p no:cacheprovider $TESTS > "$OUT/tests_ablate$t.log" 2>&1)
    echo "== ablation $a tests (rc $?): $(tail -1 "$OUT/tests_ablate$t.log")"
  fi
  (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout ${STEP_TIMEOUT:-0} \
     python3 ${BENCH:-bench/w4a16_linear.py} ${SWEEP_ARGS:-} > "$OUT/sweep_ablate$t.log" 2>&1)
  echo "== ablation $a (rc $?)"
  grep -E '^\| [0-9]+x[0-9]+ \|' "$OUT/sweep_ablate$t.log" | cut -d'|' -f2-${CUT_FIELDS:-10}
done
