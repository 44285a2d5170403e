#!/usr/bin/env bash
# Per-kernel GPU time of one training step of the Llama-style model (compare.sh's llama_1b with
# LAYERS decoder layers, default 4: the per-layer kernels are the same, the profile shorter), in
# bf16 and under each FP8 recipe, through bench/kernel_profile.sh (Nsight Compute, kernels
# serialised). What the quantisation costs and where the FP8 step's time goes (issue 38).
# MODEL=gpt_1p3b: compare.sh's GPT 1.3B instead (LayerNorm, biases, GELU, 16 heads, micro-batch 8).
# usage: [MODEL=llama_1b|gpt_1p3b] [LAYERS=N] [TOP=N] bench/fp8_profile.sh [bf16|fp8|fp8_delayed|fp8_delayed_fused|fp8_delayed_unfused|fp8_block]...
#   (default: bf16 fp8 fp8_delayed fp8_block; fp8_delayed: the SwiGLU's fused FP8 output and
#   gradient, the default; fp8_delayed_fused: the norms' too, MT_FP8_FUSED_PRODUCERS=1;
#   fp8_delayed_unfused: none, =0; docs/fp8.md "What fuses")
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
args=(--seq-length 1024 --max-position-embeddings 1024 --lr 3e-4 --lr-decay-style constant --lr-warmup-iters 0
      --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
      "${demo_data[@]}" --seed 1234 --eval-interval 100000 --eval-iters 0 --num-layers "${LAYERS:-4}"
      --hidden-size 2048)
case ${MODEL:-llama_1b} in
  llama_1b) args+=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
                   --disable-bias-linear --group-query-attention --num-attention-heads 32 --num-query-groups 8
                   --ffn-hidden-size 8192 --micro-batch-size 4 --global-batch-size 4) ;;
  gpt_1p3b) args+=(--num-attention-heads 16 --micro-batch-size 8 --global-batch-size 8) ;;
  *) echo "unknown MODEL ${MODEL}" >&2; exit 2 ;;
esac
[ $# -gt 0 ] || set -- bf16 fp8 fp8_delayed fp8_block
for v in "$@"; do
  case $v in
    bf16) extra=() ;;
    fp8) extra=(--fp8-format hybrid --fp8-recipe tensorwise) ;;
    fp8_delayed) extra=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max) ;;
    fp8_delayed_fused|fp8_delayed_unfused) extra=(--fp8-format hybrid --fp8-recipe delayed
                              --fp8-amax-history-len 1024 --fp8-amax-compute-algo max) ;;  # + MT_FP8_FUSED_PRODUCERS (below)
    fp8_block) extra=(--fp8-format e4m3 --fp8-recipe blockwise) ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  echo "== $v"
  fused=act; [ "$v" = fp8_delayed_fused ] && fused=1; [ "$v" = fp8_delayed_unfused ] && fused=0
  MT_FP8_FUSED_PRODUCERS=$fused OUT="$OUT/$v" TOP=${TOP:-30} bash "$(dirname "$0")/kernel_profile.sh" "${args[@]}" \
    "${extra[@]}"
done
