#!/usr/bin/env bash
# FP8 against bf16 training (issue 38, docs/fp8.md): the Llama-style 1.2B model (16 layers, hidden
# 2048, GQA 32/8, SwiGLU 8192, RMSNorm, RoPE, untied) trains STEPS steps on the demo data from the
# same seed (the same initial weights and samples) in bf16 and with each FP8 recipe, and the
# validation losses are printed side by side every EVAL steps (the curve) with the relative
# difference at the end: FP8 must stay within 1% of bf16. Logs under $OUT, the table in
# $OUT/fp8_loss_agreement.md.
# usage: bench/fp8_loss_agreement.sh [build] [STEPS (default 500)] [RECIPE...]
#   RECIPE: tensorwise (--fp8-format hybrid --fp8-recipe tensorwise; the default), delayed (hybrid,
#   history 1024, max: Megatron's usual delayed settings), blockwise (e4m3 1x128 / 128x128 blocks)
# Environment: MB (micro-batch, default 4), GB (global batch, default 8), EVAL (default 50).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
if [ "${1:-}" = build ]; then
  shift
  bench_build megatron || exit 1
fi
STEPS=${1:-500}; shift || true
RECIPES=("$@"); [ ${#RECIPES[@]} -eq 0 ] && RECIPES=(tensorwise)
MB=${MB:-4}; GB=${GB:-8}; EVAL=${EVAL:-50}; SEQ=1024
common=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8
        --ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope
        --untie-embeddings-and-output-weights --disable-bias-linear
        --seq-length $SEQ --max-position-embeddings $SEQ --micro-batch-size "$MB" --global-batch-size "$GB"
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
        --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress "${demo_data[@]}" --seed 1234
        --train-iters "$STEPS" --log-interval 10 --eval-interval "$EVAL" --eval-iters 10)
flags_of() {
  case $1 in
    bf16) echo "" ;;
    tensorwise) echo "--fp8-format hybrid --fp8-recipe tensorwise" ;;
    delayed) echo "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    blockwise) echo "--fp8-format e4m3 --fp8-recipe blockwise" ;;
    *) echo "unknown recipe $1" >&2; return 1 ;;
  esac
}
runs=(bf16 "${RECIPES[@]}")
for r in "${runs[@]}"; do
  f=$(flags_of "$r") || exit 1
  # shellcheck disable=SC2086
  timeout 1200 build/megatron pretrain "${common[@]}" $f > "$OUT/fp8_loss_$r.log" 2>&1 ||
    { echo "$r failed:"; tail -5 "$OUT/fp8_loss_$r.log"; }
done
python3 - "$OUT" "${runs[@]}" <<'PY' | tee "$OUT/fp8_loss_agreement.md"
import re, sys
out, runs = sys.argv[1], sys.argv[2:]
val, tok = {}, {}
for r in runs:
    log = open(f"{out}/fp8_loss_{r}.log").read()
    val[r] = {int(a): float(b) for a, b in re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", log)}
    t = re.findall(r"tokens per second: ([0-9]+)", log)
    tok[r] = sorted(int(x) for x in t)[len(t) // 2] if t else 0
print("| iteration | " + " | ".join(f"{r} validation loss" for r in runs) + " |")
print("|---|" + "---|" * len(runs))
for it in sorted(val["bf16"]):
    cells = []
    for r in runs:
        v = val[r].get(it)
        if v is None:
            cells.append("n/a")
        elif r == "bf16":
            cells.append(f"{v:.4f}")
        else:
            cells.append(f"{v:.4f} ({100 * (v - val['bf16'][it]) / val['bf16'][it]:+.2f}%)")
    print(f"| {it} | " + " | ".join(cells) + " |")
print()
print("| run | median tokens/s | final validation loss | vs bf16 | within 1% |")
print("|---|---|---|---|---|")
last = max(val["bf16"]) if val["bf16"] else None
for r in runs:
    v = val[r].get(last) if last is not None else None
    b = val["bf16"].get(last) if last is not None else None
    if v is None or b is None:
        print(f"| {r} | {tok[r]} | n/a | n/a | n/a |")
        continue
    d = (v - b) / b
    print(f"| {r} | {tok[r]} | {v:.4f} | {100 * d:+.2f}% | {'yes' if abs(d) <= 0.01 else 'NO'} |")
PY
