// Argument validation for ops/moe_echo_exchange.h, then the backend of the tensors' device.
#include "ops/moe_echo_exchange.h"

#include <cstdint>

#include "core/check.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

// A contiguous 1-D int32 tensor of `n` elements on ref's device.
void check_ints(const Tensor& t, const Tensor& ref, int64_t n, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kI32 && t.ndim() == 1 && t.is_contiguous() && t.numel() == n,
           "{}: {} must be a contiguous 1-D int32 tensor of {} elements, got {}", fn, name, n, t.str());
  MT_CHECK(t.device() == ref.device(), "{}: {} {} is not on {} like clone_expert", fn, name, t.str(),
           ref.device().str());
}

bool disjoint(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.data());
  const char* pb = static_cast<const char*>(b.data());
  return a.nbytes() == 0 || b.nbytes() == 0 || pa + a.nbytes() <= pb || pb + b.nbytes() <= pa;
}

// out: contiguous [M, n, k] of `dt` on `dev`; index: contiguous int32 [M] on `dev`. Returns M.
int64_t check_blocks_out(const Tensor& out, const Tensor& index, int64_t n, int64_t k, DType dt, Device dev,
                         const char* fn, const char* name) {
  MT_CHECK(index.dtype() == DType::kI32 && index.ndim() == 1 && index.is_contiguous(),
           "{}: index must be a contiguous 1-D int32 tensor, got {}", fn, index.str());
  const int64_t M = index.numel();
  MT_CHECK(M <= INT32_MAX, "{}: {} blocks do not fit int32", fn, M);
  MT_CHECK(out.ndim() == 3 && out.is_contiguous() && out.size(0) == M && out.size(1) == n && out.size(2) == k &&
               out.dtype() == dt,
           "{}: {} {} must be a contiguous {} [{}, {}, {}] tensor (one block per index entry)", fn, name, out.str(),
           dtype_name(dt), M, n, k);
  MT_CHECK(out.device() == dev && index.device() == dev, "{}: {} {} and index {} must be on {}", fn, name, out.str(),
           index.str(), dev.str());
  return M;
}

void check_experts_disjoint(const GroupedWeights& w, const Tensor& t, const char* fn, const char* wname,
                            const char* tname) {
  for (int64_t g = 0; g < w.groups(); ++g)
    MT_CHECK(disjoint(w[g], t), "{}: {} {} overlaps {} {} (tensor {})", fn, tname, t.str(), wname, w[g].str(), g);
}

}  // namespace

void moe_echo_exchange_index(const Tensor& w_send, const Tensor& w_recv, const Tensor& g_send, const Tensor& g_acc,
                             const Tensor& clone_expert, int64_t ep_rank, int64_t num_local, int64_t num_echo,
                             const Stream& stream) {
  const char* fn = "moe_echo_exchange_index";
  MT_CHECK(clone_expert.dtype() == DType::kI32 && clone_expert.ndim() == 1 && clone_expert.is_contiguous() &&
               clone_expert.numel() >= 1,
           "{}: clone_expert must be a non-empty contiguous 1-D int32 [P·S] tensor, got {}", fn, clone_expert.str());
  MT_CHECK(num_local >= 1 && num_echo >= 1, "{}: num_local {} and num_echo {} must be >= 1", fn, num_local, num_echo);
  const int64_t NS = clone_expert.numel();
  MT_CHECK(NS % num_echo == 0, "{}: clone_expert's {} slots are not a multiple of num_echo {}", fn, NS, num_echo);
  const int64_t P = NS / num_echo;
  MT_CHECK(ep_rank >= 0 && ep_rank < P, "{}: ep_rank {} is outside [0, {}) ({} slots / {} per rank)", fn, ep_rank, P,
           NS, num_echo);
  MT_CHECK(P * num_local <= INT32_MAX && NS <= INT32_MAX, "{}: {} ranks of {} experts do not fit int32 ids", fn, P,
           num_local);
  check_ints(w_send, clone_expert, NS, fn, "w_send");
  check_ints(w_recv, clone_expert, num_echo, fn, "w_recv");
  check_ints(g_send, clone_expert, NS, fn, "g_send");
  check_ints(g_acc, clone_expert, NS, fn, "g_acc");
  op_checks::check_stream(stream, clone_expert, fn);
  MT_DISPATCH(clone_expert.device(), moe_echo_exchange_index, w_send, w_recv, g_send, g_acc, clone_expert, ep_rank,
              num_local, num_echo, stream);
}

void moe_echo_gather_experts(const Tensor& out, const GroupedWeights& experts, const Tensor& index,
                             const Stream& stream) {
  const char* fn = "moe_echo_gather_experts";
  MT_CHECK(!experts.empty(), "{}: experts has no tensors", fn);
  check_blocks_out(out, index, experts.rows(), experts.cols(), experts.dtype(), experts.device(), fn, "out");
  check_experts_disjoint(experts, out, fn, "expert", "out");
  op_checks::check_stream(stream, out, fn);
  MT_DISPATCH(out.device(), moe_echo_gather_experts, out, experts, index, stream);
}

void moe_echo_gather_blocks(const Tensor& out, const Tensor& src, const Tensor& index, const Stream& stream) {
  const char* fn = "moe_echo_gather_blocks";
  MT_CHECK(src.ndim() == 3 && src.is_contiguous() && src.size(0) <= INT32_MAX,
           "{}: src must be a contiguous [G, n, k] tensor, got {}", fn, src.str());
  check_blocks_out(out, index, src.size(1), src.size(2), src.dtype(), src.device(), fn, "out");
  MT_CHECK(disjoint(out, src), "{}: out {} overlaps src {}", fn, out.str(), src.str());
  op_checks::check_stream(stream, out, fn);
  MT_DISPATCH(out.device(), moe_echo_gather_blocks, out, src, index, stream);
}

void moe_echo_accumulate_experts(const GroupedWeights& grads, const Tensor& src, const Tensor& index,
                                 const Stream& stream) {
  const char* fn = "moe_echo_accumulate_experts";
  MT_CHECK(!grads.empty(), "{}: grads has no tensors", fn);
  MT_CHECK(grads.dtype() == DType::kF32, "{}: grads must be fp32 main gradients, got {}", fn, grads[0].str());
  check_blocks_out(src, index, grads.rows(), grads.cols(), DType::kF32, grads.device(), fn, "src");
  check_experts_disjoint(grads, src, fn, "grad", "src");
  op_checks::check_stream(stream, src, fn);
  MT_DISPATCH(src.device(), moe_echo_accumulate_experts, grads, src, index, stream);
}

}  // namespace mt
