#include "model/moe/token_dispatcher.h"

#include "model/moe/allgather_dispatcher.h"
#include "model/moe/alltoall_dispatcher.h"
#include "model/moe/moe_utils.h"

namespace mt {

const Stream& MoeShared::shared_stream(Device device) {
  if (!shared_) shared_ = std::make_unique<Stream>(device);
  MT_CHECK(shared_->device() == device, "MoeShared: the shared experts' stream is on {}, asked for {}",
           shared_->device().str(), device.str());
  return *shared_;
}

const Stream& MoeShared::comm_stream(Device device) {
  if (!comm_) comm_ = std::make_unique<Stream>(device, StreamPriority::kHigh);  // its kernels start as SMs free
  MT_CHECK(comm_->device() == device, "MoeShared: the exchange stream is on {}, asked for {}", comm_->device().str(),
           device.str());
  return *comm_;
}

std::string moe_preprocess_region(MoeDispatcher kind, const MoeDispatchSizes& sizes) {
  if (kind == MoeDispatcher::kAllGather) return "router, selection all-gather, routing map";
  const std::string echo = sizes.num_echo > 0 ? "ECHO plan and rerouting, " : "";
  if (sizes.received_capacity > 0)
    return "router, " + echo + "routing map, block send layout, permutation 1, kept-count all-gather, receive layout";
  return "router, " + echo + "routing map, permutation 1, count all-gather (read on the host after the graph)";
}

std::unique_ptr<MoeTokenDispatcher> make_moe_token_dispatcher(MoeDispatcher kind, const ExpertParallel& ep,
                                                              const MoeDispatchSizes& sizes) {
  MT_REQUIRE(!ep.dispatch || ep.dispatch->size() == ep.ep_size * ep.etp_size,
             "MoE dispatch group has {} ranks, expected expert tensor {} x expert model {}", ep.dispatch->size(),
             ep.etp_size, ep.ep_size);
  if (kind == MoeDispatcher::kAllGather) {
    MT_REQUIRE(sizes.received_capacity == 0 && sizes.num_echo == 0,
               "--moe-received-token-capacity and --moe-enable-echo need --moe-token-dispatcher-type alltoall");
    return std::make_unique<MoEAllGatherTokenDispatcher>(ep, sizes);
  }
  const auto make = [&]() -> std::unique_ptr<MoeTokenDispatcher> {
    if (sizes.received_capacity > 0) return std::make_unique<MoEStaticAlltoAllTokenDispatcher>(ep, sizes);
    return std::make_unique<MoEAlltoAllTokenDispatcher>(ep, sizes);
  };
  if (!ep.dispatch) return make();  // layout only: no groups
  MT_REQUIRE(group_size(ep.ep_group) == ep.ep_size && group_size(ep.etp_group) == ep.etp_size,
             "MoE alltoall dispatcher: expert model parallel group of {} ranks and expert tensor parallel group of {} "
             "ranks, expected {} and {}",
             group_size(ep.ep_group), group_size(ep.etp_group), ep.ep_size, ep.etp_size);
  MT_REQUIRE(!ep.ep_group || ep.ep_group->rank() == ep.ep_rank, "MoE alltoall dispatcher: EP group rank {} != ep rank {}",
             ep.ep_group->rank(), ep.ep_rank);
  MT_REQUIRE(!ep.etp_group || ep.etp_group->rank() == ep.etp_rank,
             "MoE alltoall dispatcher: ETP group rank {} != expert tensor parallel rank {}", ep.etp_group->rank(),
             ep.etp_rank);
  return make();
}

}  // namespace mt
