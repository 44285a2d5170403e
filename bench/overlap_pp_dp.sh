#!/usr/bin/env bash
# Issue 41 item 2 on 2 GPUs, each step printing a markdown table (each step about 2-3 minutes on
# H200s):
#   pp   --overlap-p2p-communication with 1F1B: the 7B-class Llama (32 layers, h 4096, 32 heads,
#        SwiGLU 11008, seq 4096, micro-batch 1, global batch 16 = 16 micro-batches, GPT-2
#        vocabulary, untied output layer, bf16) at PP 2, without and with the flag. 32 layers, or 24
#        if 32 run out of memory on the run without the flag (the row says which; reused with it).
#   vpp  the same with the interleaved schedule, PP 2 x VPP 2 (8 layers per virtual stage).
#   dp1  data-parallel scaling of GPT-2 124M (seq 1024, micro-batch 16), one micro-batch per GPU:
#        one GPU against two GPUs with the distributed optimizer and --overlap-grad-reduce, without
#        and with --overlap-param-gather, Megatron's default bucket size and 10M-element buckets,
#        NCCL and --ddp-copy-engine; the one-GPU run is repeated at the end (drift). Scaling =
#        ms/iter on one GPU / ms/iter on two (the same work per GPU; issue 41's goal: >= 98%).
#   dp2  the same with two micro-batches per GPU.
# ms/iter, TFLOP/s and MFU are the means of the log lines after the first WARM iterations (the log
# line's own numbers: Megatron-Core's current FLOP formula, MFU against 989.4 TFLOP/s).
# Usage: bench/overlap_pp_dp.sh [pp] [vpp] [dp1] [dp2]   (default all four; 2 GPUs). Env: OUT (logs,
# default out), MT_BUILD_DIR (use the megatron binary built there instead of building build/),
# ITERS (pp/vpp: default 10; dp: default 60), WARM (default 4 for pp/vpp, 20 for dp), ATTN
# (--attention-backend, default fused).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on these machines
source bench/common.sh
B=${MT_BUILD_DIR:-build}
if [ -z "${MT_BUILD_DIR:-}" ]; then bench_build megatron || exit 1; fi
bin=$B/megatron
ATTN=${ATTN:-fused}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPUs: $ngpu x $gpu"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(pp vpp dp1 dp2)

# run NAME NGPU WARM args...: one training run, log in $OUT/NAME.log; sets ms tflops mfu mem err
run() {
  local name=$1 n=$2 warm=$3; shift 3
  if [ "$n" -gt "$ngpu" ]; then ms=NA; tflops=NA; mfu=NA; mem=NA; err="needs $n GPUs"; return; fi
  "$bin" pretrain --nproc-per-node "$n" "$@" > "$OUT/$name.log" 2>&1
  # "iteration I/ N | ... elapsed time per iteration (ms): X | throughput per GPU (TFLOP/s/GPU): Y | MFU: Z% |"
  read -r ms tflops mfu <<< "$(sed -nE 's/.*iteration +([0-9]+)\/ *[0-9]+ .*elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP\/s\/GPU\): ([0-9.]+) \|( MFU: ([0-9.]+)% \|)?.*/\1 \2 \3 \5/p' \
    "$OUT/$name.log" | awk -v w="$warm" '$1 > w { n++; a += $2; b += $3; c += $4 }
      END { if (n) printf "%.2f %.1f %.1f\n", a / n, b / n, c / n; else print "NA NA NA" }')"
  mem=$(grep -m1 "device memory per rank" "$OUT/$name.log" | grep -oE "[0-9.]+/[0-9.]+" |
        awk -F/ '$2 > m { m = $2 } END { if (m) printf "%.1f", m / 1024 }')
  err=$(grep -m1 -E "error|out of memory" "$OUT/$name.log" | cut -c1-160)
}
# pct A B: 100·A/B with one decimal, or NA
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "NA" || b == "NA" || b == 0) print "NA"; else printf "%.1f%%\n", 100 * a / b }'; }

