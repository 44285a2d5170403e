// Argument validation for ops/moe_echo.h, then the backend of the tensors' device.
#include "ops/moe_echo.h"

#include <cstdint>

#include "core/check.h"
#include "ops/op_checks.h"

namespace mt {

void moe_echo_plan(const Tensor& clone_expert, const Tensor& clone_quota, const Tensor& quota, const Tensor& counts,
                   int64_t ep, int64_t num_echo, const Stream& stream) {
  const char* fn = "moe_echo_plan";
  MT_CHECK(counts.dtype() == DType::kI32 && counts.ndim() == 2 && counts.is_contiguous() && counts.size(0) >= 1 &&
               counts.size(1) >= 1,
           "{}: counts must be a contiguous int32 [sources, E] tensor, got {}", fn, counts.str());
  const int64_t R = counts.size(0), E = counts.size(1);
  MT_CHECK(ep >= 1 && R % ep == 0, "{}: counts has {} source rows, expected a multiple of the {} EP ranks", fn, R, ep);
  MT_CHECK(E % ep == 0, "{}: {} experts are not divisible by {} EP ranks", fn, E, ep);
  MT_CHECK(num_echo >= 1, "{}: num_echo {} must be >= 1", fn, num_echo);
  const int64_t NS = ep * num_echo;
  op_checks::check_ints(clone_expert, counts, 1, NS, fn, "clone_expert");
  op_checks::check_ints(clone_quota, counts, 1, NS, fn, "clone_quota");
  op_checks::check_ints(quota, counts, 2, R * NS, fn, "quota");
  MT_CHECK(quota.size(0) == R, "{}: quota must be [{}, {}], got {}", fn, R, NS, quota.str());
  op_checks::check_stream(stream, counts, fn);
  MT_DISPATCH(counts.device(), moe_echo_plan, clone_expert, clone_quota, quota, counts, ep, num_echo, stream);
}

void moe_echo_reroute(const Tensor& rerouted, const Tensor& top, const Tensor& clone_expert, const Tensor& quota_row,
                      int64_t num_experts, const Stream& stream) {
  const char* fn = "moe_echo_reroute";
  MT_CHECK(top.dtype() == DType::kI32 && top.ndim() == 2 && top.is_contiguous(),
           "{}: top must be a contiguous int32 [T, k] tensor, got {}", fn, top.str());
  op_checks::check_ints(rerouted, top, 2, top.numel(), fn, "rerouted");
  MT_CHECK(rerouted.size(0) == top.size(0), "{}: rerouted {} must have top's shape {}", fn, rerouted.str(), top.str());
  MT_CHECK(clone_expert.ndim() == 1 && clone_expert.numel() >= 1,
           "{}: clone_expert must be a non-empty int32 [NS] tensor, got {}", fn, clone_expert.str());
  op_checks::check_ints(clone_expert, top, 1, clone_expert.numel(), fn, "clone_expert");
  op_checks::check_ints(quota_row, top, 1, clone_expert.numel(), fn, "quota_row");
  MT_CHECK(num_experts >= 1 && num_experts + clone_expert.numel() <= INT32_MAX,
           "{}: {} experts and {} clones do not fit int32 expert ids", fn, num_experts, clone_expert.numel());
  MT_CHECK(top.numel() == 0 || rerouted.data() != top.data(), "{}: rerouted must not alias top", fn);
  op_checks::check_stream(stream, top, fn);
  MT_DISPATCH(top.device(), moe_echo_reroute, rerouted, top, clone_expert, quota_row, num_experts, stream);
}

void moe_echo_virtual_experts(const Tensor& out, const Tensor& in, int64_t num_experts, int64_t ep, int64_t num_echo,
                              const Stream& stream) {
  const char* fn = "moe_echo_virtual_experts";
  MT_CHECK(in.dtype() == DType::kI32 && in.is_contiguous(), "{}: in must be a contiguous int32 tensor, got {}", fn,
           in.str());
  op_checks::check_ints(out, in, out.ndim(), in.numel(), fn, "out");
  MT_CHECK(ep >= 1 && num_experts >= ep && num_experts % ep == 0 && num_echo >= 1 &&
               num_experts + ep * num_echo <= INT32_MAX,
           "{}: {} experts, {} EP ranks and {} echo slots per rank do not fit (E % ep == 0, S >= 1)", fn, num_experts,
           ep, num_echo);
  op_checks::check_stream(stream, in, fn);
  MT_DISPATCH(in.device(), moe_echo_virtual_experts, out, in, num_experts, ep, num_echo, stream);
}

}  // namespace mt
