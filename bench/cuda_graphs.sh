#!/usr/bin/env bash
# CUDA graphs on one GPU (docs/cuda_graphs.md), side by side in one device session: GPT-2 124M
# (sequence 1024, bf16) at the launch-bound micro-batches 1, 2 and 4 — megatron.cpp eager, with
# per-layer graphs (--cuda-graph-impl local --cuda-graph-scope attn mlp), with the
# full-iteration graph (forward and backward; optimizer eager), and with the optimizer in the
# graph too; PyTorch (bench/pytorch_gpt2.py) with torch.compile default and reduce-overhead (its
# CUDA graphs). Prints one markdown row per micro-batch: step ms and host ms per step (the time
# the host spends issuing a step; megatron.cpp's log line) for each variant, to stdout and
# $OUT/cuda_graphs.md; logs under $OUT.
#
# usage: bench/cuda_graphs.sh [build] [MB...]   (default MB: 1 2 4)
# Environment: ITERS (megatron iterations, a multiple of 10, default 60; the last log line, the mean
# of the last 10, is read), TORCH_STEPS (default 30), EXTRA (more megatron flags, e.g. a MoE model).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
ITERS=${ITERS:-60}
TORCH_STEPS=${TORCH_STEPS:-30}
data=data
if [ "${1:-}" = build ]; then
  shift
  cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build -j 16 --target megatron > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
fi
mbs=("$@"); [ ${#mbs[@]} -gt 0 ] || mbs=(1 2 4)
gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12)
train=(--seq-length 1024 --max-position-embeddings 1024
       --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0
       --hidden-dropout 0 --attention-dropout 0 --bf16 --device cuda --no-progress
       --data-path $data/demo_text_document --split 98,2,0 --vocab-file $data/gpt2/encoder.json
       --merge-file $data/gpt2/vocab.bpe --seed 1234 --train-iters "$ITERS" --log-interval 10
       --eval-interval 100000 --eval-iters 0 ${EXTRA:-})
ours() {  # $1 tag, rest: flags -> "step_ms/host_ms"
  local tag=$1; shift
  timeout 300 build/megatron pretrain "${train[@]}" "$@" > "$OUT/$tag.log" 2>&1
  local line; line=$(grep -E "iteration +$ITERS/" "$OUT/$tag.log")
  local ms host
  ms=$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' <<< "$line" | grep -oE '[0-9.]+$')
  host=$(grep -oE 'host time per iteration \(ms\): [0-9.]+' <<< "$line" | grep -oE '[0-9.]+$')
  if [ -n "$ms" ]; then echo "$ms / $host"; else echo "failed: $(grep -iE 'error' "$OUT/$tag.log" | head -1)"; fi
}
theirs() {  # $1 tag, rest: flags -> "step_ms"
  local tag=$1; shift
  timeout 400 python3 bench/pytorch_gpt2.py "$@" --steps "$TORCH_STEPS" --warmup 10 --compile > "$OUT/$tag.log" 2>&1
  local ms; ms=$(tail -1 "$OUT/$tag.log" | grep -oE '[0-9.]+ ms/step' | grep -oE '[0-9.]+')
  echo "${ms:-failed}"
}
header="| micro-batch | ours eager: step / host ms | ours per-layer graphs (attn mlp) | ours graph fwd+bwd | ours graph whole step | PyTorch compile ms | PyTorch reduce-overhead ms |"
echo "$header" | tee "$OUT/cuda_graphs.md"
echo "|---|---|---|---|---|---|---|" | tee -a "$OUT/cuda_graphs.md"
for mb in "${mbs[@]}"; do
  b=("${gpt2[@]}" --micro-batch-size "$mb" --global-batch-size "$mb")
  e=$(ours "mb$mb.eager" "${b[@]}")
  l=$(ours "mb$mb.layer" "${b[@]}" --cuda-graph-impl local --cuda-graph-scope attn mlp)
  g=$(ours "mb$mb.graph" "${b[@]}" --cuda-graph-impl full_iteration)
  o=$(ours "mb$mb.graph_opt" "${b[@]}" --cuda-graph-impl full_iteration --cuda-graph-include-optimizer)
  t=$(theirs "mb$mb.torch" --micro-batch-size "$mb")
  r=$(theirs "mb$mb.torch_ro" --micro-batch-size "$mb" --compile-mode reduce-overhead)
  echo "| $mb | $e | $l | $g | $o | $t | $r |" | tee -a "$OUT/cuda_graphs.md"
done
# MOE=1: also the one-GPU MoE configuration of bench/compare.sh (moe_small, micro-batch 8) with the
# sync-free grouped GEMM, eager vs full-iteration graph (ours only).
if [ "${MOE:-0}" = 1 ]; then
  moe=(--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
       --disable-bias-linear --group-query-attention --num-layers 12 --hidden-size 1024 --num-attention-heads 16
       --num-query-groups 8 --ffn-hidden-size 3584 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 3584
       --moe-aux-loss-coeff 1e-2 --micro-batch-size 8 --global-batch-size 8)
  echo "| MoE config | ours eager (per-expert cuBLASLt): step / host ms | ours eager grouped GEMM | ours graph grouped GEMM, whole step |" | tee -a "$OUT/cuda_graphs.md"
  echo "|---|---|---|---|" | tee -a "$OUT/cuda_graphs.md"
  e=$(ours moe.eager "${moe[@]}")
  g=$(ours moe.grouped "${moe[@]}" --moe-grouped-gemm)
  o=$(ours moe.graph "${moe[@]}" --moe-grouped-gemm --cuda-graph-impl full_iteration --cuda-graph-include-optimizer)
  echo "| moe_small mb8 | $e | $g | $o |" | tee -a "$OUT/cuda_graphs.md"
  # The alltoall dispatcher (EP 1 on one GPU): dropless (split sizes read on the host) against the
  # static receive blocks at 1.25x the balanced load (8·1024·2 slots), eager and in the graph.
  a2a=(--moe-grouped-gemm --moe-token-dispatcher-type alltoall)
  cap=(--moe-received-token-capacity 20480)
  echo "| alltoall, moe_small mb8 | dropless eager | static blocks eager | static blocks graph, whole step |" | tee -a "$OUT/cuda_graphs.md"
  echo "|---|---|---|---|" | tee -a "$OUT/cuda_graphs.md"
  d=$(ours moe.a2a "${moe[@]}" "${a2a[@]}")
  se=$(ours moe.a2a_static "${moe[@]}" "${a2a[@]}" "${cap[@]}")
  sg=$(ours moe.a2a_static_graph "${moe[@]}" "${a2a[@]}" "${cap[@]}" --cuda-graph-impl full_iteration --cuda-graph-include-optimizer)
  echo "| EP 1 | $d | $se | $sg |" | tee -a "$OUT/cuda_graphs.md"
fi
