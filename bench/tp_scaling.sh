#!/usr/bin/env bash
# Tensor-parallel scaling on 1 and 2 GPUs (issue 41), each step printing a markdown table:
#   weak     the Megatron-LM paper's weak scaling (Shoeybi et al. 2019, Table 1 / Figure 5): a model
#            per GPU count with 96 channels per head — 1.2B (h 1536, 16 heads, 40 layers) on one GPU,
#            2.5B (h 1920, 20 heads, 54 layers) on two with TP 2 (the paper's layout, no SP), TP 2 +
#            SP, and TP 2 + SP + --tp-comm-overlap; micro-batch 8, sequence 1024, vocabulary 51200
#            (the paper's: GPT-2's padded to a multiple of 1024). Efficiency = TFLOP/s per GPU over
#            the one-GPU run's (the paper: 39 TFLOP/s on one V100, 77% at 8-way).
#   heads    the paper's Table 7 (attention heads and TP scaling; 8.3B at 8-way: 16 / 24 / 32 heads
#            of 192 / 128 / 96 channels gave 82% / 80% / 77%): the same hidden size 3072 and head
#            counts, 16 layers instead of 72 to fit one GPU, on one GPU and at TP 2 + SP with and
#            without --tp-comm-overlap. Efficiencies: TP 2 against the same model on one GPU, and
#            (weak, as the paper) against the 1.2B one-GPU run of `weak` when it ran.
#   llama7b  the 7B-class Llama of issue 41 (32 layers, h 4096, 32 heads, SwiGLU 11008, seq 4096,
#            micro-batch 1, global batch 16, GPT-2 vocabulary, untied output layer, distributed
#            optimizer): TP 2 + SP without and with --tp-comm-overlap, and PP 2 beside them; a layout
#            whose 32 layers do not fit the GPUs' memory runs again with 24 (its row says so;
#            LLAMA_LAYERS sets the layer count and turns the fallback off).
# TFLOP/s and MFU are the log line's (Megatron-Core's current formula, causal attention counting half
# of the s² term; MFU against 989.4 TFLOP/s, docs/flags.md). ms/iter is the mean of the log windows
# that start after the first WARM iterations, weighted by their length.
#   llama7b4 the same model on 4 GPUs (issue 46): TP 2 + SP × PP 2, TP 4 + SP, PP 4 + VPP 2, each
#            with and without the communication overlaps (--tp-comm-overlap, --overlap-p2p-communication).
# Usage: bench/tp_scaling.sh [weak] [heads] [llama7b] [llama7b4]   (default: all three; needs 2 GPUs for the
# TP rows). Env: OUT (logs, default out), MT_BUILD_DIR (use the megatron binary built there instead
# of building build/), ITERS (default 30), WARM (default 10), ATTN (--attention-backend, default
# fused: cuDNN for head dims other than 64 / 128), LLAMA_LAYERS, MT_EXTRA (flags added to every run,
# e.g. "--fp8-format hybrid --fp8-recipe tensorwise" for the FP8 rows of issue 38).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on these machines
source bench/common.sh
B=${MT_BUILD_DIR:-build}
if [ -z "${MT_BUILD_DIR:-}" ]; then bench_build megatron || exit 1; fi
bin=$B/megatron
ITERS=${ITERS:-30}; WARM=${WARM:-10}; ATTN=${ATTN:-fused}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
mem_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | awk '{print int($1/1024)}')
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "GPUs: $ngpu x $gpu ($mem_gib GiB)"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(weak heads llama7b)

common=(--seq-length 1024 --max-position-embeddings 1024 --make-vocab-size-divisible-by 1024 --lr 1e-4
        --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
        --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress "${demo_data[@]}"
        --seed 1234 --train-iters "$ITERS" --log-interval 5 --eval-interval 100000 --eval-iters 0
        --attention-backend "$ATTN")

