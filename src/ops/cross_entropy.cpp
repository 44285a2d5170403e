// Argument validation and backend dispatch for ops/cross_entropy.h.
#include "ops/cross_entropy.h"

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

/// An fp32 [m] statistics vector.
void check_row_vec(const Tensor& t, int64_t m, const char* name) { check_tensor(t, DType::kF32, {m}, name); }

void check_mask(const Tensor& loss_mask, int64_t m) {
  if (!loss_mask.empty()) check_tensor(loss_mask, DType::kF32, {m}, "loss_mask");
}

/// logits [m, V] (fp32/bf16/fp16, contiguous, V > 0) and targets int32 [m]; returns m.
int64_t check_logits_targets(const Tensor& logits, const Tensor& targets, int64_t vocab_start) {
  MT_CHECK(logits.ndim() == 2, "logits: expected [m, V], got {}", logits.str());
  MT_CHECK(op_checks::is_float(logits.dtype()), "logits: dtype {} not fp32/bf16/fp16", dtype_name(logits.dtype()));
  MT_CHECK(logits.is_contiguous(), "logits {} must be contiguous", logits.str());
  MT_CHECK(logits.size(1) > 0, "logits: empty vocabulary dimension in {}", logits.str());
  const int64_t m = logits.size(0);
  check_tensor(targets, DType::kI32, {m}, "targets");
  MT_CHECK(vocab_start >= 0, "vocab_start={} must be >= 0", vocab_start);
  MT_CHECK(vocab_start + logits.size(1) <= INT32_MAX, "vocab_start={} + V={} exceeds the int32 target range",
           vocab_start, logits.size(1));
  return m;
}

/// device_scale: empty, or fp32 [1] on the logits' device.
void check_device_scale(const Tensor& device_scale, const Tensor& logits) {
  if (device_scale.empty()) return;
  check_tensor(device_scale, DType::kF32, {1}, "device_scale");
  check_same_device({&logits, &device_scale});
}

/// valid_cols in [-1, V]; -1 = V.
int64_t resolve_valid_cols(int64_t valid_cols, const Tensor& logits) {
  const int64_t v = logits.size(1);
  MT_CHECK(valid_cols >= -1 && valid_cols <= v, "valid_cols={} must be in [0, {}] (or -1 = all)", valid_cols, v);
  return valid_cols < 0 ? v : valid_cols;
}

}  // namespace

void cross_entropy_stats(const Tensor& row_max, const Tensor& row_sumexp, const Tensor& target_logit,
                         const Tensor& logits, const Tensor& targets, int64_t vocab_start, int64_t valid_cols,
                         const Stream& stream) {
  const int64_t m = check_logits_targets(logits, targets, vocab_start);
  valid_cols = resolve_valid_cols(valid_cols, logits);
  check_row_vec(row_max, m, "row_max");
  check_row_vec(row_sumexp, m, "row_sumexp");
  check_row_vec(target_logit, m, "target_logit");
  check_same_device({&row_max, &row_sumexp, &target_logit, &logits, &targets});
  op_checks::check_stream(stream, logits, "cross_entropy_stats");
  if (m == 0) return;
  MT_DISPATCH(logits.device(), cross_entropy_stats, row_max, row_sumexp, target_logit, logits, targets, vocab_start,
              valid_cols, stream);
}

void cross_entropy_rescale_sumexp(const Tensor& row_sumexp, const Tensor& local_max, const Tensor& global_max,
                                  const Stream& stream) {
  MT_CHECK(row_sumexp.ndim() == 1, "row_sumexp: expected [m], got {}", row_sumexp.str());
  const int64_t m = row_sumexp.size(0);
  check_row_vec(row_sumexp, m, "row_sumexp");
  check_row_vec(local_max, m, "local_max");
  check_row_vec(global_max, m, "global_max");
  check_same_device({&row_sumexp, &local_max, &global_max});
  op_checks::check_stream(stream, row_sumexp, "cross_entropy_rescale_sumexp");
  if (m == 0) return;
  MT_DISPATCH(row_sumexp.device(), cross_entropy_rescale_sumexp, row_sumexp, local_max, global_max, stream);
}

void cross_entropy_loss(const Tensor& losses, const Tensor& row_max, const Tensor& row_sumexp,
                        const Tensor& target_logit, const Tensor& loss_mask, const Stream& stream) {
  MT_CHECK(losses.ndim() == 1, "losses: expected [m], got {}", losses.str());
  const int64_t m = losses.size(0);
  check_row_vec(losses, m, "losses");
  check_row_vec(row_max, m, "row_max");
  check_row_vec(row_sumexp, m, "row_sumexp");
  check_row_vec(target_logit, m, "target_logit");
  check_mask(loss_mask, m);
  check_same_device({&losses, &row_max, &row_sumexp, &target_logit, &loss_mask});
  op_checks::check_stream(stream, losses, "cross_entropy_loss");
  if (m == 0) return;
  MT_DISPATCH(losses.device(), cross_entropy_loss, losses, row_max, row_sumexp, target_logit, loss_mask, stream);
}

void cross_entropy_backward_inplace(const Tensor& logits, const Tensor& targets, const Tensor& row_max,
                                    const Tensor& row_sumexp, const Tensor& loss_mask, int64_t vocab_start,
                                    int64_t valid_cols, float grad_scale, const Tensor& device_scale,
                                    const Stream& stream) {
  const int64_t m = check_logits_targets(logits, targets, vocab_start);
  valid_cols = resolve_valid_cols(valid_cols, logits);
  check_device_scale(device_scale, logits);
  check_row_vec(row_max, m, "row_max");
  check_row_vec(row_sumexp, m, "row_sumexp");
  check_mask(loss_mask, m);
  check_same_device({&logits, &targets, &row_max, &row_sumexp, &loss_mask});
  op_checks::check_stream(stream, logits, "cross_entropy_backward_inplace");
  if (m == 0) return;
  MT_DISPATCH(logits.device(), cross_entropy_backward_inplace, logits, targets, row_max, row_sumexp, loss_mask,
              vocab_start, valid_cols, grad_scale, device_scale, stream);
}

void cross_entropy_forward_backward_inplace(const Tensor& row_max, const Tensor& row_sumexp,
                                            const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                                            const Tensor& loss_mask, int64_t valid_cols, float grad_scale,
                                            const Tensor& device_scale, const Stream& stream) {
  const int64_t m = check_logits_targets(logits, targets, 0);
  valid_cols = resolve_valid_cols(valid_cols, logits);
  check_device_scale(device_scale, logits);
  check_row_vec(row_max, m, "row_max");
  check_row_vec(row_sumexp, m, "row_sumexp");
  check_row_vec(target_logit, m, "target_logit");
  check_mask(loss_mask, m);
  check_same_device({&row_max, &row_sumexp, &target_logit, &logits, &targets, &loss_mask});
  op_checks::check_stream(stream, logits, "cross_entropy_forward_backward_inplace");
  if (m == 0) return;
  MT_DISPATCH(logits.device(), cross_entropy_forward_backward_inplace, row_max, row_sumexp, target_logit, logits,
              targets, loss_mask, valid_cols, grad_scale, device_scale, stream);
}

void sum_accumulate(const Tensor& out, const Tensor& x, float alpha, const Stream& stream) {
  check_tensor(out, DType::kF32, {1}, "out");
  check_tensor(x, DType::kF32, {-1}, "x");
  check_same_device({&out, &x});
  op_checks::check_stream(stream, out, "sum_accumulate");
  if (x.numel() == 0) return;
  MT_DISPATCH(out.device(), sum_accumulate, out, x, alpha, stream);
}

}  // namespace mt
