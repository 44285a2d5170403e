#include "parallel/context_parallel.h"

#include <algorithm>
#include <array>
#include <cstdlib>

#include <fmt/ranges.h>

#include "core/check.h"
#include "core/logging.h"
#include "core/stream.h"

#ifdef MT_WITH_NCCL
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl/peer_ring.h"
#endif

namespace mt {

CpCommType parse_cp_comm_type(const std::string& s) {
  if (s == "p2p") return CpCommType::kP2P;
  if (s == "allgather" || s == "all_gather") return CpCommType::kAllGather;
  if (s == "a2a") return CpCommType::kA2A;
  if (s == "a2a+p2p") return CpCommType::kA2AP2P;
  MT_FAIL("--cp-comm-type '{}' is not one of p2p, allgather, a2a, a2a+p2p", s);
}

const char* cp_comm_type_name(CpCommType t) {
  switch (t) {
    case CpCommType::kP2P: return "p2p";
    case CpCommType::kAllGather: return "allgather";
    case CpCommType::kA2A: return "a2a";
    case CpCommType::kA2AP2P: return "a2a+p2p";
  }
  return "?";
}

std::pair<int, int> ContextParallelOptions::levels() const {
  switch (comm_type) {
    case CpCommType::kA2A: return {size, 1};
    case CpCommType::kA2AP2P:
      return hierarchical_sizes.size() == 2 ? std::pair{hierarchical_sizes[0], hierarchical_sizes[1]}
                                            : std::pair{1, size};
    default: return {1, size};
  }
}

void validate_context_parallel(const ContextParallelOptions& o, int64_t seq, int64_t heads, int64_t groups, int tp) {
  MT_REQUIRE(o.size >= 1, "--context-parallel-size must be >= 1, got {}", o.size);
  MT_REQUIRE(tp >= 1, "--tensor-model-parallel-size must be >= 1, got {}", tp);
  if (o.size > 1)
    MT_REQUIRE(seq % (2 * o.size) == 0,
               "--seq-length {} must be divisible by 2 x --context-parallel-size = {} (each CP rank holds 2 of {} "
               "load-balanced chunks)",
               seq, 2 * o.size, 2 * o.size);
  const bool hier = o.comm_type == CpCommType::kA2AP2P;
  MT_REQUIRE(o.hierarchical_sizes.empty() || hier,
             "--hierarchical-context-parallel-sizes {} needs --cp-comm-type a2a+p2p, got {}",
             fmt::join(o.hierarchical_sizes, " "), cp_comm_type_name(o.comm_type));
  if (hier) {
    const auto& h = o.hierarchical_sizes;
    MT_REQUIRE(h.size() == 2 && h[0] >= 1 && h[1] >= 1,
               "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with two positive sizes "
               "(a2a, p2p), got [{}]",
               fmt::join(h, " "));
    MT_REQUIRE(h[0] * h[1] == o.size,
               "--hierarchical-context-parallel-sizes {} x {} = {} must equal --context-parallel-size {}", h[0], h[1],
               h[0] * h[1], o.size);
  }
  const int a2a = o.levels().first;
  if (a2a > 1) {
    const int64_t g = groups > 0 ? groups : heads;
    MT_REQUIRE(heads % tp == 0 && (heads / tp) % a2a == 0 && g % tp == 0 && (g / tp) % a2a == 0,
               "--cp-comm-type {} exchanges attention heads over {} ranks: --num-attention-heads {} and "
               "--num-query-groups {} per tensor-parallel rank (tp={}) must be divisible by {}",
               cp_comm_type_name(o.comm_type), a2a, heads, g, tp, a2a);
  }
}

int64_t cp_global_position(int64_t seq, int cp, int rank, int64_t t) {
  MT_REQUIRE(cp >= 1 && seq % (2 * cp) == 0, "sequence length {} is not divisible by 2 x context-parallel size {}",
             seq, cp);
  const int64_t c = seq / (2 * cp);
  MT_REQUIRE(rank >= 0 && rank < cp && t >= 0 && t < 2 * c, "CP rank {} of {} / local token {} of {} out of range",
             rank, cp, t, 2 * c);
  const int64_t chunk = t < c ? rank : 2 * cp - 1 - rank;
  return chunk * c + t % c;
}

std::vector<int32_t> cp_positions(int64_t seq, int cp, int rank) {
  std::vector<int32_t> p(static_cast<size_t>(seq / cp));
  for (size_t t = 0; t < p.size(); ++t)
    p[t] = static_cast<int32_t>(cp_global_position(seq, cp, rank, static_cast<int64_t>(t)));
  return p;
}

std::vector<int> cp_a2a_sort_order(int a2a) {
  MT_REQUIRE(a2a >= 1, "the a2a level of context parallelism must be >= 1, got {}", a2a);
  std::vector<int> perm(static_cast<size_t>(2 * a2a));
  for (int k = 0; k < 2 * a2a; ++k) perm[static_cast<size_t>(k)] = k < a2a ? 2 * k : 2 * (2 * a2a - 1 - k) + 1;
  return perm;
}

CpRingStep cp_ring_step(int p, int rank, int step) {
  MT_REQUIRE(p >= 1 && rank >= 0 && rank < p && step >= 0 && step < p,
             "ring step {} of ring rank {} out of range for a p2p ring of {} ranks", step, rank, p);
  const int src = (rank - step + p) % p;
  return {src, step == 0 ? CpBlockKind::kDiagonal : src < rank ? CpBlockKind::kEarlier : CpBlockKind::kLater};
}

void cp_shard_columns(int32_t* local, const int32_t* full, int64_t batch, int64_t seq, int cp, int rank) {
  const std::vector<int32_t> pos = cp_positions(seq, cp, rank);
  const int64_t sl = static_cast<int64_t>(pos.size());
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < sl; ++t) local[b * sl + t] = full[b * seq + pos[static_cast<size_t>(t)]];
}

