#!/usr/bin/env bash
# Context parallelism over NCCL on 2 GPUs (issue 17): fp32 losses of CP 2 (p2p, allgather, a2a)
# against one GPU, same data and seed. Usage: bench/gpu_cp_check.sh [build]. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
if [ "${1:-}" = build ]; then
  cmake --preset default > "$OUT/configure.log" 2>&1 && cmake --build build -j 32 --target megatron > "$OUT/build.log" 2>&1 \
    || { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
fi
flags=(pretrain --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
       --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1
       --train-iters 8 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0 --device cuda
       --no-progress --data-path data/demo_text_document --split 98,2,0 --vocab-file data/gpt2/encoder.json
       --merge-file data/gpt2/vocab.bpe --seed 1234)
losses() { grep -oE 'lm loss: [0-9.E+-]+' "$1" | awk '{print $3}' | tr '\n' ' '; }
build/megatron "${flags[@]}" > "$OUT/cp1.log" 2>&1; echo "1 GPU:          $(losses "$OUT/cp1.log")"
for t in p2p allgather a2a; do
  build/megatron "${flags[@]}" --nproc-per-node 2 --context-parallel-size 2 --cp-comm-type $t > "$OUT/cp2_$t.log" 2>&1
  echo "CP 2 $t: $(losses "$OUT/cp2_$t.log") $(grep -m1 -oE 'error.*' "$OUT/cp2_$t.log")"
done
