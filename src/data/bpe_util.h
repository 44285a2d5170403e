// Helpers shared by the byte-pair-encoding tokenizers (gpt2_tokenizer.cpp, hf_tokenizer.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <string_view>

namespace mt::data {

/// Transparent string hash: unordered maps keyed by std::string looked up with std::string_view
/// (no temporary strings on the encode path).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

/// One 64-bit key for the token pair (a, b) of a merge table.
inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace mt::data
