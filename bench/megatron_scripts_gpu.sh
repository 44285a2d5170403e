#!/usr/bin/env bash
# GPU checks of the Megatron-LM script flags (issue 42 item 1) on one GPU, a minute in all: a
# Llama-3-8B-script-shaped run shrunk to 4 layers (bf16, --train-samples schedule,
# --calculate-per-token-loss, the no-op flags, --profile, --cuda-graph-impl transformer_engine),
# and its twins that must give the same losses:
#   te_vs_local    --cuda-graph-impl transformer_engine == local (the same per-layer graphs)
#   samples_vs_iters   --train-samples/--lr-*-samples == --train-iters/--lr-*-iters (bitwise)
#   ramp_graphs    --rampup-batch-size 4 4 32 (2, 4, 6, 8 micro-batches) with per-layer CUDA graphs ==
#                  the same ramp eager, both under --deterministic-mode (the graphs of each slot replay
#                  for every micro-batch count)
# Prints one PASS/FAIL line per check; exit status = failures.
# usage: bench/megatron_scripts_gpu.sh [BUILD_DIR]   (default build; DEVICE=cpu H=64 S=64 for a dry run)
set -uo pipefail
BIN=${1:-build}/megatron
DEVICE=${DEVICE:-cuda} H=${H:-512} S=${S:-1024}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
fail=0
PREC="--bf16 --grad-reduce-in-bf16"
GRAPHS=(--cuda-graph-impl transformer_engine --cuda-graph-scope attn mlp)
if [ "$DEVICE" = cpu ]; then PREC=""; GRAPHS=(); fi
MODEL="--use-mcore-models --num-layers 4 --hidden-size $H --ffn-hidden-size $((3 * H)) --num-attention-heads 8
  --group-query-attention --num-query-groups 2 --kv-channels $((H / 8)) --seq-length $S --max-position-embeddings $S
  --position-embedding-type rope --rotary-base 1000000 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu
  --normalization RMSNorm --init-method-std 0.0134 --untie-embeddings-and-output-weights --disable-bias-linear"
COMMON="$MODEL --micro-batch-size 2 --global-batch-size 16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
  --clip-grad 1.0 --weight-decay 0.1 --adam-beta2 0.95 $PREC --cross-entropy-loss-fusion --calculate-per-token-loss
  --manual-gc --empty-unused-memory-level 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files
  --num-workers 1 --log-interval 1 --eval-iters 1 --eval-interval 100 --log-throughput --ckpt-format torch_dist
  --device $DEVICE --no-progress"
SAMPLES="--train-samples 160 --lr-decay-samples 160 --lr-warmup-samples 16"
ITERS="--train-iters 10 --lr-decay-iters 10 --lr-warmup-iters 1"

losses() { grep -o "lm loss: [0-9.E+-]*" "$1" | tr '\n' ' '; }
run() {  # name, flags...
  local name=$1; shift
  # shellcheck disable=SC2086
  eval "\"$BIN\" pretrain $(tr '\n' ' ' <<< "$*")" > "$W/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { echo "FAIL $name: rc=$rc"; tail -5 "$W/$name.log"; fail=$((fail + 1)); }
}

run main "$COMMON $SAMPLES ${GRAPHS[*]} --profile --profile-step-start 4 --profile-step-end 6"
n=$(grep -c "iteration  *[0-9]*/ *10 |" "$W/main.log")
if [ "$n" = 10 ] && grep -q "Megatron-LM flags accepted without effect here" "$W/main.log"; then
  echo "PASS main: 10 iterations; $(grep -o "throughput per GPU (TFLOP/s/GPU): [0-9.]*" "$W/main.log" | tail -1)"
else
  echo "FAIL main: $n iterations"; tail -5 "$W/main.log"; fail=$((fail + 1))
fi
if [ "$DEVICE" != cpu ]; then
  if grep -q "CUDA profiler started before step 4" "$W/main.log" && grep -q "CUDA profiler stopped" "$W/main.log"; then
    echo "PASS profile: started before step 4, stopped after step 6"
  else
    echo "FAIL profile"; fail=$((fail + 1))
  fi
  run local "$COMMON $SAMPLES --cuda-graph-impl local --cuda-graph-scope attn mlp"
  if [ -n "$(losses "$W/main.log")" ] && [ "$(losses "$W/main.log")" = "$(losses "$W/local.log")" ]; then echo "PASS te_vs_local: same losses"
  else echo "FAIL te_vs_local: $(losses "$W/main.log") vs $(losses "$W/local.log")"; fail=$((fail + 1)); fi
fi
run iters "$COMMON $ITERS ${GRAPHS[*]}"
if [ -n "$(losses "$W/main.log")" ] && [ "$(losses "$W/main.log")" = "$(losses "$W/iters.log")" ]; then echo "PASS samples_vs_iters: same losses"
else echo "FAIL samples_vs_iters: $(losses "$W/main.log") vs $(losses "$W/iters.log")"; fail=$((fail + 1)); fi
if [ "$DEVICE" != cpu ]; then
  RAMP="$COMMON $ITERS --rampup-batch-size 4 4 32 --deterministic-mode"
  run ramp_graphs "$RAMP ${GRAPHS[*]}"
  run ramp_eager "$RAMP"
  sizes=$(grep -o "global batch size: *[0-9]*" "$W/ramp_graphs.log" | grep -o "[0-9]*$" | tr '\n' ' ')
  if [ "$sizes" = "4 4 4 8 8 12 16 16 16 16 " ] && [ "$(losses "$W/ramp_graphs.log")" = "$(losses "$W/ramp_eager.log")" ]; then
    echo "PASS ramp_graphs: batches $sizes; same losses as eager"
  else
    echo "FAIL ramp_graphs: batches '$sizes'; $(losses "$W/ramp_graphs.log") vs $(losses "$W/ramp_eager.log")"
    fail=$((fail + 1))
  fi
fi
echo "losses: $(losses "$W/main.log")"
exit $fail
