#!/usr/bin/env bash
# Context parallelism at long sequences on 2 GPUs (issue 40): the Llama-style 1.18B model (16
# layers, hidden 2048, 32 heads / 8 query groups, SwiGLU 8192, RoPE, RMSNorm), bf16, micro-batch 1,
# --attention-backend fused (cuDNN blocks), mock data.
#   1. correctness: the CP tests over NCCL (cp_layouts_np2_cuda_dist_test, cp_ring_cuda_test and
#      context_attention_cuda_test's cuDNN blocks) -- before any timing;
#   2. the attention layer alone (cp_ring_bench, mpiexec -np 2): per-phase timing of one layer
#      (block compute, exposed ring communication, the rest), the ring's communication timed alone,
#      the fraction the overlap hides -- asserted (>= 50% for p2p; the script fails otherwise) --
#      and the one-GPU attention of the whole sequence; 32K, 64K, 128K, p2p and a2a;
#      context_attention_bench: one block, cuDNN against the FlashAttention-2 kernels;
#   3. end to end (megatron pretrain, $ITERS iterations, the mean of the last log interval): one GPU
#      and CP 2 at 32K; CP 2 p2p and a2a at 64K (one GPU: only if the estimate fits); CP 2 p2p at
#      128K (with --recompute-modules mlp if the plain run's estimate does not fit); tokens/s,
#      TFLOP/s per GPU (the log line's formula, docs/flags.md), the memory estimate printed at start,
#      the buffers and memory in use at start (rank 0), the measured peak per GPU (nvidia-smi
#      sampled during the run; GPUs 0..N-1 are the run's), and CP 2's speed-up over one GPU.
# Usage: bench/cp_bench.sh [build] [tests] [layer] [e2e] [64k] [128k] [long] [quick]
#   the stages named (default: tests layer e2e long; each a few minutes on 2 H200s after a build):
#   e2e runs 32K, 64k and 128k the end-to-end runs at that sequence, long = 64k 128k; quick: the
#   layer bench at 32K only; FLASH=0 leaves out the 32K CP 2 run on the FlashAttention-2 kernels.
#   Logs in $OUT/logs.tgz (one file: the device tool returns at most 8)
#   and the printed summary in $OUT/summary.txt ($OUT default out/).
set -uo pipefail
FINAL=${OUT:-out}; mkdir -p "$FINAL"
OUT=$(mktemp -d); trap 'tar -C "$OUT" -czf "$FINAL/logs.tgz" . 2>/dev/null' EXIT
exec > >(tee "$FINAL/summary.txt") 2>&1
export NCCL_NVLS_ENABLE=0
source bench/common.sh
if [ "${1:-}" = build ]; then
  bench_build megatron cp_ring_bench context_attention_bench cp_layouts_np2_cuda_dist_test cp_ring_cuda_test \
    context_attention_cuda_test || exit 1
  shift
fi
stages=" $* "
grep -qE 'tests|layer|e2e|64k|128k|long' <<<"$stages" || stages="$stages tests layer e2e long "
[[ "$stages" == *" long "* ]] && stages="$stages 64k 128k "
has() { [[ "$stages" == *" $1 "* ]]; }
quick=$(has quick && echo quick)
ITERS=${ITERS:-8}
t0=$(date +%s)
fail=0
checked=()  # the checks these stages ran (the final line names only those)

model=(pretrain --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention
       --num-query-groups 8 --swiglu --ffn-hidden-size 8192 --normalization RMSNorm --position-embedding-type rope
       --untie-embeddings-and-output-weights --disable-bias-linear --bf16 --device cuda --no-progress
       --attention-backend fused --mock-data --tokenizer-type NullTokenizer --vocab-size 50257
       --micro-batch-size 1 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1
       --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --seed 1234 --train-iters "$ITERS"
       --log-interval $((ITERS / 2)) --eval-iters 0 --eval-interval 100000 --use-distributed-optimizer)
