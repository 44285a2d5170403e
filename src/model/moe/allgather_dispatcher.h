// MoEAllGatherTokenDispatcher (Megatron-Core transformer/moe/token_dispatcher.py, the default
// --moe-token-dispatcher-type allgather): x [T, h], the selection and the probs are all-gathered
// over the dispatch group G (expert tensor × expert model parallel group); every rank picks the
// rows of its local experts out of all N = |G|·T tokens; the combine is the prob-weighted sum over
// each token's slots, then a reduce-scatter over G. The backward all-gathers dy and reduce-scatters
// dx and the probs' gradient.
//
// preprocess(): the all-gather of the selection and the probs over G and the routing map (row
// index, slot rows, tokens per local expert) on the device. The token all-gather and the
// permutation are dispatch(); preprocess_backward() is empty. With device_counts (--moe-grouped-gemm)
// nothing is read on the host.
#pragma once
#include <vector>

#include "model/moe/token_dispatcher.h"

namespace mt {

class MoEAllGatherTokenDispatcher final : public MoeTokenDispatcher {
 public:
  MoEAllGatherTokenDispatcher(const ExpertParallel& ep, const MoeDispatchSizes& sizes) : ep_(ep), s_(sizes) {}

  int64_t plan(BufferPlanner& planner, int64_t tokens, int64_t hidden) override;
  Tensor top(int slot) const override { return local(saved_.at(static_cast<size_t>(slot)).top_all); }
  Tensor probs(int slot) const override { return local(saved_.at(static_cast<size_t>(slot)).probs_all); }
  void preprocess(const Tensor& x, int slot, const Stream& stream) override;
  MoeExpertCounts dispatch(const Tensor& xp, const Tensor& x, int slot, const Stream& stream) override;
  void combine(const Tensor& y, const Tensor& out, int slot, const Stream& stream) override;
  void combine_backward(const Tensor& d_out, const Tensor& d_probs, const Tensor& dy, const Tensor& out, int slot,
                        const Stream& stream) override;
  void dispatch_backward(const Tensor& dx, const Tensor& d_xp, int slot, const Stream& stream) override;
  void preprocess_backward(const Tensor&, int, const Stream&) override {}  // dx written by dispatch_backward

 private:
  struct Saved {
    Tensor top_all;    // int32 [N, k]: the gathered selection (this rank's rows: its slice)
    Tensor probs_all;  // fp32 [N, k]: the gathered probs
    Tensor row_index;  // int32 [R_max]
    Tensor slot_row;   // int32 [N·k]: the row of each flat slot, -1 if not local
    Tensor counts;     // int32 [E_l]
  };
  int size() const;
  Communicator& group() const { return *ep_.dispatch; }
  // This rank's rows of a gathered [N, k] tensor.
  Tensor local(const Tensor& all) const;
  // `mine` all-gathered into `all` over G (returns `mine` itself on one rank).
  Tensor gather(const Tensor& all, const Tensor& mine, const Stream& st) const;
  // `all` reduce-scattered over G into `mine` (a copy on one rank).
  void scatter_sum(const Tensor& mine, const Tensor& all, const Stream& st) const;

  ExpertParallel ep_;
  MoeDispatchSizes s_;
  int64_t tokens_ = 0, gathered_ = 0;
  std::vector<Saved> saved_;  // per area
  Tensor x_all_, y_all_, dy_all_, dx_all_, d_probs_all_;
};

}  // namespace mt
