#include "model/moe/echo_peers.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "core/buffer.h"
#include "core/check.h"
#include "model/moe/moe_utils.h"
#ifdef MT_WITH_MPI
#include "comm/mpi/mpi_communicator.h"
#endif

namespace mt {
namespace {

size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// Thread ranks of one process: the peers' host buffers written with memcpy; the group's host
// barrier around the copies (CPU streams run their work inline).
class HostEchoPeers final : public EchoPeers {
 public:
  HostEchoPeers(const ExpertParallel& ep, const Sizes& sizes, const Stream& st)
      : EchoPeers(ep, sizes), group_(ep.ep_group.get()), buffer_(Device::cpu(), layout().bytes) {
    set_views(buffer_.data(), Device::cpu());
    char* mine = static_cast<char*>(buffer_.data());
    const std::vector<char> all = all_gather_host(*group_, &mine, sizeof(mine), st);
    bases_.resize(static_cast<size_t>(P_));
    std::memcpy(bases_.data(), all.data(), all.size());
  }
  int64_t bytes_sent_sync(const Stream&) const override { return bytes_; }
  void reset_bytes(const Stream&) override { bytes_ = 0; }

 private:
  void transfer(const Transfer& t, const Stream&) override {
    group_->barrier();  // every rank is done with the previous contents
    const int32_t* index = t.index.data_as<int32_t>();
    for (int64_t m = 0; m < P_ * S_; ++m) {
      const int64_t g = index[m];
      if (g < 0 || g >= t.groups) continue;
      char* dst = bases_[static_cast<size_t>(m / S_)];
      const int64_t block = t.block_base + m % S_;
      const auto* src1 = static_cast<const char*>(t.table1 ? t.table1[g] : t.base1) + (t.table1 ? 0 : g * t.bytes1);
      const auto* src2 = static_cast<const char*>(t.table2 ? t.table2[g] : t.base2) + (t.table2 ? 0 : g * t.bytes2);
      std::memcpy(dst + t.offset1 + static_cast<size_t>(block) * t.bytes1, src1, t.bytes1);
      std::memcpy(dst + t.offset2 + static_cast<size_t>(block) * t.bytes2, src2, t.bytes2);
      bytes_ += static_cast<int64_t>(t.bytes1 + t.bytes2);
    }
    group_->barrier();  // every copy is in place
  }

