#!/usr/bin/env bash
# One device session's checks, in steps that each fit one device call (the machine stays warm
# between back-to-back calls, so later steps reuse the build):
#   build          configure (preset default) and build everything with all cores (BUILD_TARGETS:
#                  only those targets — a fresh 16-core machine takes ~460 s for everything)
#   ctest          ctest -L cuda (the multi-GPU tests run at their own rank counts; those that need
#                  more GPUs than the machine has say so and skip); CTEST_ARGS adds ctest arguments
#                  (e.g. CTEST_ARGS="-R 'mla|muon'" or "-E 'mla|muon'")
#   dist2          the CUDA dist tests under mpiexec -np 2 (2-GPU machines)
#   grouped        the grouped-GEMM self-check and benchmark (bench/grouped_matmul_bench)
#   fp8            the FP8 CUDA tests and the FP8 GEMM benchmark
#   compare CFG..  bench/compare.sh CFG... (megatron.cpp against PyTorch compile, one GPU)
# Logs in $OUT/logs.tgz (one file: the device tool returns at most 8) and every step's summary in
# $OUT/summary.txt (also printed).
# usage: bench/gpu_verify.sh STEP [STEP...]    (compare takes the rest of the arguments)
set -uo pipefail
FINAL=${OUT:-out}; mkdir -p "$FINAL"
OUT=$(mktemp -d); trap 'tar -C "$OUT" -czf "$FINAL/logs.tgz" . 2>/dev/null' EXIT
exec > >(tee "$FINAL/summary.txt") 2>&1
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
t0=$(date +%s)
gpus=$(nvidia-smi -L | wc -l)
while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
      cmake --preset default -DMT_BUILD_BENCH=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      targets=(); for t in ${BUILD_TARGETS:-}; do targets+=(--target "$t"); done
      cmake --build build -j "$(nproc)" "${targets[@]}" -- -k > "$OUT/build.log" 2>&1 || { grep -E "error|\*\*\*" "$OUT/build.log" | head -40; }
      echo "build: $(( $(date +%s) - t0 )) s" ;;
    ctest)
      (cd build && timeout "${CTEST_TIMEOUT:-540}" bash -c "ctest -L cuda --output-on-failure -j $gpus ${CTEST_ARGS:-}" 2>&1) > "$OUT/ctest_cuda.log"
      grep -E "tests passed|Failed|\*\*\*|Not Run|Timeout" "$OUT/ctest_cuda.log" | tail -40
      grep -h "SKIPPED\|Skipped" -A1 "$OUT/ctest_cuda.log" | head -20 ;;
    dist2)
      for t in build/*_cuda_dist_test; do
        echo "== $t (np 2)"
        timeout 240 mpiexec --allow-run-as-root --oversubscribe -np 2 "$t" > "$OUT/$(basename "$t")_np2.log" 2>&1
        echo "rc=$?"; grep -E "PASSED|FAILED|SKIPPED" "$OUT/$(basename "$t")_np2.log" | sort | uniq -c | head -20
      done ;;
    grouped)
      cuobjdump -sass build/CMakeFiles/mt.dir/src/ops/cuda/grouped_matmul_sm90.cu.o 2>/dev/null | grep -c HGMMA
      timeout 120 build/grouped_matmul_bench --check 2>&1 | tee "$OUT/grouped_check.log" | tail -25
      timeout 240 build/grouped_matmul_bench 2>&1 | tee "$OUT/grouped_bench.log" | tail -40 ;;
    fp8)
      timeout 240 build/fp8_cuda_test 2>&1 | tee "$OUT/fp8_cuda_test.log" | grep -E "FAILED|PASSED|OK \]|Failure" | tail -40
      timeout 240 build/fp8_gemm_bench 2>&1 | tee "$OUT/fp8_gemm_bench.log" | tail -40 ;;
    compare)
      bash bench/compare.sh "$@" 2>&1 | tail -20
      shift $# ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
