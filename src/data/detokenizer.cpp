#include "data/detokenizer.h"

#include <cctype>

namespace mt::data {
namespace {

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
