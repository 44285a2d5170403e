#include "data/detokenizer.h"

#include <algorithm>
#include <cctype>

namespace mt::data {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// One unit of a UTF-8 scan from s[i]: a well-formed character, or an ill-formed maximal subpart
// (truncated: cut short by the end of s, so more bytes could still complete it).
struct Utf8Unit {
  size_t length;
  bool valid;
  bool truncated;
};

Utf8Unit utf8_unit(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return {1, true, false};
  size_t need = 0;  // continuation bytes after the start (Unicode 15 table 3-7)
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;  // no overlong forms
    if (b == 0xED) hi = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;  // no overlong forms
    if (b == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {1, false, false};  // 80..C1, F5..FF never start a character
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {k, false, true};
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < lo || c > hi) return {k, false, false};
    lo = 0x80;
    hi = 0xBF;
  }
  return {need + 1, true, false};
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  for (size_t j; (j = s.find(from, i)) != std::string::npos; i = j + from.size()) {
    out.append(s, i, j - i);
    out += to;
  }
  out.append(s, i, std::string::npos);
  s = std::move(out);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// re.sub(open \s*([^close]*?)\s* close, open \1 close): each `open` up to the next `close` (none
// between, by the character class), its inner whitespace at both ends removed; scanning resumes
// after the match, or after `open` when no `close` follows.
void tighten_pairs(std::string& s, char open, char close) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != open) {
      out += s[i++];
      continue;
    }
    const size_t j = s.find(close, i + 1);
    if (j == std::string::npos) {
      out += s[i++];
      continue;
    }
    size_t a = i + 1, z = j;
    while (a < z && is_space(s[a])) ++a;
    while (z > a && is_space(s[z - 1])) --z;
    out += open;
    out.append(s, a, z - a);
    out += close;
    i = j + 1;
  }
  s = std::move(out);
}

// re.sub(r"/' [0-9]/", r"/'[0-9]/"): the replacement is literal text.
void slash_quote_digit(std::string& s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (i + 5 <= s.size() && s.compare(i, 3, "/' ") == 0 && std::isdigit(static_cast<unsigned char>(s[i + 3])) &&
        s[i + 4] == '/') {
      out += "/'[0-9]/";
      i += 5;
    } else {
      out += s[i++];
    }
  }
  s = std::move(out);
}

}  // namespace

std::string utf8_replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const Utf8Unit u = utf8_unit(bytes, i);
    if (u.valid) {
      out.append(bytes.substr(i, u.length));
    } else {
      out.append(kReplacement);
    }
    i += u.length;
  }
  return out;
}

size_t utf8_first_invalid(std::string_view bytes) {
  for (size_t i = 0; i < bytes.size();) {
    const Utf8Unit u = utf8_unit(bytes, i);
    if (!u.valid) return i;
    i += u.length;
  }
  return std::string::npos;
}

size_t utf8_incomplete_tail(std::string_view bytes) {
  // Every scan starts a unit at each byte outside 80..BF, so a scan from 3 bytes before the end
  // finds the same last unit as a scan from the start.
  size_t i = bytes.size() > 3 ? bytes.size() - 3 : 0;
  while (i < bytes.size()) {
    const Utf8Unit u = utf8_unit(bytes, i);
    if (u.truncated) return bytes.size() - i;
    i += u.length;
  }
  return 0;
}

std::string IncrementalDetokenizer::push(int32_t id) {
  window_.push_back(id);
  const std::string bytes = tok_->decode(window_);
  // A decoder that rewrites text it already returned (none of ours does) cannot take it back:
  // continue after what it returns now.
  if (bytes.size() < emitted_) emitted_ = bytes.size();
  const std::string_view tail = std::string_view(bytes).substr(emitted_);
  size_t keep = tail.size() - utf8_incomplete_tail(tail);
  while (keep >= kReplacement.size() && tail.substr(keep - kReplacement.size(), kReplacement.size()) == kReplacement)
    keep -= kReplacement.size();
  std::string out = utf8_replace_invalid(tail.substr(0, keep));
  emitted_ += keep;
  if (emitted_ == bytes.size() && window_.size() > kContextTokens) {  // nothing held: keep a short context
    window_.erase(window_.begin(), window_.end() - static_cast<std::ptrdiff_t>(kContextTokens));
    emitted_ = tok_->decode(window_).size();
  }
  return out;
}

std::string IncrementalDetokenizer::finish() {
  const std::string bytes = tok_->decode(window_);
  std::string out = utf8_replace_invalid(std::string_view(bytes).substr(std::min(emitted_, bytes.size())));
  window_.clear();
  emitted_ = 0;
  return out;
}

DetokenizedText detokenize_pieces(const Tokenizer& tok, std::span<const int32_t> ids) {
  DetokenizedText r;
  r.text = utf8_replace_invalid(tok.decode(ids));
  IncrementalDetokenizer inc(tok);
  for (int32_t id : ids) r.pieces.push_back(inc.push(id));
  std::string rest = inc.finish();
  if (!rest.empty()) {
    if (r.pieces.empty()) r.pieces.emplace_back();
    r.pieces.back() += rest;
  }
  return r;
}

std::string wikitext_detokenize(std::string s) {
  replace_all(s, "s '", "s'");
  slash_quote_digit(s);
  replace_all(s, " @-@ ", "-");
  replace_all(s, " @,@ ", ",");
  replace_all(s, " @.@ ", ".");
  for (const char* p : {" : ", " ; ", " . ", " ! ", " ? ", " , "}) replace_all(s, p, std::string(p + 1));
  tighten_pairs(s, '(', ')');
  tighten_pairs(s, '[', ']');
  tighten_pairs(s, '{', '}');
  tighten_pairs(s, '"', '"');
  tighten_pairs(s, '\'', '\'');
  replace_all(s, "= = = =", "====");
  replace_all(s, "= = =", "===");
  replace_all(s, "= =", "==");
  replace_all(s, " \xC2\xB0 ", "\xC2\xB0");  // the degree sign, U+00B0 in UTF-8
  replace_all(s, " \n", "\n");
  replace_all(s, "\n ", "\n");
  replace_all(s, " N ", " 1 ");
  replace_all(s, " 's", "'s");
  return s;
}

std::string ptb_detokenize(std::string s) {
  replace_all(s, " '", "'");
  replace_all(s, " \n", "\n");
  replace_all(s, "\n ", "\n");
  replace_all(s, " n't", "n't");
  replace_all(s, " N ", "1 ");
  replace_all(s, "$ 1", "$1");
  replace_all(s, "# 1", "#1");
  return s;
}

const char* detokenizer_for(const std::string& path) {
  if (path.find("ptb") != std::string::npos) return "ptb";
  if (path.find("wiki") != std::string::npos) return "wikitext";
  if (path.find("lambada") != std::string::npos) return "lambada";
  return "";
}

std::string detokenize_for(const std::string& path, std::string text) {
  const std::string d = detokenizer_for(path);
  if (d == "ptb") return ptb_detokenize(std::move(text));
  if (d == "wikitext") return wikitext_detokenize(std::move(text));
  return text;
}

}  // namespace mt::data
