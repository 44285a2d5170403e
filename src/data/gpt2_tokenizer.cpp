#include "data/gpt2_tokenizer.h"

#include <algorithm>
#include <array>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/check.h"
#include "data/bpe_util.h"
#include "data/file_util.h"
#include "data/unicode.h"

namespace mt::data {
namespace {

constexpr std::string_view kEndOfText = "<|endoftext|>";
constexpr int kNumCacheShards = 16;
constexpr size_t kMaxCacheEntriesPerShard = 1 << 16;  // a full shard is cleared
constexpr size_t kMaxCachedWordBytes = 128;            // longer pieces are not cached

// bytes_to_unicode() of encoder.py: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in increasing byte order.
struct ByteMap {
  std::array<char32_t, 256> to_unicode{};
  std::array<int16_t, 512> from_unicode{};  // code point (< 512) -> byte, -1 if none
  ByteMap() {
    from_unicode.fill(-1);
    auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      to_unicode[b] = printable(b) ? static_cast<char32_t>(b) : next++;
      from_unicode[to_unicode[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Byte-level token string (UTF-8 of byte-alphabet code points) -> raw bytes. Returns false if a
// character is not in the byte alphabet (or the string is not valid UTF-8).
bool byte_level_to_bytes(std::string_view s, std::string* out) {
  out->clear();
  const ByteMap& m = byte_map();
  for (size_t i = 0; i < s.size();) {
    char32_t cp;
    i += utf8_decode(s, i, &cp);
    if (cp == kInvalidCodepoint || cp >= m.from_unicode.size() || m.from_unicode[cp] < 0) return false;
    out->push_back(static_cast<char>(m.from_unicode[cp]));
  }
  return true;
}

std::string printable(std::string_view s) {
  std::string r;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      r.push_back(static_cast<char>(c));
    } else {
      r += fmt::format("\\x{:02x}", c);
    }
  }
  return r;
}

struct Merge {
  int32_t rank;
  int32_t merged;
};

}  // namespace

struct Gpt2Tokenizer::Impl {
  std::vector<std::string> id_to_bytes;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> bytes_to_id;
  std::array<int32_t, 256> byte_id{};
  std::unordered_map<uint64_t, Merge> merges;  // pair_key(left id, right id) -> rank, merged id
  int64_t num_merges = 0;
  int32_t eod_id = -1;

  struct CacheShard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  mutable std::array<CacheShard, kNumCacheShards> cache;

  void load_vocab(std::string_view json_text, const std::string& name);
  void load_merges(std::string_view text, const std::string& name);
  void bpe(std::string_view word, std::vector<int32_t>* out) const;
  void encode_word(std::string_view word, std::vector<int32_t>* out) const;
};

void Gpt2Tokenizer::Impl::load_vocab(std::string_view json_text, const std::string& name) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text.begin(), json_text.end());
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("vocab file '{}': malformed JSON: {}", name, e.what());
  }
  MT_REQUIRE(j.is_object(), "vocab file '{}': expected a JSON object {{token: id}}, got {}", name, j.type_name());
  MT_REQUIRE(!j.empty(), "vocab file '{}': empty vocabulary", name);
  const size_t v = j.size();
  MT_REQUIRE(v < (size_t{1} << 31), "vocab file '{}': {} entries is too many", name, v);
  id_to_bytes.assign(v, std::string());
  std::vector<bool> seen(v, false);
  bytes_to_id.reserve(v);
  std::string bytes;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    MT_REQUIRE(it.value().is_number_integer(), "vocab file '{}': token \"{}\" has a non-integer id {}", name,
               printable(key), it.value().dump());
    const int64_t id = it.value().get<int64_t>();
    MT_REQUIRE(id >= 0 && static_cast<size_t>(id) < v,
               "vocab file '{}': token \"{}\" has id {} outside [0, {}) (ids must be 0..V-1, each once)", name,
               printable(key), id, v);
    MT_REQUIRE(!seen[id], "vocab file '{}': id {} is used twice (ids must be 0..V-1, each once)", name, id);
    MT_REQUIRE(byte_level_to_bytes(key, &bytes),
               "vocab file '{}': token \"{}\" (id {}) has a character outside GPT-2's byte-level alphabet", name,
               printable(key), id);
    seen[id] = true;
    auto [pos, inserted] = bytes_to_id.emplace(bytes, static_cast<int32_t>(id));
    MT_REQUIRE(inserted, "vocab file '{}': token \"{}\" appears twice (ids {} and {})", name, printable(key),
               pos->second, id);
    id_to_bytes[id] = bytes;
  }
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    auto it = bytes_to_id.find(std::string_view(&c, 1));
    MT_REQUIRE(it != bytes_to_id.end(), "vocab file '{}': the single-byte token for byte 0x{:02x} is missing", name,
               b);
    byte_id[b] = it->second;
  }
  auto eod = bytes_to_id.find(kEndOfText);
  eod_id = eod == bytes_to_id.end() ? -1 : eod->second;
}

