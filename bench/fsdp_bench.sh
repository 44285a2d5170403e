#!/usr/bin/env bash
# Megatron-FSDP on 2 GPUs (issue 45's "Done when"), each step printing a markdown table:
#   llama8b  Llama 3 8B's shape (32 layers, hidden 4096, GQA 32/8, SwiGLU 14336, sequence 8192, the
#            128K vocabulary as NullTokenizer --vocab-size 128256), micro-batch 1, global batch 16,
#            bf16, mock data: --use-megatron-fsdp with optim_grads_params (ZeRO-3), optim_grads
#            (ZeRO-2) and optim (ZeRO-1, the distributed optimizer) at DP 2, beside TP 2 + SP and PP 2
#            (the best TP / PP layouts `megatron plan` ranks for 2 GPUs) — tokens/s per GPU, TFLOP/s
#            and MFU by Megatron-Core's current formula, memory per GPU.
#   gpt1p3b  GPT 1.3B (24 layers, h 2048, 16 heads, seq 2048), DP 2 only, micro-batch 4, global
#            batch 32: ZeRO-1 / 2 / 3 memory per GPU and tokens/s in one table.
# Usage: bench/fsdp_bench.sh [llama8b] [gpt1p3b]   (default both). Env: OUT (logs, default out),
# MT_BUILD_DIR (default build; the megatron binary must be built), ITERS (default 10), WARM
# (default 4: the log windows after it are averaged, bench/common.sh log_means), PLAN_ONLY=1 (only
# `megatron plan` of each row: runs anywhere).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on these machines
source bench/common.sh
megatron_bin fsdp_bench
ITERS=${ITERS:-10}; WARM=${WARM:-4}; PLAN_ONLY=${PLAN_ONLY:-0}
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(llama8b gpt1p3b)
common=(--bf16 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --hidden-dropout 0 --attention-dropout 0 --mock-data
        --tokenizer-type NullTokenizer --seed 1234 --train-iters "$ITERS" --log-interval 2 --eval-iters 0
        --eval-interval 100000 --no-progress --device cuda --overlap-grad-reduce)
# Every row overlaps its gradient reduction with the backward (Megatron-FSDP always does) and, where
# the layout gathers the parameters after the optimizer step, that gather with the next forward
# (optim_grads_params gathers per layer before use, prefetched, and refuses the flag).
zero3=(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params)
zero2=(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --overlap-param-gather)
zero1=(--use-megatron-fsdp --data-parallel-sharding-strategy optim --overlap-param-gather)

# row NAME LABEL FLAGS...: one 2-GPU run (or its plan), one markdown row
row() {
  local name=$1 label=$2; shift 2
  local plan ms tf mfu mem tok
  plan=$("$bin" plan --world-size 2 --gpu h200 "${common[@]}" "$@" 2>&1 | grep -oE "predicted step: [0-9.]+|= [0-9.]+ GiB of" |
         sed 's/predicted step: //; s/= //; s/ GiB of//' | tr '\n' ' ')
  if [ "$PLAN_ONLY" = 1 ]; then
    echo "| $label | not run | | | | | plan: $plan |"
    return
  fi
  "$bin" pretrain --nproc-per-node 2 "${common[@]}" "$@" > "$OUT/fsdp_$name.log" 2>&1
  local rc=$?
  read -r ms tf mfu <<< "$(log_means "$OUT/fsdp_$name.log" "$WARM")"
  tok=$(grep -oE "tokens per second: [0-9]+" "$OUT/fsdp_$name.log" | tail -1 | grep -oE "[0-9]+")
  # the largest rank's buffers / memory in use (GiB)
  mem=$(largest_rank_mem "$OUT/fsdp_$name.log" | sed 's| | / |')
  local err=""
  [ $rc -eq 0 ] || err=" (exit $rc: $(grep -m1 -iE "error|out of memory" "$OUT/fsdp_$name.log" | cut -c1-120))"
  echo "| $label$err | $ms | ${tok:+$((tok / 2))} | $tf | $mfu% | $mem | plan: $plan |"
}

for step in "${steps[@]}"; do
  case $step in
    llama8b)
      m=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
         --ffn-hidden-size 14336 --swiglu --normalization RMSNorm --position-embedding-type rope
         --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 --max-position-embeddings 8192
         --vocab-size 128256 --micro-batch-size 1 --global-batch-size 16)
      echo
      echo "Llama 3 8B shape on 2 GPUs (seq 8192, micro-batch 1, global batch 16, bf16; $(date -u +%F)):"
      echo
      echo "| layout | ms/iter | tokens/s per GPU | TFLOP/s per GPU | MFU | buffers / in use GiB (largest rank) | plan: GiB with reserve (per stage), ms |"
      echo "|---|---|---|---|---|---|---|"
      row l8_zero3 "DP 2, optim_grads_params (ZeRO-3)" "${m[@]}" "${zero3[@]}"
      # Megatron-FSDP's user guide recommends reducing the gradients in bf16
      row l8_zero3_bf16 "DP 2, optim_grads_params (ZeRO-3), --grad-reduce-in-bf16" "${m[@]}" "${zero3[@]}" \
        --grad-reduce-in-bf16
      row l8_zero2 "DP 2, optim_grads (ZeRO-2)" "${m[@]}" "${zero2[@]}"
      row l8_zero1 "DP 2, optim (ZeRO-1)" "${m[@]}" "${zero1[@]}"
      row l8_tp2 "TP 2 + SP, distopt" "${m[@]}" --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer \
        --overlap-param-gather
      row l8_pp2 "PP 2, distopt" "${m[@]}" --pipeline-model-parallel-size 2 --use-distributed-optimizer \
        --overlap-param-gather ;;
    gpt1p3b)
      m=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
         --vocab-size 50257 --micro-batch-size 4 --global-batch-size 32)
      echo
      echo "GPT 1.3B, DP 2 only (seq 2048, micro-batch 4, global batch 32, bf16; $(date -u +%F)):"
      echo
      echo "| sharding | ms/iter | tokens/s per GPU | TFLOP/s per GPU | MFU | buffers / in use GiB (largest rank) | plan: GiB with reserve (per stage), ms |"
      echo "|---|---|---|---|---|---|---|"
      row g13_zero1 "optim (ZeRO-1)" "${m[@]}" "${zero1[@]}"
      row g13_zero2 "optim_grads (ZeRO-2)" "${m[@]}" "${zero2[@]}"
      row g13_zero3 "optim_grads_params (ZeRO-3)" "${m[@]}" "${zero3[@]}" ;;
    *) echo "fsdp_bench: unknown step '$step' (expected llama8b, gpt1p3b)"; exit 2 ;;
  esac
done