ContextParallelRegion::ContextParallelRegion(std::shared_ptr<Communicator> cp, const ContextParallelOptions& opts,
                                             int64_t seq, Device device)
    : cp_(std::move(cp)), opts_(opts), size_(cp_->size()), rank_(cp_->rank()), seq_(seq), device_(device) {
  MT_REQUIRE(opts.size == size_, "--context-parallel-size {} but the CP group has {} ranks", opts.size, size_);
  if (const char* e = std::getenv("MT_CP_RING"); e != nullptr && *e != '\0') {
    const std::string v = e;
    MT_REQUIRE(v == "ce" || v == "nccl",
               "MT_CP_RING={}: expected ce (the p2p ring's exchanges by copy engines) or nccl (NCCL's send/recv)", v);
    opts_.ring_copy_engine = v == "ce";
  }
  const auto [a, p] = opts_.levels();
  if (a == size_) {
    a2a_ = cp_;
  } else if (a == 1) {
    a2a_ = std::make_shared<SingleRankCommunicator>("cp-a2a(none)");
  } else {
    a2a_ = cp_->split(rank_ / a, rank_ % a, "cp-a2a");
  }
  if (p == size_) {
    p2p_ = cp_;
  } else if (p == 1) {
    p2p_ = std::make_shared<SingleRankCommunicator>("cp-p2p(none)");
  } else {
    p2p_ = cp_->split(rank_ % a, rank_ / a, "cp-p2p");
  }
  if (p > 1 && opts_.comm_type != CpCommType::kAllGather)
    ring_.reset(new Ring{Stream(device, StreamPriority::kHigh), Event(device), Event(device), nullptr, false, {}});
  std::vector<int32_t> all;
  for (int r = 0; r < size_; ++r) {
    const auto pr = cp_positions(seq, size_, r);
    all.insert(all.end(), pr.begin(), pr.end());
  }
  std::vector<int32_t> ring;  // the P ring ranks' sorted layouts (cp_a2a_sort_order)
  for (int r = 0; r < p; ++r) {
    const auto pr = cp_positions(seq, p, r);
    ring.insert(ring.end(), pr.begin(), pr.end());
  }
  positions_ = Buffer(device, all.size() * sizeof(int32_t));
  ring_positions_ = Buffer(device, ring.size() * sizeof(int32_t));
  Stream st(device);
  copy_bytes(positions_.data(), device, all.data(), Device::cpu(), all.size() * sizeof(int32_t), st);
  copy_bytes(ring_positions_.data(), device, ring.data(), Device::cpu(), ring.size() * sizeof(int32_t), st);
  st.synchronize();
}

