// GroupedWeights and the argument validation of ops/grouped_matmul.h, then the backend of the
// tensors' device.
#include "ops/grouped_matmul.h"

#include <cstdint>

#include "ops/fp8.h"
#include "ops/op_checks.h"
#ifdef MT_WITH_CUDA
#include "ops/cuda/grouped_matmul_sm90.cuh"
#endif

namespace mt {

GroupedWeights::GroupedWeights(std::vector<Tensor> weights, const Stream& stream) : w_(std::move(weights)) {
  MT_CHECK(!w_.empty(), "GroupedWeights: no weights");
  const Tensor& w0 = w_.front();
  MT_CHECK(w0.ndim() == 2 && w0.is_contiguous() && (op_checks::is_float(w0.dtype()) || is_fp8(w0.dtype())),
           "GroupedWeights: weight 0 {} must be a contiguous float or FP8 [n, k] tensor", w0.str());
  std::vector<void*> host(w_.size());
  aligned16_ = true;
  for (size_t g = 0; g < w_.size(); ++g) {
    const Tensor& w = w_[g];
    MT_CHECK(w.shape() == w0.shape() && w.dtype() == w0.dtype() && w.device() == w0.device() && w.is_contiguous(),
             "GroupedWeights: weight {} {} differs from weight 0 {} (shape, dtype, device) or is not contiguous", g,
             w.str(), w0.str());
    host[g] = w.data();
    aligned16_ = aligned16_ && reinterpret_cast<uintptr_t>(w.data()) % 16 == 0;
  }
  op_checks::check_stream(stream, w0, "GroupedWeights");
  table_ = Buffer(w0.device(), host.size() * sizeof(void*));
  copy_bytes(table_.data(), w0.device(), host.data(), Device::cpu(), host.size() * sizeof(void*), stream);
  stream.synchronize();  // `host` goes out of scope; built once, outside a step
#ifdef MT_WITH_CUDA
  if (w0.device().is_cuda()) {
    cuda::grouped_sm90::WeightMaps m = cuda::grouped_sm90::build_weight_maps(w_, stream);
    maps_ = std::move(m.maps);
    hopper_ = m.hopper;
  }
#endif
}

namespace {

// act [R, c] contiguous, act dtype (fp32 on CPU).
int64_t check_rows2(const Tensor& t, int64_t cols, DType dt, const char* fn, const char* name) {
  op_checks::check_act(t, fn, name);
  MT_CHECK(t.ndim() == 2 && t.size(1) == cols && t.dtype() == dt, "{}: {} {} must be {} [R, {}]", fn, name, t.str(),
           dtype_name(dt), cols);
  return t.size(0);
}

void check_counts(const Tensor& counts, int64_t G, const Tensor& ref, const char* fn) {
  MT_CHECK(counts.dtype() == DType::kI32 && counts.ndim() == 1 && counts.size(0) == G && counts.is_contiguous(),
           "{}: counts {} must be a contiguous int32 [{}] (one entry per group)", fn, counts.str(), G);
  MT_CHECK(counts.device() == ref.device(), "{}: counts {} must be on {} like the rows", fn, counts.str(),
           ref.device().str());
}

void check_weights(const GroupedWeights& w, const Tensor& ref, const char* fn, const char* name) {
  MT_CHECK(!w.empty(), "{}: {} has no groups", fn, name);
  MT_CHECK(w.device() == ref.device(), "{}: {} on {} but the rows on {}", fn, name, w.device().str(),
           ref.device().str());
}

void check_disjoint(const Tensor& a, const Tensor& b, const char* fn) {
  const char* pa = static_cast<const char*>(a.data());
  const char* pb = static_cast<const char*>(b.data());
  MT_CHECK(a.nbytes() == 0 || b.nbytes() == 0 || pa + a.nbytes() <= pb || pb + b.nbytes() <= pa,
           "{}: output {} overlaps input {}", fn, a.str(), b.str());
}

bool grouped_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// An FP8 operand of the grouped FP8 GEMMs: contiguous [rows, cols] of an FP8 dtype, 16-byte aligned.
void check_fp8_rows(const Tensor& t, int64_t rows, int64_t cols, const char* fn, const char* name) {
  MT_CHECK(is_fp8(t.dtype()) && t.ndim() == 2 && t.is_contiguous() && t.size(1) == cols,
           "{}: {} {} must be a contiguous fp8_e4m3/fp8_e5m2 matrix of {} columns", fn, name, t.str(), cols);
  MT_CHECK(rows < 0 || t.size(0) == rows, "{}: {} {} must have {} rows", fn, name, t.str(), rows);
  MT_CHECK(t.numel() == 0 || grouped_aligned16(t.data()), "{}: {} {} must be 16-byte aligned", fn, name, t.str());
}

// A dequantisation-scale tensor: contiguous fp32 of 1 or G elements.
void check_scales(const Tensor& s, int64_t G, const Tensor& ref, const char* fn, const char* name) {
  MT_CHECK(s.dtype() == DType::kF32 && s.is_contiguous() && (s.numel() == 1 || s.numel() == G) && !s.empty(),
           "{}: {} {} must be contiguous fp32 of 1 or G = {} elements", fn, name, s.str(), G);
  MT_CHECK(s.device() == ref.device(), "{}: {} {} must be on {}", fn, name, s.str(), ref.device().str());
}

void check_not_both_e5m2(DType a, DType b, const char* fn) {
  MT_CHECK(!(a == DType::kF8E5M2 && b == DType::kF8E5M2),
           "{}: both operands are fp8_e5m2 (no e5m2 x e5m2 GEMM; e5m2 is for gradients only)", fn);
}

void check_mult16(int64_t n, int64_t k, const char* fn, const char* what) {
  MT_CHECK(n % 16 == 0 && k % 16 == 0, "{}: {} = {} x {} must be multiples of 16 (the FP8 GEMMs' alignment)", fn,
           what, n, k);
}

}  // namespace

void grouped_fp8_linear_forward(const Tensor& y, const Tensor& aq, const Tensor& a_scale_inv, const GroupedWeights& wq,
                                const Tensor& w_scale_inv, const Tensor& counts, const Stream& stream) {
  const char* fn = "grouped_fp8_linear_forward";
  check_weights(wq, aq, fn, "wq");
  MT_CHECK(is_fp8(wq.dtype()), "{}: wq must hold FP8 weights, got {}", fn, dtype_name(wq.dtype()));
  const int64_t N = wq.rows(), K = wq.cols(), G = wq.groups();
  check_mult16(N, K, fn, "the weights' [N, K]");
  MT_CHECK(wq.aligned16(), "{}: the weights must be 16-byte aligned", fn);
  check_fp8_rows(aq, -1, K, fn, "aq");
  const int64_t R = aq.size(0);
  const DType out_dt = y.device().is_cpu() ? DType::kF32 : DType::kBF16;
  MT_CHECK(y.ndim() == 2 && y.is_contiguous() && y.size(0) == R && y.size(1) == N && y.dtype() == out_dt,
           "{}: y {} must be a contiguous {} [{}, {}] (aq {})", fn, y.str(), dtype_name(out_dt), R, N, aq.str());
  MT_CHECK(y.numel() == 0 || grouped_aligned16(y.data()), "{}: y {} must be 16-byte aligned", fn, y.str());
  check_not_both_e5m2(aq.dtype(), wq.dtype(), fn);
  check_scales(a_scale_inv, G, aq, fn, "a_scale_inv");
  check_scales(w_scale_inv, G, aq, fn, "w_scale_inv");
  check_counts(counts, G, aq, fn);
  check_same_device({&y, &aq});
  check_disjoint(y, aq, fn);
  op_checks::check_stream(stream, aq, fn);
  MT_DISPATCH(aq.device(), grouped_fp8_linear_forward, y, aq, a_scale_inv, wq, w_scale_inv, counts, stream);
}

void grouped_fp8_linear_wgrad(const GroupedWeights& dw, const Tensor& dyq_t, const Tensor& dy_scale_inv,
                              const Tensor& xq_t, const Tensor& x_scale_inv, const Tensor& counts,
                              const Stream& stream) {
  const char* fn = "grouped_fp8_linear_wgrad";
  check_weights(dw, xq_t, fn, "dw");
  MT_CHECK(dw.dtype() == DType::kF32, "{}: dw must be fp32 main gradients, got {}", fn, dtype_name(dw.dtype()));
  const int64_t n = dw.rows(), k = dw.cols(), G = dw.groups();
  check_mult16(n, k, fn, "dw's [n, k]");
  MT_CHECK(dw.aligned16(), "{}: the gradients must be 16-byte aligned", fn);
  MT_CHECK(xq_t.ndim() == 2, "{}: xq_t {} must be [k, R]", fn, xq_t.str());
  const int64_t R = xq_t.size(1);
  MT_CHECK(R % 16 == 0, "{}: R = {} rows must be a multiple of 16 (the transposes' rows are 16-byte aligned)", fn,
           R);
  // the transposes are [cols, R]: check them as [rows, cols] = [n or k, R]
  check_fp8_rows(dyq_t, n, R, fn, "dyq_t");
  check_fp8_rows(xq_t, k, R, fn, "xq_t");
  check_not_both_e5m2(dyq_t.dtype(), xq_t.dtype(), fn);
  check_scales(dy_scale_inv, G, xq_t, fn, "dy_scale_inv");
  check_scales(x_scale_inv, G, xq_t, fn, "x_scale_inv");
  check_counts(counts, G, xq_t, fn);
  check_same_device({&dyq_t, &xq_t});
  op_checks::check_stream(stream, xq_t, fn);
  MT_DISPATCH(xq_t.device(), grouped_fp8_linear_wgrad, dw, dyq_t, dy_scale_inv, xq_t, x_scale_inv, counts, stream);
}

void grouped_linear_forward(const Tensor& y, const Tensor& x, const GroupedWeights& w, const Tensor& counts,
                            const Stream& stream) {
  const char* fn = "grouped_linear_forward";
  check_weights(w, x, fn, "w");
  const int64_t n = w.rows(), k = w.cols();
  const int64_t R = check_rows2(x, k, w.dtype(), fn, "x");
  MT_CHECK(check_rows2(y, n, w.dtype(), fn, "y") == R, "{}: y {} and x {} differ in rows", fn, y.str(), x.str());
  check_counts(counts, w.groups(), x, fn);
  check_disjoint(y, x, fn);
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), grouped_linear_forward, y, x, w, counts, stream);
}

