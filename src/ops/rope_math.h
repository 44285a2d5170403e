// The RoPE formulas (ops/rope.h), shared by the CPU and CUDA backends so that both use the same
// fp32 frequencies and the same rotation expressions.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"  // MT_HD

namespace mt::rope_math {

/// inv_freq[i] = 1 / base^(2i / rotary_dim) in fp32, i < rotary_dim / 2, exactly as HF/Megatron:
/// 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)). Host only (powf of the C library),
/// so that both backends get bit-identical values.
inline std::vector<float> inv_freq(int64_t rotary_dim, float base) {
  std::vector<float> f(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    f[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  }
  return f;
}

/// YaRN rotary scaling (Peng et al. 2023, "YaRN", arXiv:2309.00071) as DeepSeek-V3 and Megatron-Core's
/// YarnRotaryEmbedding use it. off: plain RoPE.
struct Yarn {
  bool on = false;
  double factor = 1.0;                   ///< --rotary-scaling-factor (s)
  int64_t original_max_positions = 4096;  ///< --yarn-original-max-position-embeddings
  double beta_fast = 32.0, beta_slow = 1.0;  ///< --yarn-beta-fast / --yarn-beta-slow (rotations)
  double mscale = 1.0, mscale_all_dim = 0.0;  ///< --mscale / --mscale-all-dim
};

/// yarn_get_mscale: 1 for scale <= 1, else 0.1 · mscale · ln(scale) + 1 (double, as Python).
inline double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

/// The factor YaRN multiplies cos and sin by (Megatron's _yarn_get_concentration_factor; HF's
/// attention_factor): yarn_get_mscale(s, mscale) / yarn_get_mscale(s, mscale_all_dim), in fp32;
/// 1 when off.
inline float yarn_concentration(const Yarn& y) {
  if (!y.on) return 1.f;
  return static_cast<float>(yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim));
}

/// YaRN's inv_freq for rotary_dim channels (Megatron's YarnRotaryEmbedding.get_emb, correction
/// range rounded to integers): per pair i, with p_i = base^(2i / rotary_dim) (fp32),
///   extra_i = 1 / p_i,  inter_i = 1 / (s · p_i),
///   low = max(floor(c(beta_fast)), 0), high = min(ceil(c(beta_slow)), rotary_dim - 1),
///   c(r) = rotary_dim · ln(L_orig / (2π r)) / (2 ln base)   (double),
///   ramp_i = clamp((i − low) / (high − low), 0, 1) (fp32; high += 0.001 when equal),
///   inv_freq_i = inter_i · ramp_i + extra_i · (1 − ramp_i)   (fp32),
/// i.e. the high-frequency pairs (i < low) keep their frequency, the low ones (i > high) are
/// interpolated by 1/s. Host only.
inline std::vector<float> yarn_inv_freq(int64_t rotary_dim, float base, const Yarn& y) {
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(rotary_dim) *
           std::log(static_cast<double>(y.original_max_positions) / (rotations * 2.0 * 3.141592653589793)) /
           (2.0 * std::log(static_cast<double>(base)));
  };
  const double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow)), static_cast<double>(rotary_dim - 1));
  if (low == high) high += 0.001;
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  const float factor = static_cast<float>(y.factor);
  std::vector<float> f(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    const float p = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
    const float extra = 1.0f / p, inter = 1.0f / (factor * p);
    const float ramp = std::min(std::max((static_cast<float>(i) - lo) / span, 0.0f), 1.0f);
    const float mask = 1.0f - ramp;  // Megatron's inv_freq_mask: 1 keeps the original frequency
    f[static_cast<size_t>(i)] = inter * (1.0f - mask) + extra * mask;
  }
  return f;
}

/// The frequencies the backends use: yarn_inv_freq when YaRN is on, else inv_freq.
inline std::vector<float> rope_inv_freq(int64_t rotary_dim, float base, const Yarn& y) {
  return y.on ? yarn_inv_freq(rotary_dim, base, y) : inv_freq(rotary_dim, base);
}

/// angle = (float)pos * inv_freq (fp32 product).
MT_HD float angle(int32_t pos, float inv_freq) { return static_cast<float>(pos) * inv_freq; }

/// Rotates the pair (x1, x2) by the angle with cosine c and sine s (pass -s for the inverse):
/// x1' = x1 c - x2 s, x2' = x2 c + x1 s.
MT_HD void rotate(float& x1, float& x2, float c, float s) {
  const float a = x1 * c - x2 * s;
  const float b = x2 * c + x1 * s;
  x1 = a;
  x2 = b;
}

}  // namespace mt::rope_math
