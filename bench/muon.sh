#!/usr/bin/env bash
# Muon against AdamW (issue 44, docs/optimizer.md), in parts that each run in under 4 minutes on
# an H200 (the GPU times below are `megatron plan` estimates plus start-up):
#   step   — the optimizer step's share of a training step: the Llama-style 1.18B (16 layers, hidden
#            2048, GQA 32/8, SwiGLU 8192) on one GPU, micro-batch 4, global batch STEP_GB (64),
#            ITERS (30) iterations logged every iteration with --timing-log-level 1; medians over
#            the iterations after the first SKIP (10) of the whole step, of the "optimizer" timer
#            (clip + inner step + parameter gather) and tokens/s, AdamW vs Muon
#            (--muon-coefficient-type quintic, 5 steps, bf16 Newton-Schulz). ~2.5 min.
#   step7b — the same for the 7B-class Llama on 2 GPUs with the distributed optimizer (DP 2;
#            LAYOUT=tp2: TP 2 + SP), ITERS 15, SKIP 5. ~3 min.
#   conv-adam, conv-muon — convergence: GPT-2 124M on the demo data, STEPS (600) steps from the
#            same seed, AdamW at each learning rate of ADAM_LRS, Muon (Nesterov, spectral scale,
#            extra scale 0.2 — the update RMS of AdamW, Moonlight/Kimi's setting — so that one --lr
#            serves both) at each of MUON_LRS. ~1.2 min per run (2 runs each by default).
#   conv   — both conv parts (the table alone when ADAM_LRS and MUON_LRS are empty).
# After each conv part, the table over every muon_conv_*.log in $OUT: the validation curves side by
# side, the best final loss of each and the steps Muon needs to reach AdamW's best final
# validation loss (target <= 0.8 x STEPS), in $OUT/muon_convergence.md; the step parts write
# $OUT/muon_llama1b.md and $OUT/muon_llama7b.md.
# usage: bench/muon.sh [build] [step|step7b|conv-adam|conv-muon|conv (default: step)]
# ORDER="muon adam" runs Muon first (default "adam muon"). Each step run logs nvidia-smi's SM clock,
# power and temperature every 500 ms ($OUT/muon_NAME_OPT.smi); the table gives their medians over the
# run's second half (clocks under the power limit depend on what the GEMMs compute).
# PLAN=1: instead of training, `megatron plan --gpu h200` of every run (checks that the flags parse
# and validate, and prints the predicted step time; runs on a CPU-only machine).
# Environment: ITERS, SKIP (step parts), STEP_GB (1.18B global batch, default 64), STEP7B_GB (7B
# global batch, default 16), LAYERS (7B,
# default 32), STEPS (default 600), EVAL (default 50), GB (global batch of the convergence runs,
# default 32), ADAM_LRS (default "6e-4 1.2e-3"), MUON_LRS (default "1.2e-3 2.4e-3").
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
if [ "${1:-}" = build ]; then
  shift
  bench_build megatron || exit 1
fi
PART=${1:-step}
STEPS=${STEPS:-600}; EVAL=${EVAL:-50}; GB=${GB:-32}
PLAN=${PLAN:-0}
ADAM_LRS=${ADAM_LRS-"6e-4 1.2e-3"}; MUON_LRS=${MUON_LRS-"1.2e-3 2.4e-3"}
muon=(--optimizer muon --muon-momentum 0.95 --muon-nesterov --muon-coefficient-type quintic --muon-num-ns-steps 5
      --muon-scale-mode spectral --muon-extra-scale-factor 0.2)

# plan_of NPROC FLAGS...: `megatron plan` of a run on NPROC H200s (PLAN=1), its step-time line
plan_of() {
  local n=$1; shift
  build/megatron plan --world-size "$n" --gpu h200 "$@" 2>&1 | grep -E "predicted step|fits|does not fit|rror" ||
    echo "plan failed: build/megatron plan --world-size $n --gpu h200 $*"
}