void grouped_linear_dgrad(const Tensor& dx, const Tensor& dy, const GroupedWeights& w, const Tensor& counts,
                          const Stream& stream) {
  const char* fn = "grouped_linear_dgrad";
  check_weights(w, dy, fn, "w");
  const int64_t n = w.rows(), k = w.cols();
  const int64_t R = check_rows2(dy, n, w.dtype(), fn, "dy");
  MT_CHECK(check_rows2(dx, k, w.dtype(), fn, "dx") == R, "{}: dx {} and dy {} differ in rows", fn, dx.str(),
           dy.str());
  check_counts(counts, w.groups(), dy, fn);
  check_disjoint(dx, dy, fn);
  op_checks::check_stream(stream, dy, fn);
  MT_DISPATCH(dy.device(), grouped_linear_dgrad, dx, dy, w, counts, stream);
}

void grouped_linear_wgrad(const GroupedWeights& dw, const Tensor& dy, const Tensor& x, const Tensor& counts,
                          const Stream& stream) {
  const char* fn = "grouped_linear_wgrad";
  check_weights(dw, x, fn, "dw");
  MT_CHECK(dw.dtype() == DType::kF32, "{}: dw must be fp32 main gradients, got {}", fn, dtype_name(dw.dtype()));
  const int64_t n = dw.rows(), k = dw.cols();
  const int64_t R = check_rows2(x, k, x.dtype(), fn, "x");
  MT_CHECK(check_rows2(dy, n, x.dtype(), fn, "dy") == R, "{}: dy {} and x {} differ in rows (or dtype)", fn,
           dy.str(), x.str());
  check_counts(counts, dw.groups(), x, fn);
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), grouped_linear_wgrad, dw, dy, x, counts, stream);
}

}  // namespace mt
