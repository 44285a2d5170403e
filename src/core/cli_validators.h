// CLI11 validators with short messages that name the value as given, and the strict number
// syntax of every numeric flag (docs/flags.md "Numbers").
//
// CLI11 alone converts integers with strtoll/strtoull in base 0: "010" is octal 8, "0x10" is 16,
// 99999999999999999999 becomes INT64_MAX without a word, and "-1" given to an unsigned flag
// wraps to 18446744073709551615; a float flag accepts "inf", "nan" and hexadecimal floats, and
// 1e39 given to a float becomes inf. strict_numbers() puts a check in front of CLI11's
// conversion of every integer and floating-point option so that a flag holds exactly the number
// written, or the command stops with "--flag: <what was expected>, got '<value>'".
#pragma once
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace mt {

namespace cli_detail {

/// Decimal integer syntax (Python's int() on a flag, as Megatron's argparse reads them): blanks
/// around, an optional sign, decimal digits (leading zeros allowed, read as decimal). The value,
/// or nullopt for any other text ("0x10", "1e3", "1.0", ""). Values beyond about 1e36 saturate
/// (they are out of every flag's range anyway).
inline std::optional<__int128> parse_decimal_integer(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  bool negative = false;
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) {
    negative = s.front() == '-';
    s.remove_prefix(1);
  }
  if (s.empty()) return std::nullopt;
  constexpr __int128 kSaturate = static_cast<__int128>(1) << 120;
  __int128 v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    if (v < kSaturate) v = v * 10 + (c - '0');
  }
  return negative ? -v : v;
}

inline std::string to_string(__int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  unsigned __int128 u = negative ? static_cast<unsigned __int128>(-(v + 1)) + 1 : static_cast<unsigned __int128>(v);
  std::string s;
  while (u > 0) {
    s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(u % 10)));
    u /= 10;
  }
  return negative ? "-" + s : s;
}

/// Decimal floating-point syntax (no "inf", "nan", hexadecimal): [+-](d+[.d*]|.d+)([eE][+-]d+).
inline bool is_decimal_float(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  size_t i = 0;
  auto digits = [&] {
    const size_t start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    return i - start;
  };
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t mantissa = digits();
  if (i < s.size() && s[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == s.size();
}

}  // namespace cli_detail

/// Integer flags (CLI11 type INT, or UINT for unsigned variables): the decimal syntax of
/// cli_detail::parse_decimal_integer within int64 (UINT: [0, 2^64 - 1]), rewritten to plain
/// decimal before CLI11 converts it ("010" -> "10"). A narrower variable (int) rejects what does
/// not fit it in CLI11's conversion (apps/megatron.cpp names the flag and the value).
/// Messages: "expected an integer, got '1.5'", "'-1' is negative: expected an integer >= 0",
/// "'99999999999999999999' is out of range: expected an integer in [-9223372036854775808,
/// 9223372036854775807]".
inline CLI::Validator strict_integer(bool is_unsigned) {
  return CLI::Validator(
      [is_unsigned](std::string& s) -> std::string {
        const std::optional<__int128> v = cli_detail::parse_decimal_integer(s);
        if (!v) return "expected an integer, got '" + s + "'";
        if (is_unsigned) {
          if (*v < 0) return "'" + s + "' is negative: expected an integer >= 0";
          if (*v > static_cast<__int128>(std::numeric_limits<uint64_t>::max()))
            return "'" + s + "' is out of range: expected an integer in [0, 18446744073709551615]";
        } else if (*v < std::numeric_limits<int64_t>::min() || *v > std::numeric_limits<int64_t>::max()) {
          return "'" + s + "' is out of range: expected an integer in [-9223372036854775808, 9223372036854775807]";
        }
        s = cli_detail::to_string(*v);
        return {};
      },
      "");
}

/// Floating-point flags (CLI11 type FLOAT): decimal syntax (cli_detail::is_decimal_float), finite,
/// and representable as a 32-bit float (|x| <= 3.4028235e38, and not so small that it would be
/// stored as 0), since several such flags are floats. Messages: "expected a number, got 'abc'",
/// "expected a finite number, got 'inf'", "'1e39' is out of range: ...".
inline CLI::Validator strict_float() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (!cli_detail::is_decimal_float(s)) {
          const std::string l = CLI::detail::to_lower(s);
          if (l.find("inf") != std::string::npos || l.find("nan") != std::string::npos)
            return "expected a finite number, got '" + s + "'";
          return "expected a number, got '" + s + "'";
        }
        const long double v = std::strtold(s.c_str(), nullptr);
        if (!std::isfinite(v) || std::fabs(v) > FLT_MAX)
          return "'" + s + "' is out of range: expected a number of magnitude at most 3.4028235e+38";
        if (v != 0 && static_cast<float>(v) == 0.f)
          return "'" + s + "' is too small: it would be stored as 0 (the smallest positive value is 1.4e-45)";
        return {};
      },
      "");
}