# run NAME NGPU args...: one training run, log in $OUT/NAME.log; sets ms tflops mfu mem err
run() {
  local name=$1 n=$2; shift 2
  if [ "$n" -gt "$ngpu" ]; then ms=NA; tflops=NA; mfu=NA; mem=NA; err="needs $n GPUs"; return; fi
  # shellcheck disable=SC2086
  "$bin" pretrain --nproc-per-node "$n" "$@" ${MT_EXTRA:-} > "$OUT/$name.log" 2>&1
  read -r ms tflops mfu <<< "$(log_means "$OUT/$name.log" "$WARM")"
  # the largest "in use" of the ranks (MiB, "rK: buffers/in_use" pairs), in GiB
  mem=$(largest_rank_mem "$OUT/$name.log" | cut -d' ' -f2)
  [ -n "$mem" ] || mem=$(grep -oE "[0-9.]+ MiB in use on" "$OUT/$name.log" | head -1 | awk '{printf "%.1f", $1 / 1024}')
  err=$(grep -m1 -E "error|out of memory" "$OUT/$name.log" | cut -c1-160)
}
# eff A B: A / B as a percentage, or NA
eff() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{100 * float(a) / float(b):.1f}%' if a != 'NA' and b != 'NA' else 'NA')" "$1" "$2"; }
gpt() {  # gpt H HEADS LAYERS: sets model=(...), micro-batch 8 and global batch 8 (the paper's)
  model=(--num-layers "$3" --hidden-size "$1" --num-attention-heads "$2" --micro-batch-size 8 --global-batch-size 8)
}
base_tflops=NA  # the 1.2B one-GPU run of `weak`
# llama LAYERS [GLOBAL_BATCH]: sets llama=(...), the 7B-class Llama of llama7b / llama7b4
llama() {
  llama=(--num-layers "$1" --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --swiglu
         --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
         --untie-embeddings-and-output-weights --seq-length 4096 --max-position-embeddings 4096
         --micro-batch-size 1 --global-batch-size "${2:-16}" --use-distributed-optimizer --lr 1e-4 --min-lr 1e-5
         --lr-warmup-iters 2 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
         "${demo_data[@]}" --seed 1234 --train-iters "$ITERS" --log-interval 5 --eval-interval 100000
         --eval-iters 0)
}

