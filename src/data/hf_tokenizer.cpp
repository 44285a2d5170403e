#include "data/hf_tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/check.h"
#include "data/bpe_util.h"
#include "data/file_util.h"
#include "data/gpt2_tokenizer.h"
#include "data/unicode.h"

namespace mt::data {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

enum class SplitKind { kGpt2, kLlama3, kQwen2 };

struct PreStep {
  bool byte_level = false;  // ByteLevel step (else Split)
  bool add_prefix_space = false;
  bool use_regex = false;  // ByteLevel: split with GPT-2's regex
  SplitKind kind = SplitKind::kGpt2;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip, rstrip, normalized;
};

using StrMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// GPT-2 byte-level alphabet (bytes_to_unicode) inverse: code point -> byte.
bool byte_level_decode(std::string_view s, std::string* out) {
  static const std::array<int16_t, 512> inv = [] {
    std::array<int16_t, 512> a{};
    a.fill(-1);
    for (int b = 0; b < 256; ++b) a[Gpt2Tokenizer::byte_to_unicode(static_cast<uint8_t>(b))] = static_cast<int16_t>(b);
    return a;
  }();
  out->clear();
  for (size_t i = 0; i < s.size();) {
    char32_t cp;
    i += utf8_decode(s, i, &cp);
    if (cp == kInvalidCodepoint || cp >= inv.size() || inv[cp] < 0) return false;
    out->push_back(static_cast<char>(inv[cp]));
  }
  return true;
}

bool is_ws(char32_t cp) { return cp != kInvalidCodepoint && is_whitespace(cp); }

}  // namespace

struct HfTokenizer::Impl {
  std::string name;
  StrMap vocab;                        // raw bytes -> id
  std::vector<std::string> id_bytes;   // id -> raw bytes ("" and !has_id for gaps)
  std::vector<bool> has_id;
  std::array<int32_t, 256> byte_id{};  // id of each single byte
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // pair -> (rank, merged id)
  bool ignore_merges = false;
  std::vector<PreStep> steps;
  std::vector<AddedToken> added;  // sorted by content for lookup
  StrMap added_by_content;
  std::vector<int32_t> prefix_ids, suffix_ids;  // post-processor template around $A
  int32_t eod_id = -1;

  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  mutable std::array<Shard, 16> cache;

  void load(const Json& j, const Json& config);
  void parse_pre_tokenizer(const Json& p);
  void parse_post_processor(const Json& p);
  void bpe(std::string_view word, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  void encode_segment(std::string_view seg, std::vector<int32_t>* out) const;
  std::vector<std::string> pre_split(std::string_view seg) const;
};

void HfTokenizer::Impl::parse_pre_tokenizer(const Json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const Json& q : p.at("pretokenizers")) parse_pre_tokenizer(q);
    return;
  }
  PreStep s;
  if (type == "ByteLevel") {
    s.byte_level = true;
    s.add_prefix_space = p.value("add_prefix_space", false);
    s.use_regex = p.value("use_regex", true);
  } else if (type == "Split") {
    const Json& pat = p.at("pattern");
    MT_REQUIRE(pat.contains("Regex"), "{}: Split pre-tokenizer with a String pattern is not supported", name);
    const std::string re = pat.at("Regex").get<std::string>();
    if (re == kGpt2Pattern) {
      s.kind = SplitKind::kGpt2;
    } else if (re == kLlama3Pattern) {
      s.kind = SplitKind::kLlama3;
    } else if (re == kQwen2Pattern) {
      s.kind = SplitKind::kQwen2;
    } else {
      MT_FAIL("{}: unsupported Split pre-tokenizer regex {} (supported: GPT-2's, Llama-3's and Qwen-2's patterns)", name,
              re);
    }
    MT_REQUIRE(p.value("behavior", "") == "Isolated" && !p.value("invert", false),
               "{}: Split pre-tokenizer must have behavior Isolated and invert false", name);
  } else {
    MT_FAIL("{}: unsupported pre_tokenizer type '{}' (supported: ByteLevel, Split, Sequence)", name, type);
  }
  steps.push_back(s);
}

