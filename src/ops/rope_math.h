// The RoPE formulas (ops/rope.h), shared by the CPU and CUDA backends so that both use the same
// fp32 frequencies and the same rotation expressions.
#pragma once
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
