// CPU RoPE against a float64 reference that builds each rotation matrix explicitly, against the
// rotate_half formulas of Hugging Face Llama / Megatron-Core written out here, backward against
// central finite differences, backward(forward(x)) == x, explicit vs default positions, and a test
// per documented error.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/rope.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::OwnedTensor;
const Device kCpu = Device::cpu();

struct Case {
  int64_t s, b, g, qpg, d, rotary_dim;
  bool interleaved;
  bool explicit_positions;
  float base;
  int32_t max_pos;  // explicit positions drawn from [0, max_pos)
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {5, 2, 2, 3, 16, 16, false, false, 10000.f, 0},      // full rotary, default positions
      {4, 3, 1, 1, 8, 4, true, true, 10000.f, 64},         // interleaved, partial rotary
      {3, 2, 3, 2, 10, 6, false, true, 500000.f, 4096},    // rotary_dim/2 = 3, Llama-3 base
      {7, 1, 1, 4, 128, 64, true, false, 10000.f, 0},      // interleaved, half of a 128 head
      {2, 2, 2, 1, 64, 64, false, true, 10000.f, 32768},   // large positions (long context)
      {3, 1, 2, 2, 6, 2, false, false, 10000.f, 0},        // a single pair
  };
  return c;
}

std::string str(const Case& c) {
  return fmt::format("s={} b={} g={} qpg={} d={} rd={} inter={} pos={} base={}", c.s, c.b, c.g, c.qpg, c.d,
                     c.rotary_dim, c.interleaved, c.explicit_positions, c.base);
}

RopeConfig config(const Case& c) {
  RopeConfig cfg;
  cfg.queries_per_group = c.qpg;
  cfg.rotary_dim = c.rotary_dim;
  cfg.base = c.base;
  cfg.interleaved = c.interleaved;
  return cfg;
}

int64_t total(const Case& c) { return c.s * c.b * c.g * (c.qpg + 2) * c.d; }

/// The angle of pair i at position pos, defined in fp32 as HF / Megatron compute it:
/// inv_freq = 1 / base^(2i / rotary_dim) (fp32), angle = (float)pos * inv_freq (fp32).
double angle_of(int32_t pos, int64_t i, const Case& c) {
  const float inv = 1.0f / std::pow(c.base, static_cast<float>(2 * i) / static_cast<float>(c.rotary_dim));
  return static_cast<double>(static_cast<float>(pos) * inv);
}

int32_t position(const std::vector<int32_t>& pos, const Case& c, int64_t si, int64_t bi) {
  return c.explicit_positions ? pos[si * c.b + bi] : static_cast<int32_t>(si);
}

/// Float64 reference: for every token, the rotary_dim x rotary_dim rotation matrix R (sign = -1:
/// its transpose, the rotation by the negative angle) is built explicitly and applied to the
/// first rotary_dim channels of each query and key head.
std::vector<double> rope_ref(const std::vector<float>& x, const std::vector<int32_t>& pos, const Case& c,
                             double sign) {
  std::vector<double> y(x.begin(), x.end());
  const int64_t rd = c.rotary_dim, half = rd / 2;
  std::vector<double> R(rd * rd);
  for (int64_t si = 0; si < c.s; ++si) {
    for (int64_t bi = 0; bi < c.b; ++bi) {
      std::fill(R.begin(), R.end(), 0.0);
      for (int64_t i = 0; i < half; ++i) {
        const int64_t p1 = c.interleaved ? 2 * i : i, p2 = c.interleaved ? 2 * i + 1 : i + half;
        const double th = sign * angle_of(position(pos, c, si, bi), i, c);
        R[p1 * rd + p1] = std::cos(th);
        R[p1 * rd + p2] = -std::sin(th);
        R[p2 * rd + p1] = std::sin(th);
        R[p2 * rd + p2] = std::cos(th);
      }
      for (int64_t gi = 0; gi < c.g; ++gi) {
        for (int64_t h = 0; h <= c.qpg; ++h) {  // query heads, then the key head
          const int64_t o = (((si * c.b + bi) * c.g + gi) * (c.qpg + 2) + h) * c.d;
          for (int64_t r = 0; r < rd; ++r) {
            double acc = 0;
            for (int64_t k = 0; k < rd; ++k) acc += R[r * rd + k] * x[o + k];
            y[o + r] = acc;
          }
        }
      }
    }
  }
  return y;
}

