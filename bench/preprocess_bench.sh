#!/usr/bin/env bash
# preprocess-data throughput on the demo corpus (12 MB of English text, GPT-2 BPE) with 1 and
# all workers; prints MB/s and MB/s per core. Usage: bench/preprocess_bench.sh [build dir] [data dir]
set -euo pipefail
bin=${1:-build}/megatron; data=${2:-data}; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for w in 1 $(nproc); do
  line=$($bin preprocess-data --input "$data/moby-dick/data.txt" "$data/sotu" --output-prefix "$tmp/p$w" \
    --vocab-file "$data/gpt2/encoder.json" --merge-file "$data/gpt2/vocab.bpe" --append-eod --workers $w 2>&1 | tail -1)
  mbs=$(echo "$line" | sed -E 's/.*, ([0-9.]+) MB\/s.*/\1/')
  echo "workers $w: $line | per core: $(echo "$mbs / $w" | bc -l | cut -c1-5) MB/s"
done
