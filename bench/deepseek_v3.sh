#!/usr/bin/env bash
# DeepSeek-V3-shaped MoE training on the demo data (issue 43 "Done when", issue 39's per-phase
# timings; docs/benchmarks.md "DeepSeek-V3-shaped MoE"). One model, sized so that bf16 weights with
# fp32 main parameters, gradients and Adam moments plus the activations fit one 139 GiB H200
# (`megatron plan` with these flags: see `plan` below):
#   16 layers, hidden 2048, 16 heads, vocabulary 50304 (GPT-2 BPE, padded), RMSNorm, SwiGLU, untied;
#   MLA: no query latent (DeepSeek-V2-Lite's), kv-lora 512, qk-head-dim 128, qk-pos-emb 64, v 128,
#        plain RoPE on the rotated channels (interleaved pairs, as DeepSeek);
#   layer 0 dense (SwiGLU 8192), layers 1-15 MoE: 64 experts top-6 (SwiGLU MOE_FFN, default 512)
#        + 1 shared expert of MOE_FFN, sigmoid router with the aux-loss-free expert bias (update
#        rate 1e-3), 4 groups of which the best 2 (group-limited top-k), scaling factor 2.5, no
#        auxiliary loss;
#   MTP 1 (loss factor 0.1); sequence 4096, micro-batch 1, global batch 8 (32K tokens per step);
#   AdamW lr 3e-4 (10 warm-up, cosine), clip 1.0, bf16, dropout 0, --moe-grouped-gemm.
# Steps (default: 1gpu):
#   build  configure (preset default) and build megatron into build/
#   plan   `megatron plan` of the model on one H200 (memory per part, predicted step; CPU only)
#   1gpu   megatron.cpp on one GPU: (a) with MTP 1, (b) without MTP (the reference's model) with
#          MT_MOE_PHASE_TIMING=1: its per-phase MoE table (router, permute, dispatch, experts,
#          combine, shared experts) is printed at the end of the run
#   ep2    the same model (with MTP) at expert parallel 2 on 2 GPUs (alltoall dispatcher)
#   ref    transformers' DeepseekV3ForCausalLM, the same configuration without MTP
#          (bench/hf_deepseek_train.py: torch.compile, bf16 autocast, fused AdamW; REF_ITERS steps,
#          torch.compile's warm-up limited to 120 s; if the whole model does not compile, regional
#          compilation with the MoE routing eager, else eager — said in its output)
#   all    1gpu ref ep2
# After the steps a table: per run tokens/s, TFLOP/s per GPU (Megatron's formula; the reference
# is given the FLOPs per step of our no-MTP run, the same model), step ms (median after WARMUP),
# peak memory, validation loss before the first and after the last step (ours; the reference:
# training loss of its first and last steps). Exit status 1 when a run fails or our validation
# loss does not fall.
# Environment: ITERS (default 30), WARMUP (steps left out of the medians, default 5), REF_ITERS /
# REF_WARMUP (the reference's, default 12 / 3: transformers' expert loop makes its steps slow), REF_COMPILE
# (auto: the whole model, then by region; regional: by region from the start) and REF_COMPILE_S (the
# compile budget, default 120 s), GROUPED
# (1: --moe-grouped-gemm, the default; 0: the per-expert cuBLASLt loop), MEGATRON (build/megatron),
# and for small runs (a CPU check: DEVICE=cpu) LAYERS HIDDEN HEADS FFN MOE_FFN EXPERTS TOPK
# KV_LORA QK_HEAD QK_POS V_HEAD SEQ MB GB EVAL_ITERS.
# usage: bench/deepseek_v3.sh [build] [plan] [1gpu] [ep2] [ref] [all]   (logs under $OUT or ./out)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
source "$(dirname "$0")/common.sh"
MT=${MEGATRON:-build/megatron}
ITERS=${ITERS:-30}; WARMUP=${WARMUP:-5}; GROUPED=${GROUPED:-1}; DEVICE=${DEVICE:-cuda}
REF_ITERS=${REF_ITERS:-12}; REF_WARMUP=${REF_WARMUP:-3}  # the reference's steps (its MoE loop is slow)
LAYERS=${LAYERS:-16}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-16}; FFN=${FFN:-8192}; MOE_FFN=${MOE_FFN:-512}
EXPERTS=${EXPERTS:-64}; TOPK=${TOPK:-6}; KV_LORA=${KV_LORA:-512}; QK_HEAD=${QK_HEAD:-128}; QK_POS=${QK_POS:-64}
V_HEAD=${V_HEAD:-128}; SEQ=${SEQ:-4096}; MB=${MB:-1}; GB=${GB:-8}; EVAL_ITERS=${EVAL_ITERS:-2}
t0=$(date +%s)
fail=0

