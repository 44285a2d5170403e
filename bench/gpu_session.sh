#!/usr/bin/env bash
# One device session: build with all cores, run the CUDA tests, then the requested training /
# benchmark runs. Logs go to $OUT (or ./out). Usage: bench/gpu_session.sh [tests] [smoke] [train500] [mb32] [torch]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
cmake --preset default -DMT_BUILD_BENCH=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build build -j "$(nproc)" > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
bin=build/megatron
data=data
common=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
        --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0
        --attention-dropout 0 --bf16 --device cuda --no-progress --data-path $data/demo_text_document --split 98,2,0
        --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --seed 1234)
for step in "$@"; do
  case $step in
    tests)
      (cd build && ctest -L cuda --output-on-failure -j 4 2>&1) | tee "$OUT/ctest_cuda.log" | grep -E "tests passed|Failed|FAILED|Passed" ;;
    smoke)
      $bin pretrain "${common[@]}" --micro-batch-size 16 --global-batch-size 16 --train-iters 30 --lr-warmup-iters 5 \
        --log-interval 10 --eval-interval 30 --eval-iters 2 2>&1 | tee "$OUT/smoke.log" | tail -8 ;;
    train500)
      $bin pretrain "${common[@]}" --micro-batch-size 16 --global-batch-size 32 --train-iters 500 --lr-warmup-iters 50 \
        --log-interval 50 --eval-interval 100 --eval-iters 10 --save ckpt 2>&1 | tee "$OUT/train500.log" | grep -E "iteration +(50|250|500)/|validation|memory"
      $bin generate --load ckpt --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --prompt "The whale" \
        --out-seq-length 40 --top-k 40 --temperature 0.8 --device cuda 2>&1 | tee "$OUT/generate.log" | tail -5 ;;
    mb16|mb32)
      mb=${step#mb}
      $bin pretrain "${common[@]}" --micro-batch-size $mb --global-batch-size $mb --train-iters 60 --lr-warmup-iters 5 \
        --log-interval 20 --eval-interval 1000 --eval-iters 0 2>&1 | tee "$OUT/$step.log" | grep -E "iteration +(40|60)/|memory" ;;
    masks)
      $bin pretrain "${common[@]}" --micro-batch-size 16 --global-batch-size 16 --train-iters 30 --lr-warmup-iters 5 \
        --log-interval 10 --eval-interval 30 --eval-iters 2 --reset-position-ids --reset-attention-mask --eod-mask-loss \
        2>&1 | tee "$OUT/masks.log" | grep -E "iteration +30/|validation loss at iteration 30" ;;
    fp16)
      fp16=("${common[@]/--bf16/--fp16}")
      $bin pretrain "${fp16[@]}" --micro-batch-size 16 --global-batch-size 16 --train-iters 40 --lr-warmup-iters 5 \
        --log-interval 10 --eval-interval 40 --eval-iters 2 --loss-scale-window 10 2>&1 | tee "$OUT/fp16.log" | grep -E "iteration|validation" ;;
    torch)
      for mb in 16 32; do python3 bench/pytorch_gpt2.py --micro-batch-size $mb --steps 20 --compile 2>&1 | tail -1 | tee -a "$OUT/torch.log"; done ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
