// Requests and replies of `megatron serve` (train/serve.h), apart from HTTP and the model so that
// every rule is tested without a server (tests/train/serve_request_test.cpp):
//   * a body must be valid UTF-8 (else HTTP 400 naming the field that holds the first invalid byte,
//     e.g. 'prompts[1]'), valid JSON and an object;
//   * every field is read as the type it is, with its range, and a value outside it is refused
//     with the value as given (no wraparound, no rounding: random_seed -1, tokens_to_generate 3.7 or
//     2^63 are HTTP 400), as Megatron-LM's text generation server checks them
//     (megatron/inference/text_generation_server.py: "tokens_to_generate must be an integer greater
//     than or equal to 0", "random_seed must be a positive integer", ...);
//   * a documented field whose behaviour is not implemented is refused when it asks for that
//     behaviour (OpenAI's best_of > 1, logprobs, stream, suffix, penalties, logit_bias; Megatron's
//     beam_width, add_BOS, stop_on_eol, ...), never ignored; fields neither API documents are
//     ignored, as Megatron's server ignores them;
//   * replies are valid UTF-8 by construction (data/detokenizer.h) and dump_json never throws.
#pragma once
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "train/inference.h"

namespace mt {

/// An HTTP status and JSON body.
struct HttpReply {
  int status = 200;
  nlohmann::json body;
};

/// A request the server refuses: HTTP `status` (400: the request is wrong; 503: the server is
/// full) with the body {"error": message}.
struct HttpError : std::runtime_error {
  HttpError(int status, const std::string& message) : std::runtime_error(message), status(status) {}
  int status;
};

/// The JSON text of `j`. Never throws: a string that is not valid UTF-8 (none should reach a reply)
/// is written with U+FFFD for its invalid bytes.
std::string dump_json(const nlohmann::json& j);

/// Where the byte at `offset` of the JSON text `text` lies, for messages: "prompts[1]" (inside the
/// second element of the array of key "prompts"), "a.b" (nested objects), "a key of 'x'" (inside
/// a key), or "" (outside any string). Scans only up to `offset`; needs no valid JSON.
std::string json_path_at(std::string_view text, size_t offset);

/// The body of a request as a JSON object. Errors (HttpError 400): bytes that are not UTF-8
/// ("'prompts[0]' is not valid UTF-8: byte 0xFF at offset 14 of the body"), text that is not JSON
/// (nlohmann's message, which gives the position), JSON that is not an object.
nlohmann::json parse_request_body(std::string_view body);

/// A validated generation request.
struct GenerationRequest {
  std::vector<std::string> prompts;  ///< one per sequence to generate (a prompt repeated n times)
  int64_t tokens_to_generate = 0;    ///< as asked; a sequence also stops at the context length
  SamplingOptions sampling;
  int64_t n = 1;                     ///< /v1/completions: choices per prompt (prompts holds each n times)
  bool echo = false;                 ///< /v1/completions: the text starts with the prompt
  std::vector<std::string> stop;     ///< /v1/completions: the text ends before the first of these
  int64_t stop_token = -1;           ///< /api: the stop token asked for (-1: none given); the server
                                     ///< only has the tokenizer's end of document
};

/// PUT /api (Megatron): prompts (string or list of 1..max_prompts strings), tokens_to_generate
/// (integer >= 0, default 64), temperature (number in [0, 100]; 0 = greedy), top_k (integer in
/// [0, 1000]), top_p (number in [0, 1]; not with top_k), random_seed (integer in [0, 2^64 - 1],
/// default `default_seed`), stop_token (integer), logprobs (false), no_log (boolean). Errors: HttpError 400 naming the
/// field and its value.
GenerationRequest parse_megatron_api(const nlohmann::json& j, int64_t max_prompts, uint64_t default_seed);

/// POST /v1/completions (OpenAI): prompt (string or list of strings), max_tokens (integer >= 0,
/// default 16), n (integer >= 1; prompts x n <= max_prompts), temperature, top_p (1 = off), top_k
/// (an extension), seed, echo, stop (string or list of strings), model, user; best_of 1, logprobs
/// null or 0, stream false, suffix null, frequency_penalty / presence_penalty 0, logit_bias {}.
/// Errors: HttpError 400 naming the field and its value.
GenerationRequest parse_completion(const nlohmann::json& j, int64_t max_prompts, uint64_t default_seed);

/// Megatron's reply to PUT /api: {"text": [...], "segments": [[...], ...], "logprobs": null}, one
/// text per sequence (prompt and generated tokens, decoded together) and one segment per token (the
/// text that token completes: the segments of a sequence concatenate to its text; Megatron decodes
/// each token alone, which splits characters into U+FFFD).
nlohmann::json megatron_api_reply(const data::Tokenizer& tok, const std::vector<std::vector<int32_t>>& sequences);

/// The text of one completion choice: the decoded sequence after the decoded prompt (a character
/// the prompt's last token leaves incomplete goes to the completion whole), cut before the first
/// occurrence of a `stop` string (then stopped_by_string); with echo, the prompt text first.
struct CompletionText {
  std::string text;
  bool stopped_by_string = false;
};
CompletionText completion_text(const data::Tokenizer& tok, std::span<const int32_t> sequence, int64_t prompt_tokens,
                               bool echo, const std::vector<std::string>& stop);

}  // namespace mt
