# Shared by the bench scripts (sourced): the demo data's flags, the single-GPU training flags of
# the side-by-side comparisons, and the build step.
#   demo_data: --data-path/--split/tokenizer of the demo data (tools/fetch_demo_data.sh, carried)
#   bench_train: sequence 1024, bf16, dropout 0, lr 3e-4 cosine, seed 1234, $ITERS iterations logged
#                every 10, no evaluation
#   bench_build TARGET...: configure (preset default) and build the targets into build/, logs in $OUT
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
