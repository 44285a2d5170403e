// CLI11 validators with short messages. CLI::PositiveNumber names its range as "0.000000 to
// 1.797693e+308" spelled out in 300 digits; these say what was expected and what was given.
#pragma once
#include <CLI/CLI.hpp>

#include <string>

namespace mt {

/// Accepts an integer >= 1: "--workers 0" -> "must be a positive integer (>= 1), got '0'".
inline CLI::Validator positive_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          size_t pos = 0;
          const long long v = std::stoll(s, &pos);
          if (pos == s.size() && v >= 1) return {};
        } catch (const std::exception&) {
        }
        return "must be a positive integer (>= 1), got '" + s + "'";
      },
      "INT>=1");
}

}  // namespace mt
