#include "comm/nccl/peer_copy.h"

#include <unistd.h>

#include <cstring>

#include "comm/nccl/nccl_watchdog.h"
#include "core/buffer.h"
#include "core/cuda_check.h"

namespace mt {

using peer_ipc::all_ok;
using peer_ipc::wait_flag;
using peer_ipc::write_flag;

std::unique_ptr<PeerCopyGroup> PeerCopyGroup::create(const std::shared_ptr<NcclCommunicator>& comm,
                                                     const std::vector<Region>& regions, size_t stage_elems,
                                                     std::string* why_not) {
  auto refuse = [&](std::string why) -> std::unique_ptr<PeerCopyGroup> {
    if (why_not) *why_not = std::move(why);
    return nullptr;
  };
  MT_REQUIRE(comm != nullptr, "PeerCopyGroup::create: no communicator");
  const int n = comm->size();
  if (n < 2) return refuse("a group of one rank");
  if (n > kMaxRanks) return refuse(fmt::format("{} ranks (at most {} supported)", n, kMaxRanks));
  MT_REQUIRE(stage_elems >= 1, "PeerCopyGroup::create: stage_elems must be >= 1");
  set_current_device(comm->device());
  Stream setup(comm->device());  // the host all-gathers of the setup

  // Same host and the same registered sizes everywhere.
  struct Header {
    char host[64];
    uint64_t region_count;
    uint64_t stage_elems;
  } mine{};
  gethostname(mine.host, sizeof(mine.host) - 1);
  mine.region_count = regions.size();
  mine.stage_elems = stage_elems;
  const std::vector<char> headers = all_gather_host(*comm, &mine, sizeof(Header), setup);
  for (int r = 0; r < n; ++r) {
    Header h;
    std::memcpy(&h, headers.data() + r * sizeof(Header), sizeof(Header));
    if (std::strncmp(h.host, mine.host, sizeof(h.host)) != 0)
      return refuse(fmt::format("rank {} runs on host '{}', rank {} on '{}'", comm->rank(), mine.host, r, h.host));
    MT_REQUIRE(h.region_count == mine.region_count && h.stage_elems == mine.stage_elems,
               "PeerCopyGroup on {}: rank {} registers {} regions with {} staging elements, rank {} {} with {}",
               comm->name(), comm->rank(), mine.region_count, mine.stage_elems, r, h.region_count, h.stage_elems);
  }
  std::vector<uint64_t> sizes;
  for (const Region& rg : regions) {
    MT_REQUIRE(rg.base != nullptr && rg.bytes > 0, "PeerCopyGroup::create: an empty region");
    sizes.push_back(rg.bytes);
  }
  if (!sizes.empty()) {
    const std::vector<char> all = all_gather_host(*comm, sizes.data(), sizes.size() * sizeof(uint64_t), setup);
    for (int r = 0; r < n; ++r)
      MT_REQUIRE(std::memcmp(all.data() + r * sizes.size() * 8, sizes.data(), sizes.size() * 8) == 0,
                 "PeerCopyGroup on {}: rank {} registers regions of other sizes than rank {}", comm->name(), r,
                 comm->rank());
  }

  std::unique_ptr<PeerCopyGroup> g(new PeerCopyGroup());
  g->watch_ = comm;
  g->rank_ = comm->rank();
  g->size_ = n;
  g->device_ = comm->device().index;
  g->stage_elems_ = stage_elems;
  g->regions_ = regions;
  MT_CUDA_CHECK(cudaMalloc(&g->own_flags_, sizeof(Flags)));
  MT_CUDA_CHECK(cudaMemset(g->own_flags_, 0, sizeof(Flags)));
  MT_CUDA_CHECK(cudaMalloc(&g->own_staging_, 2 * n * stage_elems * sizeof(float)));
  MT_CUDA_CHECK(cudaDeviceSynchronize());

  // Export: flags, staging, then the regions; map every peer's.
  std::vector<void*> exported = {g->own_flags_, g->own_staging_};
  for (const Region& rg : regions) exported.push_back(rg.base);
  std::string why;
  if (!g->mappings_.map(*comm, exported, setup, &why)) return refuse(why);
  g->peer_base_.assign(regions.size(), {});
  for (int r = 0; r < n; ++r) {
    g->flags_[r] = static_cast<Flags*>(g->mappings_.at(0, r));
    g->staging_[r] = static_cast<float*>(g->mappings_.at(1, r));
    for (size_t k = 0; k < regions.size(); ++k) g->peer_base_[k][r] = g->mappings_.at(k + 2, r);
  }
  const bool ok = peer_ipc::stream_mem_ops_available(&why);
  if (!all_ok(*comm, ok, setup)) return refuse(why.empty() ? "a peer has no stream memory operations" : why);

  for (int r = 0; r < n; ++r) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&g->peer_streams_[r], cudaStreamNonBlocking));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&g->join_ev_[r], cudaEventDisableTiming));
  }
  MT_CUDA_CHECK(cudaEventCreateWithFlags(&g->fork_ev_, cudaEventDisableTiming));
  return g;
}