# pp_rows SCHED (1f1b | vpp2): the 7B-class Llama at PP 2 without and with --overlap-p2p-communication
pp_rows() {
  local sched=$1 iters=${ITERS:-10} warm=${WARM:-4} layers fit="" base speedup
  llama() {  # llama LAYERS: sets llama=(...)
    llama=(--num-layers "$1" --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --swiglu
           --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
           --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096
           --micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 2
           --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress "${demo_data[@]}"
           --seed 1234 --train-iters "$iters" --log-interval 1 --eval-interval 100000 --eval-iters 0
           --attention-backend "$ATTN" --pipeline-model-parallel-size 2)
    if [ "$sched" = vpp2 ]; then llama+=(--num-layers-per-virtual-pipeline-stage $(($1 / 4))); fi
  }
  local what="1F1B"; [ "$sched" = vpp2 ] && what="interleaved (VPP 2)"
  echo
  echo "7B-class Llama, PP 2 on 2 GPUs, $what (h 4096, SwiGLU 11008, seq 4096, micro-batch 1, 16 micro-batches, $gpu):"
  echo
  echo "| schedule | layers | --overlap-p2p-communication | ms/iter | TFLOP/s per GPU | MFU | speed-up | peak GiB/GPU |"
  echo "|---|---|---|---|---|---|---|---|"
  for layers in 32 24; do  # the configuration that fits, chosen without the flag
    llama "$layers"
    run "pp2_${sched}_${layers}" 2 "$warm" "${llama[@]}"
    if ! grep -q "out of memory" "$OUT/pp2_${sched}_${layers}.log"; then fit=$layers; break; fi
  done
  base=$ms
  echo "| $what | $layers | off | $ms | $tflops | $mfu% | 1 | $mem | $err"
  [ -n "$fit" ] || return
  run "pp2_${sched}_${layers}_overlap" 2 "$warm" "${llama[@]}" --overlap-p2p-communication
  speedup=$(awk -v a="$base" -v b="$ms" 'BEGIN { if (a == "NA" || b == "NA") print "NA"; else printf "%.3f\n", a / b }')
  echo "| $what | $layers | on | $ms | $tflops | $mfu% | $speedup | $mem | $err"
}

# dp_rows K: GPT-2 124M, K micro-batches of 16 per GPU, one GPU against two
dp_rows() {
  local k=$1 warm=${WARM:-20} one flags tag
  local gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 "${bench_train[@]}" --train-iters "${ITERS:-60}"
              --log-interval 5 --micro-batch-size 16)
  local zero="--use-distributed-optimizer --overlap-grad-reduce"
  echo
  echo "GPT-2 124M data-parallel scaling, 1 vs 2 GPUs, $k micro-batch(es) of 16 per GPU (seq 1024, bf16, $gpu):"
  echo
  echo "| micro-batches per GPU | GPUs | flags | ms/iter | TFLOP/s per GPU | scaling (1-GPU ms / ms) |"
  echo "|---|---|---|---|---|---|"
  run "dp_k${k}_1gpu" 1 "$warm" "${gpt2[@]}" --global-batch-size $((16 * k))
  one=$ms
  echo "| $k | 1 | | $ms | $tflops | 100% | $err"
  for flags in "$zero" "$zero --overlap-param-gather" "$zero --overlap-param-gather --ddp-bucket-size 10000000" \
               "--ddp-copy-engine $zero --overlap-param-gather --ddp-bucket-size 10000000"; do
    tag=$(echo "$flags" | sed 's/--use-distributed-optimizer/zero/; s/--overlap-grad-reduce/ogr/; s/--overlap-param-gather/opg/; s/--ddp-bucket-size 10000000/b10m/; s/--ddp-copy-engine/ce/; s/ /_/g')
    # shellcheck disable=SC2086  # $flags: several flags
    run "dp_k${k}_2gpu_$tag" 2 "$warm" "${gpt2[@]}" --global-batch-size $((32 * k)) $flags
    echo "| $k | 2 | ${flags//--/} | $ms | $tflops | $(pct "$one" "$ms") | $err"
  done
  run "dp_k${k}_1gpu_again" 1 "$warm" "${gpt2[@]}" --global-batch-size $((16 * k))
  echo "| $k | 1 (again) | | $ms | $tflops | $(pct "$one" "$ms") of the first | $err"
}

for step in "${steps[@]}"; do
  case $step in
    pp) pp_rows 1f1b ;;
    vpp) pp_rows vpp2 ;;
    dp1) dp_rows 1 ;;
    dp2) dp_rows 2 ;;
    *) echo "unknown step '$step' (expected pp, vpp, dp1, dp2)"; exit 2 ;;
  esac
done
