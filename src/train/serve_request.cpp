#include "train/serve_request.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "data/detokenizer.h"

namespace mt {

namespace {

using nlohmann::json;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

[[noreturn]] void bad(const std::string& message) { throw HttpError(400, message); }

/// A value as the client sent it, for messages (JSON text, long ones cut at a character boundary).
std::string shown(const json& v) {
  constexpr size_t kMax = 80;
  std::string s = dump_json(v);
  if (s.size() <= kMax) return s;
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

/// The value of `key`, or nullptr when it is absent or null (the default applies).
const json* find(const json& j, const char* key) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

/// An integer field in [lo, hi]. JSON numbers with a fraction or an exponent, booleans and
/// strings are refused; so is an integer outside the range, named as given.
int64_t int_field(const json& j, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  const auto refuse = [&] { bad(fmt::format("'{}' must be an integer in [{}, {}], got {}", key, lo, hi, shown(*v))); };
  if (!v->is_number_integer()) refuse();
  // Non-negative integers parse as unsigned (up to 2^64 - 1), negative ones as signed.
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(kInt64Max)) refuse();
  const auto i = v->get<int64_t>();
  if (i < lo || i > hi) refuse();
  return i;
}

/// A seed: an integer in [0, 2^64 - 1].
uint64_t seed_field(const json& j, const char* key, uint64_t fallback) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_number_unsigned())
    bad(fmt::format("'{}' must be an integer in [0, {}], got {}", key, std::numeric_limits<uint64_t>::max(),
                    shown(*v)));
  return v->get<uint64_t>();
}

/// A number (integer or not) in [lo, hi].
double number_field(const json& j, const char* key, double fallback, double lo, double hi) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_number() || !(v->get<double>() >= lo && v->get<double>() <= hi))
    bad(fmt::format("'{}' must be a number in [{}, {}], got {}", key, lo, hi, shown(*v)));
  return v->get<double>();
}

bool bool_field(const json& j, const char* key, bool fallback) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) bad(fmt::format("'{}' must be true or false, got {}", key, shown(*v)));
  return v->get<bool>();
}

std::string string_field(const json& j, const char* key, const std::string& fallback) {
  const json* v = find(j, key);
  if (v == nullptr) return fallback;
  if (!v->is_string()) bad(fmt::format("'{}' must be a string, got {}", key, shown(*v)));
  return v->get<std::string>();
}

/// A string or a non-empty list of strings.
std::vector<std::string> string_list(const json& v, const char* key) {
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array() || v.empty())
    bad(fmt::format("'{}' must be a string or a non-empty list of strings, got {}", key, shown(v)));
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) bad(fmt::format("'{}[{}]' must be a string, got {}", key, i, shown(v[i])));
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

/// A documented field this server does not implement: refused unless it has its default (null counts as default).
void refuse_unless(const json& j, const char* key, const json& allowed, const char* what) {
  const json* v = find(j, key);
  if (v != nullptr && *v != allowed)
    bad(fmt::format("'{}' {} is not supported by this server ({}); leave it out or set it to {}", key, shown(*v),
                    what, dump_json(allowed)));
}