void Gpt2Tokenizer::Impl::load_merges(std::string_view text, const std::string& name) {
  merges.reserve(text.size() / 8);
  std::string left, right;
  size_t line_no = 0;
  int32_t rank = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    if (line_no == 1 && line.starts_with("#version")) continue;
    const size_t sp = line.find(' ');
    MT_REQUIRE(sp != std::string_view::npos && sp > 0 && sp + 1 < line.size() &&
                   line.find(' ', sp + 1) == std::string_view::npos,
               "merges file '{}', line {}: expected two tokens separated by one space, got \"{}\"", name, line_no,
               printable(line));
    const std::string_view a = line.substr(0, sp), b = line.substr(sp + 1);
    MT_REQUIRE(byte_level_to_bytes(a, &left) && byte_level_to_bytes(b, &right),
               "merges file '{}', line {}: \"{}\" has a character outside GPT-2's byte-level alphabet", name,
               line_no, printable(line));
    auto ia = bytes_to_id.find(left), ib = bytes_to_id.find(right), im = bytes_to_id.find(left + right);
    MT_REQUIRE(ia != bytes_to_id.end() && ib != bytes_to_id.end() && im != bytes_to_id.end(),
               "merges file '{}', line {}: \"{}\": {} is not in the vocabulary", name, line_no, printable(line),
               ia == bytes_to_id.end() ? "the left part" : ib == bytes_to_id.end() ? "the right part" : "the merge");
    // A repeated merge keeps its first (highest-priority) rank.
    merges.emplace(pair_key(ia->second, ib->second), Merge{rank, im->second});
    ++rank;
  }
  num_merges = rank;
}