# step_share NAME NPROC FLAGS...: AdamW and Muon runs of the model, the table in $OUT/muon_NAME.md
step_share() {
  local name=$1 n=$2; shift 2
  for opt in ${ORDER:-adam muon}; do
    [ "$opt" = adam ] || [ "$opt" = muon ] || { echo "ORDER: '$opt' is not adam or muon"; return 1; }
    f=(); [ $opt = muon ] && f=("${muon[@]}")
    if [ "$PLAN" = 1 ]; then
      echo "$name $opt: $(plan_of "$n" "$@" "${f[@]}" --train-iters "$ITERS")"; continue
    fi
    local smi=""
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 500 \
        > "$OUT/muon_${name}_$opt.smi" 2>/dev/null &
      smi=$!
    fi
    timeout 600 build/megatron pretrain --nproc-per-node "$n" "$@" "${f[@]}" --train-iters "$ITERS" \
      --log-interval 1 --timing-log-level 1 > "$OUT/muon_${name}_$opt.log" 2>&1 ||
      { echo "$name $opt failed:"; tail -5 "$OUT/muon_${name}_$opt.log"; }
    [ -n "$smi" ] && { kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null; }
  done
  [ "$PLAN" = 1 ] && return
  python3 - "$OUT" "$name" "$SKIP" <<'PY' | tee "$OUT/muon_$name.md"
import re, statistics, sys
out, name, skip = sys.argv[1], sys.argv[2], int(sys.argv[3])
print(f"{name}:\n")
print("| optimizer | step ms | optimizer ms | share | optimizer-inner-step ms | tokens/s | estimated memory "
      "| SM MHz / W / °C (GPU 0, 2nd half) |")
print("|---|---|---|---|---|---|---|---|")
rows = {}
for opt in ("adam", "muon"):
    log = open(f"{out}/muon_{name}_{opt}.log").read()
    step = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)][skip:]
    optim = [float(x) for x in re.findall(r"\n\s+optimizer \.+: \(([0-9.]+), [0-9.]+\)", log)][skip:]
    inner = [float(x) for x in re.findall(r"optimizer-inner-step \.+: \(([0-9.]+), [0-9.]+\)", log)][skip:]
    tok = [int(x) for x in re.findall(r"tokens per second: ([0-9]+)", log)][skip:]
    mem = re.findall(r"memory estimate per rank: .*?total ([0-9.]+ GiB)", log)
    if not step or not optim:
        print(f"| {opt} | (no timings in the log) | | | | | |"); continue
    s, o = statistics.median(step), statistics.median(optim)
    rows[opt] = s
    smi = "-"
    try:
        samples = [l.split(",") for l in open(f"{out}/muon_{name}_{opt}.smi") if l.strip()]
        g0 = [[float(v) for v in x[1:4]] for x in samples if len(x) >= 4 and x[0].strip() == "0"]
        g0 = g0[len(g0) // 2:]
        if g0:
            smi = " / ".join(f"{statistics.median(c):.0f}" for c in zip(*g0))
    except (OSError, ValueError):
        pass
    print(f"| {opt} | {s:.1f} | {o:.1f} | {100 * o / s:.1f}% | {statistics.median(inner):.1f} | "
          f"{statistics.median(tok)} | {mem[-1] if mem else '-'} | {smi} |")
    print(f"|   (steps {', '.join(f'{x:.0f}' for x in step)}) | | | | | | | |")
if len(rows) == 2:
    print(f"\nMuon's step is {100 * (rows['muon'] / rows['adam'] - 1):+.1f}% vs AdamW end to end.\n")
PY
}

if [ "$PART" = step ]; then
  ITERS=${ITERS:-30}; SKIP=${SKIP:-10}
  # Llama-style 1.18B, one GPU, micro-batch 4, global batch STEP_GB (default 64: 16 micro-batches;
  # the optimizer step's share shrinks as the batch grows)
  step_share llama1b 1 --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention \
    --num-query-groups 8 --ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 4 \
    --global-batch-size "${STEP_GB:-64}" "${bench_train[@]}"
fi

