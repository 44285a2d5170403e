#include "data/tiktoken_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "core/check.h"
#include "data/file_util.h"
#include "data/hf_tokenizer.h"

namespace mt::data {

namespace {

// Megatron's SPECIAL_TOKENS (tiktoken_tokenizer.py) and the default vocabulary size.
const std::array<const char*, 7> kMegatronSpecials = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"};
constexpr int64_t kDefaultVocab = int64_t{1} << 17;
constexpr uint32_t kNoRank = std::numeric_limits<uint32_t>::max();

// Standard base64 (RFC 4648, '=' padding optional at the end). Error names `where`.
std::string base64_decode(std::string_view s, const std::string& where) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  while (!s.empty() && s.back() == '=') s.remove_suffix(1);
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    const int v = value(c);
    MT_REQUIRE(v >= 0, "TikTokenizer: {}: '{}' is not base64 (bad character '{}')", where, s, c);
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  MT_REQUIRE(bits < 6 && (acc & ((1u << bits) - 1)) == 0, "TikTokenizer: {}: '{}' is not base64 (bad length)", where,
             s);
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// Megatron's reload_mergeable_ranks: entry i has rank i and, for i < 256, the byte i.
std::vector<std::string> read_json_ranks(const std::string& text, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("TikTokenizer: '{}' is not valid JSON: {}", path, e.what());
  }
  MT_REQUIRE(j.is_array(), "TikTokenizer: '{}' must be a JSON list of {{rank, token_bytes, token_str}} entries", path);
  std::vector<std::string> tokens;
  tokens.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& e = j[i];
    const std::string where = fmt::format("'{}' entry {}", path, i);
    MT_REQUIRE(e.is_object() && e.contains("rank") && e.contains("token_bytes") && e["rank"].is_number_integer() &&
                   e["token_bytes"].is_string(),
               "TikTokenizer: {} needs an integer \"rank\" and a base64 string \"token_bytes\"", where);
    MT_REQUIRE(e["rank"].get<int64_t>() == static_cast<int64_t>(i), "TikTokenizer: {} has rank {}; expected {}", where,
               e["rank"].get<int64_t>(), i);
    std::string bytes = base64_decode(e["token_bytes"].get<std::string>(), where);
    MT_REQUIRE(i >= 256 || bytes == std::string(1, static_cast<char>(i)),
               "TikTokenizer: {}: the first 256 ranks must be the single bytes 0..255 in order", where);
    tokens.push_back(std::move(bytes));
  }
  return tokens;
}

// tiktoken's load_tiktoken_bpe: "base64 rank" per line (blank lines skipped), ranks 0, 1, 2, ...
std::vector<std::string> read_text_ranks(const std::string& text, const std::string& path) {
  std::vector<std::string> tokens;
  size_t pos = 0, line = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    const std::string_view l = trim(std::string_view(text).substr(pos, nl - pos));
    pos = nl + 1;
    ++line;
    if (l.empty()) continue;
    const std::string where = fmt::format("'{}' line {}", path, line);
    const size_t sp = l.find(' ');
    MT_REQUIRE(sp != std::string_view::npos, "TikTokenizer: {}: expected '<base64 token> <rank>', got '{}'", where, l);
    const std::string_view rank = trim(l.substr(sp + 1));
    MT_REQUIRE(!rank.empty() && std::all_of(rank.begin(), rank.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                   rank == std::to_string(tokens.size()),
               "TikTokenizer: {}: rank '{}'; expected {} (ranks in order from 0)", where, rank, tokens.size());
    tokens.push_back(base64_decode(l.substr(0, sp), where));
  }
  return tokens;
}

}  // namespace

struct TikTokenizer::Impl {
  std::string name;
  HfTokenizer::SplitPattern split;
  int64_t num_special = 0, vocab = 0;
  std::vector<std::string> specials;                   // id -> text, [0, num_special)
  std::vector<std::string> tokens;                     // rank -> bytes
  std::unordered_map<std::string, uint32_t> ranks;     // bytes -> rank
  std::unordered_map<std::string, int32_t> special_id;  // text -> id
  int32_t eos = 0;

