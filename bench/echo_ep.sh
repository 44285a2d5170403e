#!/usr/bin/env bash
# ECHO and the static-buffer alltoall dispatcher on NGPU GPUs of one machine (issue 16; docs/echo.md),
# side by side in one device session: a small Mixtral-style MoE (8 experts, top-2) trained on the
# demo text with expert parallelism NGPU, the alltoall dispatcher and the grouped GEMM, without a
# load-balancing loss (so the routing drifts out of balance as on real data). Variants: dropless
# (split sizes read on the host) with and without ECHO; static receive blocks at CAP_FACTOR x the
# balanced load (capturable) with and without ECHO, eager; and static + ECHO in a full-iteration
# CUDA graph. Prints one markdown row per variant: step ms, host ms, the largest receive of an EP
# rank (dropless) or the slots overflowed per iteration (static), ECHO's rerouted slots per layer,
# the MiB of clone weights and gradients the used-slot transfers sent (static + ECHO on one NVLink
# domain; the fixed all-to-alls would send 3·ep·S expert blocks per MoE layer, micro-batch and
# rank), the last loss. Logs under $OUT.
#
# usage: bench/echo_ep.sh [build] NGPU   Environment: ITERS (multiple of 10, default 60), CAP_FACTOR
# (default 1.25).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
ITERS=${ITERS:-60}
if [ "${1:-}" = build ]; then
  shift
  cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build -j "$(nproc)" --target megatron > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
fi
N=${1:-2}
MB=8; SEQ=1024; K=2
balanced=$((MB * SEQ * K))  # slots each EP rank routes per micro-batch and layer = the balanced receive
cap=$(python3 -c "print(int($balanced * ${CAP_FACTOR:-1.25}))")
data=data
model=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
       --disable-bias-linear --group-query-attention --num-layers 8 --hidden-size 1024 --num-attention-heads 16
       --num-query-groups 8 --ffn-hidden-size 3584 --num-experts 8 --moe-router-topk $K --moe-ffn-hidden-size 3584
       --seq-length $SEQ --max-position-embeddings $SEQ --micro-batch-size $MB --global-batch-size $((MB * N * 2))
       --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
       --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
       --data-path $data/demo_text_document --split 98,2,0 --vocab-file $data/gpt2/encoder.json
       --merge-file $data/gpt2/vocab.bpe --seed 1234 --train-iters "$ITERS" --log-interval 10
       --eval-interval 100000 --eval-iters 0
       --nproc-per-node "$N" --expert-model-parallel-size "$N" --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
field() { grep -oE "$1: [0-9.E+-]+" <<< "$2" | tail -1 | grep -oE '[0-9.E+-]+$'; }
row() {  # $1 tag, rest: flags
  local tag=$1; shift
  timeout 300 build/megatron pretrain "${model[@]}" "$@" > "$OUT/$tag.log" 2>&1
  local line; line=$(grep -E "iteration +$ITERS/" "$OUT/$tag.log")
  if [ -z "$line" ]; then echo "| $tag | failed: $(grep -iE 'error' "$OUT/$tag.log" | head -1 | cut -c1-150) ||||||"; return; fi
  local recv; recv=$(field "max tokens received per EP rank" "$line")
  [ -n "$recv" ] || recv="overflow $(field "tokens overflowed at the received capacity" "$line")"
  echo "| $tag | $(field "elapsed time per iteration \(ms\)" "$line") | $(field "host time per iteration \(ms\)" "$line") | $recv | $(field "ECHO rerouted tokens per layer" "$line") | $(field "ECHO clone MiB sent per iteration" "$line") | $(field "lm loss" "$line") |"
}
echo "EP $N, balanced receive $balanced slots per rank and layer, static capacity $cap" | tee "$OUT/echo_ep.md"
echo "| variant | step ms | host ms | max received (dropless) / overflowed per iter (static) | ECHO rerouted per layer | ECHO clone MiB per iter (used-slot transfers) | lm loss |" | tee -a "$OUT/echo_ep.md"
echo "|---|---|---|---|---|---|---|" | tee -a "$OUT/echo_ep.md"
{
  row dropless
  row dropless_echo --moe-enable-echo --moe-num-echo-experts 1
  row static --moe-received-token-capacity "$cap"
  row static_echo --moe-received-token-capacity "$cap" --moe-enable-echo --moe-num-echo-experts 1
  row static_echo_graph --moe-received-token-capacity "$cap" --moe-enable-echo --moe-num-echo-experts 1 \
    --cuda-graph-impl full_iteration --cuda-graph-include-optimizer
} | tee -a "$OUT/echo_ep.md"
