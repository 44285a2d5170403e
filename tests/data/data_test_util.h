// Helpers shared by the data-layer tests: temporary directories, file writing, byte-level strings.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/gpt2_tokenizer.h"

namespace mt::data::testing {

/// A fresh temporary directory, removed (recursively) at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mt_data_test_XXXXXX").string();
    char* p = ::mkdtemp(tmpl.data());
    if (p == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline void append_utf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

/// Raw bytes -> GPT-2 byte-level token string (UTF-8), as stored in vocab.json / merges.txt.
inline std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) append_utf8(Gpt2Tokenizer::byte_to_unicode(b), &out);
  return out;
}

/// JSON string literal of a UTF-8 string (escapes " and \ only; the rest is UTF-8).
inline std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out + "\"";
}

/// A small byte-level BPE vocabulary: the 256 single-byte tokens (ids 0..255 in byte order), then
/// the results of `merges` (raw bytes, in order, skipping ones already present), then <|endoftext|>.
/// Writes vocab.json and merges.txt (with a "#version" line) into dir; returns the token list.
inline std::vector<std::string> write_tiny_vocab(const std::string& dir,
                                                 const std::vector<std::pair<std::string, std::string>>& merges) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, static_cast<char>(b)));
  for (const auto& [a, b] : merges) {
    if (std::find(tokens.begin(), tokens.end(), a + b) == tokens.end()) tokens.push_back(a + b);
  }
  tokens.push_back("<|endoftext|>");
  std::string json = "{";
  for (size_t i = 0; i < tokens.size(); ++i) {
    json += (i ? ", " : "") + json_quote(byte_level(tokens[i])) + ": " + std::to_string(i);
  }
  json += "}";
  write_file(dir + "/vocab.json", json);
  std::string m = "#version: 0.2\n";
  for (const auto& [a, b] : merges) m += byte_level(a) + " " + byte_level(b) + "\n";
  write_file(dir + "/merges.txt", m);
  return tokens;
}

/// Directory of the demo data (tools/fetch_demo_data.sh): $MT_DATA_DIR, else $MT_SOURCE_DIR/data,
/// else "data".
inline std::string demo_data_dir() {
  if (const char* d = std::getenv("MT_DATA_DIR"); d != nullptr && *d != '\0') return d;
  if (const char* s = std::getenv("MT_SOURCE_DIR"); s != nullptr && *s != '\0') return std::string(s) + "/data";
  return "data";
}

/// Expects `fn` to throw mt::Error whose message contains every string in `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected mt::Error containing '" << (parts.empty() ? "" : parts[0]) << "'";
  } catch (const mt::Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
  }
}

}  // namespace mt::data::testing