SamplingOptions sampling_options(double temperature, int64_t top_k, double top_p, uint64_t seed) {
  if (top_k > 0 && top_p > 0)
    bad(fmt::format("cannot set both top_k ({}) and top_p ({}): choose one sampling", top_k, top_p));
  SamplingOptions s;
  s.greedy = temperature == 0 || top_k == 1;
  s.temperature = static_cast<float>(temperature == 0 ? 1.0 : temperature);
  s.top_k = top_k;
  s.top_p = static_cast<float>(top_p);
  s.seed = seed;
  return s;
}

}  // namespace

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string json_path_at(std::string_view s, size_t offset) {
  struct Frame {
    bool object;
    std::string key;     // object: the key whose value is being read
    int64_t index = 0;   // array: the element being read
    bool expect_key = false;
  };
  std::vector<Frame> stack;
  const auto render = [&] {
    std::string p;
    for (const Frame& f : stack) {
      if (f.object) {
        if (f.expect_key) break;  // between a ',' and the next key: no value
        p += (p.empty() ? "" : ".") + f.key;
      } else {
        p += fmt::format("[{}]", f.index);
      }
    }
    return p;
  };
  for (size_t i = 0; i < s.size() && i <= offset;) {
    const char c = s[i];
    if (c == '"') {
      size_t e = i + 1;  // the closing quote
      while (e < s.size() && s[e] != '"') e += s[e] == '\\' ? 2 : 1;
      const bool is_key = !stack.empty() && stack.back().object && stack.back().expect_key;
      if (offset <= e) {
        if (!is_key) return render();
        const std::string outer = render();
        return outer.empty() ? "a key" : fmt::format("a key of '{}'", outer);
      }
      if (is_key) {
        stack.back().key = std::string(s.substr(i + 1, e - i - 1));
        stack.back().expect_key = false;
      }
      i = e + 1;
      continue;
    }
    if (c == '{') {
      stack.push_back({true, "", 0, true});
    } else if (c == '[') {
      stack.push_back({false, "", 0, false});
    } else if ((c == '}' || c == ']') && !stack.empty()) {
      stack.pop_back();
    } else if (c == ',' && !stack.empty()) {
      if (stack.back().object) {
        stack.back().expect_key = true;
      } else {
        ++stack.back().index;
      }
    }
    ++i;
  }
  return render();
}

json parse_request_body(std::string_view body) {
  if (const size_t at = data::utf8_first_invalid(body); at != std::string::npos) {
    const std::string where = json_path_at(body, at);
    bad(fmt::format("{} is not valid UTF-8: byte 0x{:02X} at offset {} of the body",
                    where.empty() ? std::string("the body") : "'" + where + "'", static_cast<unsigned char>(body[at]),
                    at));
  }
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    bad(fmt::format("the body is not valid JSON: {}", e.what()));
  }
  if (!j.is_object()) bad(fmt::format("the request must be a JSON object, got {}", j.type_name()));
  return j;
}

GenerationRequest parse_megatron_api(const json& j, int64_t max_prompts, uint64_t default_seed) {
  // Megatron's messages for its renamed fields.
  if (j.contains("max_len")) bad("max_len is no longer used.  Replace with tokens_to_generate");
  if (j.contains("sentences")) bad("sentences is no longer used.  Replace with prompts");
  const json* prompts = find(j, "prompts");
  if (prompts == nullptr) bad("prompts argument required");
  GenerationRequest r;
  r.prompts = string_list(*prompts, "prompts");
  if (static_cast<int64_t>(r.prompts.size()) > max_prompts)
    bad(fmt::format("{} prompts; the maximum is {} (--max-prompts)", r.prompts.size(), max_prompts));
  r.tokens_to_generate = int_field(j, "tokens_to_generate", 64, 0, kInt64Max);
  refuse_unless(j, "logprobs", false, "log-probabilities");
  refuse_unless(j, "beam_width", nullptr, "beam search");
  refuse_unless(j, "length_penalty", nullptr, "beam search");
  refuse_unless(j, "top_p_decay", 0.0, "top-p decay");
  refuse_unless(j, "top_p_bound", 0.0, "top-p decay");
  refuse_unless(j, "add_BOS", false, "a BOS token before the prompt");
  refuse_unless(j, "stop_on_eol", false, "stopping at a newline");
  refuse_unless(j, "stop_on_double_eol", false, "stopping at a newline");
  refuse_unless(j, "prevent_newline_after_colon", false, "newline suppression");
  r.stop_token = int_field(j, "stop_token", -1, 0, std::numeric_limits<int32_t>::max());
  bool_field(j, "no_log", false);  // this server logs no request
  const double temperature = number_field(j, "temperature", 1.0, 0, 100);
  const int64_t top_k = int_field(j, "top_k", 0, 0, 1000);
  const double top_p = number_field(j, "top_p", 0.0, 0, 1);
  r.sampling = sampling_options(temperature, top_k, top_p, seed_field(j, "random_seed", default_seed));
  return r;
}

