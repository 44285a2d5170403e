#!/usr/bin/env bash
# Multi-GPU device session: build, CUDA tests, NCCL tests, collective bandwidth, GPT-2 124M
# data-parallel scaling, tensor-parallel bf16 runs. Logs under $OUT. Usage: bench/gpu_dist_session.sh NGPU [steps...]
# MT_BUILD_DIR=dir: use the binaries (and CTestTestfile.cmake) already in dir instead of building
# here; a CUDA build made on a Debian 12 development machine runs on the GPU machines.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=$1; shift
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
B=${MT_BUILD_DIR:-build}
t0=$(date +%s)
if [ -z "${MT_BUILD_DIR:-}" ]; then
  cmake --preset default > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build build -j "$(nproc)" > "$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
bin=$B/megatron; data=data
# ms/iter of a run: the mean of its log windows ending at the iterations matching $2 (default
# 30..80 by tens).
msit() { grep -E "iteration +(${2:-[3-8]0})/" "$1" | sed -E 's/.*elapsed time per iteration \(ms\): ([0-9.]+).*/\1/' | awk '{s+=$1;n++} END {if(n) printf "%.2f", s/n; else print "NA"}'; }
# runv VARIANT MB GBS LOG [args...]: one run of a DPREP_V-style variant "N|flags|VAR=value ..."
# (sets n, flags, envs) with micro-batch MB and global batch GBS (0: MB·N), output in
# $OUT/run.log, also appended to $OUT/LOG. errs: the run's first error line.
runv() {
  local v=$1 mb=$2 gb=$3 log=$4; shift 4
  IFS='|' read -r n flags envs <<< "$v"
  [ "$gb" != 0 ] || gb=$((mb*n))
  env $envs $bin pretrain "${gpt2[@]}" --micro-batch-size $mb --global-batch-size $gb --nproc-per-node $n $flags "$@" \
    > "$OUT/run.log" 2>&1
  cat "$OUT/run.log" >> "$OUT/$log"
}
errs() { grep -E "rror" "$OUT/run.log" | head -1 | cut -c1-200; }
gpt2=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
      --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --hidden-dropout 0
      --attention-dropout 0 --bf16 --device cuda --no-progress --data-path $data/demo_text_document --split 98,2,0
      --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --eval-iters 0 --log-interval 10)