# run NAME SEQ GPUS [flags...]: one training run; prints its row (or why it did not run).
run() {
  local name=$1 seq=$2 gpus=$3
  shift 3
  local log="$OUT/e2e_$name.log"
  local launch=()
  [ "$gpus" -gt 1 ] && launch=(--nproc-per-node "$gpus")
  # the measured peak per GPU: nvidia-smi's memory.used every 200 ms during the run (everything on
  # the GPU: buffers, CUDA context, cuBLASLt/cuDNN workspaces, NCCL), the max per GPU
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/e2e_$name.smi" 2>/dev/null &
  local smi=$!
  timeout 1500 build/megatron "${model[@]}" --seq-length "$seq" --max-position-embeddings "$seq" \
    --global-batch-size 1 "${launch[@]}" "$@" > "$log" 2>&1
  local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  local peak
  peak=$(awk -F', *' -v n="$gpus" '$1 < n && $2 > m[$1] { m[$1] = $2 } END { for (i = 0; i < n; ++i) printf "%s%.1f", (i ? " / " : ""), m[i] / 1024 }' "$OUT/e2e_$name.smi")
  local line
  line=$(grep -E "iteration +$ITERS/" "$log" | tail -1)
  local ms tok tf est mem
  ms=$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' <<<"$line" | awk '{print $NF}')
  tok=$(grep -oE 'tokens per second: [0-9.]+' <<<"$line" | awk '{print $NF}')
  tf=$(grep -oE 'TFLOP/s/GPU\): [0-9.]+' <<<"$line" | awk '{print $NF}')
  est=$(grep -m1 -oE 'memory estimate per rank: .*' "$log" | grep -oE 'total [0-9.]+ GiB')
  mem=$(grep -m1 -oE 'device memory: [0-9.]+ MiB in megatron.cpp buffers.*in use' "$log" | grep -oE '[0-9.]+ MiB' | tr '\n' ' ')
  if [ $rc -ne 0 ] || [ -z "$ms" ]; then
    printf "%-24s %7s %4s | did not run: %s\n" "$name" "$seq" "$gpus" "$(grep -m1 -oE '(error|out of memory).*' "$log" | cut -c1-160)"
    return 1
  fi
  printf "%-24s %7s %4s | %9s ms %10s tok/s %7s TFLOP/s/GPU | estimate %s | buffers, in use at start (rank 0): %s| peak per GPU (nvidia-smi): %s GiB\n" \
    "$name" "$seq" "$gpus" "$ms" "$tok" "$tf" "$est" "$mem" "$peak"
  echo "$tok" > "$OUT/e2e_$name.tok"
}
speedup() {  # speedup CP_NAME ONE_NAME
  [ -s "$OUT/e2e_$1.tok" ] && [ -s "$OUT/e2e_$2.tok" ] &&
    echo "  $1 / $2: $(awk -v a="$(cat "$OUT/e2e_$1.tok")" -v b="$(cat "$OUT/e2e_$2.tok")" \
      'BEGIN { printf "%.2fx tokens/s (%.0f%% scaling efficiency on 2 GPUs)", a / b, 50 * a / b }')"
}

if has tests; then
checked+=(tests)
echo "== 1. correctness (NCCL, 2 GPUs; one GPU) =="
timeout 900 mpiexec --allow-run-as-root -np 2 build/cp_layouts_np2_cuda_dist_test > "$OUT/cp_dist_test.log" 2>&1 \
  || fail=1
grep -E "^\[|PASSED|FAILED|SKIPPED|Failure|rel err" "$OUT/cp_dist_test.log" | head -60
for t in cp_ring_cuda_test context_attention_cuda_test; do
  timeout 600 build/$t > "$OUT/$t.log" 2>&1 || fail=1
  echo "$t: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
done

