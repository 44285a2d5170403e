#!/usr/bin/env bash
# End to end: `megatron serve` on a tiny CPU checkpoint (NullTokenizer: prompts are token ids),
# driven by curl. Megatron's PUT /api and OpenAI's POST /v1/completions give the continuation of
# `megatron generate --greedy`; 8 concurrent clients with different prompts each get their own
# answer (the same as when asked alone); malformed JSON, missing/ill-typed fields, bad sampling
# values, a prompt longer than the context and a body over --max-request-bytes get HTTP 400 with a
# message; the server still answers afterwards.
# Usage: serve_test.sh <megatron binary> <work dir>
set -euo pipefail
BIN=$1
WORK=$2
command -v curl >/dev/null || { echo "curl is required"; exit 1; }
"$BIN" --help | grep -q "serve" || { echo "megatron was built without cpp-httplib: no serve subcommand"; exit 1; }
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$WORK"
"$BIN" pretrain --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 --hidden-size 32 \
  --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 \
  --train-iters 2 --lr 1e-3 --device cpu --save ckpt --save-interval 2 --eval-iters 0 > pretrain.log 2>&1 \
  || { cat pretrain.log; exit 1; }

"$BIN" serve --load ckpt --tokenizer-type NullTokenizer --device cpu --port 0 --port-file port \
  --micro-batch-size 2 --max-request-bytes 4096 > serve.log 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do [ -s port ] && break; kill -0 $PID || { cat serve.log; exit 1; }; sleep 0.1; done
PORT=$(cat port)
URL=http://127.0.0.1:$PORT
fail() { echo "FAIL: $*"; cat serve.log; exit 1; }

# status code and body of a request: req METHOD PATH BODY -> "<code> <body>"
req() { curl -s -o body.$$ -w "%{http_code}" -X "$1" -H "Content-Type: application/json" --data-binary "$3" "$URL$2"; echo -n " "; cat body.$$; }

# The reference continuation of each prompt from `megatron generate --greedy` (prompt ids + 6 new),
# generated once per prompt (P1 and the concurrent clients' PROMPTS).
P1="5 9 2"
declare -a PROMPTS=("1 2 3" "7" "40 41 42 43 44" "9 9" "13 31" "60 1 60" "2 4 8 16" "33")
declare -A EXPECTED=()
for p in "$P1" "${PROMPTS[@]}"; do
  EXPECTED[$p]=$("$BIN" generate --load ckpt --tokenizer-type NullTokenizer --device cpu --greedy \
    --out-seq-length 6 --prompt "$p" 2>/dev/null | sed -n 2p)
  [ -n "${EXPECTED[$p]}" ] || { echo "FAIL: megatron generate gave nothing for '$p'"; exit 1; }
done
expected() { echo "${EXPECTED[$1]}"; }
# The interpreter behind `python3` itself: a version manager's shim (pyenv) costs ~1 CPU second per
# start, and the test starts ~45.
PY=$(python3 -c 'import sys; print(sys.executable)')
python_field() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

E1=$(expected "$P1")
out=$(req PUT /api "{\"prompts\": [\"$P1\"], \"tokens_to_generate\": 6, \"top_k\": 1}")
[ "${out%% *}" = 200 ] || fail "PUT /api: $out"
got=$(echo "${out#* }" | python_field 'd["text"][0]')
[ "$got" = "$E1" ] || fail "PUT /api text '$got' != generate '$E1'"
nseg=$(echo "${out#* }" | python_field 'len(d["segments"][0])')
[ "$nseg" -ge 4 ] || fail "segments: $out"

out=$(req POST /v1/completions "{\"prompt\": \"$P1\", \"max_tokens\": 6, \"temperature\": 0}")
[ "${out%% *}" = 200 ] || fail "POST /v1/completions: $out"
got=$(echo "${out#* }" | python_field 'd["choices"][0]["text"]')
[ "$P1$got" = "$E1" ] || [ "$P1 $got" = "$E1" ] || fail "completion '$got' does not continue '$P1' as '$E1'"
echo "${out#* }" | python_field 'd["object"], d["usage"]["prompt_tokens"]' | grep -q "text_completion 3" \
  || fail "completion fields: $out"

# Concurrent clients, each with its own prompt: every answer equals the prompt's own continuation.
pids=()
for i in "${!PROMPTS[@]}"; do
  ( curl -s -X PUT -H "Content-Type: application/json" \
      --data "{\"prompts\": [\"${PROMPTS[$i]}\"], \"tokens_to_generate\": 6, \"top_k\": 1}" "$URL/api" > conc.$i ) &
  pids+=($!)