void HfTokenizer::Impl::parse_post_processor(const Json& p) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const Json& q : p.at("processors")) parse_post_processor(q);
  } else if (type == "ByteLevel") {
    // offsets only
  } else if (type == "TemplateProcessing") {
    bool seen_a = false;
    for (const Json& item : p.at("single")) {
      if (item.contains("Sequence")) {
        seen_a = true;
      } else if (item.contains("SpecialToken")) {
        const std::string id = item.at("SpecialToken").at("id").get<std::string>();
        const Json& st = p.at("special_tokens").at(id);
        for (const Json& x : st.at("ids")) (seen_a ? suffix_ids : prefix_ids).push_back(x.get<int32_t>());
      } else {
        MT_FAIL("{}: unsupported TemplateProcessing item {}", name, item.dump());
      }
    }
  } else {
    MT_FAIL("{}: unsupported post_processor type '{}' (supported: ByteLevel, TemplateProcessing, Sequence)", name, type);
  }
}

void HfTokenizer::Impl::load(const Json& j, const Json& config) {
  MT_REQUIRE(j.is_object() && j.contains("model"), "{}: not a tokenizer.json (no \"model\")", name);
  const Json& m = j.at("model");
  const std::string mtype = m.value("type", "");
  MT_REQUIRE(mtype == "BPE",
             "{}: tokenizer model type '{}' is not supported; HuggingFaceTokenizer supports byte-level BPE "
             "tokenizer.json files only",
             name, mtype.empty() ? "(none)" : mtype);
  MT_REQUIRE(!m.contains("dropout") || m["dropout"].is_null(), "{}: BPE dropout is not supported", name);
  MT_REQUIRE(!m.value("byte_fallback", false), "{}: BPE byte_fallback (SentencePiece-style BPE) is not supported", name);
  auto empty_or_null = [&](const char* k) {
    return !m.contains(k) || m[k].is_null() || (m[k].is_string() && m[k].get<std::string>().empty());
  };
  MT_REQUIRE(empty_or_null("continuing_subword_prefix") && empty_or_null("end_of_word_suffix"),
             "{}: BPE continuing_subword_prefix / end_of_word_suffix are not supported", name);
  ignore_merges = m.value("ignore_merges", false);
  const Json& normalizer = j.value("normalizer", Json());
  MT_REQUIRE(normalizer.is_null(), "{}: normalizer {} is not supported (only null)", name, normalizer.dump());
  parse_pre_tokenizer(j.value("pre_tokenizer", Json()));
  MT_REQUIRE(std::any_of(steps.begin(), steps.end(), [](const PreStep& s) { return s.byte_level; }),
             "{}: the pre_tokenizer has no ByteLevel step; only byte-level BPE is supported", name);
  parse_post_processor(j.value("post_processor", Json()));

  int64_t max_id = -1;
  std::string bytes;
  for (auto it = m.at("vocab").begin(); it != m.at("vocab").end(); ++it) {
    MT_REQUIRE(byte_level_decode(it.key(), &bytes), "{}: vocab token \"{}\" is not in the byte-level alphabet", name,
               it.key());
    const int64_t id = it.value().get<int64_t>();
    MT_REQUIRE(id >= 0 && id < INT32_MAX, "{}: vocab id {} out of range", name, id);
    vocab.emplace(bytes, static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
    if (static_cast<int64_t>(id_bytes.size()) <= id) {
      id_bytes.resize(id + 1);
      has_id.resize(id + 1, false);
    }
    id_bytes[id] = bytes;
    has_id[id] = true;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(std::string(1, static_cast<char>(b)));
    MT_REQUIRE(it != vocab.end(), "{}: the vocabulary lacks the byte-level token of byte 0x{:02x}", name, b);
    byte_id[b] = it->second;
  }
  int32_t rank = 0;
  std::string left, right;
  for (const Json& mg : m.at("merges")) {
    std::string a, b;
    if (mg.is_string()) {
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ');
      MT_REQUIRE(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                 "{}: merge {} \"{}\" is not \"a b\"", name, rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      MT_REQUIRE(mg.is_array() && mg.size() == 2, "{}: merge {} is not a pair", name, rank);
      a = mg[0].get<std::string>();
      b = mg[1].get<std::string>();
    }
    MT_REQUIRE(byte_level_decode(a, &left) && byte_level_decode(b, &right), "{}: merge {} has non-byte-level tokens",
               name, rank);
    auto ia = vocab.find(left), ib = vocab.find(right), im = vocab.find(left + right);
    MT_REQUIRE(ia != vocab.end() && ib != vocab.end() && im != vocab.end(),
               "{}: merge {} (\"{} {}\") refers to tokens not in the vocabulary", name, rank, a, b);
    merges.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, im->second));
    ++rank;
  }
  for (const Json& t : j.value("added_tokens", Json::array())) {
    AddedToken a{t.at("content").get<std::string>(), t.at("id").get<int32_t>(), t.value("lstrip", false),
                 t.value("rstrip", false), t.value("normalized", false)};
    MT_REQUIRE(!t.value("single_word", false), "{}: added token \"{}\" has single_word = true (not supported)", name,
               a.content);
    MT_REQUIRE(!a.content.empty() && a.id >= 0, "{}: bad added token {}", name, t.dump());
    added_by_content[a.content] = a.id;
    max_id = std::max<int64_t>(max_id, a.id);
    added.push_back(std::move(a));
  }
  id_bytes.resize(max_id + 1);
  has_id.resize(max_id + 1, false);
  for (const AddedToken& a : added) {
    id_bytes[a.id] = a.content;
    has_id[a.id] = true;
  }
  // EOD: tokenizer_config.json eos_token, else well-known names.
  std::string eos;
  if (config.is_object() && config.contains("eos_token")) {
    const Json& e = config["eos_token"];
    if (e.is_string()) eos = e.get<std::string>();
    if (e.is_object() && e.contains("content")) eos = e["content"].get<std::string>();
  }
  auto lookup = [&](const std::string& s) -> int32_t {
    if (auto it = added_by_content.find(s); it != added_by_content.end()) return it->second;
    if (auto it = vocab.find(s); it != vocab.end()) return it->second;
    return -1;
  };
  if (!eos.empty()) {
    eod_id = lookup(eos);
    MT_REQUIRE(eod_id >= 0, "{}: eos_token \"{}\" of tokenizer_config.json is not a token", name, eos);
  } else {
    for (const char* c : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
      if ((eod_id = lookup(c)) >= 0) break;
    }
  }
}