ContextParallelRegion::Ring& ContextParallelRegion::ring() const {
  MT_CHECK(ring_ != nullptr, "the p2p ring of a CP region with p2p size {}", p2p_size());
  return *ring_;
}

bool ContextParallelRegion::ring_copy_engine_requested() const {
  return opts_.ring_copy_engine && device_.is_cuda() && ring_ != nullptr;
}

void ContextParallelRegion::ring_register(const std::vector<Tensor>& recv) const {
  if (!ring_copy_engine_requested()) return;
  Ring& r = *ring_;
  if (r.registered) {
#ifdef MT_WITH_NCCL
    if (r.copy_engine)
      for (const Tensor& t : recv)
        MT_REQUIRE(t.empty() || r.copy_engine->registered(t.data(), t.nbytes()),
                   "the CP ring's copy-engine exchange: a receive buffer of {} bytes outside the allocations "
                   "registered by the first layer (layers of one CP region planned in different planners?)",
                   t.nbytes());
#endif
    return;
  }
  r.registered = true;  // collective below: once per region
#ifdef MT_WITH_NCCL
  auto nccl = std::dynamic_pointer_cast<NcclCommunicator>(p2p_);
  if (!nccl) {
    r.why_not = "the p2p ring is not an NCCL group";
  } else {
    std::vector<const void*> ptrs;
    for (const Tensor& t : recv)
      if (!t.empty()) ptrs.push_back(t.data());
    r.copy_engine = PeerRingExchange::create(nccl, ptrs, &r.why_not);
  }
#else
  r.why_not = "built without NCCL";
#endif
  if (rank_ == 0) {
    if (r.copy_engine)
      log_info("> context parallel: the p2p ring's exchanges by copy-engine transfers ({} ranks)", p2p_size());
    else
      log_warn("context parallel: the p2p ring's exchanges stay on NCCL (copy engines asked for): {}", r.why_not);
  }
}

bool ContextParallelRegion::ring_uses_copy_engine(const Stream& st) const {
#ifdef MT_WITH_NCCL
  return ring_ && ring_->copy_engine && !peer_ipc::is_capturing(static_cast<cudaStream_t>(st.cuda_stream()));
#else
  (void)st;
  return false;
#endif
}

void ContextParallelRegion::ring_copy_exchange(std::span<const std::pair<Tensor, Tensor>> send_recv) const {
#ifdef MT_WITH_NCCL
  MT_CHECK(ring_ && ring_->copy_engine, "ring_copy_exchange without a copy-engine ring ({})",
           ring_ ? ring_->why_not : std::string("no p2p ring"));
  std::array<PeerRingExchange::Transfer, 4> t{};
  size_t n = 0;
  for (const auto& [send, recv] : send_recv) {
    if (send.empty() && recv.empty()) continue;
    MT_CHECK(send.nbytes() == recv.nbytes(), "ring_copy_exchange: send {} bytes, receive {} bytes", send.nbytes(),
             recv.nbytes());
    MT_CHECK(n < t.size(), "ring_copy_exchange: more than {} transfers", t.size());
    t[n++] = {send.data(), recv.data(), static_cast<size_t>(recv.nbytes())};
  }
  ring_->copy_engine->exchange(std::span<const PeerRingExchange::Transfer>(t.data(), n),
                               static_cast<cudaStream_t>(ring_->stream.cuda_stream()));
#else
  (void)send_recv;
  MT_FAIL("ring_copy_exchange: built without NCCL");
#endif
}