if [ "$PART" = step7b ]; then
  ITERS=${ITERS:-15}; SKIP=${SKIP:-5}
  # the 7B-class Llama of docs/benchmarks.md on 2 GPUs with the distributed optimizer, micro-batch
  # 1, global batch 16, sequence 4096, LAYERS (default 32) layers. LAYOUT=dp2 (default): DP 2 with
  # overlapped reduce-scatter and parameter gather — Muon's layer-wise sharding, each GPU
  # orthogonalises half the matrices (`megatron plan`: 102.5 GiB of 140 with AdamW). LAYOUT=tp2:
  # TP 2 + SP, DP 1 (every matrix on both GPUs, --muon-tp-mode duplicated).
  layout=(--overlap-grad-reduce --overlap-param-gather)
  [ "${LAYOUT:-dp2}" = tp2 ] && layout=(--tensor-model-parallel-size 2 --sequence-parallel)
  step_share llama7b 2 --num-layers "${LAYERS:-32}" --hidden-size 4096 --num-attention-heads 32 \
    --ffn-hidden-size 11008 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size "${STEP7B_GB:-16}" \
    --use-distributed-optimizer "${layout[@]}" "${bench_train[@]}" --seq-length 4096 --max-position-embeddings 4096
fi

case $PART in
  conv-adam) MUON_LRS= ;;
  conv-muon) ADAM_LRS= ;;
esac
if [ "$PART" = conv ] || [ "$PART" = conv-adam ] || [ "$PART" = conv-muon ]; then
  gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
        --micro-batch-size 16 --global-batch-size "$GB" --min-lr 0 --lr-decay-style cosine --lr-warmup-iters 50
        --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
        "${demo_data[@]}" --seed 1234 --train-iters "$STEPS" --log-interval 50 --eval-interval "$EVAL"
        --eval-iters 10)
  runs=()
  for lr in $ADAM_LRS; do runs+=("adam_$lr"); done
  for lr in $MUON_LRS; do runs+=("muon_$lr"); done
  for r in "${runs[@]}"; do
    opt=${r%%_*}; lr=${r#*_}
    f=(); [ "$opt" = muon ] && f=("${muon[@]}")
    if [ "$PLAN" = 1 ]; then echo "conv $r: $(plan_of 1 "${gpt2[@]}" --lr "$lr" "${f[@]}")"; continue; fi
    timeout 300 build/megatron pretrain "${gpt2[@]}" --lr "$lr" "${f[@]}" > "$OUT/muon_conv_$r.log" 2>&1 ||
      { echo "$r failed:"; tail -5 "$OUT/muon_conv_$r.log"; }
  done
  [ "$PLAN" = 1 ] && exit 0
  # the table over every run in $OUT (so that AdamW and Muon may run in separate invocations)
  python3 - "$OUT" <<'PY' | tee "$OUT/muon_convergence.md"
import glob, os, re, sys
out = sys.argv[1]
runs = sorted(os.path.basename(f)[len("muon_conv_"):-len(".log")] for f in glob.glob(f"{out}/muon_conv_*.log"))
val = {}
for r in runs:
    log = open(f"{out}/muon_conv_{r}.log").read()
    val[r] = {int(a): float(b) for a, b in
              re.findall(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)", log)}
its = sorted(set().union(*[set(v) for v in val.values()]))
print("| iteration | " + " | ".join(runs) + " |")
print("|---|" + "---|" * len(runs))
for it in its:
    print(f"| {it} | " + " | ".join(f"{val[r][it]:.4f}" if it in val[r] else "-" for r in runs) + " |")
def best(prefix):
    c = [r for r in runs if r.startswith(prefix) and val[r]]
    return min(c, key=lambda r: val[r][max(val[r])]) if c else None
a, m = best("adam_"), best("muon_")
if a and m:
    target, last = val[a][max(val[a])], max(val[a])
    reach = next((it for it in sorted(val[m]) if val[m][it] <= target), None)
    print(f"\nbest AdamW: {a} final {target:.4f}; best Muon: {m} final {val[m][max(val[m])]:.4f}")
    if reach is None:
        print(f"Muon did not reach AdamW's final validation loss {target:.4f} in {max(val[m])} steps")
    else:
        print(f"Muon reaches AdamW's final validation loss {target:.4f} at step {reach} "
              f"= {reach / last:.2f} x AdamW's {last} steps (target <= 0.80, eval every {its[1] - its[0] if len(its) > 1 else 0})")
PY
fi
