#include "comm/communicator.h"

namespace mt {

void SingleRankCommunicator::all_gather(const Tensor& out, const Tensor& in, const Stream& stream) {
  MT_CHECK(out.numel() == in.numel(), "{}: all_gather out {} vs in {} on a size-1 group", name_, out.str(), in.str());
  if (out.data() != in.data()) copy(out, in, stream);
}

void SingleRankCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp, const Stream& stream) {
  MT_CHECK(out.numel() == in.numel(), "{}: reduce_scatter out {} vs in {} on a size-1 group", name_, out.str(),
           in.str());
  if (out.data() != in.data()) copy(out, in, stream);
}

ProcessGroups ProcessGroups::single() {
  ProcessGroups g;
  g.world = std::make_shared<SingleRankCommunicator>("world");
  g.tp = std::make_shared<SingleRankCommunicator>("tp");
  g.dp = std::make_shared<SingleRankCommunicator>("dp");
  g.pp = std::make_shared<SingleRankCommunicator>("pp");
  return g;
}

}  // namespace mt
