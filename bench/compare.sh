#!/usr/bin/env bash
# Side by side on one GPU, in one device session: megatron.cpp (`megatron pretrain` on the demo
# data, bf16) and the PyTorch reference (bench/pytorch_gpt2.py: same model, torch.compile, SDPA,
# fused AdamW, bf16 autocast) for each named configuration; prints one markdown table row per
# configuration (tokens/s, TFLOP/s per GPU by Megatron's formula, ratio, peak memory) to stdout
# and $OUT/compare.md, logs under $OUT.
#
# usage: bench/compare.sh [build] CONFIG...
#   gpt2_mb16 gpt2_mb32   GPT-2 124M, sequence 1024, micro-batch 16 / 32
#   gpt_1p3b              GPT 1.3B (24 layers, hidden 2048, 16 heads), micro-batch 8
#   llama_1b              Llama-style 1.2B (16 layers, hidden 2048, GQA 32/8, SwiGLU 8192), micro-batch 4
#   moe_small             Mixtral-style MoE (12 layers, hidden 1024, GQA 16/8, 8 experts top-2, expert
#                         SwiGLU 3584, aux loss 1e-2), micro-batch 8
# Environment: ITERS (megatron iterations, a multiple of 10, default 40; the last log line, the mean
# of the last 10 iterations, is read),
# TORCH_STEPS (default 20). Needs data/ (tools/fetch_demo_data.sh + preprocess; carried).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
ITERS=${ITERS:-40}
TORCH_STEPS=${TORCH_STEPS:-20}
source "$(dirname "$0")/common.sh"
train=("${bench_train[@]}")
llama=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
       --disable-bias-linear --group-query-attention)

config() {  # sets mt (megatron flags) and pt (pytorch flags) for $1
  case $1 in
    gpt2_mb16|gpt2_mb32)
      local mb=${1#gpt2_mb}
      mt=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size "$mb" --global-batch-size "$mb")
      pt=(--micro-batch-size "$mb") ;;
    gpt_1p3b)
      mt=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --micro-batch-size 8 --global-batch-size 8)
      pt=(--layers 24 --hidden 2048 --heads 16 --micro-batch-size 8) ;;
    llama_1b)
      mt=("${llama[@]}" --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 8
          --ffn-hidden-size 8192 --micro-batch-size 4 --global-batch-size 4)
      pt=(--arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192 --micro-batch-size 4) ;;
    moe_small)
      mt=("${llama[@]}" --num-layers 12 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 8
          --ffn-hidden-size 3584 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 3584
          --moe-aux-loss-coeff 1e-2 --micro-batch-size 8 --global-batch-size 8)
      pt=(--arch llama --layers 12 --hidden 1024 --heads 16 --kv-heads 8 --ffn 3584 --experts 8 --topk 2
          --moe-ffn 3584 --aux-loss-coeff 1e-2 --micro-batch-size 8) ;;
    *) echo "unknown configuration $1" >&2; return 1 ;;
  esac
}

if [ "${1:-}" = build ]; then
  shift
  bench_build megatron || exit 1
fi

header="| configuration | megatron.cpp tok/s | PyTorch tok/s | ratio | TFLOP/s/GPU (ours) | step ms ours / PyTorch | memory ours / PyTorch (GiB) |"
echo "$header" | tee "$OUT/compare.md"
echo "|---|---|---|---|---|---|---|" | tee -a "$OUT/compare.md"
for c in "$@"; do
  config "$c" || continue
  timeout 300 build/megatron pretrain "${train[@]}" "${mt[@]}" > "$OUT/$c.megatron.log" 2>&1
  line=$(grep -E "iteration +$ITERS/" "$OUT/$c.megatron.log")
  tok=$(grep -oE 'tokens per second: [0-9]+' <<< "$line" | grep -oE '[0-9]+$')
  tfl=$(grep -oE 'TFLOP/s/GPU\): [0-9.]+' <<< "$line" | grep -oE '[0-9.]+$')
  ms=$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' <<< "$line" | grep -oE '[0-9.]+$')
  mib=$(grep -oE 'device memory: [0-9.]+ MiB' "$OUT/$c.megatron.log" | grep -oE '[0-9.]+' | head -1)
  [ -n "$tok" ] || { echo "| $c | failed: $(grep -iE 'error' "$OUT/$c.megatron.log" | head -1) | | | | | |" | tee -a "$OUT/compare.md"; continue; }
  timeout 400 python3 bench/pytorch_gpt2.py "${pt[@]}" --steps "$TORCH_STEPS" --warmup 5 --compile > "$OUT/$c.torch.log" 2>&1
  tline=$(tail -1 "$OUT/$c.torch.log")
  ttok=$(grep -oE '[0-9]+ tok/s' <<< "$tline" | grep -oE '[0-9]+')
  tms=$(grep -oE '[0-9.]+ ms/step' <<< "$tline" | grep -oE '[0-9.]+')
  tgib=$(grep -oE 'peak mem [0-9.]+' <<< "$tline" | grep -oE '[0-9.]+$')
  ratio=$(awk -v a="$tok" -v b="${ttok:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
  gib=$(awk -v m="${mib:-0}" 'BEGIN { printf "%.1f", m / 1024 }')
  echo "| $c | $tok | ${ttok:-failed} | $ratio | $tfl | $ms / ${tms:-?} | $gib / ${tgib:-?} |" | tee -a "$OUT/compare.md"
done
