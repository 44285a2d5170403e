// Argument checks shared by the ops' validation layers (ops/<op>.cpp). Each throws mt::Error with
// a message naming the op (`fn`), the argument and the offending tensor (dtype, shape, device).
#pragma once
#include <utility>

#include "core/check.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace mt::op_checks {

inline bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

/// A contiguous fp32/bf16/fp16 tensor.
inline void check_float(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(is_float(t.dtype()), "{}: {} must be fp32/bf16/fp16, got {}", fn, name, t.str());
  MT_CHECK(t.is_contiguous(), "{}: {} must be contiguous, got {}", fn, name, t.str());
}

/// An activation: contiguous fp32/bf16/fp16, and fp32 on the CPU (the reference backend).
inline void check_act(const Tensor& t, const char* fn, const char* name) {
  check_float(t, fn, name);
  MT_CHECK(!t.device().is_cpu() || t.dtype() == DType::kF32, "{}: {} on CPU must be fp32, got {}", fn, name,
           t.str());
}

/// The stream runs on the tensor's device (type and index).
inline void check_stream(const Stream& stream, const Tensor& t, const char* fn) {
  MT_CHECK(stream.device() == t.device(), "{}: stream on {} but tensors on {}", fn, stream.device().str(),
           t.device().str());
}

/// Same shape and dtype as `ref`.
inline void check_like(const Tensor& t, const Tensor& ref, const char* fn, const char* name, const char* ref_name) {
  MT_CHECK(t.shape() == ref.shape() && t.dtype() == ref.dtype(), "{}: {} {} must match {} {} (shape and dtype)", fn,
           name, t.str(), ref_name, ref.str());
}

/// x: [..., h] with h >= 1, viewed as rows; returns {rows, h}.
inline std::pair<int64_t, int64_t> rows_of(const Tensor& x, const char* fn) {
  MT_CHECK(x.ndim() >= 1 && x.size(-1) >= 1, "{}: x {} needs a non-empty last dimension", fn, x.str());
  const int64_t h = x.size(-1);
  return {x.numel() / h, h};
}

/// A contiguous fp32 vector of n elements (any shape): per-row norm statistics, FP8 scales and amaxes.
inline void check_stats(const Tensor& t, int64_t n, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 && t.numel() == n && t.is_contiguous(),
           "{}: {} must be a contiguous fp32 tensor of {} element(s), got {}", fn, name, n, t.str());
}

/// An FP8 dtype: kF8E4M3 or kF8E5M2.
inline void check_fp8_dtype(DType t, const char* fn, const char* name) {
  MT_CHECK(is_fp8(t), "{}: {} must be fp8_e4m3 or fp8_e5m2, got {}", fn, name, dtype_name(t));
}

/// q: the FP8 copy of `ref`: an FP8 dtype, contiguous, ref's shape.
inline void check_fp8_like(const Tensor& q, const Tensor& ref, const char* fn, const char* name,
                           const char* ref_name) {
  check_fp8_dtype(q.dtype(), fn, name);
  MT_CHECK(q.shape() == ref.shape() && q.is_contiguous(), "{}: {} {} must be contiguous with {}'s shape {}", fn, name,
           q.str(), ref_name, ref.shape_str());
}

/// A tensorwise quantiser's scale (fp32, one element) and optional amax record (empty, or fp32,
/// one element).
inline void check_fp8_scale_amax(const Tensor& scale, const Tensor& amax, const char* fn) {
  check_stats(scale, 1, fn, "scale");
  if (!amax.empty()) check_stats(amax, 1, fn, "amax");
}

/// A contiguous int32 tensor of `n` elements on ref's device, with `ndim` dimensions (any shape
/// when ndim < 0).
inline void check_ints(const Tensor& t, const Tensor& ref, int ndim, int64_t n, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kI32 && (ndim < 0 || t.ndim() == ndim) && t.is_contiguous() && t.numel() == n,
           "{}: {} must be a contiguous int32 tensor of {} elements{}, got {}", fn, name, n,
           ndim < 0 ? "" : fmt::format(" and {} dimension(s)", ndim), t.str());
  MT_CHECK(t.device() == ref.device(), "{}: {} {} is not on {} like the others", fn, name, t.str(), ref.device().str());
}

}  // namespace mt::op_checks
