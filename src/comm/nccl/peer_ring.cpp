#include "comm/nccl/peer_ring.h"

#include <array>
#include <cstring>

#include "comm/nccl/nccl_watchdog.h"
#include "core/check.h"
#include "core/cuda_check.h"

namespace mt {

std::atomic<int64_t> PeerRingExchange::issued_total_{0};

std::unique_ptr<PeerRingExchange> PeerRingExchange::create(const std::shared_ptr<NcclCommunicator>& comm,
                                                           const std::vector<const void*>& recv,
                                                           std::string* why_not) {
  auto refuse = [&](std::string why) -> std::unique_ptr<PeerRingExchange> {
    if (why_not) *why_not = std::move(why);
    return nullptr;
  };
  MT_REQUIRE(comm != nullptr, "PeerRingExchange::create: no communicator");
  const int n = comm->size();
  if (n < 2) return refuse("a ring of one rank");
  if (n > kMaxRanks) return refuse(fmt::format("{} ranks (at most {} supported)", n, kMaxRanks));
  set_current_device(comm->device());
  Stream setup(comm->device());  // the host all-gathers of the setup
  if (std::string why = peer_ipc::other_host(*comm, setup); !why.empty()) return refuse(why);

  // The allocations holding the receive buffers (each once) and every buffer's place in them.
  std::unique_ptr<PeerRingExchange> g(new PeerRingExchange());
  g->watch_ = comm;
  g->rank_ = comm->rank();
  g->size_ = n;
  g->device_ = comm->device().index;
  g->next_ = (g->rank_ + 1) % n;
  g->prev_ = (g->rank_ + n - 1) % n;
  struct Place {
    uint64_t alloc_bytes, offset;
  };
  std::vector<Place> places;
  std::vector<void*> bases;
  for (const void* p : recv) {
    MT_REQUIRE(p != nullptr, "PeerRingExchange::create: a null receive buffer");
    const auto [base, bytes] = peer_ipc::allocation_of(p);
    size_t k = 0;
    while (k < bases.size() && bases[k] != base) ++k;
    if (k == bases.size()) {
      bases.push_back(base);
      g->local_.emplace_back(static_cast<const char*>(base), bytes);
    }
    places.push_back({bytes, static_cast<uint64_t>(static_cast<const char*>(p) - static_cast<const char*>(base))});
  }
  const uint64_t count = recv.size();
  const std::vector<char> counts = all_gather_host(*comm, &count, sizeof(count), setup);
  for (int r = 0; r < n; ++r) {
    uint64_t c;
    std::memcpy(&c, counts.data() + r * sizeof(c), sizeof(c));
    MT_REQUIRE(c == count, "PeerRingExchange on {}: rank {} registers {} receive buffers, rank {} {}", comm->name(),
               comm->rank(), count, r, c);
  }
  if (!places.empty()) {
    const std::vector<char> all = all_gather_host(*comm, places.data(), places.size() * sizeof(Place), setup);
    bool same = true;
    for (int r = 0; r < n; ++r)
      same = same && std::memcmp(all.data() + r * places.size() * sizeof(Place), places.data(),
                                 places.size() * sizeof(Place)) == 0;
    if (!same)  // every rank sees the same gathered places: the decision is agreed
      return refuse("the receive buffers lie at different offsets (or in allocations of different sizes) on "
                    "different ranks");
  }

  MT_CUDA_CHECK(cudaMalloc(&g->own_flags_, 256));
  MT_CUDA_CHECK(cudaMemset(g->own_flags_, 0, 256));
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<void*> exported = {g->own_flags_};
  exported.insert(exported.end(), bases.begin(), bases.end());
  std::string why;
  if (!g->mappings_.map(*comm, exported, setup, &why)) return refuse(why);
  const bool ok = peer_ipc::stream_mem_ops_available(&why);
  if (!peer_ipc::all_ok(*comm, ok, setup)) return refuse(why.empty() ? "a peer has no stream memory operations" : why);
  return g;
}

PeerRingExchange::~PeerRingExchange() {
  cudaSetDevice(device_);
  // Every write into this rank's memory (the flags, prev's copies) was waited for by an exchange
  // on this rank's ring stream: once the device is idle none is pending (a peer that failed
  // mid-exchange leaves a wait unsatisfied, and the watchdog ends the process).
  cudaDeviceSynchronize();
  mappings_.close();
  if (own_flags_) cudaFree(own_flags_);
  cudaGetLastError();
}

bool PeerRingExchange::registered(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  for (const auto& [base, size] : local_)
    if (c >= base && c + bytes <= base + size) return true;
  return false;
}

void PeerRingExchange::exchange(std::span<const Transfer> transfers, cudaStream_t s) {
  if (transfers.empty()) return;
  set_current_device(Device::cuda(device_));
  peer_ipc::require_not_capturing(s, "PeerRingExchange::exchange");
  // The destinations: next's allocation k at our buffer's offset in our allocation k.
  std::array<char*, 4> dst{};
  MT_REQUIRE(transfers.size() <= dst.size(), "PeerRingExchange::exchange: {} transfers (at most {})",
             transfers.size(), dst.size());
  for (size_t t = 0; t < transfers.size(); ++t) {
    const char* p = static_cast<const char*>(transfers[t].recv);
    size_t k = 0;
    while (k < local_.size() &&
           !(p >= local_[k].first && p + transfers[t].bytes <= local_[k].first + local_[k].second))
      ++k;
    MT_REQUIRE(k < local_.size(), "PeerRingExchange::exchange: receive range [{}, +{}) outside the registered "
               "allocations", static_cast<const void*>(p), transfers[t].bytes);
    dst[t] = static_cast<char*>(mappings_.at(k + 1, next_)) + (p - local_[k].first);
  }
  const uint32_t seq = ++seq_;
  Flags* mine = static_cast<Flags*>(mappings_.at(0, rank_));
  Flags* next = static_cast<Flags*>(mappings_.at(0, next_));
  Flags* prev = static_cast<Flags*>(mappings_.at(0, prev_));
  peer_ipc::write_flag(s, &prev->free, seq);  // 1. our receive buffers are free
  peer_ipc::wait_flag(s, &mine->free, seq);   // 2. next's are
  for (size_t t = 0; t < transfers.size(); ++t)  // 3. the copies
    if (transfers[t].bytes > 0)
      MT_CUDA_CHECK(cudaMemcpyAsync(dst[t], transfers[t].send, transfers[t].bytes, cudaMemcpyDeviceToDevice, s));
  peer_ipc::write_flag(s, &next->arrived, seq);  // 4. fenced after the copies
  peer_ipc::wait_flag(s, &mine->arrived, seq);   // 5. prev's copies landed here
  nccl_detail::Watchdog::instance().enqueued(watch_->raw(), s, "copy-engine ring exchange");
  issued_total_.fetch_add(1);
}

}  // namespace mt