struct Inputs {
  std::vector<float> x;
  std::vector<int32_t> pos;
  OwnedTensor positions;  // empty tensor when !explicit_positions
};

Inputs make_inputs(const Case& c, const Stream& st) {
  Inputs in;
  in.x = testing::randn(total(c));
  if (c.explicit_positions) {
    in.pos = testing::randint(c.s * c.b, 0, c.max_pos);
    in.positions = testing::make_int_tensor(in.pos, kCpu, {c.s, c.b}, st);
  }
  return in;
}

/// True iff element e of qkv belongs to a value head or a pass-through channel.
bool untouched(const Case& c, int64_t e) {
  const int64_t ch = e % c.d, head = (e / c.d) % (c.qpg + 2);
  return head == c.qpg + 1 || ch >= c.rotary_dim;
}

/// Element-wise |got - ref| <= tol * (|x1| + |x2|) of the element's pair (few fp32 ulps of the
/// rotated magnitudes), untouched elements bitwise; and norm-wise rel. error.
void expect_rotated(const std::vector<float>& got, const std::vector<double>& ref, const std::vector<float>& x,
                    const Case& c, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_LT(testing::rel_err(got, ref), tol) << what;
  const int64_t half = c.rotary_dim / 2;
  for (int64_t e = 0; e < static_cast<int64_t>(got.size()); ++e) {
    if (untouched(c, e)) {
      ASSERT_EQ(got[e], x[e]) << what << " e=" << e;
      continue;
    }
    const int64_t ch = e % c.d, head0 = e - ch;
    int64_t partner;
    if (c.interleaved) {
      partner = ch ^ 1;
    } else {
      partner = ch < half ? ch + half : ch - half;
    }
    const double mag = std::fabs(x[e]) + std::fabs(x[head0 + partner]);
    ASSERT_LE(std::fabs(got[e] - ref[e]), tol * mag + 1e-30) << what << " e=" << e;
  }
}

