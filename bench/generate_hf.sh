#!/usr/bin/env bash
# Generation speed, GPT-2 124M on one GPU: megatron generate (KV cache, greedy, bf16) beside
# Hugging Face transformers' generate (KV cache, greedy, bf16) with the same weights, at batch 1
# and 16, 128 new tokens per sequence. Weights: $HF_GPT2_DIR (a local GPT-2 model directory) or,
# offline, a random GPT-2 124M written by bench/hf_generate.py (speed does not depend on the
# values). Imported with `megatron import-hf`. Our tokens/s counts prefill + decode of all new
# tokens (the first of two equal batches warms up; both are counted); HF's one warm-up call is
# excluded. Usage: bench/generate_hf.sh [build]   (needs data/gpt2/encoder.json + vocab.bpe)
# Output under $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
BIN=${BIN:-build/megatron}
VOCAB=data/gpt2/encoder.json
MERGES=data/gpt2/vocab.bpe
NEW=128
PROMPT="The quick brown fox jumps over the lazy dog. In the beginning"
if [ "${1:-}" = build ]; then
  cmake --preset default > "$OUT/configure.log" 2>&1 && cmake --build build -j 12 --target megatron > "$OUT/build.log" 2>&1 \
    || { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; }
fi
HF=${HF_GPT2_DIR:-$OUT/gpt2_random}
if [ ! -f "$HF/config.json" ]; then
  python3 bench/hf_generate.py --model "$HF" --vocab $VOCAB --merges $MERGES --make-random || exit 1
fi
rm -rf "$OUT/gpt2_ckpt"
$BIN import-hf --hf-dir "$HF" --save "$OUT/gpt2_ckpt" > "$OUT/import.log" 2>&1 || { tail -20 "$OUT/import.log"; exit 1; }
for b in 1 16; do
  prompts=()
  for _ in $(seq 1 $((2 * b))); do prompts+=(--prompt "$PROMPT"); done
  $BIN generate --load "$OUT/gpt2_ckpt" --vocab-file $VOCAB --merge-file $MERGES --device cuda --bf16 --greedy \
    --max-new-tokens $NEW --micro-batch-size $b --seq-length 1024 "${prompts[@]}" > "$OUT/ours_b$b.txt" 2> "$OUT/ours_b$b.log"
  echo "megatron.cpp batch $b: $(grep -E 'tokens/s' "$OUT/ours_b$b.log")"
done
python3 bench/hf_generate.py --model "$HF" --vocab $VOCAB --merges $MERGES --batch 1 16 --new-tokens $NEW \
  --prompt "$PROMPT" 2>&1 | tee "$OUT/hf.log" | grep -E "^hf"
