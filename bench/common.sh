# Shared by the bench scripts (sourced): the demo data's flags, the single-GPU training flags of
# the side-by-side comparisons, and the build step.
#   demo_data: --data-path/--split/tokenizer of the demo data (tools/fetch_demo_data.sh, carried)
#   bench_train: sequence 1024, bf16, dropout 0, lr 3e-4 cosine, seed 1234, $ITERS iterations logged
#                every 10, no evaluation
#   bench_build TARGET...: configure (preset default) and build the targets into build/, logs in $OUT
#   megatron_bin NAME: bin=$MT_BUILD_DIR/megatron (default build/), or exit 2 naming NAME when it is
#                not built
#   log_means LOG WARM, largest_rank_mem LOG: figures from a `megatron pretrain` log (below)
demo_data=(--data-path data/demo_text_document --split 98,2,0 --vocab-file data/gpt2/encoder.json
           --merge-file data/gpt2/vocab.bpe)
bench_train=(--seq-length 1024 --max-position-embeddings 1024 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
             --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16
             --device cuda --no-progress "${demo_data[@]}" --seed 1234
             --train-iters "${ITERS:-40}" --log-interval 10 --eval-interval 100000 --eval-iters 0)
bench_build() {
  cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; return 1; }
  cmake --build build -j 16 --target "$@" > "$OUT/build.log" 2>&1 ||
    { grep -E "error" -A5 "$OUT/build.log" | head -60; return 1; }
}
# log_means LOG WARM: "ms tflops mfu" of `megatron pretrain`'s log lines, the means over the log
# windows that start after the first WARM iterations, weighted by their length (a log line
# averages the iterations since the previous one); "NA NA NA" when no window qualifies; mfu "nan"
# when the line has none (CPU runs).
log_means() {
  python3 - "$1" "$2" <<'PY'
import re, sys
log, warm = open(sys.argv[1]).read(), int(sys.argv[2])
rows = [(int(i), float(ms), float(tf), float(m) if m else float("nan")) for i, ms, tf, m in re.findall(
    r"iteration +(\d+)/ *\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
    r"([0-9.]+) \|(?: MFU: ([0-9.]+)% \|)?", log)]
kept, prev = [], 0
for r in rows:
    if prev >= warm:
        kept.append((r[0] - prev, r))
    prev = r[0]
if not kept:
    print("NA NA NA")
else:
    w = sum(k for k, _ in kept)
    mean = lambda j: sum(k * r[j] for k, r in kept) / w
    print(f"{mean(1):.1f} {mean(2):.1f} {mean(3):.1f}")
PY
}
# largest_rank_mem LOG: "buffers in_use" (GiB, one decimal) of the rank with the most memory in use,
# from the log's "device memory per rank" line (several ranks); nothing when the line is missing.
largest_rank_mem() {
  grep -m1 "device memory per rank" "$1" | grep -oE "[0-9.]+/[0-9.]+" |
    awk -F/ '$2 > u { u = $2; b = $1 } END { if (u) printf "%.1f %.1f", b / 1024, u / 1024 }'
}
megatron_bin() {
  bin=${MT_BUILD_DIR:-build}/megatron
  [ -x "$bin" ] || { echo "$1: $bin is not built (set MT_BUILD_DIR)"; exit 2; }
}
