#!/usr/bin/env bash
# One device session for the layer-spec refactor (issue 13): build this tree and, when ref_tree/
# holds the pre-refactor source (git archive <commit> | tar -x -C ref_tree), that one too; run the
# CUDA tests, the Hugging Face logits check (tools/hf_check.py), and GPT-2 124M bf16 speed of both
# binaries alternately in the same session. Usage: bench/gpu_issue13.sh [build] [tests] [hf] [speed] [llama] [torch]
# Logs go to $OUT (or ./out). Needs data/ (tools/fetch_demo_data.sh + preprocess, carried).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
data=data
train=(--seq-length 1024 --max-position-embeddings 1024 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0
        --attention-dropout 0 --bf16 --device cuda --no-progress --data-path $data/demo_text_document --split 98,2,0
        --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --seed 1234)
common=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 "${train[@]}")
for step in "$@"; do
  case $step in
    build)
      if [ -d ref_tree ]; then
        (cmake -S ref_tree -B build_ref -DCMAKE_BUILD_TYPE=Release -DMT_BUILD_TESTS=OFF -DMT_BUILD_BENCH=OFF \
           > "$OUT/ref_configure.log" 2>&1 && cmake --build build_ref -j 6 --target megatron > "$OUT/ref_build.log" 2>&1) &
      fi
      cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      cmake --build build -j 12 > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
      wait
      echo "build: $(( $(date +%s) - t0 )) s" ;;
    tests)
      (cd build && timeout 300 ctest -L cuda --output-on-failure -j 4 2>&1) > "$OUT/ctest_cuda.log"
      grep -E "tests passed|Failed|FAILED|Passed|Timeout" "$OUT/ctest_cuda.log" | tail -40 ;;
    hf)
      timeout 240 python3 tools/hf_check.py build/megatron /tmp/hfcheck --device cuda 2>&1 | tee "$OUT/hf_check.log" | tail -8 ;;
    speed)
      # GPT-2 124M, micro-batch 16, pre-refactor (build_ref) and this tree, alternately, twice.
      for round in 1 2; do
        for bin in build_ref/megatron build/megatron; do
          [ -x "$bin" ] || continue
          timeout 120 $bin pretrain "${common[@]}" --micro-batch-size 16 --global-batch-size 16 --train-iters 60 \
            --lr-warmup-iters 5 --log-interval 20 --eval-interval 1000 --eval-iters 0 > "$OUT/speed_${round}_${bin%%/*}.log" 2>&1
          echo "round $round $bin: $(grep -E 'iteration +60/' "$OUT/speed_${round}_${bin%%/*}.log" | grep -oE 'elapsed time per iteration \(ms\): [0-9.]+|tokens per second: [0-9]+' | tr '\n' ' ') $(grep -oE 'device memory: [0-9.]+ MiB' "$OUT/speed_${round}_${bin%%/*}.log")"
        done
      done ;;
    llama)
      # The Llama-style ~1B model of issue 13 on the demo data: validation loss must fall.
      timeout 300 build/megatron pretrain --num-layers 16 --hidden-size 2048 --num-attention-heads 32 \
        --group-query-attention --num-query-groups 8 --swiglu --ffn-hidden-size 8192 --normalization RMSNorm \
        --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16 \
        --train-iters ${LLAMA_ITERS:-120} --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20 --lr-decay-style cosine \
        --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress \
        --data-path $data/demo_text_document --split 98,2,0 --vocab-file $data/gpt2/encoder.json \
        --merge-file $data/gpt2/vocab.bpe --seed 1234 --log-interval 20 --eval-interval 40 --eval-iters 4 \
        2>&1 | tee "$OUT/llama1b.log" | grep -E "model:|iteration +(20|40|60|80|100|120)/|validation loss|memory" ;;
    flash)
      # GPT-2 124M at micro-batch 16 and 32 with the flash attention (auto) and the local one; the
      # Llama-style 1.2B and a GPT 1.3B (24 layers, h 2048, 16 heads) with flash.
      for mb in 16 32; do
        for backend in flash local; do
          timeout 120 build/megatron pretrain "${common[@]}" --micro-batch-size $mb --global-batch-size $mb             --train-iters 60 --lr-warmup-iters 5 --log-interval 20 --eval-interval 1000 --eval-iters 0             --attention-backend $backend > "$OUT/gpt2_${backend}_mb$mb.log" 2>&1
          echo "gpt2 mb$mb $backend: $(grep -E 'iteration +60/' "$OUT/gpt2_${backend}_mb$mb.log" | grep -oE 'elapsed time per iteration \(ms\): [0-9.]+|TFLOP/s/GPU\): [0-9.]+|tokens per second: [0-9]+' | tr '\n' ' ') $(grep -oE 'device memory: [0-9.]+ MiB' "$OUT/gpt2_${backend}_mb$mb.log") $(grep -oE 'error.*' "$OUT/gpt2_${backend}_mb$mb.log" | head -1)"
        done
      done
      timeout 150 build/megatron pretrain --num-layers 16 --hidden-size 2048 --num-attention-heads 32 \
        --group-query-attention --num-query-groups 8 --swiglu --ffn-hidden-size 8192 --normalization RMSNorm \
        --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear \
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 16 \
        --train-iters 40 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20 --lr-decay-style cosine \
        --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress \
        --data-path $data/demo_text_document --split 98,2,0 --vocab-file $data/gpt2/encoder.json \
        --merge-file $data/gpt2/vocab.bpe --seed 1234 --log-interval 20 --eval-interval 1000 --eval-iters 0 \
        2>&1 | tee "$OUT/llama1b_flash.log" | grep -E "model:|iteration +40/|memory"
      timeout 150 build/megatron pretrain "${train[@]}" --num-layers 24 --hidden-size 2048 \
        --num-attention-heads 16 --micro-batch-size 8 --global-batch-size 8 --train-iters 30 --lr-warmup-iters 5 \
        --log-interval 10 --eval-interval 1000 --eval-iters 0 2>&1 | tee "$OUT/gpt1p3b_flash.log" | grep -E "model:|iteration +30/|memory" ;;
    torch)
      timeout 200 python3 bench/pytorch_gpt2.py --arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 \
        --ffn 8192 --micro-batch-size 4 --seq-length 1024 --steps 10 --warmup 5 --compile 2>&1 | tail -1 | tee -a "$OUT/torch.log"
      for mb in 16 32; do
        timeout 150 python3 bench/pytorch_gpt2.py --micro-batch-size $mb --steps 20 --compile 2>&1 | tail -1 | tee -a "$OUT/torch.log"
      done
      timeout 200 python3 bench/pytorch_gpt2.py --layers 24 --hidden 2048 --heads 16 --micro-batch-size 8 --steps 10 \
        --warmup 5 --compile 2>&1 | tail -1 | tee -a "$OUT/torch.log" ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