done
wait "${pids[@]}"
for i in "${!PROMPTS[@]}"; do
  got=$(python_field 'd["text"][0]' < conc.$i) || fail "concurrent client $i: $(cat conc.$i)"
  want=$(expected "${PROMPTS[$i]}")
  [ "$got" = "$want" ] || fail "concurrent client $i: '$got' != '$want'"
done

# Bad requests: 400 with a message, never a crash.
check400() {
  out=$(req "$1" "$2" "$3")
  [ "${out%% *}" = 400 ] || fail "expected 400 for $3: $out"
  echo "${out#* }" | python_field 'd["error"]' > /dev/null || fail "no error message for $3: $out"
}
check400 PUT /api '{"prompts": ["1 2"'
check400 PUT /api 'not json'
check400 PUT /api '{"tokens_to_generate": 4}'
check400 PUT /api '{"prompts": "1 2", "tokens_to_generate": "many"}'
check400 PUT /api '{"prompts": [], "tokens_to_generate": 4}'
check400 PUT /api '{"prompts": [3], "tokens_to_generate": 4}'
check400 PUT /api '{"prompts": ["1"], "tokens_to_generate": -1}'
check400 PUT /api '{"prompts": ["1"], "temperature": -2}'
check400 PUT /api '{"prompts": ["1"], "top_k": 5, "top_p": 0.5}'
check400 PUT /api '{"prompts": ["1 99"]}'
check400 PUT /api "{\"prompts\": [\"$(seq -s ' ' 1 40 | sed 's/[0-9]\+/1/g')\"]}"
check400 POST /v1/completions '{"max_tokens": 3}'
check400 POST /v1/completions '[1, 2]'
big=$(head -c 6000 /dev/zero | tr '\0' '1' | sed 's/1/1 /g')
check400 PUT /api "{\"prompts\": [\"$big\"]}"
# Still serving.
out=$(req PUT /api "{\"prompts\": [\"$P1\"], \"tokens_to_generate\": 6, \"top_k\": 1}")
[ "${out%% *}" = 200 ] || fail "after bad requests: $out"
kill -0 $PID || fail "the server died"
kill $PID; wait $PID 2>/dev/null || true

# Tensor and pipeline parallel servers (2 CPU ranks under mpiexec): rank 0 serves HTTP and
# broadcasts each generation; the answers equal the one-rank continuations, also for a request of
# more prompts than --micro-batch-size (several broadcast jobs) and for concurrent clients.
if command -v mpiexec > /dev/null; then
  for layout in "--tensor-model-parallel-size 2" "--pipeline-model-parallel-size 2"; do
    rm -f port
    "$BIN" serve --load ckpt --tokenizer-type NullTokenizer --device cpu --port 0 --port-file port \
      --micro-batch-size 2 --nproc-per-node 2 $layout > serve_mp.log 2>&1 &
    PID=$!
    for _ in $(seq 1 300); do [ -s port ] && break; kill -0 $PID || { cat serve_mp.log; exit 1; }; sleep 0.1; done
    [ -s port ] || fail "$layout: the server did not start"
    URL=http://127.0.0.1:$(cat port)
    grep -q "with 2 ranks" serve_mp.log || fail "$layout: $(cat serve_mp.log)"
    MP=("${PROMPTS[0]}" "${PROMPTS[2]}" "$P1")
    out=$(req PUT /api "{\"prompts\": [\"${MP[0]}\", \"${MP[1]}\", \"${MP[2]}\"], \"tokens_to_generate\": 6, \"top_k\": 1}")
    [ "${out%% *}" = 200 ] || fail "$layout: $out"
    for k in 0 1 2; do
      got=$(echo "${out#* }" | python_field "d['text'][$k]")
      want=$(expected "${MP[$k]}")
      [ "$got" = "$want" ] || fail "$layout: prompt $k '$got' != '$want'"
    done
    pids=()
    for i in 1 3 5 7; do
      ( curl -s -X PUT -H "Content-Type: application/json" \
          --data "{\"prompts\": [\"${PROMPTS[$i]}\"], \"tokens_to_generate\": 6, \"top_k\": 1}" "$URL/api" > mp.$i ) &
      pids+=($!)
    done
    wait "${pids[@]}"
    for i in 1 3 5 7; do
      got=$(python_field 'd["text"][0]' < mp.$i) || fail "$layout client $i: $(cat mp.$i)"
      [ "$got" = "$(expected "${PROMPTS[$i]}")" ] || fail "$layout client $i: '$got'"
    done
    check400 PUT /api '{"prompts": []}'
    kill $PID; wait $PID 2>/dev/null || true
  done
else
  echo "serve_test: mpiexec not found: the tensor / pipeline parallel server was not tested"
fi
echo "serve_test: OK"
