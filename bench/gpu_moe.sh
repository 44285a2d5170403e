#!/usr/bin/env bash
# One device session for mixture of experts on one GPU (issue 15): build, the CUDA tests, a
# Mixtral-style and a DeepSeek-style small MoE trained on the demo data (validation loss must
# fall), and the side-by-side table against the PyTorch reference MoE (bench/compare.sh).
# usage: bench/gpu_moe.sh [build] [tests] [train] [compare] ; logs under $OUT (or ./out).
# Needs data/ (tools/fetch_demo_data.sh + preprocess; carried).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
data=data
common=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
        --disable-bias-linear --group-query-attention --num-layers 12 --hidden-size 1024 --num-attention-heads 16
        --num-query-groups 8 --ffn-hidden-size 3584 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 3584
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32
        --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
        --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
        --data-path $data/demo_text_document --split 98,2,0 --vocab-file $data/gpt2/encoder.json
        --merge-file $data/gpt2/vocab.bpe --seed 1234 --log-interval 20 --eval-interval 50 --eval-iters 4)
for step in "$@"; do
  case $step in
    build)
      cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      cmake --build build -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
      echo "build: $(( $(date +%s) - t0 )) s" ;;
    tests)
      (cd build && timeout 400 ctest -L cuda --output-on-failure -j 4 2>&1) > "$OUT/ctest_cuda.log"
      grep -E "tests passed|Failed|FAILED|Timeout" "$OUT/ctest_cuda.log" | tail -30 ;;
    train)
      # Mixtral-style: softmax top-2, switch load-balancing loss and z-loss.
      timeout 420 build/megatron pretrain "${common[@]}" --train-iters ${MOE_ITERS:-150} --moe-aux-loss-coeff 1e-2 \
        --moe-z-loss-coeff 1e-3 2>&1 | tee "$OUT/moe_mixtral.log" | grep -E "model:|iteration +[0-9]+/|validation loss|memory|rror" | cut -c1-400
      # DeepSeek-style: sigmoid scores, aux-loss-free expert bias, group-limited top-k, shared expert.
      timeout 420 build/megatron pretrain "${common[@]}" --train-iters ${MOE_ITERS:-150} \
        --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 \
        --moe-router-group-topk 2 --moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss \
        --moe-aux-loss-coeff 1e-4 2>&1 | tee "$OUT/moe_deepseek.log" | grep -E "model:|iteration +[0-9]+/|validation loss|memory|rror" | cut -c1-400 ;;
    compare)
      bash bench/compare.sh ${COMPARE:-moe_small} ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
