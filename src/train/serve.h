// `megatron serve`: a text-generation server over HTTP (cpp-httplib):
//   * PUT /api — Megatron-LM's text-generation server (megatron/inference/text_generation_server.py):
//     {"prompts": [...], "tokens_to_generate": 64, "temperature": 1.0, "top_k": 0, "top_p": 0.0,
//      "random_seed": ...} -> {"text": [prompt + continuation, ...], "segments": [[text per
//      token], ...], "logprobs": null};
//   * POST /v1/completions — OpenAI-compatible: {"prompt": str | [str], "max_tokens": 16, "n": 1,
//     "temperature": 1.0 (0 = greedy), "top_p": 1.0, "top_k"?: 0, "seed"?, "echo"?, "stop"?} ->
//     {"id", "object": "text_completion", "created", "model", "choices": [{"text", "index",
//     "logprobs": null, "finish_reason": "stop" | "length"}], "usage": {...}}.
// Fields are validated as train/serve_request.h describes; text is valid UTF-8 by construction
// (data/detokenizer.h). Requests are queued (one generation at a time; a request's prompts form
// batches of --micro-batch-size); at most --max-queued-requests generate or wait, the next get HTTP
// 503 with Retry-After. Connections are served by --http-threads threads with httplib's read / write
// timeouts (--http-timeout) and keep-alive limits, so idle and slow clients cannot hold the server.
// Under tensor / pipeline parallelism (--nproc-per-node with --tensor-model-parallel-size /
// --pipeline-model-parallel-size) rank 0 serves HTTP and broadcasts each generation to the other
// ranks, which generate with it (Megatron's server does the same). A bad request gets HTTP 400 and
// {"error": message}; nothing a client sends stops the server. docs/evaluation.md states the
// guarantees.
#pragma once
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "data/tokenizer.h"

namespace mt {

struct ServeArgs {
  std::string load;
  std::string vocab_file, merge_file, tokenizer_type = "HuggingFaceTokenizer", tokenizer_model;
  data::TikTokenOptions tiktoken;  ///< --tiktoken-pattern, ... (TikTokenizer; add_tiktoken_options)
  std::string host = "127.0.0.1";  ///< --host
  int port = 5000;                 ///< --port (Megatron's default); 0 = any free port
  std::string port_file;           ///< --port-file: write the bound port there once listening
  int64_t micro_batch_size = 4;    ///< --micro-batch-size: prompts generated together
  int64_t seq_length = 0;          ///< --seq-length (0 = the checkpoint's)
  int64_t max_prompts = 128;       ///< --max-prompts per request (Megatron: 128)
  size_t max_request_bytes = 1 << 20;  ///< --max-request-bytes
  int http_threads = 256;              ///< --http-threads: HTTP worker threads (one per open connection)
  int64_t max_queued_requests = 64;    ///< --max-queued-requests: generating or waiting; more get 503
  int http_timeout = 10;               ///< --http-timeout: seconds a read or write may stall
  std::string device = "auto";
  bool bf16 = false, fp16 = false;
  int tensor_model_parallel_size = 1;    ///< --tensor-model-parallel-size
  int pipeline_model_parallel_size = 1;  ///< --pipeline-model-parallel-size
  int nproc_per_node = 1;                ///< --nproc-per-node: start tp·pp ranks here
};
void add_serve_options(CLI::App& app, ServeArgs& args);
int run_serve(const ServeArgs& args);

}  // namespace mt
