// Helpers of the FP8 tests (fp8_test.cpp, fp8_cuda_test.cpp): FP8 tensors as raw bytes on any
// device, random FP8 operands, the float64 reference of a scaled FP8 GEMM and its fp32
// accumulation bound.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_matmul.h"
#include "testing/testing.h"

namespace mt::fp8_test {

using testing::OwnedTensor;

/// Bytes -> a new tensor of `dtype` (any 1-byte dtype) on `device`.
inline OwnedTensor bytes_tensor(const std::vector<uint8_t>& b, DType dtype, Device device,
                                const std::vector<int64_t>& shape, const Stream& stream) {
  OwnedTensor o(dtype, device, shape);
  MT_CHECK(static_cast<int64_t>(b.size()) == o.t.numel(), "bytes_tensor: {} bytes for {}", b.size(), o.t.str());
  if (!b.empty()) copy_bytes(o.t.data(), device, b.data(), Device::cpu(), b.size(), stream);
  stream.synchronize();
  return o;
}

/// The bytes of a 1-byte tensor on any device (synchronises).
inline std::vector<uint8_t> to_bytes(const Tensor& t, const Stream& stream) {
  std::vector<uint8_t> b(static_cast<size_t>(t.numel()));
  if (!b.empty()) copy_bytes(b.data(), Device::cpu(), t.data(), t.device(), b.size(), stream);
  stream.synchronize();
  return b;
}

/// Fills a 1-byte tensor with `byte` (poisoning FP8 outputs: 0x7f is NaN in both formats).
inline void poison_bytes(const Tensor& t, const Stream& stream, int byte = 0x7f) {
  if (t.numel() > 0) memset_tensor(t, byte, stream);
}

/// n random finite FP8 codes of `t` whose values lie in [-max_abs, max_abs] (NaN / inf excluded).
inline std::vector<uint8_t> random_codes(int64_t n, DType t, float max_abs) {
  std::vector<uint8_t> ok;
  for (int c = 0; c < 256; ++c) {
    const float f = fp8_bits_to_f32(t, static_cast<uint8_t>(c));
    if (std::isfinite(f) && std::fabs(f) <= max_abs) ok.push_back(static_cast<uint8_t>(c));
  }
  std::uniform_int_distribution<size_t> d(0, ok.size() - 1);
  std::vector<uint8_t> out(static_cast<size_t>(n));
  for (auto& b : out) b = ok[d(testing::test_rng())];
  return out;
}

/// Codes of small integers in [-lim, lim] (exact in both formats for lim <= 8): GEMMs of such
/// operands are exact in any accumulation order while the partial sums stay within the
/// accumulator's precision (Hopper's FP8 tensor cores keep about 14 bits between promotions:
/// |sum| <= k * lim^2 in the worst case, ~sqrt(k) * lim^2 typically).
inline std::vector<uint8_t> integer_codes(int64_t n, DType t, int lim) {
  std::uniform_int_distribution<int> d(-lim, lim);
  std::vector<uint8_t> out(static_cast<size_t>(n));
  for (auto& b : out) b = f32_to_fp8_bits(t, static_cast<float>(d(testing::test_rng())));
  return out;
}

/// Scale of element (r, c) of an operand [rows, k] from its scale_inv values.
inline double scale_at(const std::vector<float>& s, Fp8Scaling sc, int64_t r, int64_t c, int64_t rows, int64_t k) {
  return s[static_cast<size_t>(fp8_math::scale_index(sc, r, c, rows, k))];
}

/// The float64 reference of fp8_matmul: ref[i, j] = Σ_k deq(a)[i, k] deq(b)[j, k] (+ c0), and
/// bound[i, j] = Σ_k |deq(a)[i, k] deq(b)[j, k]| (for accumulation-error tolerances).
struct GemmRef {
  std::vector<double> ref, bound;
};
inline GemmRef gemm_ref(const std::vector<uint8_t>& a, DType at, const std::vector<float>& sa, Fp8Scaling sca,
                        const std::vector<uint8_t>& b, DType bt, const std::vector<float>& sb, Fp8Scaling scb,
                        int64_t m, int64_t n, int64_t k, const std::vector<float>* c0) {
  std::vector<double> ad(static_cast<size_t>(m * k)), bd(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t kk = 0; kk < k; ++kk) {
      ad[i * k + kk] = fp8_bits_to_f32(at, a[i * k + kk]) * scale_at(sa, sca, i, kk, m, k);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t kk = 0; kk < k; ++kk) {
      bd[j * k + kk] = fp8_bits_to_f32(bt, b[j * k + kk]) * scale_at(sb, scb, j, kk, n, k);
    }
  }
  GemmRef r{std::vector<double>(static_cast<size_t>(m * n)), std::vector<double>(static_cast<size_t>(m * n))};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, sabs = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const double p = ad[i * k + kk] * bd[j * k + kk];
        s += p;
        sabs += std::fabs(p);
      }
      r.ref[i * n + j] = s + (c0 ? (*c0)[i * n + j] : 0.0);
      r.bound[i * n + j] = sabs + (c0 ? std::fabs((*c0)[i * n + j]) : 0.0);
    }
  }
  return r;
}

