#!/usr/bin/env bash
# The single-GPU comparison of issue 14: in one device session, megatron.cpp (`megatron pretrain`)
# and the PyTorch reference (bench/pytorch_gpt2.py: same model, torch.compile, SDPA, fused AdamW,
# bf16 autocast) train each named configuration for ITERS steps FROM THE SAME WEIGHTS ON THE SAME
# TOKENS, and one markdown table row per configuration is printed (stdout and $OUT/compare.md):
# tokens/s, TFLOP/s per GPU (Megatron's formula, the same FLOPs per step for both), MFU against the
# GPU's dense bf16 peak, step-time median and spread (10th-90th percentile over the steps after
# WARMUP), peak memory, and both losses at step ITERS (they must agree within bf16 noise).
#   weights: one megatron.cpp step at learning rate 0 is saved and exported (`export-hf`, fp32) and
#            loaded by the reference (--init-hf);
#   tokens:  bench/train_samples_bench writes the samples `megatron pretrain` reads (demo data),
#            the reference trains on them (--samples), with the padded vocabulary rows outside its
#            softmax (--loss-vocab 50257) as in Megatron;
#   timing:  both sides time every step with a host synchronisation per step (megatron.cpp:
#            --log-interval 1, which reads the loss each iteration; the reference: synchronize and
#            loss.item()).
# The MoE configuration has no Hugging Face export in the reference's layout: its row compares
# speed only (the reference on random tokens from its own initialisation), losses "n/a".
#
# usage: bench/compare.sh [build] CONFIG...
#   gpt2_mb16 gpt2_mb32   GPT-2 124M, sequence 1024, micro-batch 16 / 32
#   gpt_350m              GPT 350M (24 layers, hidden 1024, 16 heads), micro-batch 16
#   gpt_1p3b              GPT 1.3B (24 layers, hidden 2048, 16 heads), micro-batch 8
#   llama_1b              Llama-style 1.2B (16 layers, hidden 2048, GQA 32/8, SwiGLU 8192), micro-batch 4
#   llama_1b_mb8          the same at micro-batch 8
#   <config>_gaN          any of the above with N micro-batches accumulated per step (global batch =
#                         N x micro-batch on both sides: megatron.cpp's --global-batch-size, the
#                         reference's --grad-accum), as Megatron's users train; tok/s and step times
#                         per step of N micro-batches (the optimizer and FP8's weight casts once per step)
#   CONFIG:VARIANT        the same configuration, megatron.cpp with other flags (the reference run,
#                         the weights and the samples of CONFIG are reused within one invocation):
#                         norm_act = --recompute-granularity selective --recompute-modules layernorm
#                         mlp_act (the norms' and the MLP activation's outputs recomputed);
#                         graph = --cuda-graph-impl full_iteration (forward + backward replayed
#                         as one CUDA graph); fa2 = --attention-backend flash (the FlashAttention-2
#                         kernels instead of the default cuDNN fused attention); fp8 = --fp8-format
#                         hybrid --fp8-recipe tensorwise (FP8 GEMMs in every decoder linear layer,
#                         current scaling; docs/fp8.md), fp8_delayed = hybrid delayed scaling (amax
#                         history 1024, max), fp8_block = e4m3 blockwise (1x128 / 128x128 scales),
#                         fp8_graph = fp8 with the full-iteration CUDA graph, fp8_delayed_graph =
#                         fp8_delayed with it (fp8_delayed: the SwiGLU writes fc2's FP8 input and
#                         fc1's FP8 output gradient, the default; docs/fp8.md "What fuses"),
#                         fp8_delayed_fused = with the norms' fused FP8 outputs as well
#                         (MT_FP8_FUSED_PRODUCERS=1), fp8_delayed_unfused = no fused producer
#                         (MT_FP8_FUSED_PRODUCERS=0)
#   moe_small             Mixtral-style MoE (12 layers, hidden 1024, GQA 16/8, 8 experts top-2, expert
#                         SwiGLU 3584, aux loss 1e-2), micro-batch 8 (speed only)
# Environment: ITERS (steps, default 40), WARMUP (steps left out of the timing, default 10), LR
# (constant, default 3e-4), PEAK_TFLOPS (default: 989.4, the H100/H200 SXM dense bf16 peak).
# Needs data/ (tools/fetch_demo_data.sh + preprocess; carried).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
ITERS=${ITERS:-40}; WARMUP=${WARMUP:-10}; LR=${LR:-3e-4}; PEAK=${PEAK_TFLOPS:-989.4}
source "$(dirname "$0")/common.sh"
SEQ=1024
train=(--seq-length $SEQ --max-position-embeddings $SEQ --lr-decay-style constant --lr-warmup-iters 0
       --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
       "${demo_data[@]}" --seed 1234 --eval-interval 100000 --eval-iters 0)
llama=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
       --disable-bias-linear --group-query-attention)

