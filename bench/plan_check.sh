#!/usr/bin/env bash
# `megatron plan` against measured runs (issue 42): each configuration is trained on its GPUs and
# planned with the same flags (`megatron plan --world-size N --gpu h200`), and one markdown row per
# configuration sets them side by side:
#   time    the mean iteration time of the log windows after WARM iterations (log_means,
#           bench/common.sh) against the plan's "predicted step";
#   memory  each pipeline stage's static buffers as the trainer measured them (the largest rank of
#           the stage, "device memory per rank" buffers) against the plan's stage total (the same
#           estimate the trainer prints); and the largest rank's memory in use against the plan's
#           total with its reserve.
# Configurations (2 GPUs; the shapes of docs/benchmarks.md "Several GPUs", GPT-2 vocabulary, bf16,
# dropout 0): gpt1p3b_tp2sp (24 layers, h 2048, 16 heads, seq 1024, micro-batch 8, global 8, TP 2 +
# SP), gpt1p3b_pp2 (the same, global 64, PP 2), gpt7b_tp2sp (32 layers, h 4096, 32 heads, seq 2048,
# micro-batch 1, global 16, distributed optimizer, TP 2 + SP), gpt7b_pp2 (the same, PP 2).
# Usage: bench/plan_check.sh [CONFIG...] (default: all four). Env: OUT (logs, default out),
# MT_BUILD_DIR (default build; the megatron binary must be built), ITERS (default 15), WARM
# (default 5), PLAN_ONLY=1 (the plan's rows only: runs without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on these machines
source bench/common.sh
megatron_bin plan_check
ITERS=${ITERS:-15}; WARM=${WARM:-5}; PLAN_ONLY=${PLAN_ONLY:-0}
configs=("$@"); [ ${#configs[@]} -gt 0 ] || configs=(gpt1p3b_tp2sp gpt1p3b_pp2 gpt7b_tp2sp gpt7b_pp2)

common=(--lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2 --bf16 --device cuda --no-progress "${demo_data[@]}"
        --seed 1234 --hidden-dropout 0 --attention-dropout 0 --train-iters "$ITERS" --log-interval 5
        --eval-interval 100000 --eval-iters 0)
# flags_of CONFIG: sets n (GPUs) and flags=(...), or fails for an unknown name
flags_of() {
  local g13=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024
             --max-position-embeddings 1024 --micro-batch-size 8)
  local g7=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048
            --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 16 --use-distributed-optimizer)
  n=2
  case $1 in
    gpt1p3b_tp2sp) flags=("${g13[@]}" --global-batch-size 8 --tensor-model-parallel-size 2 --sequence-parallel) ;;
    gpt1p3b_pp2) flags=("${g13[@]}" --global-batch-size 64 --pipeline-model-parallel-size 2) ;;
    gpt7b_tp2sp) flags=("${g7[@]}" --tensor-model-parallel-size 2 --sequence-parallel) ;;
    gpt7b_pp2) flags=("${g7[@]}" --pipeline-model-parallel-size 2) ;;
    *) echo "plan_check: unknown configuration '$1' (expected gpt1p3b_tp2sp, gpt1p3b_pp2, gpt7b_tp2sp, gpt7b_pp2)"
       return 1 ;;
  esac
}
pct() { python3 -c "import sys; a, b = map(float, sys.argv[1:]); print(f'{100 * (b - a) / a:+.1f}%')" "$1" "$2" 2>/dev/null || echo NA; }

ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "plan against measured ($ngpu GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); $(date -u +%F))"
echo
echo "| configuration | GPUs | measured ms | plan ms | error | stage buffers MiB measured | plan MiB | error | in use MiB (largest rank) | plan + reserve MiB | error |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
  flags_of "$c" || exit 2
  "$bin" plan --world-size "$n" --gpu h200 "${common[@]}" "${flags[@]}" > "$OUT/plan_$c.log" 2>&1
  plan_ms=$(grep -oP "predicted step: \K[0-9.]+" "$OUT/plan_$c.log")
  # per stage: "stage K (ranks a,b), ... total X GiB" then "+ R GiB reserved"
  plan_stage=$(grep -oP "^> *stage \d+ .*total \K[0-9.]+(?= GiB)" "$OUT/plan_$c.log" | awk '{printf "%s%.0f", (NR == 1 ? "" : " / "), $1 * 1024}')
  reserve=$(grep -m1 -oP "\+ \K[0-9.]+(?= GiB reserved)" "$OUT/plan_$c.log")
  plan_max=$(grep -oP "^> *stage \d+ .*total \K[0-9.]+(?= GiB)" "$OUT/plan_$c.log" | sort -g | tail -1)
  plan_use=$(python3 -c "import sys; print(f'{(float(sys.argv[1]) + float(sys.argv[2])) * 1024:.0f}')" "$plan_max" "$reserve" 2>/dev/null || echo NA)
  if [ "$PLAN_ONLY" = 1 ] || [ "$n" -gt "$ngpu" ]; then
    echo "| $c | $n | not run | $plan_ms | | | $plan_stage | | | $plan_use | |"
    continue
  fi
  "$bin" pretrain --nproc-per-node "$n" "${common[@]}" "${flags[@]}" > "$OUT/run_$c.log" 2>&1
  rc=$?
  read -r ms _ _ <<< "$(log_means "$OUT/run_$c.log" "$WARM")"
  read -r stage_mib in_use <<< "$(python3 - "$OUT/run_$c.log" "$OUT/plan_$c.log" <<'EOF'
import re, sys
log, plan = open(sys.argv[1]).read(), open(sys.argv[2]).read()
# ranks of each stage from the plan's "stage K (ranks a,b)" lines
stages = [[int(r) for r in m.split(",")] for m in re.findall(r"stage \d+ \(ranks? ([0-9,]+)\)", plan)]
per_rank = {int(r): (float(b), float(u)) for r, b, u in re.findall(r" r(\d+): ([0-9.]+)/([0-9.]+)", log)}
if per_rank and stages and all(any(r in per_rank for r in s) for s in stages):
    stage_mib = " / ".join(f"{max(per_rank[r][0] for r in s if r in per_rank):.0f}" for s in stages)
    in_use = f"{max(u for b, u in per_rank.values()):.0f}"
else:
    stage_mib = in_use = "NA"
print(stage_mib.replace(" ", "_"), in_use)
EOF
)"
  stage_mib=${stage_mib//_/ }
  err=""; [ $rc -eq 0 ] || err=" (exit $rc: $(grep -m1 -iE "error|out of memory" "$OUT/run_$c.log" | cut -c1-120))"
  # the stage errors, one per stage
  serr=$(paste -d' ' <(echo "$stage_mib" | tr '/' '\n') <(echo "$plan_stage" | tr '/' '\n') |
         while read -r a b; do pct "$a" "$b"; done | paste -sd/ | sed 's|/| / |g')
  echo "| $c$err | $n | $ms | $plan_ms | $(pct "$ms" "$plan_ms") | $stage_mib | $plan_stage | $serr | $in_use | $plan_use | $(pct "$in_use" "$plan_use") |"
done
