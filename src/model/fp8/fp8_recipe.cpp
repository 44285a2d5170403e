#include "model/fp8/fp8_recipe.h"

#include <fmt/format.h>

#include "core/check.h"

namespace mt {

Fp8Format parse_fp8_format(const std::string& s) {
  if (s == "e4m3") return Fp8Format::kE4M3;
  if (s == "hybrid") return Fp8Format::kHybrid;
  MT_FAIL("--fp8-format '{}' is not supported: expected e4m3 or hybrid", s);
}

Fp8Recipe parse_fp8_recipe(const std::string& s) {
  if (s == "tensorwise") return Fp8Recipe::kTensorwise;
  if (s == "delayed") return Fp8Recipe::kDelayed;
  if (s == "blockwise") return Fp8Recipe::kBlockwise;
  if (s == "mxfp8" || s == "custom")
    MT_FAIL("--fp8-recipe {} is not built (mxfp8 needs Blackwell's MX GEMMs, custom a Python recipe factory): use "
            "tensorwise, delayed or blockwise",
            s);
  MT_FAIL("--fp8-recipe '{}' is not supported: expected tensorwise, delayed or blockwise", s);
}

fp8_math::AmaxAlgo parse_fp8_amax_compute_algo(const std::string& s) {
  if (s == "most_recent") return fp8_math::AmaxAlgo::kMostRecent;
  if (s == "max") return fp8_math::AmaxAlgo::kMax;
  MT_FAIL("--fp8-amax-compute-algo '{}' is not supported: expected most_recent or max", s);
}

const char* fp8_format_name(Fp8Format f) {
  switch (f) {
    case Fp8Format::kE4M3: return "e4m3";
    case Fp8Format::kHybrid: return "hybrid";
    case Fp8Format::kNone: break;
  }
  return "off";
}

const char* fp8_recipe_name(Fp8Recipe r) {
  switch (r) {
    case Fp8Recipe::kTensorwise: return "tensorwise";
    case Fp8Recipe::kDelayed: return "delayed";
    case Fp8Recipe::kBlockwise: return "blockwise";
  }
  return "?";
}

const char* fp8_amax_compute_algo_name(fp8_math::AmaxAlgo a) {
  return a == fp8_math::AmaxAlgo::kMax ? "max" : "most_recent";
}

std::string Fp8Settings::summary() const {
  std::string s = fmt::format("{} {}", fp8_format_name(format), fp8_recipe_name(recipe));
  if (recipe == Fp8Recipe::kDelayed)
    s += fmt::format(" (history {}, {}, margin {})", amax_history_len, fp8_amax_compute_algo_name(amax_compute_algo),
                     margin);
  return s;
}

}  // namespace mt
