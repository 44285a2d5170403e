#!/usr/bin/env bash
# `megatron serve` and `megatron generate` as users and hostile clients use them (issue 37), on a
# tiny random CPU model with a 257-token byte-level BPE vocabulary, so that sampled tokens split and
# break UTF-8 characters all the time (client side: serve_probe.py):
#   * UTF-8 prompts (emoji, Japanese, Cyrillic) through PUT /api and POST /v1/completions: HTTP 200,
#     the text starts with the prompt, segments concatenate to the text; raw invalid bytes in a
#     prompt -> 400 naming the field; fields of the wrong type or range -> 400 naming the value as
#     given; n, echo, stop implemented; unsupported options refused;
#   * a seeded sampling sweep of 300 requests: all 200 with valid UTF-8 JSON;
#   * `megatron generate` with sampling prints valid UTF-8; the largest --out-seq-length and
#     tokens_to_generate generate up to the context;
#   * 128 idle and 16 half-sent connections beside a real request: answered within the read
#     timeout, and the server closes the stalled connections itself;
#   * --max-queued-requests 1: requests beside a running generation get 503 with Retry-After; bad
#     values of the server's flags are refused with their names.
# Usage: serve_robustness_test.sh <megatron binary> <work dir>
set -euo pipefail
BIN=$1
WORK=$2
HERE=$(cd "$(dirname "$0")" && pwd)
command -v python3 >/dev/null || { echo "python3 is required"; exit 1; }
# The interpreter behind `python3` itself (a version manager's shim costs ~1 CPU second per start).
PROBE="$(python3 -c 'import sys; print(sys.executable)') $HERE/serve_probe.py"
"$BIN" --help | grep -q "serve" || { echo "megatron was built without cpp-httplib: no serve subcommand"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$WORK"
$PROBE vocab .
TOK="--vocab-file vocab.json --merge-file merges.txt"
"$BIN" pretrain --mock-data $TOK --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 64 \
  --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --train-iters 1 --lr 1e-3 --device cpu \
  --save ckpt --save-interval 1 --eval-iters 0 > pretrain.log 2>&1 || { cat pretrain.log; exit 1; }

# `megatron generate`: sampled continuations of UTF-8 prompts print as valid UTF-8.
"$BIN" generate --load ckpt $TOK --device cpu --out-seq-length 40 --num-samples 8 --temperature 1.5 --seed 5 \
  --prompt "日本語" --prompt "Привет 😀" > generate.out 2> generate.log || { cat generate.log; exit 1; }
$PROBE stdout-utf8 generate.out
# The largest --out-seq-length generates up to the context (it overflowed and crashed before).
"$BIN" generate --load ckpt $TOK --device cpu --out-seq-length 9223372036854775807 --greedy --prompt "ab" \
  > generate_max.out 2> generate_max.log || { echo "FAIL: --out-seq-length 2^63-1"; cat generate_max.log; exit 1; }
grep -q "generated 62 tokens" generate_max.log || { echo "FAIL: --out-seq-length 2^63-1"; cat generate_max.log; exit 1; }

PID=
start_server() {  # start_server LOG FLAGS...
  local log=$1
  shift
  rm -f port
  "$BIN" serve --load ckpt $TOK --device cpu --port 0 --port-file port "$@" > "$log" 2>&1 &
  PID=$!
  for _ in $(seq 1 300); do [ -s port ] && break; kill -0 $PID || { cat "$log"; exit 1; }; sleep 0.1; done
  [ -s port ] || { echo "FAIL: the server did not start"; cat "$log"; exit 1; }
  URL=http://127.0.0.1:$(cat port)
}
stop_server() {
  kill -0 $PID || { echo "FAIL: the server died"; cat "$1"; exit 1; }
  kill $PID
  wait $PID 2>/dev/null || true
  PID=
}
trap '[ -n "$PID" ] && kill $PID 2>/dev/null || true' EXIT

# Bad server flags: refused before anything is loaded, naming the flag and the value.
bad_flag() {  # bad_flag EXPECTED FLAGS...
  local want=$1
  shift
  if "$BIN" serve --load ckpt $TOK --device cpu --port 0 "$@" > bad_flag.log 2>&1; then
    echo "FAIL: serve $* was accepted"; exit 1
  fi
  grep -q -- "$want" bad_flag.log || { echo "FAIL: serve $*: no '$want' in:"; cat bad_flag.log; exit 1; }
}
bad_flag "--max-queued-requests 300 must be smaller than --http-threads 256" --max-queued-requests 300
bad_flag "--http-timeout" --http-timeout 0
bad_flag "--http-threads" --http-threads 1

TIMEOUT=2
start_server serve.log --micro-batch-size 4 --http-timeout $TIMEOUT
# The last step checks the server still serves after the load.
$PROBE "$URL" utf8 sweep=300 load=$TIMEOUT utf8 || { cat serve.log; exit 1; }
stop_server serve.log

start_server serve_busy.log --micro-batch-size 1 --max-queued-requests 1 --http-threads 8
$PROBE "$URL" busy || { cat serve_busy.log; exit 1; }
stop_server serve_busy.log
echo "serve_robustness_test: OK"
