#!/usr/bin/env bash
# One device call does it all: install torchforge (building csrc/), run the whole test suite with the CUDA
# tests, run the benchmarks and the demo. Logs go under $OUT (the device tool brings them back).
#   device run:  bash bench/gpu_suite.sh        (carry .whl: wheels missing on the device, e.g. expecttest)
#   decode only: SUITE=bench BENCHES=decode bash bench/gpu_suite.sh   (DECODE_ARGS: e.g. "--batches 1")
#   sanitizer:   SUITE=sanitize bash bench/gpu_suite.sh   (compute-sanitizer on the csrc kernels' tests; SANITIZE_SETS
#                picks some of "quantize mma wgmma cluster pdl")
#   some tests: SUITE=tests TESTS="tests/ops/x.py ..." (PYTEST_ARGS="-k 'a or b'" too), or SHARD=1/2 then SHARD=2/2 for all of them; W4A16_ARGS / DECODE_ARGS / MOE_ARGS pass
#   arguments to the benchmarks; BENCHES="w4a16 w4a16_sweep" runs w4a16_linear.py a second time with W4A16_SWEEP_ARGS
set -uo pipefail
OUT=${OUT:-/tmp/torchforge-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
start=$(date +%s)
# The build takes about 3 minutes of a 10-minute call. SAVE_EXT=1 copies the built extension (gzipped) and a hash of
# the sources it was built from to $OUT; a later call can carry both back (gunzip -c $files_at/_C*.so.gz >
# torchforge/<the same name without .gz>; torchforge/_C.sources) and skip the build with PREBUILT=1, which builds
# anyway if csrc/ or setup.py changed since.
sources_hash() { cat setup.py csrc/* | sha256sum | cut -d' ' -f1; }
if [ -n "${PREBUILT:-}" ] && ls torchforge/_C*.so >/dev/null 2>&1 \
    && [ "$(cat torchforge/_C.sources 2>/dev/null)" = "$(sources_hash)" ]; then
  echo "PREBUILT: using the carried $(ls torchforge/_C*.so), built from these sources; no build"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  [ -n "${PREBUILT:-}" ] && echo "PREBUILT: no carried extension built from these sources; building"
  python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; }
  # (stripped of its local symbols and gzipped: with the group-32 wgmma kernels, thirty-first session, the .so passed
  # the 16 MiB a returned file may have; stripped it was still 15.3 MB on the device, thirty-second session)
  if [ -n "${SAVE_EXT:-}" ]; then
    for so in torchforge/_C*.so; do
      [ -f "$so" ] || continue
      tmp=$(mktemp)
      cp "$so" "$tmp" && { strip --strip-unneeded "$tmp" 2>/dev/null || true; } \
        && gzip -1 -c "$tmp" > "$OUT/$(basename "$so").gz"
      rm -f "$tmp"
    done
    sources_hash > "$OUT/_C.sources"
  fi
fi
echo "build: $(( $(date +%s) - start )) s; extension: $(python3 -c 'from torchforge.ops._ext import has_cuda_ext; print(has_cuda_ext())')"
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, print the tail
  local name=$1; shift
  local t0=$(date +%s)
  timeout "${STEP_TIMEOUT:-0}" "$@" > "$OUT/$name.log" 2>&1; local rc=$?  # STEP_TIMEOUT: a hung kernel ends the step (rc 124), not the call
  echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s"; tail -n "${TAIL:-25}" "$OUT/$name.log"
}
SUITE=${SUITE:-tests bench demo}
# SHARD=i/n (e.g. 1/2): every n-th test file from the i-th, so the whole suite (over 420 s on the device since the
# sixteenth session) runs in n calls; --durations names the slowest cases to mark. Twenty-first session: 1/2 took
# 233 s, but 2/2 ran past 540 s; 2/4 then 4/4 (which together are 2/2) took 395 s and 230 s.
# Twenty-fourth session: 1/4, 2/4, 3/4, 4/4 took 229, 207, 283 and 248 s (1/2 had reached 541 s).
# Twenty-seventh session: 267 s, over 290 (cut at 93%), 277 (with the rest of 2/4) and 385 s; twenty-eighth: 209, 264,
# 269 and 427 s (4/4 near its limit: SHARD=i/5 from now on would be safer). Give each shard
# STEP_TIMEOUT=540, one shard per call.
if [ -n "${SHARD:-}" ] && [ -z "${TESTS:-}" ]; then
  TESTS=$(find tests -name 'test_*.py' | sort | awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" '(NR - i) % n == 0' | tr '\n' ' ')
  for t in ${SHARD_EXTRA:-}; do case " $TESTS " in *" $t "*) ;; *) TESTS="$TESTS $t" ;; esac; done  # changed files
fi
# PYTEST_ARGS is parsed with shell quoting, so PYTEST_ARGS="-k 'a or b'" keeps its expression whole (unquoted, it was
# split at the spaces and pytest took "or" for a file: twenty-sixth session).
eval "pytest_args=(${PYTEST_ARGS:-})"
case " $SUITE " in *" tests "*) step tests python3 -m pytest -q -rf --maxfail=20 --durations=15 -p no:cacheprovider ${TESTS:-tests} "${pytest_args[@]}" ;; esac
# tests_tf: TESTS_TF against a newer transformers than the device's, carried as wheels in TF_WHEELS (default .whl_tf;
# list it in .git/info/exclude), installed apart in /tmp/site_tf. The thirtieth session's set (5.24, 23 MB):
#   pip download -q --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any --only-binary=:all: -d .whl_tf transformers==5.24.0 huggingface_hub==2.4.0 tokenizers==0.23.3 \
#     safetensors==0.8.0 httpx2==2.16.2 httpcore2==2.16.2 hf-xet==1.8.0 regex==2026.5.9 truststore click==8.5.1
case " $SUITE " in *" tests_tf "*)
  tf_wheels=${TF_WHEELS:-.whl_tf}
  if ! ls "$tf_wheels"/*.whl >/dev/null 2>&1; then
    echo "== tests_tf: skipped, no wheels in $tf_wheels (carry them: see above)"
  elif ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_tf \
      "$tf_wheels"/*.whl > "$OUT/tests_tf_install.log" 2>&1; then
    echo "== tests_tf: FAILED to install the wheels"; tail -5 "$OUT/tests_tf_install.log"
  else  # the check fails the step if the carried transformers is not the one imported
    step tests_tf env PYTHONPATH="/tmp/site_tf${PYTHONPATH:+:$PYTHONPATH}" sh -c 'python3 -c "import transformers; \
print(\"transformers\", transformers.__version__, transformers.__file__); \
assert transformers.__file__.startswith(\"/tmp/site_tf/\"), \"not the carried transformers\"" && \
python3 -m pytest -q -rf --maxfail=20 -p no:cacheprovider '"${TESTS_TF:-tests/nn}"' '"${PYTEST_TF_ARGS:-}"
  fi
  ;;
esac
case " $SUITE " in *" bench "*)
  for b in ${BENCHES:-w4a16 quantize moe gptq nvfp4}; do
    case $b in
      w4a16) TAIL=22 step bench_w4a16_linear python3 bench/w4a16_linear.py ${W4A16_ARGS:-} ;;
      w4a16_sweep) if [ -n "${W4A16_SWEEP_ARGS:-}" ]; then TAIL=22 step bench_w4a16_sweep python3 bench/w4a16_linear.py $W4A16_SWEEP_ARGS
                   else echo "== bench_w4a16_sweep: skipped, W4A16_SWEEP_ARGS is empty"; fi ;;  # a second run, e.g. a sweep
      quantize) TAIL=12 step bench_awq_quantize python3 bench/awq_quantize.py ;;
      dequant) TAIL=12 step bench_awq_dequantize python3 bench/awq_dequantize.py ${DEQUANT_ARGS:-} ;;  # the backward's dequantization
      grouped_mm) TAIL=10 step bench_grouped_mm python3 bench/grouped_mm.py ${GROUPED_MM_ARGS:-} ;;  # the backward's fp32 grouped GEMM
      moe) TAIL=${MOE_TAIL:-10} step bench_moe_w4a16 python3 bench/moe_w4a16.py ${MOE_ARGS:-} ;;
      gptq) TAIL=40 step bench_gptq python3 bench/gptq.py ;;  # GPTQ solver (issue 3): reference loop vs fast, quality
      gptq_act_order) TAIL=16 step bench_gptq_act_order python3 bench/gptq_act_order.py ${GPTQ_ACT_ARGS:-} ;;  # act-order GPTQ on the mma layout
      group_size) TAIL=36 step bench_group_size python3 bench/group_size.py ${GROUP_SIZE_ARGS:-} ;;  # group 32 / 64 / 128 layers as dispatched
      nvfp4) TAIL=30 step bench_nvfp4_moe python3 bench/nvfp4_moe.py ${NVFP4_ARGS:---w4a4} ;;  # issue 6
      decode_profile) TAIL=${PROFILE_TAIL:-150} step bench_decode_profile python3 bench/decode_profile.py ${PROFILE_ARGS:-} ;;  # kernels per step (+ --host: host time)
      moe_block) TAIL=20 step bench_moe_block python3 bench/moe_block.py ${MOE_BLOCK_ARGS:-} ;;  # fused decode path on / off by tokens
      host) TAIL=${HOST_TAIL:-60} step bench_op_host_overhead python3 bench/op_host_overhead.py ${HOST_ARGS:-} ;;  # host us per eager op call
      moe_align) TAIL=22 step bench_moe_align python3 bench/moe_align.py ${MOE_ALIGN_ARGS:-} ;;  # the MoE row sort three ways
      decode) TAIL=30 step bench_decode_e2e python3 bench/decode_e2e.py ${DECODE_ARGS:-} ;;  # end-to-end generate, bf16 vs W4A16 (not in the default list: ~4 min)
      read_ceiling) TAIL=8 step bench_read_ceiling python3 bench/decode_read_ceiling.py ${CEILING_ARGS:-} ;;  # the one-row decode against a plain read of its bytes
    esac
  done ;;
esac
case " $SUITE " in *" demo "*) step demo python3 -m torchforge demo ;; esac
# compute-sanitizer (memcheck, racecheck) on the csrc kernels' tests (quantize, batch-1 GEMV, mma layout dense and grouped,
# the Hopper wgmma kernel); PyTorch's caching allocator is turned off so
# that out-of-bounds accesses inside a cached block are caught too.
case " $SUITE " in *" sanitize "*)
  sets=" ${SANITIZE_SETS:-quantize mma wgmma cluster pdl} "  # which of the groups below
  for tool in memcheck racecheck; do
    [[ $sets == *" quantize "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_awq_quantize_cuda.py tests/ops/test_awq_gemv_cuda.py -m "not slow" \
      -k "${SANITIZE_K:-296x384 or 2x264x320 or ties or tiny or huge or matches or errors}"
    # the mma-layout kernels (dense and grouped): one parametrization in four of the dense matrix cases
    [[ $sets == *" mma "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_mma_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_awq_mma_cuda.py tests/ops/test_awq_mma_moe.py -m "not slow" \
      -k "${SANITIZE_MMA_K:-1-True-dtype1 or 2-False-dtype0 or independent or opcheck or grouped or direct or bf16_scales or tickets}"
    # the Hopper kernel (csrc/awq_wgmma.cu: bulk copies, mbarriers, wgmma): every block shape once, K slices, tails
    [[ $sets == *" wgmma "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_wgmma_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_awq_wgmma_cuda.py -m "not slow" \
      -k "${SANITIZE_WGMMA_K:-bit_exact and (dtype0 or dtype2) or 1024-320 or independent or opcheck or producer_warp}"
    # its grouped form (MoE prefill): an uneven load, and out-of-range ids with the shared expert
    [[ $sets == *" wgmma "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_wgmma_moe_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_awq_wgmma_moe.py -m "not slow" -k "${SANITIZE_WGMMA_MOE_K:-dtype1-33-4-3-128 or shared_expert and True}"
    # its K slices as clusters (distributed shared memory, the cluster barrier): every block shape and slice count once
    [[ $sets == *" cluster "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_cluster_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_awq_wgmma_cluster.py -m "not slow" -k "${SANITIZE_CLUSTER_K:-1152-128 or one_hot and dtype0}"
    # programmatic dependent launch (csrc/pdl.cuh): chains of decode, wgmma and MoE decode calls at every level
    [[ $sets == *" pdl "* ]] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 TAIL=6 step "sanitize_pdl_$tool" timeout "${SANITIZE_TIMEOUT:-240}" \
      compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
      tests/ops/test_pdl_cuda.py -m "not slow" -k "${SANITIZE_PDL_K:-decode_kernel_chain and dtype1 or stream-k-7 or moe}"
  done ;;
esac