// BPE of one piece (raw bytes): repeatedly merge the lowest-ranked adjacent pair (leftmost first).
void HfTokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>* out) const {
  const int n = static_cast<int>(word.size());
  struct Sym {
    int32_t id;
    int prev, next;
  };
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; ++i) sym[i] = {byte_id[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  struct Cand {
    int32_t rank;
    int left;
    int32_t left_id, right_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int l) {
    if (l < 0 || sym[l].next < 0) return;
    auto it = merges.find(pair_key(sym[l].id, sym[sym[l].next].id));
    if (it != merges.end()) heap.push({it->second.first, l, sym[l].id, sym[sym[l].next].id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int r = sym[c.left].next;
    if (sym[c.left].id != c.left_id || r < 0 || sym[r].id != c.right_id) continue;  // stale
    sym[c.left].id = merges.find(pair_key(c.left_id, c.right_id))->second.second;
    sym[c.left].next = sym[r].next;
    if (sym[r].next >= 0) sym[sym[r].next].prev = c.left;
    sym[r].id = -1;
    push(sym[c.left].prev);
    push(c.left);
  }
  for (int i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
}

void HfTokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (ignore_merges) {
    if (auto it = vocab.find(piece); it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (piece.size() > 128) {
    bpe(piece, out);
    return;
  }
  Shard& sh = cache[std::hash<std::string_view>{}(piece) % cache.size()];
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    if (auto it = sh.map.find(piece); it != sh.map.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out->size();
  bpe(piece, out);
  std::lock_guard<std::mutex> lock(sh.mu);
  if (sh.map.size() > (1u << 16)) sh.map.clear();
  sh.map.emplace(std::string(piece), std::vector<int32_t>(out->begin() + static_cast<std::ptrdiff_t>(start), out->end()));
}

std::vector<std::string> HfTokenizer::Impl::pre_split(std::string_view seg) const {
  std::vector<std::string> pieces{std::string(seg)};
  for (const PreStep& s : steps) {
    std::vector<std::string> next;
    for (std::string& p : pieces) {
      if (s.byte_level && s.add_prefix_space && !p.starts_with(' ')) p.insert(p.begin(), ' ');
      if (s.byte_level && !s.use_regex) {
        next.push_back(std::move(p));
        continue;
      }
      std::vector<std::string_view> parts;
      if (s.byte_level || s.kind == SplitKind::kGpt2) {
        parts = Gpt2Tokenizer::pretokenize(p);
      } else {
        parts = HfTokenizer::pretokenize_llama3(p, s.kind == SplitKind::kLlama3 ? 3 : 1);
      }
      for (std::string_view v : parts) next.emplace_back(v);
    }
    pieces = std::move(next);
  }
  return pieces;
}

void HfTokenizer::Impl::encode_segment(std::string_view seg, std::vector<int32_t>* out) const {
  if (seg.empty()) return;
  for (const std::string& p : pre_split(seg)) encode_piece(p, out);
}

std::vector<std::string_view> HfTokenizer::pretokenize_llama3(std::string_view text, int max_digits) {
  return pretokenize_split(text, SplitPattern{true, max_digits, false, false});
}

std::vector<std::string_view> HfTokenizer::pretokenize_split(std::string_view text, const SplitPattern& pattern) {
  const int max_digits = pattern.max_digits;
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  auto unit = [&](size_t p, char32_t* cp) { return utf8_decode(text, p, cp); };
  auto cls = [](char32_t cp) { return char_class(cp); };
  auto run_end = [&](size_t p, CharClass c) {
    char32_t cp;
    while (p < n) {
      const size_t l = unit(p, &cp);
      if (cls(cp) != c) break;
      p += l;
    }
    return p;
  };
  auto crlf_end = [&](size_t p) {
    while (p < n && (text[p] == '\r' || text[p] == '\n' || (pattern.slash_after_punctuation && text[p] == '/'))) ++p;
    return p;
  };
  // The run of units from p that satisfy pred (invalid bytes never do).
  auto run_of = [&](size_t p, bool (*pred)(char32_t)) {
    char32_t cp;
    while (p < n) {
      const size_t l = unit(p, &cp);
      if (cp == kInvalidCodepoint || !pred(cp)) break;
      p += l;
    }
    return p;
  };
  constexpr size_t kNone = std::string_view::npos;
  // U*W+ from j (U = upper-or-mark, W = lower-or-mark), with the regex's backtracking: W+ after the
  // whole U run, else after the last W inside it (U* gives units back).
  auto upper_star_lower_plus = [&](size_t j) {
    const size_t k = run_of(j, is_upper_or_mark);
    if (const size_t e = run_of(k, is_lower_or_mark); e > k) return e;
    size_t end = kNone;
    char32_t cp;
    for (size_t p = j; p < k;) {
      const size_t l = unit(p, &cp);
      if (is_lower_or_mark(cp)) end = p + l;
      p += l;
    }
    return end;
  };
  auto upper_plus_lower_star = [&](size_t j) {
    const size_t k = run_of(j, is_upper_or_mark);
    return k > j ? run_of(k, is_lower_or_mark) : kNone;
  };
  auto lower = [](char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c); };
  size_t i = 0;
  while (i < n) {
    size_t end = 0;
    char32_t c0;
    const size_t l0 = unit(i, &c0);
    const CharClass k0 = cls(c0);
    // 1. (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (pattern.contractions && text[i] == '\'' && i + 1 < n) {
      const char a = lower(text[i + 1]);
      const char b = i + 2 < n ? lower(text[i + 2]) : '\0';
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        end = i + 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        end = i + 3;
      } else if (static_cast<unsigned char>(text[i + 1]) == 0xC5 && i + 2 < n &&
                 static_cast<unsigned char>(text[i + 2]) == 0xBF) {
        end = i + 3;  // U+017F LATIN SMALL LETTER LONG S case-folds to 's'
      }
    }
    // 2. (cased) [^\r\n\p{L}\p{N}]?U*W+ | [^\r\n\p{L}\p{N}]?U+W*, each alternative with its optional
    // prefix first (a mark is both a prefix and U / W)
    const bool prefix = k0 != CharClass::kLetter && k0 != CharClass::kNumber && c0 != '\r' && c0 != '\n';
    if (end == 0 && pattern.cased_letters) {
      for (const auto& alt : {std::function<size_t(size_t)>(upper_star_lower_plus),
                              std::function<size_t(size_t)>(upper_plus_lower_star)}) {
        size_t e = prefix && i + l0 < n ? alt(i + l0) : kNone;
        if (e == kNone) e = alt(i);
        if (e != kNone) {
          end = e;
          break;
        }
      }
    }
    //    (plain) [^\r\n\p{L}\p{N}]?\p{L}+
    if (end == 0 && !pattern.cased_letters) {
      if (k0 == CharClass::kLetter) {
        end = run_end(i, CharClass::kLetter);
      } else if (k0 != CharClass::kNumber && c0 != '\r' && c0 != '\n' && i + l0 < n) {
        char32_t c1;
        unit(i + l0, &c1);
        if (cls(c1) == CharClass::kLetter) end = run_end(i + l0, CharClass::kLetter);
      }
    }
    // 3. \p{N}{1,max_digits}
    if (end == 0 && k0 == CharClass::kNumber) {
      size_t p = i;
      for (int d = 0; d < max_digits && p < n; ++d) {
        char32_t cp;
        const size_t l = unit(p, &cp);
        if (cls(cp) != CharClass::kNumber) break;
        p += l;
      }
      end = p;
    }
    // 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    if (end == 0) {
      if (text[i] == ' ' && i + 1 < n) {
        char32_t c1;
        unit(i + 1, &c1);
        if (cls(c1) == CharClass::kOther) end = crlf_end(run_end(i + 1, CharClass::kOther));
      }
      if (end == 0 && k0 == CharClass::kOther) end = crlf_end(run_end(i, CharClass::kOther));
    }
    // 5.-7. whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+
    if (end == 0) {
      size_t p = i, last_crlf = std::string_view::npos, last_start = i;
      char32_t cp;
      while (p < n) {
        const size_t l = unit(p, &cp);
        if (!is_ws(cp)) break;
        if (cp == '\r' || cp == '\n') last_crlf = p;
        last_start = p;
        p += l;
      }
      if (last_crlf != std::string_view::npos) {
        end = last_crlf + 1;
      } else if (p == n || last_start == i) {
        end = p;
      } else {
        end = last_start;
      }
    }
    pieces.push_back(text.substr(i, end - i));
    i = end;
  }
  return pieces;
}

// ---------------------------------------------------------------------------------------------------

HfTokenizer HfTokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                                   const std::string& name) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  Json j, c;
  try {
    j = Json::parse(tokenizer_json.begin(), tokenizer_json.end());
    if (!config_json.empty()) c = Json::parse(config_json.begin(), config_json.end());
  } catch (const Json::exception& e) {
    MT_FAIL("{}: malformed JSON: {}", name, e.what());
  }
  try {
    impl->load(j, c);
  } catch (const Json::exception& e) {
    MT_FAIL("{}: unexpected tokenizer.json content: {}", name, e.what());
  }
  return HfTokenizer(std::move(impl));
}

