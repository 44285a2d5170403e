#!/usr/bin/env bash
# Per-kernel GPU time of one training step (Nsight Compute, gpu__time_duration.sum; kernels
# serialised by the profiler): runs `build/megatron pretrain ARGS --train-iters 3` under ncu and
# prints the kernels of the last iteration (between the last two AdamW launches; else the last
# third of the kernels) summed by kernel name, with the total and the GEMM share.
# usage: [TOP=N] [CACHE=all|none] bench/kernel_profile.sh ARGS...   (N kernel names, default 14;
# CACHE: ncu's --cache-control, default all = caches flushed before each kernel; none = kept, as in
# a real step (GPT-2 124M mb16 on an H100, 2026-11-25: 30.39 vs 30.41 ms, no difference); logs under $OUT)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); [ -n "$NCU" ] || NCU=$(command -v ncu)
timeout 400 "$NCU" --clock-control none --cache-control "${CACHE:-all}" --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  build/megatron pretrain "$@" --train-iters 3 > "$OUT/ncu_run.log" 2>&1 || { tail -3 "$OUT/ncu_run.log"; exit 1; }
python3 - "$OUT/ncu.csv" "${TOP:-14}" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
head, data = None, []
for r in rows:
    if 'Kernel Name' in r:
        head = r
        continue
    if head and len(r) == len(head):
        data.append(dict(zip(head, r)))
scale = {'ns': 1e-6, 'nsecond': 1e-6, 'us': 1e-3, 'usecond': 1e-3, 'ms': 1.0, 'msecond': 1.0}
agg = collections.defaultdict(lambda: [0, 0.0])
# one iteration: the kernels after the second-to-last AdamW launch up to the last one (else the
# last third of the kernels, about one iteration)
opt = [i for i, d in enumerate(data) if 'adamw' in d['Kernel Name']]
window = data[opt[-2] + 1:opt[-1] + 1] if len(opt) >= 2 else data[2 * len(data) // 3:]
for d in window:
    v = float(d['Metric Value'].replace(',', '')) * scale.get(d.get('Metric Unit', 'ns'), 1e-6)
    agg[d['Kernel Name'][:80]][0] += 1
    agg[d['Kernel Name'][:80]][1] += v
total = sum(t for _, t in agg.values())
gemm = sum(t for k, (_, t) in agg.items() if 'nvjet' in k or 'gemm' in k.lower() or 'tc_kernel' in k)
print(f"kernels {len(data)}; {'one iteration' if len(opt) >= 2 else 'last third'}: {total:.2f} ms, GEMMs {gemm:.2f} ms")
for k, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 14]:
    print(f"{t:8.2f} ms {c:5d}  {k}")
PY
