#!/usr/bin/env bash
# Correctness beside speed: megatron.cpp and the PyTorch reference (bench/pytorch_gpt2.py) train
# GPT-2 124M from the same initial weights (megatron.cpp's, exported with `megatron export-hf` and
# loaded by the reference) on the same samples (bench/train_samples_bench writes the ones
# `megatron pretrain` reads) with the same optimizer settings (constant lr, AdamW, weight decay 0.1
# on the matrices, clip 1.0, bf16, dropout 0), and prints both losses every 10 steps and the mean
# of the last 10. Logs under $OUT, the table in $OUT/loss_agreement.md.
# usage: bench/loss_agreement.sh [build] [STEPS (default 100)] [MICRO_BATCH (default 8)]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
if [ "${1:-}" = build ]; then
  shift
  bench_build megatron train_samples_bench || exit 1
fi
STEPS=${1:-100}; MB=${2:-8}; LR=3e-4; SEQ=1024
data=("${demo_data[@]}")
model=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length $SEQ --max-position-embeddings $SEQ)
common=("${model[@]}" "${data[@]}" --micro-batch-size "$MB" --global-batch-size "$MB" --lr-decay-style constant
        --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16
        --device cuda --no-progress --seed 1234 --eval-interval 100000 --eval-iters 0)
# 1. the initial weights: one step at learning rate 0 changes nothing; saved and exported
rm -rf "$OUT/init" "$OUT/hf"
build/megatron pretrain "${common[@]}" --lr 0 --train-iters 1 --save "$OUT/init" --save-interval 1 \
  > "$OUT/init.log" 2>&1 || { tail -5 "$OUT/init.log"; exit 1; }
build/megatron export-hf --load "$OUT/init" --hf-dir "$OUT/hf" --hf-dtype fp32 > "$OUT/export.log" 2>&1 ||
  { tail -5 "$OUT/export.log"; exit 1; }
# 2. megatron.cpp: STEPS iterations from the same seed (the same weights), every loss logged
build/megatron pretrain "${common[@]}" --lr $LR --train-iters "$STEPS" --log-interval 1 > "$OUT/megatron.log" 2>&1 ||
  { tail -5 "$OUT/megatron.log"; exit 1; }
# 3. the samples those iterations read, and the reference on them
build/train_samples_bench "$OUT/samples.bin" $((STEPS * MB)) $SEQ 1234 "$STEPS" "$MB" 100000 0 "${data[@]}" \
  > "$OUT/samples.log" 2>&1 || { tail -5 "$OUT/samples.log"; exit 1; }
python3 bench/pytorch_gpt2.py --init-hf "$OUT/hf" --samples "$OUT/samples.bin" --vocab 50257 --seq-length $SEQ \
  --micro-batch-size "$MB" --lr $LR --steps "$STEPS" --warmup 0 --compile > "$OUT/torch.log" 2>&1 ||
  { tail -5 "$OUT/torch.log"; exit 1; }
python3 - "$OUT" "$STEPS" <<'PY' | tee "$OUT/loss_agreement.md"
import re, sys
out, steps = sys.argv[1], int(sys.argv[2])
ours = {int(m.group(1)): float(m.group(2)) for m in
        re.finditer(r"iteration +(\d+)/ *\d+ .*?lm loss: ([0-9.E+-]+)", open(f"{out}/megatron.log").read())}
ref = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+) loss ([0-9.]+)", open(f"{out}/torch.log").read())}
print("| step | megatron.cpp lm loss | PyTorch loss | difference |\n|---|---|---|---|")
for s in [1] + list(range(10, steps + 1, 10)):
    if s in ours and s in ref:
        print(f"| {s} | {ours[s]:.4f} | {ref[s]:.4f} | {ours[s] - ref[s]:+.4f} |")
last = [s for s in range(steps - 9, steps + 1) if s in ours and s in ref]
if last:
    a = sum(ours[s] for s in last) / len(last)
    b = sum(ref[s] for s in last) / len(last)
    print(f"| mean of steps {last[0]}-{last[-1]} | {a:.4f} | {b:.4f} | {a - b:+.4f} ({100 * (a - b) / b:+.2f}%) |")
PY