int64_t cp_ring_copy_engine_exchanges() {
#ifdef MT_WITH_NCCL
  return PeerRingExchange::issued_total();
#else
  return 0;
#endif
}

Tensor ContextParallelRegion::positions(int first, int count) const {
  MT_CHECK(first >= 0 && count >= 1 && first + count <= size_, "positions of CP ranks [{}, {}) of {}", first,
           first + count, size_);
  return positions_.as(DType::kI32, {seq_}).flat_range(first * local_seq(), count * local_seq());
}

int CpRingTrace::begin(Kind kind, const Stream& stream) {
  const size_t i = static_cast<size_t>(used_);
  while (events_.size() < 2 * (i + 1)) events_.push_back(std::make_unique<Event>(device_));
  if (kinds_.size() <= i) kinds_.resize(i + 1);
  kinds_[i] = kind;
  events_[2 * i]->record(stream);
  return used_++;
}

void CpRingTrace::end(int span, const Stream& stream) {
  MT_CHECK(span >= 0 && span < used_, "CpRingTrace::end of span {} of {}", span, used_);
  events_[2 * static_cast<size_t>(span) + 1]->record(stream);
}

std::vector<CpRingTrace::Span> CpRingTrace::spans_ms() const {
  std::vector<Span> out;
  if (used_ == 0) return out;
  // The origin: the earliest begin (the ring stream may start before the compute stream's first span).
  float origin = 0;
  for (int i = 0; i < used_; ++i) origin = std::min(origin, events_[2 * i]->elapsed_ms_since(*events_[0]));
  for (int i = 0; i < used_; ++i) {
    const float b = events_[2 * i]->elapsed_ms_since(*events_[0]) - origin;
    const float e = events_[2 * i + 1]->elapsed_ms_since(*events_[0]) - origin;
    out.push_back({kinds_[static_cast<size_t>(i)], b, e});
  }
  return out;
}

CpOverlap cp_overlap(const std::vector<CpRingTrace::Span>& spans) {
  // The union of the compute spans as sorted disjoint intervals.
  std::vector<std::pair<double, double>> comp;
  CpOverlap o;
  for (const auto& s : spans) {
    MT_CHECK(s.end_ms >= s.begin_ms, "a ring trace span ends ({} ms) before it begins ({} ms)", s.end_ms, s.begin_ms);
    if (s.kind == CpRingTrace::Kind::kCompute) {
      comp.emplace_back(s.begin_ms, s.end_ms);
      o.compute_ms += s.end_ms - s.begin_ms;
    }
  }
  std::sort(comp.begin(), comp.end());
  std::vector<std::pair<double, double>> merged;
  for (const auto& c : comp) {
    if (!merged.empty() && c.first <= merged.back().second) merged.back().second = std::max(merged.back().second, c.second);
    else merged.push_back(c);
  }
  double hidden = 0;
  for (const auto& s : spans) {
    if (s.kind != CpRingTrace::Kind::kExchange) continue;
    o.exchange_ms += s.end_ms - s.begin_ms;
    for (const auto& [b, e] : merged)
      hidden += std::max(0.0, std::min<double>(e, s.end_ms) - std::max<double>(b, s.begin_ms));
  }
  o.exposed_ms = o.exchange_ms - hidden;
  return o;
}

Tensor ContextParallelRegion::ring_positions(int p) const {
  const int n = p2p_size();
  MT_CHECK(p >= 0 && p < n, "positions of ring rank {} of {}", p, n);
  const int64_t rows = seq_ / n;
  return ring_positions_.as(DType::kI32, {seq_}).flat_range(p * rows, rows);
}

}  // namespace mt