  uint32_t rank_of(std::string_view b) const {
    const auto it = ranks.find(std::string(b));
    return it == ranks.end() ? kNoRank : it->second;
  }
};

TikTokenizer TikTokenizer::from_file(const std::string& path, const TikTokenOptions& options) {
  const std::string text = read_file_to_string(path, "TikTokenizer --tokenizer-model");
  const size_t first = text.find_first_not_of(" \t\r\n");
  std::vector<std::string> tokens =
      first != std::string::npos && text[first] == '[' ? read_json_ranks(text, path) : read_text_ranks(text, path);
  return from_ranks(std::move(tokens), options, path);
}

TikTokenizer TikTokenizer::from_ranks(std::vector<std::string> token_bytes, const TikTokenOptions& o,
                                      const std::string& name) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  MT_REQUIRE(o.pattern == "v1" || o.pattern == "v2", "--tiktoken-pattern: expected v1 or v2, got '{}'", o.pattern);
  // v1: [^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+ (the
  // possessive quantifiers and \s*[\r\n] match what the plain ones and \s*[\r\n]+ match here).
  impl->split = o.pattern == "v1" ? HfTokenizer::SplitPattern{false, 1, false, false}
                                  : HfTokenizer::SplitPattern{false, 1, true, true};
  impl->vocab = o.vocab_size > 0 ? o.vocab_size : kDefaultVocab;
  impl->num_special = o.num_special_tokens;
  std::vector<std::string> specials = o.special_tokens;
  if (specials.empty()) specials.assign(kMegatronSpecials.begin(), kMegatronSpecials.end());
  for (size_t i = 0; i < specials.size(); ++i)
    for (size_t k = 0; k < i; ++k)
      MT_REQUIRE(specials[i] != specials[k], "--tokenizer-special-tokens: '{}' is given twice", specials[i]);
  for (const char* s : kMegatronSpecials)
    MT_REQUIRE(std::find(specials.begin(), specials.end(), s) != specials.end(),
               "--tokenizer-special-tokens must include Megatron's {} (missing '{}')",
               "<unk> <s> </s> <mask> <pad> <cls> <sep>", s);
  MT_REQUIRE(static_cast<int64_t>(specials.size()) <= impl->num_special && impl->num_special < impl->vocab,
             "TikTokenizer: expected {} special tokens <= --tiktoken-num-special-tokens {} < vocabulary size {} "
             "(--vocab-size; default 131072)",
             specials.size(), impl->num_special, impl->vocab);
  for (int64_t i = static_cast<int64_t>(specials.size()); i < impl->num_special; ++i)
    specials.push_back(fmt::format("<SPECIAL_{}>", i));
  for (size_t i = 0; i < specials.size(); ++i) {
    MT_REQUIRE(!specials[i].empty(), "--tokenizer-special-tokens: an empty special token");
    MT_REQUIRE(impl->special_id.emplace(specials[i], static_cast<int32_t>(i)).second,
               "TikTokenizer: special token '{}' is repeated (a filler <SPECIAL_k> given by name?)", specials[i]);
  }
  impl->eos = impl->special_id.at("</s>");
  impl->specials = std::move(specials);
  const int64_t inner = impl->vocab - impl->num_special;
  MT_REQUIRE(static_cast<int64_t>(token_bytes.size()) >= inner,
             "TikTokenizer: '{}' has {} ranks; vocabulary size {} - {} special tokens needs {} (give --vocab-size {} "
             "to use them all)",
             name, token_bytes.size(), impl->vocab, impl->num_special, inner,
             static_cast<int64_t>(token_bytes.size()) + impl->num_special);
  token_bytes.resize(static_cast<size_t>(inner));  // Megatron: vocab[:max_vocab]
  for (size_t r = 0; r < token_bytes.size(); ++r) {
    MT_REQUIRE(!token_bytes[r].empty(), "TikTokenizer: '{}' rank {} is an empty token", name, r);
    MT_REQUIRE(impl->ranks.emplace(token_bytes[r], static_cast<uint32_t>(r)).second,
               "TikTokenizer: '{}' rank {} repeats the bytes of rank {}", name, r, impl->ranks.at(token_bytes[r]));
  }
  for (int b = 0; b < 256; ++b)
    MT_REQUIRE(impl->ranks.count(std::string(1, static_cast<char>(b))),
               "TikTokenizer: '{}' has no rank for the single byte 0x{:02X} (every byte needs one)", name, b);
  impl->tokens = std::move(token_bytes);
  return TikTokenizer(std::move(impl));
}

