// Argument validation and backend dispatch for ops/fp8.h.
#include "ops/fp8.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

using op_checks::check_fp8_dtype;
using op_checks::check_stats;

/// x [..., cols] as [rows, cols] (op_checks::check_act), with q (x's shape) and q_t ([cols, rows])
/// FP8 of one dtype where given; at least one given. Returns {rows, cols}.
std::pair<int64_t, int64_t> check_quantize_io(const Tensor& q, const Tensor& q_t, const Tensor& x, const char* fn) {
  op_checks::check_act(x, fn, "x");
  const auto [rows, cols] = op_checks::rows_of(x, fn);
  MT_CHECK(!q.empty() || !q_t.empty(), "{}: q and q_t are both empty: nothing to write", fn);
  if (!q.empty()) {
    op_checks::check_fp8_like(q, x, fn, "q", "x");
  }
  if (!q_t.empty()) {
    check_fp8_dtype(q_t.dtype(), fn, "q_t");
    MT_CHECK(q_t.ndim() == 2 && q_t.size(0) == cols && q_t.size(1) == rows && q_t.is_contiguous(),
             "{}: q_t {} must be a contiguous [{}, {}] (x {} transposed)", fn, q_t.str(), cols, rows, x.shape_str());
    MT_CHECK(q.empty() || q.dtype() == q_t.dtype(), "{}: q {} and q_t {} need one FP8 dtype", fn, q.str(), q_t.str());
  }
  return {rows, cols};
}

void check_scale_tensor(const Tensor& s, Fp8Scaling scaling, int64_t rows, int64_t cols, const char* fn,
                        const char* name) {
  const std::vector<int64_t> want = fp8_scale_shape(scaling, rows, cols);
  if (scaling == Fp8Scaling::kTensor) {
    check_stats(s, 1, fn, name);
    return;
  }
  MT_CHECK(s.dtype() == DType::kF32 && s.shape() == want && s.is_contiguous(),
           "{}: {} must be a contiguous fp32 [{}, {}] (the scales of a [{}, {}] tensor), got {}", fn, name, want[0],
           want[1], rows, cols, s.str());
}

}  // namespace

std::vector<int64_t> fp8_scale_shape(Fp8Scaling s, int64_t rows, int64_t cols) {
  MT_CHECK(rows >= 0 && cols >= 0, "fp8_scale_shape: negative size rows={} cols={}", rows, cols);
  if (s == Fp8Scaling::kTensor) return {1};
  return {fp8_math::scale_rows(s, rows, cols), fp8_math::scale_cols(s, rows, cols)};
}

void fp8_check_device(Device device, bool blockwise) {
  if (device.is_cpu()) return;
#ifdef MT_WITH_CUDA
  const int cc = compute_capability(device);
  MT_REQUIRE(cc >= 89,
             "FP8 training (--fp8-format) needs a GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
             "Blackwell); {} has compute capability {}.{}",
             device.str(), cc / 10, cc % 10);
  MT_REQUIRE(!blockwise || cc / 10 == 9,
             "--fp8-recipe blockwise needs a Hopper GPU (compute capability 9.x: cuBLASLt's 1x128 / 128x128 block "
             "scaling); {} has compute capability {}.{} (use --fp8-recipe tensorwise or delayed)",
             device.str(), cc / 10, cc % 10);
#else
  no_cuda_backend("fp8_check_device");
#endif
}

void fp8_amax(const Tensor& amax, const Tensor& x, const Stream& stream) {
  op_checks::check_act(x, "fp8_amax", "x");
  check_stats(amax, 1, "fp8_amax", "amax");
  check_same_device({&amax, &x});
  op_checks::check_stream(stream, amax, "fp8_amax");
  MT_DISPATCH(amax.device(), fp8_amax, amax, x, stream);
}

void fp8_scale_from_amax(const Tensor& scale, const Tensor& scale_inv, const Tensor& amax, DType fp8, bool pow2,
                         float epsilon, const Stream& stream) {
  const char* fn = "fp8_scale_from_amax";
  check_fp8_dtype(fp8, fn, "fp8");
  MT_CHECK(epsilon >= 0.f, "{}: epsilon must be >= 0, got {}", fn, epsilon);
  const int64_t n = amax.numel();
  MT_CHECK(n >= 1, "{}: amax {} is empty", fn, amax.str());
  check_stats(amax, n, fn, "amax");
  check_stats(scale, n, fn, "scale");
  check_stats(scale_inv, n, fn, "scale_inv");
  check_same_device({&scale, &scale_inv, &amax});
  op_checks::check_stream(stream, amax, fn);
  MT_DISPATCH(amax.device(), fp8_scale_from_amax, scale, scale_inv, amax, fp8, pow2, epsilon, stream);
}