/// An integer in [lo, hi]: "must be an integer in [1, 4294967295], got '-1'" (or "must be an
/// integer >= 0, got ..." when hi is INT64_MAX). Use with the strict syntax (strict_numbers).
inline CLI::Validator integer_range(int64_t lo, int64_t hi = std::numeric_limits<int64_t>::max()) {
  return CLI::Validator(
      [lo, hi](const std::string& s) -> std::string {
        const std::optional<__int128> v = cli_detail::parse_decimal_integer(s);
        if (v && *v >= lo && *v <= hi) return {};
        if (hi == std::numeric_limits<int64_t>::max())
          return "must be an integer >= " + std::to_string(lo) + ", got '" + s + "'";
        return "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + s + "'";
      },
      "");
}

/// Accepts an integer >= 1: "--workers 0" -> "must be a positive integer (>= 1), got '0'".
inline CLI::Validator positive_integer() {
  return CLI::Validator(
      [](const std::string& s) -> std::string {
        const std::optional<__int128> v = cli_detail::parse_decimal_integer(s);
        if (v && *v >= 1 && *v <= std::numeric_limits<int64_t>::max()) return {};
        return "must be a positive integer (>= 1), got '" + s + "'";
      },
      "");
}

/// No upper bound for number_range.
inline constexpr double kNoMax = std::numeric_limits<double>::max();

/// A number x in [lo, hi] (an end excluded when open_low / open_high): "must be in [0, 1), got
/// '1'", "must be > 0, got '0'" (hi = kNoMax). Use with the strict syntax (strict_numbers).
inline CLI::Validator number_range(double lo, double hi, bool open_low = false, bool open_high = false) {
  return CLI::Validator(
      [lo, hi, open_low, open_high](const std::string& s) -> std::string {
        if (cli_detail::is_decimal_float(s)) {
          const double v = std::strtod(s.c_str(), nullptr);
          if ((open_low ? v > lo : v >= lo) && (open_high ? v < hi : v <= hi)) return {};
        }
        const auto num = [](double x) { return fmt::format("{}", x); };
        if (hi == kNoMax) return fmt::format("must be {} {}, got '{}'", open_low ? ">" : ">=", num(lo), s);
        return fmt::format("must be in {}{}, {}{}, got '{}'", open_low ? "(" : "[", num(lo), num(hi), open_high ? ")" : "]", s);
      },
      "");
}

/// Puts strict_integer / strict_float in front of every integer and floating-point option of
/// `app` and of its subcommands (recursively), by CLI11's type name (INT, UINT, FLOAT). Call once,
/// after all options are registered.
inline void strict_numbers(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name().substr(0, opt->get_type_name().find(':'));
    if (type == "INT" || type == "UINT") opt->transform(strict_integer(type == "UINT"));
    if (type == "FLOAT") opt->transform(strict_float());
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) strict_numbers(*sub);
}

/// The message for CLI11's ConversionError ("Could not convert: --flag = v1,v2") once
/// strict_numbers has checked the syntax: the value is then an integer too large for a flag held
/// in a 32-bit int -> "--tensor-model-parallel-size: '99999999999' is out of range: expected an
/// integer in [-2147483648, 2147483647]". Any other text is returned unchanged.
inline std::string conversion_error_message(const std::string& what) {
  constexpr std::string_view kPrefix = "Could not convert: ";
  const size_t eq = what.find(" = ");
  if (what.rfind(kPrefix, 0) != 0 || eq == std::string::npos) return what;
  const std::string name = what.substr(kPrefix.size(), eq - kPrefix.size());
  std::string value = what.substr(eq + 3);
  if (const size_t comma = value.rfind(','); comma != std::string::npos) value = value.substr(comma + 1);  // the last
  const std::optional<__int128> v = cli_detail::parse_decimal_integer(value);
  if (!v || (*v >= std::numeric_limits<int32_t>::min() && *v <= std::numeric_limits<int32_t>::max())) return what;
  return name + ": '" + value + "' is out of range: expected an integer in [-2147483648, 2147483647]";
}

}  // namespace mt
