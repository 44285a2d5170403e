// GroupedWeights and the argument validation of ops/grouped_matmul.h, then the backend of the
// tensors' device.
#include "ops/grouped_matmul.h"

#include <cstdint>

#include "ops/op_checks.h"
#ifdef MT_WITH_CUDA
#include "ops/cuda/grouped_matmul_sm90.cuh"
#endif

namespace mt {

GroupedWeights::GroupedWeights(std::vector<Tensor> weights, const Stream& stream) : w_(std::move(weights)) {
  MT_CHECK(!w_.empty(), "GroupedWeights: no weights");
  const Tensor& w0 = w_.front();
  MT_CHECK(w0.ndim() == 2 && w0.is_contiguous() && op_checks::is_float(w0.dtype()),
           "GroupedWeights: weight 0 {} must be a contiguous float [n, k] tensor", w0.str());
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

}  // namespace

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
