// CPU reference of ops/rope.h (fp32): per (position, sample) token the cos/sin of its
// rotary_dim / 2 angles are computed once and applied to the g·(qpg + 1) query and key heads.
#include <cmath>
#include <vector>

#include "ops/rope.h"
#include "ops/rope_math.h"

namespace mt::cpu {
namespace {

/// sign = +1: forward rotation; -1: rotation by the negative angle (backward).
void rope_apply(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, float sign) {
  const int64_t s = qkv.size(0), b = qkv.size(1), g = qkv.size(2), heads = qkv.size(3), d = qkv.size(4);
  const int64_t rotated = cfg.queries_per_group + 1;  // query heads, then the key head
  const int64_t half = cfg.rotary_dim / 2;
  const std::vector<float> inv_freq = rope_math::rope_inv_freq(cfg.rotary_dim, cfg.base, cfg.yarn);
  const float amp = rope_math::yarn_concentration(cfg.yarn);
  const int32_t* pos = positions.empty() ? nullptr : positions.data_as<int32_t>();
  float* p = qkv.data_as<float>();
  const int64_t tokens = s * b;
  const int64_t i1_step = cfg.interleaved ? 2 : 1;           // channel of x1 = i * i1_step
  const int64_t i2_off = cfg.interleaved ? 1 : half;         // channel of x2 = channel of x1 + i2_off
#pragma omp parallel
  {
    std::vector<float> cs(half), sn(half);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int32_t tp = pos ? pos[t] : static_cast<int32_t>(t / b);
      for (int64_t i = 0; i < half; ++i) {
        const float a = rope_math::angle(tp, inv_freq[i]);
        cs[i] = amp * std::cos(a);
        sn[i] = sign * (amp * std::sin(a));
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        for (int64_t hi = 0; hi < rotated; ++hi) {
          float* x = p + ((t * g + gi) * heads + hi) * d;
          for (int64_t i = 0; i < half; ++i) {
            const int64_t c1 = i * i1_step;
            rope_math::rotate(x[c1], x[c1 + i2_off], cs[i], sn[i]);
          }
        }
      }
    }
  }
}

}  // namespace

void rope_forward(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  rope_apply(qkv, positions, cfg, 1.f);
}

void rope_backward(const Tensor& dqkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  rope_apply(dqkv, positions, cfg, -1.f);
}

}  // namespace mt::cpu