for step in "${steps[@]}"; do
  case $step in
    weak)
      echo
      echo "Weak scaling (paper Table 1 rows 1-2; micro-batch 8, global batch 8, seq 1024, bf16, $gpu):"
      echo
      echo "| GPUs | model | layout | ms/iter | TFLOP/s per GPU | MFU | weak-scaling efficiency | paper (V100) | peak GiB/GPU |"
      echo "|---|---|---|---|---|---|---|---|---|"
      gpt 1536 16 40
      run weak_1gpu 1 "${common[@]}" "${model[@]}"
      base_tflops=$tflops
      echo "| 1 | 1.2B: h 1536, 16 heads, 40 layers | one GPU | $ms | $tflops | $mfu% | 100% | 100% (39 TFLOP/s) | $mem | $err"
      for lay in "--tensor-model-parallel-size 2" "--tensor-model-parallel-size 2 --sequence-parallel" \
                 "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"; do
        tag=$(echo "$lay" | sed 's/--tensor-model-parallel-size /tp/; s/ --sequence-parallel/_sp/; s/ --tp-comm-overlap/_overlap/')
        gpt 1920 20 54
        # shellcheck disable=SC2086  # $lay: several flags
        run "weak_2gpu_$tag" 2 "${common[@]}" "${model[@]}" $lay
        echo "| 2 | 2.5B: h 1920, 20 heads, 54 layers | ${lay//--/} | $ms | $tflops | $mfu% | $(eff "$tflops" "$base_tflops") | (Figure 5; 77% at 8 GPUs) | $mem | $err"
      done ;;
    heads)
      echo
      echo "Attention heads and TP scaling (paper Table 7 shape: h 3072, 16 layers instead of 72; micro-batch 8, seq 1024, $gpu):"
      echo
      echo "| heads | channels per head | layout | ms/iter | TFLOP/s per GPU | MFU | TP 2 efficiency (vs one GPU, same model) | weak efficiency (vs 1.2B on one GPU) | paper (8.3B, 8-way) | peak GiB/GPU |"
      echo "|---|---|---|---|---|---|---|---|---|---|"
      for heads in 16 24 32; do
        case $heads in 16) paper="82%";; 24) paper="80%";; 32) paper="77%";; esac
        gpt 3072 "$heads" 16
        run "heads${heads}_1gpu" 1 "${common[@]}" "${model[@]}"
        one=$tflops
        echo "| $heads | $((3072 / heads)) | one GPU | $ms | $tflops | $mfu% | 100% | $(eff "$tflops" "$base_tflops") | | $mem | $err"
        for lay in "--tensor-model-parallel-size 2 --sequence-parallel" \
                   "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap"; do
          tag=$(echo "$lay" | sed 's/--tensor-model-parallel-size /tp/; s/ --sequence-parallel/_sp/; s/ --tp-comm-overlap/_overlap/')
          # shellcheck disable=SC2086
          run "heads${heads}_$tag" 2 "${common[@]}" "${model[@]}" $lay
          echo "| $heads | $((3072 / heads)) | ${lay//--/} | $ms | $tflops | $mfu% | $(eff "$tflops" "$one") | $(eff "$tflops" "$base_tflops") | $paper | $mem | $err"
        done
      done ;;
    llama7b)
      echo
      echo "7B-class Llama on 2 GPUs (h 4096, 32 heads, SwiGLU 11008, seq 4096, micro-batch 1, global batch 16, $gpu):"
      echo
      echo "| layout | layers | ms/iter | TFLOP/s per GPU | MFU | peak GiB/GPU |"
      echo "|---|---|---|---|---|---|"
      for lay in "--tensor-model-parallel-size 2 --sequence-parallel" \
                 "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap" \
                 "--pipeline-model-parallel-size 2"; do
        tag=$(echo "$lay" | sed 's/--tensor-model-parallel-size /tp/; s/--pipeline-model-parallel-size /pp/; s/ --sequence-parallel/_sp/; s/ --tp-comm-overlap/_overlap/')
        # 32 layers (LLAMA_LAYERS), or 24 when 32 do not fit the GPUs' memory (said in the row)
        layers=${LLAMA_LAYERS:-32}
        llama "$layers"
        # shellcheck disable=SC2086
        run "llama7b_$tag" 2 "${llama[@]}" $lay
        if [ -z "${LLAMA_LAYERS:-}" ] && grep -q "out of memory" "$OUT/llama7b_$tag.log"; then
          layers="24 (32: out of memory)"
          llama 24
          # shellcheck disable=SC2086
          run "llama7b_${tag}_24" 2 "${llama[@]}" $lay
        fi
        echo "| ${lay//--/} | $layers | $ms | $tflops | $mfu% | $mem | $err"
      done ;;
    llama7b4)
      # the 4-GPU layouts of issue 46: global batch 32
      llama 32 32
      echo
      echo "7B-class Llama on 4 GPUs (32 layers, h 4096, 32 heads, SwiGLU 11008, seq 4096, micro-batch 1, global batch 32, $gpu${MT_EXTRA:+, $MT_EXTRA}):"
      echo
      echo "| layout | ms/iter | TFLOP/s per GPU | MFU | peak GiB/GPU |"
      echo "|---|---|---|---|---|"
      for lay in "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2" \
                 "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap --pipeline-model-parallel-size 2 --overlap-p2p-communication" \
                 "--tensor-model-parallel-size 4 --sequence-parallel" \
                 "--tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap" \
                 "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4" \
                 "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4 --overlap-p2p-communication"; do
        tag=$(echo "$lay" | tr -d ' -' | cut -c1-60)
        # shellcheck disable=SC2086
        run "llama7b4_$tag" 4 "${llama[@]}" $lay
        echo "| ${lay//--/} | $ms | $tflops | $mfu% | $mem | $err"
      done ;;
    *) echo "unknown step '$step' (expected weak, heads, llama7b, llama7b4)"; exit 2 ;;
  esac
done
