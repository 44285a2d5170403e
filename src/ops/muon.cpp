#include "ops/muon.h"

#include "ops/op_checks.h"
#include "ops/optimizer.h"

namespace mt {

using op_checks::check_stream;

namespace {
void check_f32_vector(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 && t.is_contiguous(), "{}: {} must be a contiguous fp32 tensor, got {}", fn,
           name, t.str());
}
void check_scratch(const Tensor& scratch, const Tensor& x, const char* fn) {
  check_f32_vector(scratch, fn, "scratch");
  MT_CHECK(scratch.numel() >= kMuonNormScratch, "{}: scratch needs {} fp32 elements, got {}", fn, kMuonNormScratch,
           scratch.str());
  MT_CHECK(scratch.device() == x.device(), "{}: scratch on {} but x on {}", fn, scratch.device().str(),
           x.device().str());
}
}  // namespace

void muon_momentum(const Tensor& u, const Tensor& grad, const Tensor& momentum, float beta, bool nesterov,
                   const Tensor& scalars, const Stream& stream) {
  for (const auto& [t, name] : {std::pair{&u, "u"}, {&grad, "grad"}, {&momentum, "momentum"}}) {
    check_f32_vector(*t, "muon_momentum", name);
    MT_CHECK(t->numel() == grad.numel() && t->device() == grad.device(),
             "muon_momentum: {} {} must have grad's {} elements on {}", name, t->str(), grad.numel(),
             grad.device().str());
  }
  MT_CHECK(beta >= 0.f && beta < 1.f, "muon_momentum: beta must be in [0, 1), got {}", beta);
  MT_CHECK(u.numel() == 0 || u.data() != momentum.data(), "muon_momentum: u must not alias momentum");
  MT_CHECK(scalars.dtype() == DType::kU8 && scalars.numel() == static_cast<int64_t>(sizeof(OptimizerScalars)) &&
               scalars.device() == grad.device(),
           "muon_momentum: scalars must be {} uint8 bytes on {}, got {}", sizeof(OptimizerScalars),
           grad.device().str(), scalars.str());
  check_stream(stream, grad, "muon_momentum");
  if (grad.numel() == 0) return;
  MT_DISPATCH(grad.device(), muon_momentum, u, grad, momentum, beta, nesterov, scalars, stream);
}

void muon_sumsq(const Tensor& scratch, const Tensor& x, const Stream& stream) {
  MT_CHECK((x.dtype() == DType::kF32 || x.dtype() == DType::kBF16) && x.is_contiguous(),
           "muon_sumsq: x must be contiguous fp32 or bf16, got {}", x.str());
  check_scratch(scratch, x, "muon_sumsq");
  check_stream(stream, x, "muon_sumsq");
  MT_DISPATCH(x.device(), muon_sumsq, scratch, x, stream);
}

void muon_normalize(const Tensor& y, const Tensor& x, const Tensor& scratch, float eps, const Stream& stream) {
  check_f32_vector(x, "muon_normalize", "x");
  MT_CHECK((y.dtype() == DType::kF32 || y.dtype() == DType::kBF16) && y.is_contiguous() && y.numel() == x.numel() &&
               y.device() == x.device(),
           "muon_normalize: y must be contiguous fp32 or bf16 with x's {} elements on {}, got {}", x.numel(),
           x.device().str(), y.str());
  MT_CHECK(y.dtype() == DType::kF32 || y.data() != x.data(), "muon_normalize: a bf16 y must not alias x");
  MT_CHECK(eps > 0.f, "muon_normalize: eps must be positive, got {}", eps);
  check_scratch(scratch, x, "muon_normalize");
  check_stream(stream, x, "muon_normalize");
  if (x.numel() == 0) return;
  MT_DISPATCH(x.device(), muon_normalize, y, x, scratch, eps, stream);
}

void muon_copy_2d(const Tensor& dst, int64_t dst_stride, const Tensor& src, int64_t src_stride, int64_t rows,
                  int64_t cols, const Stream& stream) {
  MT_CHECK(dst.dtype() == src.dtype() && dst.device() == src.device() && dst.is_contiguous() && src.is_contiguous(),
           "muon_copy_2d: dst {} and src {} must be contiguous with one dtype and device", dst.str(), src.str());
  MT_CHECK(rows >= 0 && cols >= 0 && dst_stride >= cols && src_stride >= cols,
           "muon_copy_2d: rows={} cols={} dst_stride={} src_stride={} (strides must be >= cols >= 0)", rows, cols,
           dst_stride, src_stride);
  if (rows == 0 || cols == 0) return;
  MT_CHECK((rows - 1) * dst_stride + cols <= dst.numel() && (rows - 1) * src_stride + cols <= src.numel(),
           "muon_copy_2d: {} rows of {} (strides {} / {}) exceed dst {} or src {}", rows, cols, dst_stride,
           src_stride, dst.str(), src.str());
  check_stream(stream, dst, "muon_copy_2d");
  MT_DISPATCH(dst.device(), muon_copy_2d, dst, dst_stride, src, src_stride, rows, cols, stream);
}

}  // namespace mt