config() {  # sets mt (megatron flags), pt (pytorch flags), mb, ga and loss (1: compare losses) for $1
  loss=1; ga=1
  local name=$1
  if [[ $name =~ ^(.*)_ga([0-9]+)$ ]]; then name=${BASH_REMATCH[1]}; ga=${BASH_REMATCH[2]}; fi
  case $name in
    gpt2_mb16|gpt2_mb32)
      mb=${name#gpt2_mb}
      mt=(--num-layers 12 --hidden-size 768 --num-attention-heads 12)
      pt=() ;;
    gpt_350m)
      mb=16
      mt=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16)
      pt=(--layers 24 --hidden 1024 --heads 16) ;;
    gpt_1p3b)
      mb=8
      mt=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16)
      pt=(--layers 24 --hidden 2048 --heads 16) ;;
    llama_1b|llama_1b_mb8)
      mb=4; [ "$name" = llama_1b ] || mb=${name#llama_1b_mb}
      mt=("${llama[@]}" --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 8
          --ffn-hidden-size 8192)
      pt=(--arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn 8192) ;;
    moe_small)
      mb=8; loss=0
      mt=("${llama[@]}" --num-layers 12 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 8
          --ffn-hidden-size 3584 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 3584
          --moe-aux-loss-coeff 1e-2)
      pt=(--arch llama --layers 12 --hidden 1024 --heads 16 --kv-heads 8 --ffn 3584 --experts 8 --topk 2
          --moe-ffn 3584 --aux-loss-coeff 1e-2) ;;
    *) echo "unknown configuration $1" >&2; return 1 ;;
  esac
  mt+=(--micro-batch-size "$mb" --global-batch-size $((mb * ga)))
  pt+=(--micro-batch-size "$mb" --grad-accum "$ga" --seq-length $SEQ --lr "$LR")
}

if [ "${1:-}" = build ]; then
  shift
  bench_build megatron train_samples_bench || exit 1
fi

# Row of the table from the two logs: $1 config, $2 megatron log, $3 torch log, $4 compare losses.
row() {
  python3 - "$@" "$ITERS" "$WARMUP" "$PEAK" "$SEQ" <<'PY'
import re, statistics, sys
name, mlog, tlog, loss, iters, warm, peak, seq = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", \
    int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), int(sys.argv[8])
m = open(mlog).read()
t = open(tlog).read() if tlog else ""
it = [(int(a), float(b), float(c), float(d)) for a, b, c, d in re.findall(
    r"iteration +(\d+)/ *\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): "
    r"([0-9.]+) .*?lm loss: ([0-9.E+-]+)", m)]
if not it:
    err = re.search(r"error.*", m, re.I)
    print(f"| {name} | failed: {err.group(0) if err else 'no iterations'} |")
    sys.exit()
def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]
ms = [x[1] for x in it if x[0] > warm]
ours_ms = statistics.median(ms)
flops = statistics.median([x[1] * x[2] for x in it if x[0] > warm]) / 1e3  # TFLOP per step
ours_tf = flops / (ours_ms / 1e3)
tokens = re.findall(r"tokens per second: ([0-9]+)", m)  # with the last line's time: tokens per step
tok_per_step = round(int(tokens[-1]) * it[-1][1] / 1e3) if tokens else 0
mem = re.search(r"device memory: ([0-9.]+) MiB", m)
ours_gib = float(mem.group(1)) / 1024 if mem else float("nan")
ours_loss = {x[0]: x[3] for x in it}
ref_ms = [float(x) for x in re.search(r"step times ms: ([0-9. ]+)", t).group(1).split()] if "step times ms" in t else []
ref_loss = {int(a): float(b) for a, b in re.findall(r"step (\d+) loss ([0-9.]+)", t)}
pm = re.search(r"peak mem ([0-9.]+) GiB", t)
cell = lambda xs: f"{statistics.median(xs):.1f} ({pct(xs, 0.1):.1f}-{pct(xs, 0.9):.1f})"
if ref_ms:
    ref_med = statistics.median(ref_ms)
    ref_tf = flops / (ref_med / 1e3)
    ref_cols = (f"{tok_per_step / (ref_med / 1e3) / 1e3:.1f}K", f"{ours_ms and ref_med / ours_ms:.2f}",
                f"{ref_tf:.1f} ({100 * ref_tf / peak:.1f}%)", cell(ref_ms), pm.group(1) if pm else "?")
else:
    ref_cols = ("failed", "n/a", "n/a", "n/a", "?")
if loss and iters in ours_loss and iters in ref_loss:
    lcol = f"{ours_loss[iters]:.4f} / {ref_loss[iters]:.4f} ({ours_loss[iters] - ref_loss[iters]:+.4f})"
else:
    lcol = "n/a"
