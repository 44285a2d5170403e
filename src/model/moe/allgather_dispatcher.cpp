#include "model/moe/allgather_dispatcher.h"

#include <algorithm>
#include <numeric>

#include "model/moe/moe_utils.h"
#include "ops/elementwise.h"
#include "ops/moe.h"

namespace mt {

int64_t MoEAllGatherTokenDispatcher::plan(BufferPlanner& p, int64_t tokens, int64_t h) {
  const DType t = p.act_dtype();
  const int64_t k = s_.topk;
  tokens_ = tokens;
  gathered_ = tokens * size();
  int64_t max_rows = gathered_ * std::min(k, s_.num_local);
  // with an expert capacity C: at most C rows per local expert from each of the size() sources
  if (s_.capacity_factor > 0)
    max_rows = std::min(max_rows, size() * s_.num_local *
                                      moe_expert_capacity(tokens, k, s_.num_experts, s_.capacity_factor));
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.top_all = p.saved(DType::kI32, {gathered_, k}, "routing (gathered)");
  sv.probs_all = p.saved(DType::kF32, {gathered_, k}, "routing probs (gathered)");
  sv.row_index = p.saved(DType::kI32, {max_rows}, "expert row index");
  sv.slot_row = p.saved(DType::kI32, {gathered_ * k}, "row of each routed slot");
  sv.counts = p.saved(DType::kI32, {s_.num_local}, "tokens per local expert");
  x_all_ = p.scratch("moe.x_all", t, {gathered_, h});
  y_all_ = p.scratch("moe.y_all", t, {gathered_, h});
  dy_all_ = p.scratch("moe.dy_all", t, {gathered_, h});
  dx_all_ = p.scratch("moe.dx_all", t, {gathered_, h});
  d_probs_all_ = p.scratch("moe.d_probs_all", DType::kF32, {gathered_, k});
  return max_rows;
}

// The gathered selection and probs, and the routing map on the device (row_index is -1 beyond
// the routed rows, which permute skips).
void MoEAllGatherTokenDispatcher::preprocess(const Tensor& x, int slot, const Stream& st) {
  (void)x;  // the tokens are gathered by dispatch()
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  if (size() > 1) {
    group().all_gather(sv.top_all, local(sv.top_all), st);
    group().all_gather(sv.probs_all, local(sv.probs_all), st);
  }
  moe_routing_map_device(sv.row_index, sv.slot_row, sv.counts, sv.top_all, s_.first_expert, s_.num_local, st);
}

MoeExpertCounts MoEAllGatherTokenDispatcher::dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& st) {
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Tensor x_all = gather(x_all_, x, st);  // issued before the host read: it runs meanwhile
  MoeExpertCounts out;
  out.device = sv.counts;
  if (s_.device_counts) {  // sync-free
    moe_permute(rows(xp).slice0(0, sv.row_index.numel()), x_all, sv.row_index, s_.topk, st);
    return out;
  }
  std::vector<int32_t> host(static_cast<size_t>(s_.num_local));
  copy_bytes(host.data(), Device::cpu(), sv.counts.data(), sv.counts.device(), host.size() * sizeof(int32_t), st);
  st.synchronize();  // the expert GEMM shapes
  out.host.assign(host.begin(), host.end());
  const int64_t R = std::accumulate(out.host.begin(), out.host.end(), int64_t{0});
  MT_CHECK(R <= xp.size(0), "MoE allgather dispatch: {} expert rows exceed the planned {}", R, xp.size(0));
  moe_permute(row_range(xp, 0, R), x_all, sv.row_index, s_.topk, st);
  return out;
}

void MoEAllGatherTokenDispatcher::combine(const Tensor& y, const Tensor& out, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Tensor y_all = size() == 1 ? y : y_all_;
  moe_unpermute(y_all, out, sv.probs_all, sv.slot_row, st);
  scatter_sum(y, y_all, st);
}

void MoEAllGatherTokenDispatcher::combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy,
                                                   const Tensor& out, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Tensor dy_all = gather(dy_all_, dy, st);
  const Tensor d_probs_all = size() == 1 ? d_probs : d_probs_all_;
  moe_unpermute_backward(d_out, d_probs_all, dy_all, out, sv.probs_all, sv.row_index, sv.slot_row, st);
  if (size() > 1) group().reduce_scatter(d_probs, d_probs_all_, ReduceOp::kSum, st);
}

void MoEAllGatherTokenDispatcher::dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Tensor dx_all = size() == 1 ? dx : dx_all_;
  moe_permute_backward(dx_all, d_xp, sv.slot_row, s_.topk, st);
  scatter_sum(dx, dx_all, st);
}

int MoEAllGatherTokenDispatcher::size() const { return group_size(ep_.dispatch); }

Tensor MoEAllGatherTokenDispatcher::local(const Tensor& all) const {
  if (size() == 1) return all;
  const int64_t r = group().rank();
  return all.slice0(r * tokens_, (r + 1) * tokens_);
}

Tensor MoEAllGatherTokenDispatcher::gather(const Tensor& all, const Tensor& mine, const Stream& st) const {
  if (size() == 1) return mine;
  group().all_gather(all, mine, st);
  return all;
}

void MoEAllGatherTokenDispatcher::scatter_sum(const Tensor& mine, const Tensor& all, const Stream& st) const {
  if (size() == 1) {
    if (mine.data() != all.data()) copy(mine, all, st);
    return;
  }
  group().reduce_scatter(mine, all, ReduceOp::kSum, st);
}

}  // namespace mt