PeerCopyGroup::~PeerCopyGroup() {
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  // Every write INTO this rank's memory has landed once the acknowledgements of our last
  // reduce-scatter piece are here (data and gather flags were waited for by our own streams).
  // A peer that never sends them (it failed mid-step) leaves our flags and staging mapped on its
  // side: then they are not freed, rather than freed under a pending write.
  bool quiet = true;
  if (own_flags_ && rs_seq_ > 0) {
    quiet = false;
    Flags f{};
    for (int tries = 0; tries < 20000 && !quiet; ++tries) {  // <= ~10 s
      if (cudaMemcpy(&f, own_flags_, sizeof(f), cudaMemcpyDeviceToHost) != cudaSuccess) break;
      quiet = true;
      for (int j = 0; j < size_; ++j)
        if (j != rank_ && static_cast<int32_t>(f.ack[j] - rs_seq_) < 0) quiet = false;
      if (!quiet) usleep(500);
    }
  }
  mappings_.close();
  for (cudaStream_t s : peer_streams_)
    if (s) cudaStreamDestroy(s);
  for (cudaEvent_t e : join_ev_)
    if (e) cudaEventDestroy(e);
  if (fork_ev_) cudaEventDestroy(fork_ev_);
  if (quiet) {
    if (own_staging_) cudaFree(own_staging_);
    if (own_flags_) cudaFree(own_flags_);
  }
  cudaGetLastError();
}

void PeerCopyGroup::fork(cudaStream_t s) {
  MT_CUDA_CHECK(cudaEventRecord(fork_ev_, s));
  for (int r = 0; r < size_; ++r)
    if (r != rank_) MT_CUDA_CHECK(cudaStreamWaitEvent(peer_streams_[r], fork_ev_, 0));
}

void PeerCopyGroup::join(cudaStream_t s) {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MT_CUDA_CHECK(cudaEventRecord(join_ev_[r], peer_streams_[r]));
    MT_CUDA_CHECK(cudaStreamWaitEvent(s, join_ev_[r], 0));
  }
}

void PeerCopyGroup::push(int j, void* dst, const void* src, size_t bytes, uint32_t* flag, uint32_t value) {
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, peer_streams_[j]));
  write_flag(peer_streams_[j], flag, value);
}

void PeerCopyGroup::check_stream(cudaStream_t s, const char* op) const {
  peer_ipc::require_not_capturing(s, fmt::format("PeerCopyGroup::{}", op).c_str());
}

void PeerCopyGroup::check_range(int region, size_t offset_bytes, size_t bytes, const char* op) const {
  MT_REQUIRE(region >= 0 && static_cast<size_t>(region) < regions_.size(), "PeerCopyGroup::{}: no region {}", op,
             region);
  MT_REQUIRE(offset_bytes + bytes <= regions_[region].bytes,
             "PeerCopyGroup::{}: bytes [{}, {}) outside region {} of {} bytes", op, offset_bytes,
             offset_bytes + bytes, region, regions_[region].bytes);
}

