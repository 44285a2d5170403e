#!/usr/bin/env bash
# Checkpoint speed on one GPU (issue 20 part 4): save and load GB/s for GPT-2 124M and a 1.3B GPT
# (24 layers, hidden 2048, 16 heads), and the step slowdown of --async-save for GPT-2 124M
# at --save-interval 50 and 10 against no checkpoints (target < 2% at 50; `async` below). Mock
# data with the NullTokenizer (no data files needed), bf16.
# Also `tensorboard`: a short GPT-2 run with --tensorboard-dir read back by the real tensorboard
# package (tools/check_tensorboard.py; falls back to its builtin reader when the package is absent).
# Usage: bench/checkpoint_bench.sh [build] [saveload] [async] [tensorboard]   (default: all four)
# Needs the megatron binary in build/ (the build step makes it). Results: $OUT/checkpoint_bench.txt
# and the logs in $OUT; checkpoints go to ${CKPT_DIR:-/tmp/mt_ckpt_bench} (removed at the end).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
CK=${CKPT_DIR:-/tmp/mt_ckpt_bench}
bin=build/megatron
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build saveload async tensorboard)
res="$OUT/checkpoint_bench.txt"
common=(--seq-length 1024 --max-position-embeddings 1024 --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine
        --lr-decay-iters 100000 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 --eval-iters 0 --seed 1234)
gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size 16 --global-batch-size 16)
gpt13=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --micro-batch-size 4 --global-batch-size 4)

saveload() {  # name, model flags...: train 10 iterations, save at 10 (synchronous), then load it
  local name=$1; shift
  rm -rf "$CK/$name"
  $bin pretrain "$@" "${common[@]}" --train-iters 10 --log-interval 10 --save "$CK/$name" > "$OUT/ckpt_${name}_save.log" 2>&1 \
    || { tail -5 "$OUT/ckpt_${name}_save.log"; return 1; }
  sync
  $bin pretrain "$@" "${common[@]}" --train-iters 11 --log-interval 1 --load "$CK/$name" > "$OUT/ckpt_${name}_load.log" 2>&1 \
    || { tail -5 "$OUT/ckpt_${name}_load.log"; return 1; }
  echo "$name save: $(grep -o 'successfully saved checkpoint.*' "$OUT/ckpt_${name}_save.log" | tail -1)" | tee -a "$res"
  echo "$name load (page cache warm): $(grep -o 'checkpoint read and verified.*' "$OUT/ckpt_${name}_load.log")" | tee -a "$res"
  # Cold load, when the page cache can be dropped (root).
  if sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
    $bin pretrain "$@" "${common[@]}" --train-iters 11 --log-interval 1 --load "$CK/$name" > "$OUT/ckpt_${name}_coldload.log" 2>&1
    echo "$name load (page cache dropped): $(grep -o 'checkpoint read and verified.*' "$OUT/ckpt_${name}_coldload.log")" | tee -a "$res"
  fi
  rm -rf "$CK/$name"
}

loop_ms() {  # the trainer's "> training loop: N iterations in S s: X ms per iteration" (everything included)
  grep -o 'training loop: .* ms per iteration' "$1" | grep -o '[0-9.]* ms per iteration' | awk '{ print $1 }'
}

# GPT-2 124M: the step slowdown of checkpointing. Each run is timed by the trainer's whole-loop
# line (every iteration, log, validation and checkpoint included; not the wait for the last
# --async-save after the loop) and compared with a run of as many iterations without --save:
#   300 iterations: no saving, synchronous saves every 50, --async-save every 50;
#   150 iterations: no saving, --async-save every 10 (15 checkpoints of 1.49 GB on disk at once).
# Target (issue 20): --async-save every 50 iterations slows the steps by < 2%.
async() {
  local runs=("none 300 0" "sync 300 50" "async 300 50" "none 150 0" "async 150 10")
  declare -A base
  for r in "${runs[@]}"; do
    read -r mode it every <<< "$r"
    local tag=${mode}_${it}_${every}
    rm -rf "$CK/$tag"
    local extra=()
    [ "$mode" != none ] && extra=(--save "$CK/$tag" --save-interval "$every")
    [ "$mode" = async ] && extra+=(--async-save)
    $bin pretrain "${gpt2[@]}" "${common[@]}" --train-iters "$it" --log-interval 10 "${extra[@]}" > "$OUT/ckpt_$tag.log" 2>&1 \
      || { tail -5 "$OUT/ckpt_$tag.log"; rm -rf "$CK/$tag"; return 1; }
    local ms; ms=$(loop_ms "$OUT/ckpt_$tag.log")
    local snap; snap=$(grep -o 'snapshot taken in [0-9.]* s' "$OUT/ckpt_$tag.log" | awk '{ s += $4; n++; if ($4 > m) m = $4 } END { if (n) printf "%d snapshots, %.3f s blocking in total (longest %.3f s)", n, s, m; else print "-" }')
    if [ "$mode" = none ]; then
      base[$it]=$ms
      echo "GPT-2 124M, $it iterations, no checkpoints: $ms ms per iteration (whole loop)" | tee -a "$res"
    else
      local slow; slow=$(awk -v a="$ms" -v b="${base[$it]}" 'BEGIN { printf "%+.2f%%", 100 * (a / b - 1) }')
      local copy; copy=$(grep -o 'device-to-host copy into pinned memory in [0-9.]* ms' "$OUT/ckpt_$tag.log" | grep -o '[0-9.]* ms')
      echo "GPT-2 124M, $it iterations, $mode save every $every: $ms ms per iteration (whole loop), $slow against no checkpoints; $snap${copy:+; device-to-host copy of the last snapshot: $copy on the GPU}" | tee -a "$res"
    fi
    rm -rf "$CK/$tag"
  done
}

for step in "${steps[@]}"; do
  case $step in
    build)
      cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      cmake --build build -j 12 --target megatron > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -40; exit 1; } ;;
    saveload)
      mkdir -p "$CK"; df -h "$CK" | tee -a "$res"
      saveload gpt2_124m "${gpt2[@]}"
      saveload gpt_1.3b "${gpt13[@]}" ;;
    async) mkdir -p "$CK"; async ;;
    tensorboard)
      rm -rf "$OUT/tb"
      $bin pretrain "${gpt2[@]}" "${common[@]}" --train-iters 20 --log-interval 5 --eval-interval 10 --eval-iters 2 \
        --tensorboard-dir "$OUT/tb" --log-timers-to-tensorboard --log-memory-to-tensorboard \
        --log-validation-ppl-to-tensorboard --timing-log-level 1 --metrics-file "$OUT/metrics.jsonl" > "$OUT/tb_run.log" 2>&1 \
        || { tail -5 "$OUT/tb_run.log"; exit 1; }
      reader=(); python3 -c "import tensorboard" 2>/dev/null || reader=(--reader builtin)
      python3 tools/check_tensorboard.py "$OUT/tb" "${reader[@]}" --require-tag "lm loss=20" --require-tag learning-rate \
        --require-tag grad-norm=4 --require-tag loss-scale --require-tag throughput --require-tag iteration-time \
        --require-tag mem-allocated-bytes --require-tag mem-reserved-bytes --require-tag "lm loss validation=3" \
        --require-tag "lm loss validation ppl=3" --require-tag forward-backward-time 2>&1 | tee -a "$res" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
rm -rf "$CK"