for step in "$@"; do
  case $step in
    tests)
      (cd "$B" && ctest -L cuda -V -j 1 --timeout 180 2>&1) | tee "$OUT/ctest_cuda.log" | grep -E "tests passed|\*\*\*|FAILED  \]|^[0-9]+: \[(tp|dp)|Failure" ;;
    nccl)
      mpiexec --allow-run-as-root -np $N $B/nccl_cuda_dist_test 2>&1 | tee "$OUT/nccl_test.log" | grep -E "PASSED|FAILED|Failure" | sort | uniq -c
      timeout 120 $B/nccl_failure_cuda_test 2>&1 | tee "$OUT/nccl_failure.log" | grep -E "PASSED|FAILED|Failure" ;;
    bench)
      mpiexec --allow-run-as-root -np $N $B/comm_bench --max-mib 512 --iters 20 2>&1 | tee "$OUT/comm_bench.log" | grep -E "op|512|gradient|unavailable" ;;
    dp)
      for n in 1 2 4; do
        [ $n -le $N ] || continue
        for ov in "" "--overlap-grad-reduce"; do
          [ $n -gt 1 ] || [ -z "$ov" ] || continue
          tag=dp$n${ov:+_overlap}
          $bin pretrain "${gpt2[@]}" --micro-batch-size 16 --global-batch-size $((16*n)) --train-iters 40 --nproc-per-node $n $ov 2>&1 \
            | tee "$OUT/$tag.log" | grep -E "iteration +40/" | sed "s/^/$tag: /" | cut -c1-260
        done
      done ;;
    dpx)
      # Overlap experiments at DP 4: smaller buckets; fewer NCCL channels (less SM contention).
      for v in "--ddp-bucket-size 10000000|" "--ddp-bucket-size 40000000|NCCL_MAX_NCHANNELS=8" "|NCCL_MAX_NCHANNELS=8"; do
        flags=${v%%|*}; envs=${v#*|}
        ov=--overlap-grad-reduce; [ -n "$flags" ] || ov=""
        env $envs $bin pretrain "${gpt2[@]}" --micro-batch-size 16 --global-batch-size 64 --train-iters 40 --nproc-per-node 4 $ov $flags 2>&1 \
          | tee "$OUT/dpx.log" | grep -E "iteration +40/" | sed "s/^/dp4 [$flags $envs]: /" | cut -c1-200
      done ;;
    dpce)
      # DP scaling with NCCL vs copy-engine collectives (--ddp-copy-engine). ms/iter = mean of the
      # log lines at iterations 30..80 (10-iteration windows), 1-GPU baseline run before and after.
      for mb in ${DPCE_MB:-32 16}; do
        for v in "1|" "4|" "4|--use-distributed-optimizer" "4|--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
                 "4|--ddp-copy-engine" "4|--ddp-copy-engine --overlap-grad-reduce" "4|--ddp-copy-engine --use-distributed-optimizer" \
                 "4|--ddp-copy-engine --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
                 "4|--ddp-copy-engine --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 10000000" "1|"; do
          n=${v%%|*}; flags=${v#*|}
          [ $n -le $N ] || continue
          tag=dpce_mb${mb}_n$n$(echo "$flags" | sed 's/--//g; s/ /_/g')
          $bin pretrain "${gpt2[@]}" --micro-batch-size $mb --global-batch-size $((mb*n)) --train-iters 80 --nproc-per-node $n $flags \
            > "$OUT/run.log" 2>&1
          echo "mb$mb n$n [$flags]: $(msit "$OUT/run.log") ms/iter; $(grep -E "data-parallel collectives|rror" "$OUT/run.log" | head -2 | cut -c1-200)"
          cat "$OUT/run.log" >> "$OUT/dpce_all.log"
        done
      done ;;
    dprep)
      # Repeated, interleaved: the one-GPU baseline and the best DP layouts, DPREP_REPS rounds.
      # DPREP_V overrides the variants: entries "N|flags" or "N|flags|VAR=value ..." separated by ';'.
      ov="--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 10000000"
      IFS=';' read -r -a variants <<< "${DPREP_V:-1|;4|--use-distributed-optimizer;4|--use-distributed-optimizer $ov;4|--ddp-copy-engine --use-distributed-optimizer $ov;4|--use-distributed-optimizer --grad-reduce-in-bf16;4|--use-distributed-optimizer --grad-reduce-in-bf16 $ov;4|--ddp-copy-engine --use-distributed-optimizer --grad-reduce-in-bf16 $ov}"
      for mb in ${DPCE_MB:-32 16}; do
        for rep in $(seq ${DPREP_REPS:-3}); do
          for v in "${variants[@]}"; do
            runv "$v" $mb 0 dprep_all.log --train-iters 80
            echo "rep$rep mb$mb n$n [$flags] $envs: $(msit "$OUT/run.log") ms/iter $(errs)"
          done
        done
      done ;;
    gbs)
      # Strong scaling at a fixed global batch (GBS, default 512 sequences = 0.5M tokens, llm.c's
      # GPT-2 124M batch): micro-batch 32, so 16 / 8 / 4 micro-batches per step on 1 / 2 / 4 GPUs.
      # 24 iterations, ms/iter = mean of the 4-iteration log windows at 12..24. DPREP_REPS rounds.
      gbs=${GBS:-512}; ov="--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 10000000"
      IFS=';' read -r -a variants <<< "${DPREP_V:-1|;2|--use-distributed-optimizer;4|--use-distributed-optimizer;4|--ddp-copy-engine --use-distributed-optimizer $ov}"
      for rep in $(seq ${DPREP_REPS:-2}); do
        for v in "${variants[@]}"; do
          runv "$v" 32 $gbs gbs_all.log --train-iters 24 --log-interval 4
          echo "rep$rep gbs$gbs n$n [$flags] $envs: $(msit "$OUT/run.log" "12|16|20|24") ms/iter $(errs)"
        done
      done ;;
    timers)
      # Where a DP step's time goes: --timing-log-level 1 per rank (--timing-log-option all) for the
      # variants of DPREP_V (same syntax as dprep, plus an optional third field of environment
      # assignments: "N|flags|VAR=1"), micro-batch 32, report of iterations 41..80.
      ov="--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 10000000"
      IFS=';' read -r -a variants <<< "${DPREP_V:-1|;4|--use-distributed-optimizer;4|--ddp-copy-engine --use-distributed-optimizer $ov}"
      for v in "${variants[@]}"; do
        runv "$v" 32 0 timers_all.log --train-iters 80 --log-interval 40 --timing-log-level 1 --timing-log-option all
        echo "== n$n [$flags] $envs: $(grep -E "iteration +80/" "$OUT/run.log" | sed -E 's/.*elapsed time per iteration \(ms\): ([0-9.]+).*/\1/') ms/iter"
        awk '/iteration +80\//{f=1;next} f&&/^ \[|^---/{exit} f' "$OUT/run.log" | awk '/:$/{printf "\n%s", $1; next} /rank/{printf " %s", $3} END{print ""}'
        echo
      done ;;
    solo4)
      # The slowest-GPU ceiling: one-GPU runs (micro-batch 32) on each GPU in turn, then N of them at
      # once; ms/iter each, with the SM clock, power and throttle reasons sampled by nvidia-smi.
      nvidia-smi --query-gpu=index,clocks.max.sm,power.limit,temperature.gpu --format=csv,noheader
      R=clocks_event_reasons.active; nvidia-smi --query-gpu=$R --format=csv > /dev/null 2>&1 || R=clocks_throttle_reasons.active
      smi() { nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu,$R --format=csv,noheader,nounits -lms 500 > "$OUT/smi_$1.csv" 2>&1 & smipid=$!; }
      smisum() { kill $smipid 2>/dev/null; wait $smipid 2>/dev/null
        awk -F', *' '$3+0>300 {n[$1]++; c[$1]+=$2; p[$1]+=$3; t[$1]=$4; r[$1]=$5} END {for (g in n) printf "  GPU %s: SM %.0f MHz, %.0f W, %s C, reasons %s (%d busy samples)\n", g, c[g]/n[g], p[g]/n[g], t[g], r[g], n[g]}' "$OUT/smi_$1.csv" | sort; }
      for g in $(seq 0 $((N-1))); do
        smi seq$g
        CUDA_VISIBLE_DEVICES=$g $bin pretrain "${gpt2[@]}" --micro-batch-size 32 --global-batch-size 32 --train-iters 80 > "$OUT/seq$g.log" 2>&1
        echo "GPU $g alone: $(msit "$OUT/seq$g.log") ms/iter"; smisum seq$g | grep "GPU $g:"
      done
      smi all
      for g in $(seq 0 $((N-1))); do
        CUDA_VISIBLE_DEVICES=$g $bin pretrain "${gpt2[@]}" --micro-batch-size 32 --global-batch-size 32 --train-iters 80 > "$OUT/solo$g.log" 2>&1 &
      done
      wait $(jobs -p | grep -v "^$smipid$")
      for g in $(seq 0 $((N-1))); do echo "GPU $g, $N at once: $(msit "$OUT/solo$g.log") ms/iter"; done
      smisum all ;;
    jitter)
      # Step-to-step spread: --log-interval 1 runs (80 iterations; per-iteration ms in the logs):
      # each GPU alone in turn, N at once, and the DP variants of DPREP_V (default NCCL, no overlap).
      for g in $(seq 0 $((N-1))); do
        CUDA_VISIBLE_DEVICES=$g $bin pretrain "${gpt2[@]}" --micro-batch-size 32 --global-batch-size 32 --train-iters 80 \
          --log-interval 1 > "$OUT/jit_seq$g.log" 2>&1
      done
      for g in $(seq 0 $((N-1))); do
        CUDA_VISIBLE_DEVICES=$g $bin pretrain "${gpt2[@]}" --micro-batch-size 32 --global-batch-size 32 --train-iters 80 \
          --log-interval 1 > "$OUT/jit_all$g.log" 2>&1 &
      done
      wait
      i=0; IFS=';' read -r -a variants <<< "${DPREP_V:-$N|--use-distributed-optimizer}"
      for v in "${variants[@]}"; do
        runv "$v" 32 0 jit_dp$i.log --train-iters 80 --log-interval 1
        echo "jit_dp$i: n$n [$flags] $envs"; i=$((i+1))
      done
      for f in "$OUT"/jit_*.log; do
        grep -E "iteration +[0-9]+/" "$f" | sed -E 's/.*iteration +([0-9]+)\/.*elapsed time per iteration \(ms\): ([0-9.]+).*/\1 \2/' \
          | awk -v f="$(basename "$f")" '$1>20 {s+=$2; q+=$2*$2; n++} END {m=s/n; printf "%s: mean %.2f sd %.2f ms (n %d)\n", f, m, sqrt(q/n-m*m), n}'
      done ;;
    layouts)
      mpiexec --allow-run-as-root -np 2 $B/grad_sync_np2_cuda_dist_test 2>&1 | tee "$OUT/grad_sync_np2.log" | grep -E "^\[|PASSED|FAILED|Failure" | head -20
      mpiexec --allow-run-as-root -np 4 $B/parallel_layouts_cuda_dist_test 2>&1 | tee "$OUT/layouts_np4.log" | grep -E "^\[|PASSED|FAILED|Failure|Expected|actual" | head -60 ;;
    np2)
      mpiexec --allow-run-as-root -np 2 $B/parallel_layouts_cuda_dist_test 2>&1 | tee "$OUT/layouts_np2.log" | grep -E "^\[|PASSED|FAILED|Failure" | head -40 ;;
    tp)
      for t in 1 2; do
        $bin pretrain "${gpt2[@]}" --micro-batch-size 8 --global-batch-size 8 --train-iters 30 --nproc-per-node $t \
          --tensor-model-parallel-size $t --make-vocab-size-divisible-by 64 --log-interval 5 2>&1 | tee "$OUT/tp$t.log" \
          | grep -E "iteration +(5|30)/" | sed "s/^/tp$t: /" | cut -c1-300
      done
      $bin pretrain "${gpt2[@]}" --micro-batch-size 8 --global-batch-size 8 --train-iters 30 --nproc-per-node 2 \
          --tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 64 --log-interval 5 2>&1 \
          | tee "$OUT/tp2sp.log" | grep -E "iteration +(5|30)/" | sed "s/^/tp2sp: /" | cut -c1-300 ;;
    big)
      big=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
           --lr 2e-4 --lr-warmup-iters 2 --bf16 --device cuda --no-progress --data-path $data/demo_text_document
           --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --eval-iters 0 --log-interval 10
           --hidden-dropout 0 --attention-dropout 0 --train-iters 20)
      for t in 2 4; do
        [ $t -le $N ] || continue
        $bin pretrain "${big[@]}" --micro-batch-size 8 --global-batch-size $((8*N/t)) --nproc-per-node $N \
          --tensor-model-parallel-size $t --sequence-parallel 2>&1 | tee "$OUT/big_tp$t.log" | grep -E "iteration +20/|memory|error" | sed "s/^/1.3B tp$t: /" | cut -c1-300
      done ;;
    ppbench)
      # Pipeline bubble, ~7B layer shape (h 4096, 32 heads, s 2048), 32 layers over N stages.
      mpiexec --allow-run-as-root -np $N $B/pipeline_bench --pp $N --num-layers 32 --hidden-size 4096 \
        --num-attention-heads 32 --seq-length 2048 --microbatches 4,8,16 --vpp 1,2 --iters 3 2>&1 \
        | tee "$OUT/pipeline_bench.log" | grep -E "^pp|error" ;;
    7b)
      # ~7B GPT (32 layers, h 4096, 32 heads, seq 2048, GPT-2 vocabulary): TP, PP and combinations.
      b7=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048
          --lr 1e-4 --lr-warmup-iters 2 --bf16 --device cuda --no-progress --data-path $data/demo_text_document
          --vocab-file $data/gpt2/encoder.json --merge-file $data/gpt2/vocab.bpe --eval-iters 0 --log-interval 5
          --hidden-dropout 0 --attention-dropout 0 --train-iters 10 --micro-batch-size 1 --global-batch-size 16
          --nproc-per-node $N --use-distributed-optimizer)
      for lay in "--tensor-model-parallel-size 4 --sequence-parallel" \
                 "--tensor-model-parallel-size 2 --sequence-parallel" \
                 "--pipeline-model-parallel-size 4" \
                 "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4" \
                 "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2" \
                 "--pipeline-model-parallel-size 2"; do
        name=$(echo "$lay" | sed 's/--tensor-model-parallel-size /tp/; s/--pipeline-model-parallel-size /pp/; s/--num-layers-per-virtual-pipeline-stage /lpv/; s/--sequence-parallel/sp/g; s/ //g')
        $bin pretrain "${b7[@]}" $lay 2>&1 | tee "$OUT/7b_$name.log" | grep -E "iteration +10/|memory per rank|pipeline:|error|out of memory" \
          | sed "s/^/7B $name: /" | cut -c1-420
      done ;;
  esac
done
echo "total: $(( $(date +%s) - t0 )) s"