/// Random dequantisation scales for an operand [rows, k] (powers of two in [2^-max_exp, 2^max_exp]
/// when pow2, else uniform in [0.01, 4]); padding entries 0.
inline std::vector<float> random_scales(Fp8Scaling sc, int64_t rows, int64_t k, bool pow2, int max_exp = 6) {
  const std::vector<int64_t> shape = fp8_scale_shape(sc, rows, k);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> s(static_cast<size_t>(n), 0.f);
  std::uniform_int_distribution<int> e(-max_exp, max_exp);
  std::uniform_real_distribution<float> u(0.01f, 4.f);
  auto draw = [&] { return pow2 ? std::ldexp(1.f, e(testing::test_rng())) : u(testing::test_rng()); };
  if (sc == Fp8Scaling::kTensor) {
    s[0] = draw();
    return s;
  }
  for (int64_t r = 0; r < rows; r += sc == Fp8Scaling::kBlock1x128 ? 1 : fp8_math::kBlock) {
    for (int64_t c = 0; c < k; c += fp8_math::kBlock)
      s[static_cast<size_t>(fp8_math::scale_index(sc, r, c, rows, k))] = draw();
  }
  return s;
}

/// n fp32 values (normal, std `std`) that exercise the rounding to bf16 before FP8
/// (fp8_quantize_bf16_rounded): every third one moved onto a bf16 tie (the lower half of its
/// bits 0x8000: nearest even decides), just above or just below one; with `specials` the first
/// ones are NaN of either sign, +-inf, -0, a subnormal, values that saturate FP8 (1e6) and that
/// round to bf16 infinity (FLT_MAX, the tie at bf16's largest value); n >= 12 then.
inline std::vector<float> bf16_rounding_values(int64_t n, float std, bool specials) {
  std::vector<float> x = testing::randn(n, std);
  for (int64_t i = 0; i < n; i += 3) {
    const uint32_t hi = f32_to_bits(x[static_cast<size_t>(i)]) & 0xffff0000u;
    const uint32_t off = (i / 3) % 3 == 0 ? 0x8000u : (i / 3) % 3 == 1 ? 0x8001u : 0x7fffu;
    x[static_cast<size_t>(i)] = bits_to_f32(hi | off);
  }
  if (specials) {
    MT_CHECK(n >= 12, "bf16_rounding_values: {} values leave no room for the 12 specials", n);
    const float sp[] = {NAN, -NAN, INFINITY, -INFINITY, -0.f, 1e-40f, 1e6f, -1e6f, FLT_MAX, -FLT_MAX,
                        bits_to_f32(0x7f7f8000u), bits_to_f32(0xff7f7fffu)};
    for (size_t i = 0; i < 12; ++i) x[i] = sp[i];
  }
  return x;
}

/// What the quantisation of a weight kept in its bf16 parameter storage gives (Fp8Linear::
/// quantize_weight) for fp32 main values x [rows, cols] on `device`: tensorwise (scale == nullptr:
/// the amax, all that follows from it, then q and q_t) or delayed (q and q_t with *scale, the amax
/// recorded into a record holding 0.5). fused: fp8_quantize_bf16_rounded of x (tensorwise: with
/// fp8_amax of x rounded to bf16); else staged as before it: x cast to bf16 (widened to fp32 again
/// on the CPU, whose ops are fp32) through fp8_amax and fp8_quantize.
struct WeightQuant {
  std::vector<float> amax, scale, scale_inv;  // tensorwise: the state; delayed: the record
  std::vector<uint8_t> q, q_t;
};
inline WeightQuant quantize_weight_values(const std::vector<float>& x, int64_t rows, int64_t cols, DType t,
                                          const float* scale, bool fused, Device device, const Stream& st) {
  const OwnedTensor xf = testing::make_tensor(x, DType::kF32, device, {rows, cols}, st);
  OwnedTensor xb(DType::kBF16, device, {rows, cols}), xw(DType::kF32, device, {rows, cols});
  Tensor in = xf.t;
  if (!fused) {
    cast(xb.t, xf.t, st);
    in = xb.t;
    if (device.is_cpu()) {
      cast(xw.t, xb.t, st);
      in = xw.t;
    }
  }
  OwnedTensor q(t, device, {rows, cols}), q_t(t, device, {cols, rows}), b1(DType::kBF16, device, {1});
  poison_bytes(q.t, st);
  poison_bytes(q_t.t, st);
  OwnedTensor amax = testing::make_tensor({0.5f}, DType::kF32, device, {1}, st);
  OwnedTensor s = testing::make_tensor({scale ? *scale : 0.f}, DType::kF32, device, {1}, st);
  OwnedTensor si = testing::make_tensor({0.f}, DType::kF32, device, {1}, st);
  if (!scale) {
    fp8_amax(amax.t, in, st);
    if (fused) {  // Fp8Model::round_to_bf16
      cast(b1.t, amax.t, st);
      cast(amax.t, b1.t, st);
    }
    fp8_scale_from_amax(s.t, si.t, amax.t, t, /*pow2=*/false, 0.f, st);
  }
  const Tensor record = scale ? amax.t : Tensor();
  if (fused) fp8_quantize_bf16_rounded(q.t, q_t.t, in, s.t, record, st);
  else fp8_quantize(q.t, q_t.t, in, s.t, record, st);
  return {testing::to_host(amax.t, st), testing::to_host(s.t, st), testing::to_host(si.t, st), to_bytes(q.t, st),
          to_bytes(q_t.t, st)};
}

}  // namespace mt::fp8_test