void PeerCopyGroup::reduce_scatter_sum(int region, size_t offset, size_t m, DType dtype, const Stream& stream) {
  MT_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16,
             "PeerCopyGroup::reduce_scatter_sum: fp32 or bf16 only, got {}", dtype_name(dtype));
  const size_t es = dtype_size(dtype);
  check_range(region, offset * es, size_ * m * es, "reduce_scatter_sum");
  if (m == 0) return;
  set_current_device(Device::cuda(device_));
  cudaStream_t s = static_cast<cudaStream_t>(stream.cuda_stream());
  check_stream(s, "reduce_scatter_sum");
  // A staging slot holds stage_elems_ fp32 values: 2x as many bf16 ones.
  const size_t piece = stage_elems_ * sizeof(float) / es;
  // One fork for all pieces: the copies of piece p+1 run while `s` sums piece p.
  fork(s);
  for (size_t p0 = 0; p0 < m; p0 += piece) reduce_scatter_piece(region, offset, m, p0, std::min(piece, m - p0), dtype, s);
  join(s);
  nccl_detail::Watchdog::instance().enqueued(watch_->raw(), s, "copy-engine reduce-scatter");
}

void PeerCopyGroup::reduce_scatter_piece(int region, size_t offset, size_t m, size_t p0, size_t len, DType dtype,
                                         cudaStream_t s) {
  const uint32_t seq = ++rs_seq_;
  const size_t gen = seq % 2;
  const size_t es = dtype_size(dtype);
  const size_t slot = stage_elems_ * sizeof(float);  // bytes per staging slot
  char* mine = static_cast<char*>(peer_base_[region][rank_]);
  auto stage = [&](int owner, int sender) {
    return reinterpret_cast<char*>(staging_[owner]) + (gen * size_ + sender) * slot;
  };
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    // Rank j consumed the piece that used this generation before (operation seq - 2).
    if (seq > 2) wait_flag(peer_streams_[j], &flags_[rank_]->ack[j], seq - 2);
    push(j, stage(j, rank_), mine + (offset + j * m + p0) * es, len * es, &flags_[j]->data[rank_], seq);
  }
  std::array<const void*, kMaxRanks> src{};
  for (int i = 0; i < size_; ++i) {
    if (i == rank_) {
      src[i] = mine + (offset + rank_ * m + p0) * es;
    } else {
      wait_flag(s, &flags_[rank_]->data[i], seq);
      src[i] = stage(rank_, i);
    }
  }
  launch_sum_ranks(mine + (offset + rank_ * m + p0) * es, src, size_, len, dtype, s);
  for (int i = 0; i < size_; ++i)
    if (i != rank_) write_flag(s, &flags_[i]->ack[rank_], seq);
}

void PeerCopyGroup::all_gather(int region, size_t offset, size_t chunk_bytes, const Stream& stream) {
  check_range(region, offset, size_ * chunk_bytes, "all_gather");
  if (chunk_bytes == 0) return;
  set_current_device(Device::cuda(device_));
  cudaStream_t s = static_cast<cudaStream_t>(stream.cuda_stream());
  check_stream(s, "all_gather");
  const uint32_t seq = ++ag_seq_;
  const size_t at = offset + rank_ * chunk_bytes;
  const char* src = static_cast<const char*>(peer_base_[region][rank_]) + at;
  fork(s);
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    push(j, static_cast<char*>(peer_base_[region][j]) + at, src, chunk_bytes, &flags_[j]->gather[rank_], seq);
  }
  for (int i = 0; i < size_; ++i)
    if (i != rank_) wait_flag(s, &flags_[rank_]->gather[i], seq);
  join(s);
  nccl_detail::Watchdog::instance().enqueued(watch_->raw(), s, "copy-engine all-gather");
}

}  // namespace mt
