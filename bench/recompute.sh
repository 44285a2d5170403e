#!/usr/bin/env bash
# Activation recompute on one GPU: memory saved and time cost of --recompute-granularity
# selective (--recompute-modules) / full against no recompute, on the demo data, bf16, for GPT-2 124M and GPT 1.3B.
# Prints one markdown table (ms per iteration = the mean of the last 10 iterations of the log,
# tokens/s, megatron.cpp's static buffers and cudaMemGetInfo's in-use memory) to stdout and
# $OUT/recompute.md; logs under $OUT.
#
# usage: bench/recompute.sh [build] [MODEL...]   MODEL: gpt2 (micro-batch 16, 32), gpt_1p3b (8, 16)
# Environment: ITERS (a multiple of 10, default 30). Needs data/ (carried).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
ITERS=${ITERS:-30}
source "$(dirname "$0")/common.sh"
train=("${bench_train[@]}")
if [ "${1:-}" = build ]; then
  shift
  bench_build megatron || exit 1
fi
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(gpt2 gpt_1p3b)

variants=("none|"
          "selective layernorm mlp_act|--recompute-granularity selective --recompute-modules layernorm mlp_act"
          "selective layernorm mlp|--recompute-granularity selective --recompute-modules layernorm mlp"
          "selective, local attention|--attention-backend local --recompute-granularity selective"
          "none, local attention|--attention-backend local"
          "full uniform 1|--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
          "full uniform 4|--recompute-granularity full --recompute-method uniform --recompute-num-layers 4"
          "full block 6|--recompute-granularity full --recompute-method block --recompute-num-layers 6")

echo "| model | micro-batch | recompute | ms/iter | tok/s | buffers MiB | in use MiB |" | tee "$OUT/recompute.md"
echo "|---|---|---|---|---|---|---|" | tee -a "$OUT/recompute.md"
for model in "${models[@]}"; do
  case $model in
    gpt2) arch=(--num-layers 12 --hidden-size 768 --num-attention-heads 12); mbs=(16 32) ;;
    gpt_1p3b) arch=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16); mbs=(8 16) ;;
    *) echo "unknown model $model" >&2; continue ;;
  esac
  for mb in "${mbs[@]}"; do
    for v in "${variants[@]}"; do
      name=${v%%|*}; flags=${v#*|}
      log="$OUT/${model}_mb${mb}_$(tr ' ,' '__' <<< "$name").log"
      # shellcheck disable=SC2086
      timeout 300 build/megatron pretrain "${train[@]}" "${arch[@]}" --micro-batch-size "$mb" \
        --global-batch-size "$mb" $flags > "$log" 2>&1
      line=$(grep -E "iteration +$ITERS/" "$log")
      ms=$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' <<< "$line" | grep -oE '[0-9.]+$')
      tok=$(grep -oE 'tokens per second: [0-9]+' <<< "$line" | grep -oE '[0-9]+$')
      buf=$(grep -oE 'device memory: [0-9.]+ MiB' "$log" | grep -oE '[0-9.]+' | head -1)
      use=$(grep -oE '[0-9.]+ MiB in use' "$log" | grep -oE '[0-9.]+' | head -1)
      [ -n "$ms" ] || { ms="failed: $(grep -iE 'error|out of memory' "$log" | head -1)"; }
      echo "| $model | $mb | $name | $ms | ${tok:-} | ${buf:-} | ${use:-} |" | tee -a "$OUT/recompute.md"
    done
  done
done