  Communicator* group_;
  Buffer buffer_;
  std::vector<char*> bases_;  // every rank's buffer
  int64_t bytes_ = 0;
};

void check_blocks(const Tensor& t, int64_t blocks, int64_t n, int64_t k, DType dt, Device dev, const char* what) {
  MT_CHECK(t.ndim() == 3 && t.is_contiguous() && t.size(0) == blocks && t.size(1) == n && t.size(2) == k &&
               t.dtype() == dt && t.device() == dev,
           "EchoPeers: {} {} must be a contiguous {} [{}, {}, {}] tensor on {}", what, t.str(), dtype_name(dt), blocks,
           n, k, dev.str());
}

void check_index(const Tensor& t, int64_t n, Device dev, const char* what) {
  MT_CHECK(t.dtype() == DType::kI32 && t.ndim() == 1 && t.is_contiguous() && t.numel() == n && t.device() == dev,
           "EchoPeers: {} {} must be a contiguous int32 [{}] tensor on {}", what, t.str(), n, dev.str());
}

}  // namespace

EchoPeers::EchoPeers(const ExpertParallel& ep, const Sizes& sizes)
    : P_(group_size(ep.ep_group)), S_(sizes.num_echo), me_(ep.ep_group ? ep.ep_group->rank() : 0), sizes_(sizes) {}

EchoPeers::Layout EchoPeers::layout() const {
  const size_t a = dtype_size(sizes_.act), e1 = static_cast<size_t>(sizes_.n1 * sizes_.k1),
               e2 = static_cast<size_t>(sizes_.n2 * sizes_.k2), S = static_cast<size_t>(S_),
               NS = static_cast<size_t>(P_ * S_);
  Layout l;
  l.w1 = 0;
  l.w2 = round_up(S * e1 * a);
  l.g1 = l.w2 + round_up(S * e2 * a);
  l.g2 = l.g1 + round_up(NS * e1 * 4);
  l.bytes = l.g2 + round_up(NS * e2 * 4);
  return l;
}

void EchoPeers::set_views(void* base, Device device) {
  const Layout l = layout();
  char* b = static_cast<char*>(base);
  const int64_t NS = P_ * S_;
  clone_w1_ = Tensor(b + l.w1, sizes_.act, device, {S_, sizes_.n1, sizes_.k1});
  clone_w2_ = Tensor(b + l.w2, sizes_.act, device, {S_, sizes_.n2, sizes_.k2});
  grads_in1_ = Tensor(b + l.g1, DType::kF32, device, {NS, sizes_.n1, sizes_.k1});
  grads_in2_ = Tensor(b + l.g2, DType::kF32, device, {NS, sizes_.n2, sizes_.k2});
}

bool EchoPeers::available(const ExpertParallel& ep, Device device, std::string* why_not) {
  auto no = [&](const char* why) {
    if (why_not) *why_not = why;
    return false;
  };
  if (!ep.ep_group) return no("no expert model parallel group");
  if (device.is_cuda()) return echo_detail::nccl_echo_peers_available(ep, why_not);
#ifdef MT_WITH_MPI
  if (dynamic_cast<const MpiCommunicator*>(ep.ep_group.get()) != nullptr)
    return no("the EP ranks are separate MPI processes (their host memory is not shared)");
#endif
  return true;
}

std::unique_ptr<EchoPeers> EchoPeers::create(const ExpertParallel& ep, Device device, const Sizes& s) {
  std::string why;
  MT_REQUIRE(available(ep, device, &why), "ECHO's used-slot transfers are not available on this EP group: {}", why);
  MT_REQUIRE(s.num_echo >= 1 && s.n1 >= 1 && s.k1 >= 1 && s.n2 >= 1 && s.k2 >= 1,
             "EchoPeers: {} spare slots of experts [{}, {}] / [{}, {}]", s.num_echo, s.n1, s.k1, s.n2, s.k2);
  if (device.is_cuda()) return echo_detail::make_nccl_echo_peers(ep, device, s);
  // CPU: the ranks must share an address space (thread ranks of one process); checked over the group
  Communicator& g = *ep.ep_group;
  const Stream st(Device::cpu());
  const int64_t pid = static_cast<int64_t>(::getpid());
  const std::vector<char> pids = all_gather_host(g, &pid, sizeof(pid), st);
  for (int r = 0; r < g.size(); ++r) {
    int64_t p = 0;
    std::memcpy(&p, pids.data() + static_cast<size_t>(r) * sizeof(p), sizeof(p));
    MT_REQUIRE(p == pid, "EchoPeers: EP rank {} is process {}, rank {} process {}: their host memory is not shared",
               r, p, g.rank(), pid);
  }
  return std::make_unique<HostEchoPeers>(ep, s, st);
}

void EchoPeers::put_weights(const GroupedWeights& w1, const GroupedWeights& w2, const Tensor& w_send,
                            const Stream& stream) {
  const Device dev = clone_w1_.device();
  MT_CHECK(!w1.empty() && w1.groups() == w2.groups() && w1.rows() == sizes_.n1 && w1.cols() == sizes_.k1 &&
               w2.rows() == sizes_.n2 && w2.cols() == sizes_.k2 && w1.dtype() == sizes_.act &&
               w2.dtype() == sizes_.act && w1.device() == dev && w2.device() == dev,
           "EchoPeers::put_weights: local experts {} x [{}, {}] / [{}, {}] ({}) do not match [{}, {}] / [{}, {}] ({}) on {}",
           w1.empty() ? 0 : w1.groups(), w1.empty() ? 0 : w1.rows(), w1.empty() ? 0 : w1.cols(),
           w2.empty() ? 0 : w2.rows(), w2.empty() ? 0 : w2.cols(), w1.empty() ? "none" : dtype_name(w1.dtype()),
           sizes_.n1, sizes_.k1, sizes_.n2, sizes_.k2, dtype_name(sizes_.act), dev.str());
  check_index(w_send, P_ * S_, dev, "w_send");
  const Layout l = layout();
  Transfer t;
  t.table1 = w1.table();
  t.table2 = w2.table();
  t.bytes1 = static_cast<size_t>(sizes_.n1 * sizes_.k1) * dtype_size(sizes_.act);
  t.bytes2 = static_cast<size_t>(sizes_.n2 * sizes_.k2) * dtype_size(sizes_.act);
  t.offset1 = l.w1;
  t.offset2 = l.w2;
  t.groups = w1.groups();
  t.block_base = 0;
  t.aligned16 = w1.aligned16() && w2.aligned16() && t.bytes1 % 16 == 0 && t.bytes2 % 16 == 0;
  t.index = w_send;
  transfer(t, stream);
}

void EchoPeers::put_grads(const Tensor& g1, const Tensor& g2, const Tensor& g_send, const Stream& stream) {
  const Device dev = clone_w1_.device();
  check_blocks(g1, S_, sizes_.n1, sizes_.k1, DType::kF32, dev, "g1");
  check_blocks(g2, S_, sizes_.n2, sizes_.k2, DType::kF32, dev, "g2");
  check_index(g_send, P_ * S_, dev, "g_send");
  const Layout l = layout();
  Transfer t;
  t.base1 = g1.data();
  t.base2 = g2.data();
  t.bytes1 = static_cast<size_t>(sizes_.n1 * sizes_.k1) * 4;
  t.bytes2 = static_cast<size_t>(sizes_.n2 * sizes_.k2) * 4;
  t.offset1 = l.g1;
  t.offset2 = l.g2;
  t.groups = S_;
  t.block_base = me_ * S_;
  t.aligned16 = reinterpret_cast<uintptr_t>(g1.data()) % 16 == 0 && reinterpret_cast<uintptr_t>(g2.data()) % 16 == 0 &&
                t.bytes1 % 16 == 0 && t.bytes2 % 16 == 0;
  t.index = g_send;
  transfer(t, stream);
}

#ifndef MT_WITH_NCCL
namespace echo_detail {
bool nccl_echo_peers_available(const ExpertParallel&, std::string* why_not) {
  if (why_not) *why_not = "this build has no NCCL";
  return false;
}
bool nccl_device_api_matches(std::string* why_not) {
  if (why_not) *why_not = "this build has no NCCL";
  return false;
}
std::unique_ptr<EchoPeers> make_nccl_echo_peers(const ExpertParallel&, Device, const EchoPeers::Sizes&) {
  MT_FAIL("EchoPeers: this build has no NCCL");
}
}  // namespace echo_detail
#endif

}  // namespace mt