void fp8_delayed_scale_update(const Tensor& amax_history, const Tensor& scale, const Tensor& scale_inv, DType fp8,
                              int margin, fp8_math::AmaxAlgo algo, const Stream& stream) {
  const char* fn = "fp8_delayed_scale_update";
  check_fp8_dtype(fp8, fn, "fp8");
  MT_CHECK(margin >= 0, "{}: margin (--fp8-margin) must be >= 0, got {}", fn, margin);
  MT_CHECK(algo == fp8_math::AmaxAlgo::kMax || algo == fp8_math::AmaxAlgo::kMostRecent, "{}: unknown amax algo {}", fn,
           static_cast<int>(algo));
  MT_CHECK(amax_history.dtype() == DType::kF32 && amax_history.ndim() == 2 && amax_history.size(0) >= 1 &&
               amax_history.size(1) >= 1 && amax_history.is_contiguous(),
           "{}: amax_history must be a contiguous fp32 [len >= 1, n >= 1], got {}", fn, amax_history.str());
  const int64_t n = amax_history.size(1);
  check_stats(scale, n, fn, "scale");
  check_stats(scale_inv, n, fn, "scale_inv");
  check_same_device({&amax_history, &scale, &scale_inv});
  op_checks::check_stream(stream, amax_history, fn);
  MT_DISPATCH(amax_history.device(), fp8_delayed_scale_update, amax_history, scale, scale_inv, fp8, margin, algo,
              stream);
}

void fp8_quantize(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale, const Tensor& amax,
                  const Stream& stream) {
  const char* fn = "fp8_quantize";
  check_quantize_io(q, q_t, x, fn);
  op_checks::check_fp8_scale_amax(scale, amax, fn);
  check_same_device({&q, &q_t, &x, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_quantize, q, q_t, x, scale, amax, stream);
}

void fp8_quantize_bf16_rounded(const Tensor& q, const Tensor& q_t, const Tensor& x, const Tensor& scale,
                               const Tensor& amax, const Stream& stream) {
  const char* fn = "fp8_quantize_bf16_rounded";
  MT_CHECK(x.dtype() == DType::kF32, "{}: x must be fp32 (the values rounded to bf16), got {}", fn, x.str());
  check_quantize_io(q, q_t, x, fn);
  op_checks::check_fp8_scale_amax(scale, amax, fn);
  check_same_device({&q, &q_t, &x, &scale, &amax});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_quantize_bf16_rounded, q, q_t, x, scale, amax, stream);
}

void fp8_quantize_blockwise(const Tensor& q, const Tensor& q_scale_inv, const Tensor& q_t, const Tensor& q_t_scale_inv,
                            const Tensor& x, Fp8Scaling scaling, bool pow2, const Stream& stream) {
  const char* fn = "fp8_quantize_blockwise";
  MT_CHECK(scaling == Fp8Scaling::kBlock1x128 || scaling == Fp8Scaling::kBlock128x128,
           "{}: scaling must be 1x128 or 128x128 blocks, got {}", fn, static_cast<int>(scaling));
  const auto [rows, cols] = check_quantize_io(q, q_t, x, fn);
  MT_CHECK(q.empty() == q_scale_inv.empty() && q_t.empty() == q_t_scale_inv.empty(),
           "{}: q ({}) and q_scale_inv ({}), q_t ({}) and q_t_scale_inv ({}) come in pairs", fn, q.str(),
           q_scale_inv.str(), q_t.str(), q_t_scale_inv.str());
  if (!q.empty()) check_scale_tensor(q_scale_inv, scaling, rows, cols, fn, "q_scale_inv");
  if (!q_t.empty()) check_scale_tensor(q_t_scale_inv, scaling, cols, rows, fn, "q_t_scale_inv");
  check_same_device({&q, &q_scale_inv, &q_t, &q_t_scale_inv, &x});
  op_checks::check_stream(stream, x, fn);
  MT_DISPATCH(x.device(), fp8_quantize_blockwise, q, q_scale_inv, q_t, q_t_scale_inv, x, scaling, pow2, stream);
}

void fp8_dequantize(const Tensor& y, const Tensor& q, const Tensor& scale_inv, Fp8Scaling scaling,
                    const Stream& stream) {
  const char* fn = "fp8_dequantize";
  op_checks::check_act(y, fn, "y");
  op_checks::check_fp8_like(q, y, fn, "q", "y");
  const auto [rows, cols] = op_checks::rows_of(q, fn);
  check_scale_tensor(scale_inv, scaling, rows, cols, fn, "scale_inv");
  check_same_device({&y, &q, &scale_inv});
  op_checks::check_stream(stream, y, fn);
  MT_DISPATCH(y.device(), fp8_dequantize, y, q, scale_inv, scaling, stream);
}

}  // namespace mt