HfTokenizer HfTokenizer::from_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::string file = path, config;
  if (fs::is_directory(path)) file = (fs::path(path) / "tokenizer.json").string();
  const std::string cfg = (fs::path(file).parent_path() / "tokenizer_config.json").string();
  if (is_regular_file(cfg)) config = read_file_to_string(cfg, "tokenizer config");
  return from_json(read_file_to_string(file, "tokenizer.json (--tokenizer-model)"), config, file);
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> out;
  const Impl& m = *impl_;
  if (add_special_tokens) out = m.prefix_ids;
  // Added tokens: first those with normalized = false, then (in the gaps) those with normalized = true;
  // leftmost-longest at each stage, lstrip/rstrip absorbing neighbouring whitespace.
  struct Span {
    size_t b, e;
    int32_t id;  // -1 = plain text
  };
  std::vector<Span> spans{{0, text.size(), -1}};
  for (int stage = 0; stage < 2; ++stage) {
    std::vector<Span> next;
    for (const Span& s : spans) {
      if (s.id >= 0) {
        next.push_back(s);
        continue;
      }
      size_t pos = s.b, gap = s.b;
      while (pos < s.e) {
        const AddedToken* best = nullptr;
        for (const AddedToken& a : m.added) {
          if (a.normalized != (stage == 1)) continue;
          if (a.content.size() <= s.e - pos && text.compare(pos, a.content.size(), a.content) == 0 &&
              (!best || a.content.size() > best->content.size())) {
            best = &a;
          }
        }
        if (!best) {
          ++pos;
          continue;
        }
        size_t b = pos, e = pos + best->content.size();
        if (best->lstrip) {
          while (b > gap && (text[b - 1] == ' ' || text[b - 1] == '\t' || text[b - 1] == '\n' || text[b - 1] == '\r')) --b;
        }
        if (best->rstrip) {
          while (e < s.e && (text[e] == ' ' || text[e] == '\t' || text[e] == '\n' || text[e] == '\r')) ++e;
        }
        if (b > gap) next.push_back({gap, b, -1});
        next.push_back({b, e, best->id});
        gap = pos = e;
      }
      if (gap < s.e) next.push_back({gap, s.e, -1});
    }
    spans = std::move(next);
  }
  for (const Span& s : spans) {
    if (s.id >= 0) {
      out.push_back(s.id);
    } else {
      m.encode_segment(text.substr(s.b, s.e - s.b), &out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return out;
}

void HfTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  const std::vector<int32_t> ids = encode(text, true);
  out->insert(out->end(), ids.begin(), ids.end());
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    MT_REQUIRE(id >= 0 && id < vocab_size() && impl_->has_id[id],
               "HuggingFaceTokenizer decode: token id {} (position {}) is not in the vocabulary (size {})", id, k,
               vocab_size());
    out += impl_->id_bytes[id];
  }
  return out;
}

int32_t HfTokenizer::eod() const {
  MT_REQUIRE(impl_->eod_id >= 0,
             "{}: no end-of-document token (no eos_token in tokenizer_config.json and none of <|endoftext|>, "
             "<|end_of_text|>, </s>)",
             impl_->name);
  return impl_->eod_id;
}

int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_bytes.size()); }

int32_t HfTokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return -1;
}

std::vector<std::string_view> HfTokenizer::pretokenize(std::string_view text) const {
  // Views into `text` are only possible without add_prefix_space; callers use it for tests.
  std::vector<std::string_view> out;
  std::vector<std::string_view> pieces{text};
  for (const PreStep& s : impl_->steps) {
    if (s.byte_level && !s.use_regex) continue;
    std::vector<std::string_view> next;
    for (std::string_view p : pieces) {
      auto parts = (s.byte_level || s.kind == SplitKind::kGpt2) ? Gpt2Tokenizer::pretokenize(p)
                                                                : pretokenize_llama3(p, s.kind == SplitKind::kLlama3 ? 3 : 1);
      next.insert(next.end(), parts.begin(), parts.end());
    }
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace mt::data
