// Argument validation for ops/moe_block.h, then the backend of the tensors' device.
#include "ops/moe_block.h"

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/check.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

// No output shares bytes with an input or another output (the kernels read inputs while writing).
void check_disjoint(std::initializer_list<std::pair<const Tensor*, const char*>> outs,
                    std::initializer_list<std::pair<const Tensor*, const char*>> ins, const char* fn) {
  const auto overlap = [](const Tensor& a, const Tensor& b) {
    if (a.empty() || b.empty() || a.nbytes() == 0 || b.nbytes() == 0) return false;
    const auto* a0 = static_cast<const char*>(a.data());
    const auto* b0 = static_cast<const char*>(b.data());
    return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  };
  for (auto o = outs.begin(); o != outs.end(); ++o) {
    for (const auto& i : ins)
      MT_CHECK(!overlap(*o->first, *i.first), "{}: output {} overlaps input {}", fn, o->second, i.second);
    for (auto p = std::next(o); p != outs.end(); ++p)
      MT_CHECK(!overlap(*o->first, *p->first), "{}: outputs {} and {} overlap", fn, o->second, p->second);
  }
}

}  // namespace

void moe_block_send_layout(const Tensor& send_index, const Tensor& slot_send, const Tensor& sent,
                           const Tensor& overflow, const Tensor& counts, const Tensor& row_index, int64_t num_dest,
                           int64_t block, const Stream& stream) {
  const char* fn = "moe_block_send_layout";
  MT_CHECK(counts.dtype() == DType::kI32 && counts.ndim() == 1 && counts.is_contiguous() && counts.numel() >= 1,
           "{}: counts must be a contiguous non-empty int32 [Ev] tensor, got {}", fn, counts.str());
  const int64_t Ev = counts.numel();
  MT_CHECK(num_dest >= 1, "{}: num_dest {} must be >= 1", fn, num_dest);
  MT_CHECK(Ev % num_dest == 0, "{}: {} experts are not divisible by {} destinations", fn, Ev, num_dest);
  MT_CHECK(block >= 0 && block <= INT32_MAX && num_dest * block <= INT32_MAX,
           "{}: block {} must be >= 0 and {} destinations x block must fit int32", fn, block, num_dest);
  MT_CHECK(row_index.dtype() == DType::kI32 && row_index.is_contiguous() && row_index.numel() <= INT32_MAX,
           "{}: row_index must be a contiguous int32 tensor of at most 2^31 - 1 slots, got {}", fn, row_index.str());
  const int64_t n = row_index.numel();
  op_checks::check_ints(row_index, counts, -1, n, fn, "row_index");
  op_checks::check_ints(slot_send, counts, -1, n, fn, "slot_send");
  op_checks::check_ints(send_index, counts, 1, num_dest * block, fn, "send_index");
  op_checks::check_ints(sent, counts, 1, Ev, fn, "sent");
  if (!overflow.empty()) {
    MT_CHECK(overflow.dtype() == DType::kF32 && overflow.numel() == 1 && overflow.is_contiguous(),
             "{}: overflow must be an fp32 [1] tensor or empty, got {}", fn, overflow.str());
    MT_CHECK(overflow.device() == counts.device(), "{}: overflow {} is not on {} like the others", fn, overflow.str(),
             counts.device().str());
  }
  check_disjoint({{&send_index, "send_index"}, {&slot_send, "slot_send"}, {&sent, "sent"}, {&overflow, "overflow"}},
                 {{&counts, "counts"}, {&row_index, "row_index"}}, fn);
  op_checks::check_stream(stream, counts, fn);
  MT_DISPATCH(counts.device(), moe_block_send_layout, send_index, slot_send, sent, overflow, counts, row_index,
              num_dest, block, stream);
}

void moe_block_receive_layout(const Tensor& gather_index, const Tensor& scatter_index, const Tensor& local_counts,
                              const Tensor& sent_all, int64_t first, int64_t num_local, int64_t block,
                              const Stream& stream) {
  const char* fn = "moe_block_receive_layout";
  MT_CHECK(sent_all.dtype() == DType::kI32 && sent_all.ndim() == 2 && sent_all.is_contiguous() &&
               sent_all.size(0) >= 1 && sent_all.size(1) >= 1,
           "{}: sent_all must be a contiguous int32 [C, Ev] tensor, got {}", fn, sent_all.str());
  const int64_t C = sent_all.size(0), Ev = sent_all.size(1);
  MT_CHECK(first >= 0 && num_local >= 1 && first + num_local <= Ev,
           "{}: local experts [{}, {}) are empty or outside the {} experts of sent_all", fn, first, first + num_local,
           Ev);
  MT_CHECK(block >= 0 && block <= INT32_MAX && C * block <= INT32_MAX,
           "{}: block {} must be >= 0 and {} sources x block must fit int32", fn, block, C);
  op_checks::check_ints(gather_index, sent_all, 1, C * block, fn, "gather_index");
  op_checks::check_ints(scatter_index, sent_all, 1, C * block, fn, "scatter_index");
  op_checks::check_ints(local_counts, sent_all, 1, num_local, fn, "local_counts");
  check_disjoint({{&gather_index, "gather_index"}, {&scatter_index, "scatter_index"}, {&local_counts, "local_counts"}},
                 {{&sent_all, "sent_all"}}, fn);
  op_checks::check_stream(stream, sent_all, fn);
  MT_DISPATCH(sent_all.device(), moe_block_receive_layout, gather_index, scatter_index, local_counts, sent_all, first,
              num_local, block, stream);
}

}  // namespace mt