model=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN"
       --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
       --disable-bias-linear
       --multi-latent-attention --kv-lora-rank "$KV_LORA" --qk-head-dim "$QK_HEAD" --qk-pos-emb-head-dim "$QK_POS"
       --v-head-dim "$V_HEAD" --rope-type rope
       --num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-ffn-hidden-size "$MOE_FFN"
       --moe-shared-expert-intermediate-size "$MOE_FFN" --moe-layer-freq "([0]+[1]*$((LAYERS - 1)))"
       --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
       --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5
       --seq-length "$SEQ" --max-position-embeddings "$SEQ")
[ "$GROUPED" = 1 ] && model+=(--moe-grouped-gemm)
train=(--micro-batch-size "$MB" --global-batch-size "$GB" --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5
       --lr-decay-style cosine --lr-warmup-iters $((ITERS < 20 ? 1 : 10)) --weight-decay 0.1 --clip-grad 1.0
       --hidden-dropout 0 --attention-dropout 0 --device "$DEVICE" --no-progress "${demo_data[@]}"
       --seed 1234 --log-interval 1 --eval-interval "$ITERS" --eval-iters "$EVAL_ITERS")
[ "$DEVICE" = cpu ] || train+=(--bf16)  # the CPU backend trains in fp32
mtp=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)

# ours TAG EXTRA...: one `megatron pretrain` run, log $OUT/TAG.log
ours() {
  local tag=$1; shift
  echo "== $tag: megatron pretrain $* (log $OUT/$tag.log)"
  timeout 420 "$MT" pretrain "${model[@]}" "${train[@]}" "$@" > "$OUT/$tag.log" 2>&1
  local rc=$?
  grep -E "validation loss|rror" "$OUT/$tag.log" | cut -c1-300
  grep -E "iteration +[0-9]+/" "$OUT/$tag.log" | tail -1 | cut -c1-400
  grep -A12 "^MoE phase timing" "$OUT/$tag.log"
  [ $rc = 0 ] || { echo "$tag: failed (exit $rc)"; fail=1; }
}

steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(1gpu)
[ "${steps[*]}" = all ] && steps=(1gpu ref ep2)
for step in "${steps[@]}"; do
  case $step in
    build)
      bench_build megatron || exit 1
      echo "build: $(( $(date +%s) - t0 )) s" ;;
    plan)
      "$MT" plan "${model[@]}" "${mtp[@]}" "${train[@]}" --world-size 1 --gpu h200 ;;
    1gpu)
      ours dsv3_1gpu_mtp "${mtp[@]}"
      MT_MOE_PHASE_TIMING=1 MT_MOE_PHASE_TIMING_WARMUP=$WARMUP ours dsv3_1gpu_nomtp ;;
    ep2)
      NCCL_NVLS_ENABLE=0 ours dsv3_ep2_mtp "${mtp[@]}" --nproc-per-node 2 --expert-model-parallel-size 2 \
        --moe-token-dispatcher-type alltoall ;;
    ref)
      echo "== ref: bench/hf_deepseek_train.py (log $OUT/dsv3_ref.log)"
      timeout 330 python3 "$(dirname "$0")/hf_deepseek_train.py" --layers "$LAYERS" --hidden "$HIDDEN" \
        --heads "$HEADS" --ffn "$FFN" --moe-ffn "$MOE_FFN" --experts "$EXPERTS" --topk "$TOPK" --kv-lora "$KV_LORA" \
        --qk-head "$QK_HEAD" --qk-pos "$QK_POS" --v-head "$V_HEAD" --seq "$SEQ" --micro-batch-size "$MB" \
        --global-batch-size "$GB" --steps "$REF_ITERS" --warmup "$REF_WARMUP" --data data/demo_text_document \
        --compile "${REF_COMPILE:-auto}" --compile-budget-s "${REF_COMPILE_S:-120}" > "$OUT/dsv3_ref.log" 2>&1
      rc=$?
      grep -E "^(config|data|parameters|compile|reference|step 1 |step $REF_ITERS |FAIL|note)|rror" "$OUT/dsv3_ref.log" |
        cut -c1-300
      [ $rc = 0 ] || { echo "ref: failed (exit $rc)"; tail -5 "$OUT/dsv3_ref.log"; fail=1; } ;;
    *) echo "unknown step $step (build plan 1gpu ep2 ref all)"; exit 2 ;;
  esac