TEST(Rope, ForwardMatchesRotationMatrixReference) {
  Stream st;
  for (const Case& c : cases()) {
    Inputs in = make_inputs(c, st);
    auto qkv = testing::make_tensor(in.x, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    rope_forward(qkv, in.positions, config(c), st);
    expect_rotated(testing::to_host(qkv, st), rope_ref(in.x, in.pos, c, 1.0), in.x, c, 2e-6, str(c));
  }
}

// The formulas of Hugging Face Llama (apply_rotary_pos_emb with rotate_half; cos/sin = cat(freqs,
// freqs)) and of Megatron-Core's interleaved variant (_rotate_half with x[..., ::2] / x[..., 1::2];
// freqs repeated pairwise), written out in float64: q' = q * cos + rotate_half(q) * sin.
TEST(Rope, MatchesHfRotateHalfFormula) {
  Stream st;
  for (const Case& c : cases()) {
    Inputs in = make_inputs(c, st);
    auto qkv = testing::make_tensor(in.x, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    rope_forward(qkv, in.positions, config(c), st);
    const int64_t rd = c.rotary_dim, half = rd / 2;
    std::vector<double> ref(in.x.begin(), in.x.end()), cos_full(rd), sin_full(rd), rot(rd);
    for (int64_t si = 0; si < c.s; ++si) {
      for (int64_t bi = 0; bi < c.b; ++bi) {
        for (int64_t k = 0; k < rd; ++k) {
          // HF: emb = cat(freqs, freqs); Megatron interleaved: freqs repeated as (f0, f0, f1, f1, ...).
          const int64_t i = c.interleaved ? k / 2 : k % half;
          const double th = angle_of(position(in.pos, c, si, bi), i, c);
          cos_full[k] = std::cos(th);
          sin_full[k] = std::sin(th);
        }
        for (int64_t gi = 0; gi < c.g; ++gi) {
          for (int64_t h = 0; h <= c.qpg; ++h) {
            const int64_t o = (((si * c.b + bi) * c.g + gi) * (c.qpg + 2) + h) * c.d;
            const float* t = &in.x[o];
            for (int64_t k = 0; k < rd; ++k) {
              if (c.interleaved) {
                rot[k] = k % 2 == 0 ? -double(t[k + 1]) : double(t[k - 1]);  // stack((-x2, x1), -1)
              } else {
                rot[k] = k < half ? -double(t[k + half]) : double(t[k - half]);  // cat((-x2, x1), -1)
              }
            }
            for (int64_t k = 0; k < rd; ++k) ref[o + k] = t[k] * cos_full[k] + rot[k] * sin_full[k];
          }
        }
      }
    }
    expect_rotated(testing::to_host(qkv, st), ref, in.x, c, 2e-6, str(c));
  }
}

// L = sum G * rope(x) with fixed random G: dL/dx = rope_backward(G). Central differences of the
// float64 reference for every element of x (L is linear in x: the differences are exact up to
// rounding).
TEST(Rope, BackwardMatchesFiniteDifferences) {
  Stream st;
  for (const Case& c : {cases()[0], cases()[1], cases()[2], cases()[5]}) {
    Inputs in = make_inputs(c, st);
    const auto gv = testing::randn(total(c));
    auto dqkv = testing::make_tensor(gv, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    rope_backward(dqkv, in.positions, config(c), st);
    std::vector<double> xd(in.x.begin(), in.x.end()), ref(total(c));
    // L(x) = sum_e G_e rope(x)_e, the pair formula evaluated on float64 x.
    auto loss_at = [&] {
      const int64_t rd = c.rotary_dim, half = rd / 2;
      double l = 0;
      for (int64_t si = 0; si < c.s; ++si) {
        for (int64_t bi = 0; bi < c.b; ++bi) {
          for (int64_t gi = 0; gi < c.g; ++gi) {
            for (int64_t h = 0; h < c.qpg + 2; ++h) {
              const int64_t o = (((si * c.b + bi) * c.g + gi) * (c.qpg + 2) + h) * c.d;
              for (int64_t k = 0; k < c.d; ++k) {
                double v = xd[o + k];
                if (h <= c.qpg && k < rd) {
                  const int64_t i = c.interleaved ? k / 2 : k % half;
                  const bool first = c.interleaved ? k % 2 == 0 : k < half;
                  const int64_t partner = c.interleaved ? (k ^ 1) : (first ? k + half : k - half);
                  const double th = angle_of(position(in.pos, c, si, bi), i, c);
                  v = first ? xd[o + k] * std::cos(th) - xd[o + partner] * std::sin(th)
                            : xd[o + k] * std::cos(th) + xd[o + partner] * std::sin(th);
                }
                l += gv[o + k] * v;
              }
            }
          }
        }
      }
      return l;
    };
    for (int64_t e = 0; e < total(c); ++e) ref[e] = testing::finite_diff(loss_at, xd, e);
    const auto got = testing::to_host(dqkv, st);
    EXPECT_LT(testing::rel_err(got, ref), 1e-5) << str(c);
    for (int64_t e = 0; e < total(c); ++e) {
      ASSERT_LE(std::fabs(got[e] - ref[e]), 1e-5 * (std::fabs(ref[e]) + 1.0)) << str(c) << " e=" << e;
      if (untouched(c, e)) {
        ASSERT_EQ(got[e], gv[e]) << str(c) << " e=" << e;
      }
    }
    // And the rotation by the negative angle, from the explicit matrices.
    expect_rotated(got, rope_ref(gv, in.pos, c, -1.0), gv, c, 2e-6, str(c));
  }
}

TEST(Rope, BackwardInvertsForward) {
  Stream st;
  for (const Case& c : cases()) {
    Inputs in = make_inputs(c, st);
    auto qkv = testing::make_tensor(in.x, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    rope_forward(qkv, in.positions, config(c), st);
    rope_backward(qkv, in.positions, config(c), st);
    const auto got = testing::to_host(qkv, st);
    EXPECT_LT(testing::rel_err(got, in.x), 1e-6) << str(c);
    for (int64_t e = 0; e < total(c); ++e) {
      if (untouched(c, e)) {
        ASSERT_EQ(got[e], in.x[e]) << str(c) << " e=" << e;
      }
    }
  }
}

TEST(Rope, DefaultPositionsAreSequenceIndices) {
  Stream st;
  for (Case c : cases()) {
    c.explicit_positions = false;
    Inputs in = make_inputs(c, st);
    std::vector<int32_t> pos(c.s * c.b);
    for (int64_t si = 0; si < c.s; ++si) {
      for (int64_t bi = 0; bi < c.b; ++bi) pos[si * c.b + bi] = static_cast<int32_t>(si);
    }
    auto positions = testing::make_int_tensor(pos, kCpu, {c.s, c.b}, st);
    auto a = testing::make_tensor(in.x, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    auto b = testing::make_tensor(in.x, DType::kF32, kCpu, {c.s, c.b, c.g, c.qpg + 2, c.d}, st);
    rope_forward(a, Tensor(), config(c), st);
    rope_forward(b, positions, config(c), st);
    EXPECT_EQ(testing::to_host(a, st), testing::to_host(b, st)) << str(c);
  }
}

TEST(Rope, BadInputThrows) {
  Stream st;
  const int64_t s = 3, b = 2, g = 2, qpg = 2, d = 8;
  auto qkv = testing::make_tensor(testing::randn(s * b * g * (qpg + 2) * d), DType::kF32, kCpu, {s, b, g, qpg + 2, d},
                                  st);
  auto pos = testing::make_int_tensor(testing::randint(s * b, 0, 100), kCpu, {s, b}, st);
  RopeConfig ok;
  ok.queries_per_group = qpg;
  ok.rotary_dim = d;
  EXPECT_NO_THROW(rope_forward(qkv, pos, ok, st));
  EXPECT_NO_THROW(rope_forward(qkv, Tensor(), ok, st));
  EXPECT_NO_THROW(rope_backward(qkv, pos, ok, st));
  auto with = [&](auto edit) {
    RopeConfig c = ok;
    edit(c);
    return c;
  };
  const RopeConfig odd = with([](RopeConfig& c) { c.rotary_dim = 5; });
  const RopeConfig too_wide = with([&](RopeConfig& c) { c.rotary_dim = d + 2; });
  const RopeConfig zero = with([](RopeConfig& c) { c.rotary_dim = 0; });
  const RopeConfig bad_base = with([](RopeConfig& c) { c.base = 0.f; });
  const RopeConfig bad_qpg = with([](RopeConfig& c) { c.queries_per_group = 3; });  // qkv has qpg + 2 = 4 heads
  const RopeConfig zero_qpg = with([](RopeConfig& c) { c.queries_per_group = 0; });
  for (const RopeConfig* c : {&odd, &too_wide, &zero, &bad_base, &bad_qpg, &zero_qpg}) {
    EXPECT_THROW(rope_forward(qkv, pos, *c, st), Error);
    EXPECT_THROW(rope_backward(qkv, pos, *c, st), Error);
  }
  // positions of the wrong shape or dtype.
  OwnedTensor pos_t(DType::kI32, kCpu, {b, s}), pos_1d(DType::kI32, kCpu, {s * b}), pos_f(DType::kF32, kCpu, {s, b});
  OwnedTensor pos_i64(DType::kI64, kCpu, {s, b});
  for (const OwnedTensor* p : {&pos_t, &pos_1d, &pos_f, &pos_i64}) {
    EXPECT_THROW(rope_forward(qkv, *p, ok, st), Error);
    EXPECT_THROW(rope_backward(qkv, *p, ok, st), Error);
  }
  // qkv not [s, b, g, qpg + 2, d]: rank 4, rank 3, non-contiguous, CPU bf16, int.
  EXPECT_THROW(rope_forward(qkv.t.view({s * b, g, qpg + 2, d}), pos, ok, st), Error);
  EXPECT_THROW(rope_forward(qkv.t.view({s, b, g * (qpg + 2) * d}), pos, ok, st), Error);
  OwnedTensor wide(DType::kF32, kCpu, {s, b, g, qpg + 2, 2 * d});
  EXPECT_THROW(rope_forward(wide.t.slice(4, 0, d), pos, ok, st), Error);
  OwnedTensor q_bf16(DType::kBF16, kCpu, {s, b, g, qpg + 2, d}), q_i32(DType::kI32, kCpu, {s, b, g, qpg + 2, d});
  EXPECT_THROW(rope_forward(q_bf16, pos, ok, st), Error);
  EXPECT_THROW(rope_forward(q_i32, pos, ok, st), Error);
}

}  // namespace
}  // namespace mt