GenerationRequest parse_completion(const json& j, int64_t max_prompts, uint64_t default_seed) {
  const json* prompt = find(j, "prompt");
  if (prompt == nullptr) bad("'prompt' is required");
  GenerationRequest r;
  const std::vector<std::string> prompts = string_list(*prompt, "prompt");
  r.n = int_field(j, "n", 1, 1, max_prompts);
  if (static_cast<int64_t>(prompts.size()) * r.n > max_prompts)
    bad(fmt::format("{} prompts x n {} = {} completions; the maximum is {} (--max-prompts)", prompts.size(), r.n,
                    static_cast<int64_t>(prompts.size()) * r.n, max_prompts));
  for (const auto& p : prompts) r.prompts.insert(r.prompts.end(), static_cast<size_t>(r.n), p);
  r.tokens_to_generate = int_field(j, "max_tokens", 16, 0, kInt64Max);
  refuse_unless(j, "best_of", 1, "best-of sampling");
  refuse_unless(j, "stream", false, "streaming");
  refuse_unless(j, "suffix", nullptr, "insertion");
  refuse_unless(j, "frequency_penalty", 0, "penalties");
  refuse_unless(j, "presence_penalty", 0, "penalties");
  if (const json* lp = find(j, "logprobs"); lp != nullptr && *lp != 0)
    bad(fmt::format("'logprobs' {} is not supported by this server (log-probabilities); leave it out or set it to "
                    "null", shown(*lp)));
  if (const json* lb = find(j, "logit_bias"); lb != nullptr && !(lb->is_object() && lb->empty()))
    bad(fmt::format("'logit_bias' {} is not supported by this server; leave it out or set it to {{}}", shown(*lb)));
  r.echo = bool_field(j, "echo", false);
  if (const json* stop = find(j, "stop"); stop != nullptr) {
    for (auto& s : string_list(*stop, "stop"))
      if (!s.empty()) r.stop.push_back(std::move(s));
  }
  string_field(j, "model", "");
  string_field(j, "user", "");
  double top_p = number_field(j, "top_p", 1.0, 0, 1);
  if (top_p == 1.0) top_p = 0.0;  // OpenAI's 1 = no nucleus cut
  const double temperature = number_field(j, "temperature", 1.0, 0, 100);
  const int64_t top_k = int_field(j, "top_k", 0, 0, 1000);
  r.sampling = sampling_options(temperature, top_k, top_p, seed_field(j, "seed", default_seed));
  return r;
}

json megatron_api_reply(const data::Tokenizer& tok, const std::vector<std::vector<int32_t>>& sequences) {
  json text = json::array(), segments = json::array();
  for (const auto& ids : sequences) {
    data::DetokenizedText d = data::detokenize_pieces(tok, ids);
    text.push_back(std::move(d.text));
    segments.push_back(std::move(d.pieces));
  }
  return {{"text", text}, {"segments", segments}, {"logprobs", nullptr}};
}

CompletionText completion_text(const data::Tokenizer& tok, std::span<const int32_t> sequence, int64_t prompt_tokens,
                               bool echo, const std::vector<std::string>& stop) {
  const std::string all = data::utf8_replace_invalid(tok.decode(sequence));
  const std::string prompt = data::utf8_replace_invalid(tok.decode(sequence.first(static_cast<size_t>(prompt_tokens))));
  size_t cut = 0;  // the longest common prefix, moved back to a character boundary of `all`
  while (cut < all.size() && cut < prompt.size() && all[cut] == prompt[cut]) ++cut;
  while (cut > 0 && cut < all.size() && (static_cast<unsigned char>(all[cut]) & 0xC0) == 0x80) --cut;
  CompletionText r;
  r.text = all.substr(cut);
  size_t first = std::string::npos;
  for (const auto& s : stop) first = std::min(first, r.text.find(s));
  if (first != std::string::npos) {
    r.text.resize(first);
    r.stopped_by_string = true;
  }
  if (echo) r.text = all.substr(0, cut) + r.text;
  return r;
}

}  // namespace mt
