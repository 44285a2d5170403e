#!/usr/bin/env bash
# One device session for MoE at scale (issue 39 items 2-4) on 2 GPUs of one machine, in steps that
# each fit one device call (≤ 10 minutes):
#   build     configure (preset default, benchmarks on) and build the MoE targets
#   tests     the MoE CUDA tests: moe_echo_peers_cuda_dist_test and moe_layouts_cuda_dist_test under
#             mpiexec -np 2; moe_cuda_test, moe_echo_cuda_test, moe_echo_exchange_cuda_test
#   dispatch  moe_dispatch_bench (the dispatchers' exchanges against NCCL's all-to-all), mpiexec -np 2
#   overlap   bench/moe_overlap.sh 2 (the overlap flags on vs off, Mixtral-style, EP 2)
#   echo      bench/echo_ep.sh 2 (ECHO; the used-slot transfers' MiB per iteration)
# Logs under $OUT (or ./out); the last lines of each step are printed. Needs data/ (carried) for
# overlap and echo.
# usage: bench/gpu_issue39.sh STEP [STEP...]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
t0=$(date +%s)
mpi=(mpiexec --allow-run-as-root --oversubscribe -np 2)
for step in "$@"; do
  case $step in
    build)
      cmake --preset default -DMT_BUILD_BENCH=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      cmake --build build -j "$(nproc)" --target megatron moe_echo_peers_cuda_dist_test moe_layouts_cuda_dist_test \
        moe_cuda_test moe_echo_cuda_test moe_echo_exchange_cuda_test moe_dispatch_bench > "$OUT/build.log" 2>&1 ||
        { grep -E "error|\*\*\*" -A3 "$OUT/build.log" | head -60; exit 1; }
      echo "build: $(( $(date +%s) - t0 )) s" ;;
    tests)
      for t in moe_echo_peers_cuda_dist_test moe_layouts_cuda_dist_test; do
        timeout 300 "${mpi[@]}" "build/$t" > "$OUT/${t}_np2.log" 2>&1
        echo "== $t (np 2): rc=$?"
        grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|bytes written|tensors differ|rel err|wrote" "$OUT/${t}_np2.log" | head -60
      done
      for t in moe_cuda_test moe_echo_cuda_test moe_echo_exchange_cuda_test; do
        timeout 120 "build/$t" > "$OUT/$t.log" 2>&1
        echo "== $t: rc=$? $(grep -E "PASSED|FAILED" "$OUT/$t.log" | tr '\n' ' ')"
      done ;;
    dispatch)
      timeout 240 "${mpi[@]}" build/moe_dispatch_bench --tokens 8192 --hidden 4096 --experts 8 --topk 2 2>&1 |
        tee "$OUT/moe_dispatch_bench.log" | tail -20 ;;
    overlap)
      timeout 540 bash bench/moe_overlap.sh 2 2>&1 | tail -12 ;;
    echo)
      ITERS=${ITERS:-30} timeout 540 bash bench/echo_ep.sh 2 2>&1 | tail -10 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
