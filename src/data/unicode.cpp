#include "data/unicode.h"

#include <algorithm>
#include <array>

namespace mt::data {
namespace {

using unicode_detail::CodepointRange;

bool in_ranges(const CodepointRange* ranges, size_t n, char32_t cp) {
  // First range whose hi >= cp; cp is inside when lo <= cp.
  const CodepointRange* end = ranges + n;
  const CodepointRange* it =
      std::lower_bound(ranges, end, cp, [](const CodepointRange& r, char32_t c) { return r.hi < c; });
  return it != end && it->lo <= cp;
}

// ASCII fast path, built from the same tables.
struct AsciiClasses {
  std::array<CharClass, 128> cls{};
  AsciiClasses() {
    for (char32_t c = 0; c < 128; ++c) {
      cls[c] = is_letter(c) ? CharClass::kLetter
               : is_number(c) ? CharClass::kNumber
               : is_whitespace(c) ? CharClass::kWhitespace
                                  : CharClass::kOther;
    }
  }
};

}  // namespace

size_t utf8_decode(std::string_view text, size_t pos, char32_t* cp) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  const unsigned char b0 = s[pos];
  *cp = kInvalidCodepoint;
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t len;
  char32_t value;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte (shortest form, no surrogates)
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    value = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    value = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    value = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // > U+10FFFF
  } else {
    return 1;  // continuation byte, C0/C1 or F5..FF: invalid
  }
  if (pos + len > n) return 1;
  for (size_t k = 1; k < len; ++k) {
    const unsigned char b = s[pos + k];
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 1;
    value = (value << 6) | (b & 0x3F);
  }
  *cp = value;
  return len;
}

bool is_letter(char32_t cp) {
  return in_ranges(unicode_detail::kLetterRanges, unicode_detail::kNumLetterRanges, cp);
}
bool is_number(char32_t cp) {
  return in_ranges(unicode_detail::kNumberRanges, unicode_detail::kNumNumberRanges, cp);
}
bool is_whitespace(char32_t cp) {
  return in_ranges(unicode_detail::kWhitespaceRanges, unicode_detail::kNumWhitespaceRanges, cp);
}
bool is_upper_or_mark(char32_t cp) {
  return in_ranges(unicode_detail::kUpperOrMarkRanges, unicode_detail::kNumUpperOrMarkRanges, cp);
}
bool is_lower_or_mark(char32_t cp) {
  return in_ranges(unicode_detail::kLowerOrMarkRanges, unicode_detail::kNumLowerOrMarkRanges, cp);
}

CharClass char_class(char32_t cp) {
  static const AsciiClasses ascii;
  if (cp < 128) return ascii.cls[cp];
  if (cp == kInvalidCodepoint) return CharClass::kOther;
  if (is_letter(cp)) return CharClass::kLetter;
  if (is_number(cp)) return CharClass::kNumber;
  if (is_whitespace(cp)) return CharClass::kWhitespace;
  return CharClass::kOther;
}

const char* unicode_version() { return unicode_detail::kUnicodeVersion; }

}  // namespace mt::data
