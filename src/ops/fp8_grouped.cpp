// Argument validation of ops/fp8_grouped.h, then the backend of the tensors' device.
#include "ops/fp8_grouped.h"

#include "core/dtype.h"
#include "ops/op_checks.h"

namespace mt {

namespace fp8_grouped {
int64_t value_stride(const Tensor& t, int64_t groups, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 && ((t.ndim() == 1 && t.size(0) == groups && t.is_contiguous()) ||
                                        (t.ndim() == 2 && t.size(0) == groups && t.size(1) == 1)),
           "{}: {} {} must be fp32 [{}] contiguous or [{}, 1] (one value per group)", fn, name, t.str(), groups,
           groups);
  return groups > 1 ? t.stride(0) : 1;
}
}  // namespace fp8_grouped

namespace {
void check_rows_counts(const Tensor& x, const Tensor& counts, const char* fn) {
  MT_CHECK(x.ndim() == 2 && x.is_contiguous() &&
               (x.dtype() == DType::kF32 || (x.device().is_cuda() && (x.dtype() == DType::kBF16 ||
                                                                      x.dtype() == DType::kF16))),
           "{}: x {} must be a contiguous [R, k] matrix, fp32 (CPU) or fp32/bf16/fp16 (CUDA)", fn, x.str());
  MT_CHECK(counts.dtype() == DType::kI32 && counts.ndim() == 1 && counts.size(0) >= 1 && counts.is_contiguous() &&
               counts.device() == x.device(),
           "{}: counts {} must be a contiguous int32 [G] (G >= 1) on {} like x", fn, counts.str(), x.device().str());
}
}  // namespace

void fp8_grouped_amax(const Tensor& amax, const Tensor& x, const Tensor& counts, const Stream& stream) {
  check_rows_counts(x, counts, "fp8_grouped_amax");
  fp8_grouped::value_stride(amax, counts.size(0), "fp8_grouped_amax", "amax");
  check_same_device({&amax, &x});
  op_checks::check_stream(stream, x, "fp8_grouped_amax");
  MT_DISPATCH(x.device(), fp8_grouped_amax, amax, x, counts, stream);
}

void fp8_grouped_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                          const Tensor& record, const Tensor& counts, const Stream& stream) {
  const char* fn = "fp8_grouped_quantize";
  check_rows_counts(x, counts, fn);
  const int64_t G = counts.size(0), R = x.size(0), k = x.size(1);
  fp8_grouped::value_stride(scale, G, fn, "scale");
  if (!record.empty()) fp8_grouped::value_stride(record, G, fn, "record");
  MT_CHECK(!q.empty() || !q_t.empty(), "{}: neither q nor q_t given", fn);
  if (!q.empty())
    MT_CHECK(is_fp8(q.dtype()) && q.is_contiguous() && q.shape() == x.shape() && q.device() == x.device(),
             "{}: q {} must be a contiguous FP8 [{}, {}] on {}", fn, q.str(), R, k, x.device().str());
  if (!q_t.empty())
    MT_CHECK(is_fp8(q_t.dtype()) && q_t.is_contiguous() && q_t.ndim() == 2 && q_t.size(0) == k && q_t.size(1) >= R &&
                 q_t.device() == x.device() && (q.empty() || q.dtype() == q_t.dtype()),
             "{}: q_t {} must be a contiguous FP8 [{}, >= {}] on {} of q's dtype", fn, q_t.str(), k, R,
             x.device().str());
  check_same_device({&scale, &x});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_grouped_quantize, q, q_t, x, scale, record, counts, stream);
}

}  // namespace mt
