#include "comm/communicator.h"

#include <cstring>

#include "comm/comm_util.h"
#include "core/buffer.h"

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

void SingleRankCommunicator::all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) {
  MT_CHECK(out.numel() == in.numel(), "{}: all_to_all out {} vs in {}", name_, out.str(), in.str());
  if (out.data() != in.data()) copy(out, in, stream);
}

std::vector<int64_t> AllToAllvSplits::resolved_offsets() const {
  if (!offsets.empty()) return offsets;
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) off[r] = off[r - 1] + counts[r - 1];
  return off;
}

int64_t AllToAllvSplits::total() const {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  return n;
}

void SingleRankCommunicator::all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in,
                                         const AllToAllvSplits& send, const Stream& stream) {
  const auto [roff, soff] = comm_detail::check_all_to_allv(*this, out, recv, in, send);
  MT_REQUIRE(recv.counts[0] == send.counts[0], "all_to_allv on {}: sends {} elements to itself but receives {}",
             comm_detail::describe(*this), send.counts[0], recv.counts[0]);
  if (send.counts[0] > 0) copy(out.flat_range(roff[0], recv.counts[0]), in.flat_range(soff[0], send.counts[0]), stream);
}

void SingleRankCommunicator::send(const Tensor&, int peer, const Stream&) {
  MT_FAIL("{}: send to rank {} in a group of one rank", name_, peer);
}

void SingleRankCommunicator::recv(const Tensor&, int peer, const Stream&) {
  MT_FAIL("{}: recv from rank {} in a group of one rank", name_, peer);
}

std::shared_ptr<Communicator> SingleRankCommunicator::split(int color, int, const std::string& name) {
  if (color < 0) return nullptr;
  return std::make_shared<SingleRankCommunicator>(name);
}

ProcessGroups ProcessGroups::single() {
  ProcessGroups g;
  auto one = [](const char* n) { return std::make_shared<SingleRankCommunicator>(n); };
  g.world = one("world");
  g.tp = one("tp");
  g.cp = one("cp");
  g.dp = one("dp");
  g.pp = one("pp");
  g.tp_cp = one("tp-cp");
  g.dp_cp = one("dp-cp");
  g.mp = one("mp");
  g.ep = one("ep");
  g.etp = one("etp");
  g.edp = one("edp");
  g.etp_ep = one("etp-ep");
  g.etp_ep_pp = one("etp-ep-pp");
  g.embedding = one("embedding");
  return g;
}

std::vector<char> all_gather_host(Communicator& comm, const void* mine, size_t bytes, const Stream& stream) {
  const int n = comm.size(), me = comm.rank();
  std::vector<char> out(bytes * static_cast<size_t>(n));
  if (n == 1 || bytes == 0) {
    if (bytes) std::memcpy(out.data(), mine, bytes);
    return out;
  }
  const Device dev = stream.device();
  Buffer buf(dev, out.size());
  const Tensor all = buf.as(DType::kU8, {static_cast<int64_t>(out.size())});
  const Tensor part = all.flat_range(static_cast<int64_t>(bytes) * me, static_cast<int64_t>(bytes));
  copy_bytes(part.data(), dev, mine, Device::cpu(), bytes, stream);
  comm.all_gather(all, part, stream);
  copy_bytes(out.data(), Device::cpu(), all.data(), dev, out.size(), stream);
  stream.synchronize();
  return out;
}

}  // namespace mt