fi
if has layer; then
checked+=("the ring's overlap check")
echo "== 2. one attention layer (cp_ring_bench, CP 2) and one block (context_attention_bench) =="
seqs=32768,65536,131072
[ "$quick" = quick ] && seqs=32768
# the 1.18B's attention: the table (its exchanges are 2-4% of the layer, within the blocks' timing
# noise, so it does not gate: --min-hidden -100) ...
timeout 900 mpiexec --allow-run-as-root -np 2 build/cp_ring_bench --seqs $seqs --types p2p,a2a --backend fused \
  --min-hidden -100 2>&1 | tee "$OUT/cp_ring_bench.log" | grep -v "^\["
# ... and the overlap check where the exchanges weigh: 8 heads in 8 groups (the same K/V bytes per
# token, a quarter of the attention FLOPs), 16K and 32K; the ring against its serialised self
timeout 300 mpiexec --allow-run-as-root -np 2 build/cp_ring_bench --seqs 16384,32768 --types p2p --ring nccl,ce \
  --heads 8 --groups 8 --backend fused --iters 9 2>&1 | tee "$OUT/cp_ring_bench_check.log" | grep -v "^\[" ;
[ "${PIPESTATUS[0]}" = 0 ] || fail=1
timeout 300 mpiexec --allow-run-as-root -np 2 build/cp_ring_bench --seqs 32768 --types p2p --backend flash \
  2>&1 | tee "$OUT/cp_ring_bench_flash.log" | grep -v "^\["
timeout 300 build/context_attention_bench --dims 64 --qpg 4 --seqs 8192,16384,32768 --iters 5 \
  2>&1 | tee "$OUT/context_attention_bench.log"

fi
if has e2e; then
echo "== 3. end to end: the 1.18B model, micro-batch 1 =="
printf "%-24s %7s %4s | %s\n" "run" "seq" "GPUs" "ms/iter, tokens/s (all GPUs), TFLOP/s per GPU, memory"
rm -f "$OUT"/e2e_*32k*.tok
run one_gpu_32k 32768 1
run cp2_p2p_32k 32768 2 --context-parallel-size 2 --cp-comm-type p2p
run cp2_a2a_32k 32768 2 --context-parallel-size 2 --cp-comm-type a2a
[ "${FLASH:-1}" = 1 ] && run cp2_p2p_flash_32k 32768 2 --context-parallel-size 2 --cp-comm-type p2p --attention-backend flash
speedup cp2_p2p_32k one_gpu_32k; speedup cp2_a2a_32k one_gpu_32k; speedup cp2_p2p_flash_32k one_gpu_32k
fi
if has 64k; then
  echo "== 4. end to end at 64K =="
  rm -f "$OUT"/e2e_*64k*.tok
  run one_gpu_64k 65536 1 || run one_gpu_64k_recompute_mlp 65536 1 --recompute-granularity selective \
    --recompute-modules mlp
  run cp2_p2p_64k 65536 2 --context-parallel-size 2 --cp-comm-type p2p
  run cp2_a2a_64k 65536 2 --context-parallel-size 2 --cp-comm-type a2a
  one64=one_gpu_64k; [ -s "$OUT/e2e_one_gpu_64k.tok" ] || one64=one_gpu_64k_recompute_mlp
  speedup cp2_p2p_64k $one64; speedup cp2_a2a_64k $one64
fi
if has 128k; then
  echo "== 5. end to end at 128K, CP 2 =="
  run cp2_p2p_128k 131072 2 --context-parallel-size 2 --cp-comm-type p2p ||
    run cp2_p2p_128k_recompute_mlp 131072 2 --context-parallel-size 2 --cp-comm-type p2p \
      --recompute-granularity selective --recompute-modules mlp
fi
if [ $fail != 0 ]; then verdict="FAILED: see above"
elif [ ${#checked[@]} = 0 ]; then verdict="runs only (no tests or overlap check in these stages)"
else verdict="$(IFS=,; echo "${checked[*]}" | sed 's/,/ and /') passed"; fi
echo "total: $(( $(date +%s) - t0 )) s; $verdict"
exit $fail