// BPE of one pre-token, with encoder.py's semantics: while some adjacent pair has a rank, take the
// lowest rank r and merge every occurrence of that pair in one left-to-right pass (non-overlapping),
// then repeat. Implemented with a linked list of symbols and a min-heap of candidate pairs keyed by
// (rank, position): all valid heap entries of rank r are taken together and applied left to right,
// which is exactly one pass of the reference; pairs formed by a merge are pushed for later passes.
void Gpt2Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>* out) const {
  const int n = static_cast<int>(word.size());
  if (n == 1) {
    out->push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  struct Sym {
    int32_t id;
    int prev, next;  // -1 = none
  };
  std::vector<Sym> sym(n);
  for (int i = 0; i < n; ++i) sym[i] = {byte_id[static_cast<unsigned char>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};
  struct Cand {
    int32_t rank;
    int left;  // index of the left symbol (its original position: order along the word)
    int32_t left_id, right_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push_pair = [&](int l) {
    if (l < 0 || sym[l].next < 0) return;
    const int r = sym[l].next;
    auto it = merges.find(pair_key(sym[l].id, sym[r].id));
    if (it != merges.end()) heap.push({it->second.rank, l, sym[l].id, sym[r].id});
  };
  auto valid = [&](const Cand& c) {
    return sym[c.left].id == c.left_id && sym[c.left].next >= 0 && sym[sym[c.left].next].id == c.right_id;
  };
  for (int i = 0; i + 1 < n; ++i) push_pair(i);
  std::vector<Cand> pass;
  while (!heap.empty()) {
    const int32_t rank = heap.top().rank;
    pass.clear();
    while (!heap.empty() && heap.top().rank == rank) {  // popped in increasing position
      pass.push_back(heap.top());
      heap.pop();
    }
    const int32_t merged = merges.find(pair_key(pass[0].left_id, pass[0].right_id))->second.merged;
    for (const Cand& c : pass) {
      if (!valid(c)) continue;  // stale, or consumed by the previous occurrence in this pass
      const int r = sym[c.left].next;
      sym[c.left].id = merged;
      sym[c.left].next = sym[r].next;
      if (sym[r].next >= 0) sym[sym[r].next].prev = c.left;
      sym[r].id = -1;
      push_pair(sym[c.left].prev);
      push_pair(c.left);
    }
  }
  for (int i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
}

void Gpt2Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>* out) const {
  if (word.size() > kMaxCachedWordBytes) {
    bpe(word, out);
    return;
  }
  CacheShard& shard = cache[std::hash<std::string_view>{}(word) % kNumCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.map.find(word);
    if (it != shard.map.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out->size();
  bpe(word, out);
  std::vector<int32_t> ids(out->begin() + static_cast<std::ptrdiff_t>(start), out->end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() >= kMaxCacheEntriesPerShard) shard.map.clear();
  shard.map.emplace(std::string(word), std::move(ids));
}

// ---------------------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------------------

Gpt2Tokenizer Gpt2Tokenizer::from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                          const std::string& vocab_name, const std::string& merges_name) {
  auto impl = std::make_shared<Impl>();
  impl->load_vocab(vocab_json, vocab_name);
  impl->load_merges(merges_txt, merges_name);
  return Gpt2Tokenizer(std::move(impl));
}

Gpt2Tokenizer Gpt2Tokenizer::from_files(const std::string& vocab_path, const std::string& merges_path) {
  const std::string vocab = read_file_to_string(vocab_path, "vocab file");
  const std::string merges = read_file_to_string(merges_path, "merges file");
  return from_strings(vocab, merges, vocab_path, merges_path);
}

std::vector<std::string_view> Gpt2Tokenizer::pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  size_t i = 0;
  // Class and length of the unit at byte p (p < n).
  auto unit = [&](size_t p, size_t* len) {
    char32_t cp;
    *len = utf8_decode(text, p, &cp);
    return char_class(cp);
  };
  // End of the run of units of class `cls` starting at p.
  auto run_end = [&](size_t p, CharClass cls) {
    size_t len;
    while (p < n && unit(p, &len) == cls) p += len;
    return p;
  };
  while (i < n) {
    size_t end = 0;
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive)
    if (text[i] == '\'' && i + 1 < n) {
      const char c = text[i + 1];
      if (c == 's' || c == 't' || c == 'm' || c == 'd') {
        end = i + 2;
      } else if (i + 2 < n && ((c == 'r' && text[i + 2] == 'e') || (c == 'v' && text[i + 2] == 'e') ||
                               (c == 'l' && text[i + 2] == 'l'))) {
        end = i + 3;
      }
    }
    if (end == 0) {
      size_t len0;
      const CharClass c0 = unit(i, &len0);
      if (text[i] == ' ' && i + 1 < n) {
        size_t len1;
        const CharClass c1 = unit(i + 1, &len1);
        // ' ?\p{L}+' | ' ?\p{N}+' | ' ?[^\s\p{L}\p{N}]+' with the optional space taken
        if (c1 != CharClass::kWhitespace) end = run_end(i + 1, c1);
      }
      if (end == 0) {
        if (c0 != CharClass::kWhitespace) {
          end = run_end(i, c0);  // the same three alternatives without the space
        } else {
          // '\s+(?!\S)' then '\s+': the whole run if it reaches the end of the text; otherwise the run
          // minus its last unit (which then precedes non-space), or the single unit if the run has one.
          size_t last_start = i, p = i, len;
          while (p < n && unit(p, &len) == CharClass::kWhitespace) {
            last_start = p;
            p += len;
          }
          end = (p == n || last_start == i) ? p : last_start;
        }
      }
    }
    pieces.push_back(text.substr(i, end - i));
    i = end;
  }
  return pieces;
}

void Gpt2Tokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  for (std::string_view piece : pretokenize(text)) impl_->encode_word(piece, out);
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  encode_append(text, &out);
  return out;
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  const int64_t v = vocab_size();
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    MT_REQUIRE(id >= 0 && id < v, "GPT-2 decode: token id {} (position {}) is out of range for vocab size {}", id,
               k, v);
    out += impl_->id_to_bytes[id];
  }
  return out;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  return decode(std::span<const int32_t>(ids.data(), ids.size()));
}

std::string Gpt2Tokenizer::decode_token(int32_t id) const {
  MT_REQUIRE(id >= 0 && id < vocab_size(), "GPT-2 decode: token id {} is out of range for vocab size {}", id,
             vocab_size());
  return impl_->id_to_bytes[id];
}

int32_t Gpt2Tokenizer::token_to_id(std::string_view token_bytes) const {
  auto it = impl_->bytes_to_id.find(token_bytes);
  return it == impl_->bytes_to_id.end() ? -1 : it->second;
}

int32_t Gpt2Tokenizer::eod() const {
  MT_REQUIRE(impl_->eod_id >= 0, "GPT-2 tokenizer: the vocabulary has no \"{}\" token", kEndOfText);
  return impl_->eod_id;
}

int64_t Gpt2Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_bytes.size()); }

int64_t Gpt2Tokenizer::num_merges() const { return impl_->num_merges; }

char32_t Gpt2Tokenizer::byte_to_unicode(uint8_t b) { return byte_map().to_unicode[b]; }

}  // namespace mt::data