std::vector<std::string_view> TikTokenizer::pretokenize(std::string_view text) const {
  return HfTokenizer::pretokenize_split(text, impl_->split);
}

// tiktoken's byte_pair_encode / _byte_pair_merge.
std::vector<int32_t> TikTokenizer::encode_piece(std::string_view piece) const {
  const Impl& m = *impl_;
  const auto id = [&](uint32_t rank) { return static_cast<int32_t>(rank + m.num_special); };
  if (const uint32_t r = m.rank_of(piece); r != kNoRank) return {id(r)};
  // parts[k] = start of part k; rank[k] = rank of parts k and k+1 merged.
  std::vector<size_t> start;
  for (size_t i = 0; i <= piece.size(); ++i) start.push_back(i);
  auto pair_rank = [&](size_t k) {
    return k + 2 < start.size() ? m.rank_of(piece.substr(start[k], start[k + 2] - start[k])) : kNoRank;
  };
  std::vector<uint32_t> rank(start.size(), kNoRank);
  for (size_t k = 0; k + 2 < start.size(); ++k) rank[k] = pair_rank(k);
  for (;;) {
    size_t best = 0;
    uint32_t best_rank = kNoRank;
    for (size_t k = 0; k + 1 < start.size(); ++k)
      if (rank[k] < best_rank) best_rank = rank[k], best = k;
    if (best_rank == kNoRank) break;
    start.erase(start.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    rank.erase(rank.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    rank[best] = pair_rank(best);
    if (best > 0) rank[best - 1] = pair_rank(best - 1);
  }
  std::vector<int32_t> out;
  for (size_t k = 0; k + 1 < start.size(); ++k) {
    const uint32_t r = m.rank_of(piece.substr(start[k], start[k + 1] - start[k]));
    MT_CHECK(r != kNoRank, "TikTokenizer: a merged part without a rank");
    out.push_back(id(r));
  }
  return out;
}

void TikTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  const Impl& m = *impl_;
  size_t pos = 0;
  while (pos <= text.size()) {
    // the next special token: leftmost, then longest
    size_t at = std::string_view::npos, len = 0;
    int32_t sid = -1;
    for (const auto& [s, i] : m.special_id) {
      const size_t p = text.find(s, pos);
      if (p == std::string_view::npos) continue;
      if (p < at || (p == at && s.size() > len)) at = p, len = s.size(), sid = i;
    }
    const size_t end = at == std::string_view::npos ? text.size() : at;
    for (std::string_view piece : pretokenize(text.substr(pos, end - pos))) {
      const std::vector<int32_t> ids = encode_piece(piece);
      out->insert(out->end(), ids.begin(), ids.end());
    }
    if (sid < 0) break;
    out->push_back(sid);
    pos = at + len;
  }
}

std::string TikTokenizer::decode(std::span<const int32_t> ids) const {
  const Impl& m = *impl_;
  std::string s;
  for (const int32_t id : ids) {
    MT_REQUIRE(id >= 0 && id < m.vocab, "TikTokenizer decode: id {} outside [0, {})", id, m.vocab);
    s += id < m.num_special ? m.specials[static_cast<size_t>(id)] : m.tokens[static_cast<size_t>(id - m.num_special)];
  }
  return s;
}

int32_t TikTokenizer::eod() const { return impl_->eos; }

int64_t TikTokenizer::vocab_size() const { return impl_->vocab; }

}  // namespace mt::data