print(f"| {name} | {tok_per_step / (ours_ms / 1e3) / 1e3:.1f}K | {ref_cols[0]} | {ref_cols[1]} | "
      f"{ours_tf:.1f} ({100 * ours_tf / peak:.1f}%) | {ref_cols[2]} | {cell(ms)} | {ref_cols[3]} | "
      f"{ours_gib:.1f} / {ref_cols[4]} | {lcol} |")
PY
}

header="| configuration | megatron.cpp tok/s | PyTorch tok/s | ratio | TFLOP/s/GPU (MFU) ours | TFLOP/s/GPU (MFU) PyTorch | step ms median (p10-p90) ours | step ms PyTorch | peak memory GiB ours / PyTorch | loss at step $ITERS ours / PyTorch |"
echo "$header" | tee "$OUT/compare.md"
echo "|---|---|---|---|---|---|---|---|---|---|" | tee -a "$OUT/compare.md"
declare -A torch_done=()
for c in "$@"; do
  base=${c%%:*}
  config "$base" || continue
  fused=act
  case $c in
    "$base") ;;
    "$base:norm_act") mt+=(--recompute-granularity selective --recompute-modules layernorm mlp_act) ;;
    "$base:graph") mt+=(--cuda-graph-impl full_iteration) ;;
    "$base:fa2") mt+=(--attention-backend flash) ;;
    "$base:fp8") mt+=(--fp8-format hybrid --fp8-recipe tensorwise) ;;
    "$base:fp8_delayed") mt+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                              --fp8-amax-compute-algo max) ;;
    "$base:fp8_block") mt+=(--fp8-format e4m3 --fp8-recipe blockwise) ;;
    "$base:fp8_graph") mt+=(--fp8-format hybrid --fp8-recipe tensorwise --cuda-graph-impl full_iteration) ;;
    "$base:fp8_delayed_fused") mt+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                                    --fp8-amax-compute-algo max); fused=1 ;;
    "$base:fp8_delayed_unfused") mt+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                                      --fp8-amax-compute-algo max); fused=0 ;;
    "$base:fp8_delayed_graph") mt+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                                    --fp8-amax-compute-algo max --cuda-graph-impl full_iteration) ;;
    "$base:pao") mt+=(--use-precision-aware-optimizer) ;;
    "$base:pao_norm_act") mt+=(--use-precision-aware-optimizer --recompute-granularity selective
                               --recompute-modules layernorm mlp_act) ;;
    *) echo "unknown variant ${c#*:}" >&2; continue ;;
  esac
  ref_init=()
  if [ "$loss" = 1 ] && [ -d "$OUT/$base.hf" ]; then
    ref_init=(--init-hf "$OUT/$base.hf" --samples "$OUT/$base.samples.bin" --loss-vocab 50257)
  elif [ "$loss" = 1 ]; then
    # the initial weights: one step at learning rate 0 changes nothing; saved and exported
    rm -rf "$OUT/$base.init" "$OUT/$base.hf"
    timeout 300 build/megatron pretrain "${train[@]}" "${mt[@]}" --lr 0 --train-iters 1 --save "$OUT/$base.init" \
      --save-interval 1 > "$OUT/$base.init.log" 2>&1 &&
    timeout 300 build/megatron export-hf --load "$OUT/$base.init" --hf-dir "$OUT/$base.hf" --hf-dtype fp32 \
      > "$OUT/$base.export.log" 2>&1 &&
    timeout 300 build/train_samples_bench "$OUT/$base.samples.bin" $((ITERS * mb * ga)) $SEQ 1234 "$ITERS" $((mb * ga)) 100000 0 \
      "${demo_data[@]}" > "$OUT/$base.samples.log" 2>&1 &&
    ref_init=(--init-hf "$OUT/$base.hf" --samples "$OUT/$base.samples.bin" --loss-vocab 50257) ||
      { echo "| $base | the shared weights or samples failed: $(tail -1 "$OUT/$base.init.log" "$OUT/$base.export.log" 2>/dev/null | tail -1) |" | tee -a "$OUT/compare.md"; continue; }
  fi
  c=${c/:/_}  # file names
  MT_FP8_FUSED_PRODUCERS=$fused timeout 300 build/megatron pretrain "${train[@]}" "${mt[@]}" --lr "$LR" \
    --train-iters "$ITERS" --log-interval 1 > "$OUT/$c.megatron.log" 2>&1
  if [ -z "${torch_done[$base]:-}" ]; then
    timeout 400 python3 bench/pytorch_gpt2.py "${pt[@]}" "${ref_init[@]}" --steps $((ITERS - WARMUP)) \
      --warmup "$WARMUP" --compile > "$OUT/$base.torch.log" 2>&1
    torch_done[$base]=1
  fi
  row "$c" "$OUT/$c.megatron.log" "$OUT/$base.torch.log" "$loss" | tee -a "$OUT/compare.md"
done
for c in "$@"; do rm -rf "$OUT/${c%%:*}.init" "$OUT/${c%%:*}.hf" "$OUT/${c%%:*}.samples.bin"; done
