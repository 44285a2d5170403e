// CPU reference of ops/grouped_matmul.h: fp32, one OpenBLAS sgemm per non-empty group, the
// counts read from host memory. The FP8 ops run the FP8 emulation (cpu::fp8_matmul) per group.
#include <cblas.h>

#include <algorithm>
#include <vector>

#include "ops/fp8_matmul.h"
#include "ops/grouped_matmul.h"
#include "ops/cpu/group_offsets.h"

namespace mt::cpu {
namespace {

void require_f32(const char* fn, const Tensor& t) {
  MT_CHECK(t.dtype() == DType::kF32, "{}: the CPU backend supports fp32 only, got {}", fn, t.str());
}

blasint bi(int64_t v) { return static_cast<blasint>(v); }

/// Group g's dequantisation scale: entry g of a G-element scale tensor, or its only element.
Fp8Operand group_operand(const Tensor& data, const Tensor& scale_inv, int64_t g) {
  const int64_t i = scale_inv.numel() == 1 ? 0 : g;
  return Fp8Operand{data, scale_inv.slice0(i, i + 1), Fp8Scaling::kTensor};
}

/// Columns [c0, c0 + c) of a byte matrix t [rows, R], copied into `buf` and viewed as [rows, c].
// The copy is padded with zero columns (FP8 +0: exact zero products) to a multiple of 16: the
// reduction length of the per-expert FP8 path (Fp8Linear pads each expert's rows to 16), so that
// sgemm sums in its order and the grouped and sequential FP8 experts agree bitwise on the CPU.
Tensor column_segment(const Tensor& t, int64_t c0, int64_t c, std::vector<uint8_t>& buf) {
  const int64_t rows = t.size(0), R = t.size(1), cp = (c + 15) / 16 * 16;
  buf.assign(static_cast<size_t>(rows * cp), uint8_t{0});
  const uint8_t* src = t.data_as<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * R + c0, c, buf.data() + r * cp);
  return Tensor(buf.data(), t.dtype(), Device::cpu(), {rows, cp});
}

}  // namespace

void grouped_linear_forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts,
                            const Stream&) {
  const char* fn = "grouped_linear_forward";
  require_f32(fn, x);
  const int64_t R = x.size(0), n = w.rows(), k = w.cols();
  const std::vector<int64_t> off = group_offsets(counts, R, fn);
  const float* X = x.data_as<float>();
  float* Y = y.data_as<float>();
  for (int64_t g = 0; g < w.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    float* yg = Y + off[static_cast<size_t>(g)] * n;
    if (m == 0 || n == 0) continue;
    if (k == 0) {
      std::fill(yg, yg + m * n, 0.f);
      continue;
    }
    // y_g[m, n] = x_g[m, k] · W_g[n, k]ᵀ
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bi(m), bi(n), bi(k), 1.f, X + off[static_cast<size_t>(g)] * k,
                bi(k), w[g].data_as<float>(), bi(k), 0.f, yg, bi(n));
  }
  std::fill(Y + off.back() * n, Y + R * n, 0.f);
}

void grouped_linear_dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts,
                          const Stream&) {
  const char* fn = "grouped_linear_dgrad";
  require_f32(fn, dy);
  const int64_t R = dy.size(0), n = w.rows(), k = w.cols();
  const std::vector<int64_t> off = group_offsets(counts, R, fn);
  const float* DY = dy.data_as<float>();
  float* DX = dx.data_as<float>();
  for (int64_t g = 0; g < w.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    float* dxg = DX + off[static_cast<size_t>(g)] * k;
    if (m == 0 || k == 0) continue;
    if (n == 0) {
      std::fill(dxg, dxg + m * k, 0.f);
      continue;
    }
    // dx_g[m, k] = dy_g[m, n] · W_g[n, k]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, bi(m), bi(k), bi(n), 1.f,
                DY + off[static_cast<size_t>(g)] * n, bi(n), w[g].data_as<float>(), bi(k), 0.f, dxg, bi(k));
  }
  std::fill(DX + off.back() * k, DX + R * k, 0.f);
}

void grouped_linear_wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts,
                          const Stream&) {
  const char* fn = "grouped_linear_wgrad";
  require_f32(fn, x);
  const int64_t R = x.size(0), n = dw.rows(), k = dw.cols();
  const std::vector<int64_t> off = group_offsets(counts, R, fn);
  const float* DY = dy.data_as<float>();
  const float* X = x.data_as<float>();
  for (int64_t g = 0; g < dw.groups(); ++g) {
    const int64_t m = off[static_cast<size_t>(g + 1)] - off[static_cast<size_t>(g)];
    if (m == 0 || n == 0 || k == 0) continue;
    // dW_g[n, k] += dy_g[m, n]ᵀ · x_g[m, k]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, bi(n), bi(k), bi(m), 1.f,
                DY + off[static_cast<size_t>(g)] * n, bi(n), X + off[static_cast<size_t>(g)] * k, bi(k), 1.f,
                dw[g].data_as<float>(), bi(k));
  }
}

void grouped_fp8_linear_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                                const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream) {
  const int64_t R = aq.size(0), N = wq.rows();
  const std::vector<int64_t> off = group_offsets(counts, R, "grouped_fp8_linear_forward");
  for (int64_t g = 0; g < wq.groups(); ++g) {
    const int64_t r0 = off[static_cast<size_t>(g)], r1 = off[static_cast<size_t>(g + 1)];
    if (r1 == r0) continue;
    // y_g[c_g, N] = (sa · sb) · aq_g[c_g, K] · wq_g[N, K]ᵀ
    cpu::fp8_matmul(y.slice0(r0, r1), group_operand(aq.slice0(r0, r1), a_scale_inv, g),
                    group_operand(wq[g], w_scale_inv, g), /*accumulate=*/false,
                    /*fast_accum=*/false, stream, Tensor());
  }
  float* Y = y.data_as<float>();
  std::fill(Y + off.back() * N, Y + R * N, 0.f);
}

void grouped_fp8_linear_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv,
                              const Tensor& xq_t, const Tensor& x_scale_inv, const Tensor& counts,
                              const Stream& stream) {
  const std::vector<int64_t> off = group_offsets(counts, xq_t.size(1), "grouped_fp8_linear_wgrad");
  std::vector<uint8_t> a_buf, b_buf;
  for (int64_t g = 0; g < dw.groups(); ++g) {
    const int64_t r0 = off[static_cast<size_t>(g)], c = off[static_cast<size_t>(g + 1)] - r0;
    if (c == 0) continue;
    // dW_g[n, k] += (s_dy · s_x) · dyq_t[:, segment] · xq_t[:, segment]ᵀ
    const Tensor a = column_segment(dyq_t, r0, c, a_buf), b = column_segment(xq_t, r0, c, b_buf);
    cpu::fp8_matmul(dw[g], group_operand(a, dy_scale_inv, g), group_operand(b, x_scale_inv, g),
                    /*accumulate=*/true, /*fast_accum=*/false, stream, Tensor());
  }
}

}  // namespace mt::cpu