done

# The table of every run present in $OUT.
python3 - "$OUT" "$WARMUP" <<'PY' || fail=1
import os, re, statistics, sys
out, warm = sys.argv[1], int(sys.argv[2])
rows, ok = [], True
flops_nomtp = None
def ours(tag, name):
    global flops_nomtp, ok
    p = os.path.join(out, tag + ".log")
    if not os.path.exists(p):
        return
    m = open(p).read()
    it = [(int(a), float(b), float(c)) for a, b, c in re.findall(
        r"iteration +(\d+)/ *\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per GPU "
        r"\(TFLOP/s/GPU\): ([0-9.]+)", m)]
    val = [float(v) for v in re.findall(r"validation loss at iteration +\d+ .*?lm loss value: ([0-9.E+-]+)", m)]
    if not it or len(val) < 2:
        rows.append(f"| {name} | failed: {len(it)} iterations, {len(val)} validations logged |||||")
        ok = False
        return
    timed = [x for x in it if x[0] > warm] or it
    ms = statistics.median(x[1] for x in timed)
    tf = statistics.median(x[2] for x in timed)
    flops = statistics.median(x[1] * x[2] for x in timed) / 1e3  # TFLOP per step (per GPU)
    if tag == "dsv3_1gpu_nomtp":
        flops_nomtp = flops
    tok = re.findall(r"tokens per second: ([0-9]+)", m)
    # CUDA: the static buffers (the peak; the CUDA context adds ~0.6 GiB); CPU: the allocated buffers
    mem = re.search(r"device memory: ([0-9.]+) MiB", m) or re.search(r"from the ([0-9.]+) MiB allocated", m)
    falls = val[-1] < val[0]
    ok = ok and falls
    rows.append(f"| {name} | {tok[-1] if tok else '?'} | {tf:.1f} | {ms:.1f} | "
                f"{float(mem.group(1)) / 1024 if mem else float('nan'):.1f} | {val[0]:.3f} → {val[-1]:.3f}{'' if falls else ' (NOT FALLING)'} |")
ours("dsv3_1gpu_mtp", "megatron.cpp, 1 GPU, MTP 1")
ours("dsv3_1gpu_nomtp", "megatron.cpp, 1 GPU, no MTP (phase timing on)")
ours("dsv3_ep2_mtp", "megatron.cpp, EP 2 on 2 GPUs, MTP 1 (tokens/s of both GPUs)")
p = os.path.join(out, "dsv3_ref.log")
if os.path.exists(p):
    t = open(p).read()
    r = re.search(r"reference: ([0-9.]+) ms/step, ([0-9.]+) tok/s, peak mem ([0-9.]+) GiB, loss ([0-9.]+) -> ([0-9.]+), (\S+)", t)
    if r:
        ms = float(r.group(1))
        tf = f"{flops_nomtp / (ms / 1e3):.1f}" if flops_nomtp else "n/a"
        rows.append(f"| transformers DeepseekV3ForCausalLM ({r.group(6)}), no MTP | {float(r.group(2)):.0f} | {tf} | "
                    f"{ms:.1f} | {r.group(3)} | {r.group(4)} → {r.group(5)} (training loss) |")
    else:
        rows.append("| transformers DeepseekV3ForCausalLM | failed |||||")
        ok = False
print("| run | tokens/s | TFLOP/s/GPU | step ms (median) | peak memory GiB | validation loss start → end |")
print("|---|---|---|---|---|---|")
print("\n".join(rows))
sys.exit(0 if ok else 1)
PY
echo "total: $(( $(date +%s) - t0 )) s"
exit $fail
