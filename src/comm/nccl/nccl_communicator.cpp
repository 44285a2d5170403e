#include "comm/nccl/nccl_communicator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "comm/comm_util.h"
#include "comm/nccl/nccl_watchdog.h"
#include "core/cuda_check.h"

namespace mt {

namespace {

using comm_detail::describe;
using nccl_detail::HostCallGuard;
using nccl_detail::Watchdog;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
    case DType::kF64: return ncclFloat64;
    // NCCL has no 16-bit integer type: int16 moves as 16-bit words (all-gather, broadcast,
    // send/recv copy bits unchanged; reductions reject int16, comm_util.cpp).
    case DType::kI16: return ncclFloat16;
    // FP8 moves as bytes (all-gather of FP8 weights); reductions reject it (comm_util.cpp).
    case DType::kF8E4M3:
    case DType::kF8E5M2: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

/// Stable C strings for ncclConfig_t::commName (kept for the life of the process).
const char* intern(const std::string& s) {
  static std::mutex mu;
  static std::set<std::string> names;
  std::lock_guard<std::mutex> lk(mu);
  return names.insert(s).first->c_str();
}

// Operations enqueued inside an NCCL group are launched only at the outermost ncclGroupEnd; NCCL
// groups are per thread and span communicators, so the pending list is thread-local too.
struct PendingOp {
  ncclComm_t comm;
  cudaStream_t stream;
  const char* op;
};
thread_local int t_group_depth = 0;
thread_local std::vector<PendingOp> t_pending;

}  // namespace

template <class Call>
ncclResult_t NcclCommunicator::guarded(const char* op, Call&& call) const {
  HostCallGuard guard(op, &desc_, timeout_s_);
  return call();
}

template <class Call>
void NcclCommunicator::checked(const char* op, Call&& call) const {
  check(guarded(op, std::forward<Call>(call)), op);
}

NcclCommunicator::UniqueId NcclCommunicator::make_unique_id() {
  static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId), "NCCL_UNIQUE_ID_BYTES changed");
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  MT_REQUIRE(r == ncclSuccess, "ncclGetUniqueId failed: {} ({})", ncclGetErrorString(r), ncclGetLastError(nullptr));
  UniqueId id;
  std::memcpy(id.data(), &uid, sizeof(uid));
  return id;
}

NcclCommunicator::NcclCommunicator(const UniqueId& id, int rank, int size, Device device, std::string name,
                                   double timeout_s)
    : rank_(rank), size_(size), device_(device), name_(std::move(name)), timeout_s_(timeout_s) {
  desc_ = describe(*this);
  MT_REQUIRE(device.is_cuda(), "NCCL communicator {} needs a CUDA device, got {}", desc_, device.str());
  MT_REQUIRE(size >= 1 && rank >= 0 && rank < size, "NCCL communicator {}: invalid rank/size", desc_);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  set_current_device(device_);
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.commName = intern(name_);
  {
    HostCallGuard guard(fmt::format("NCCL initialisation of {} on {}", desc_, device_.str()), timeout_s_);
    check(ncclCommInitRankConfig(&comm_, size, uid, rank, &cfg), "ncclCommInitRankConfig");
  }
  init_common();
}

NcclCommunicator::NcclCommunicator(ncclComm_t comm, Device device, std::string name, double timeout_s)
    : comm_(comm), device_(device), name_(std::move(name)), timeout_s_(timeout_s) {
  ncclCommUserRank(comm_, &rank_);
  ncclCommCount(comm_, &size_);
  desc_ = describe(*this);
  init_common();
}

void NcclCommunicator::init_common() {
  Watchdog::instance().add_comm(comm_, desc_, timeout_s_, device_.index);
  MT_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(int)));
  MT_CUDA_CHECK(cudaMemset(barrier_buf_, 0, sizeof(int)));
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking));
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  Watchdog::instance().remove_comm(comm_);
  cudaSetDevice(device_.index);
  if (barrier_stream_) cudaStreamDestroy(barrier_stream_);
  if (barrier_buf_) cudaFree(barrier_buf_);
  HostCallGuard guard(fmt::format("ncclCommDestroy of {}", desc_), timeout_s_);
  ncclCommDestroy(comm_);
}

void NcclCommunicator::check(ncclResult_t r, const char* call) const {
  if (r != ncclSuccess && r != ncclInProgress) [[unlikely]] {
    MT_FAIL("NCCL error '{}' in {} on {}: {}", ncclGetErrorString(r), call, desc_, ncclGetLastError(comm_));
  }
}

cudaStream_t NcclCommunicator::stream_of(const Stream& s, const char* op) const {
  MT_REQUIRE(!s.is_cpu() && s.device() == device_, "{} on {}: needs a CUDA stream on {}, got a stream on {}", op,
             desc_, device_.str(), s.device().str());
  return static_cast<cudaStream_t>(s.cuda_stream());
}

void NcclCommunicator::require_device(const Tensor& t, const char* op) const {
  MT_REQUIRE(t.device() == device_, "{} on {}: the NCCL backend takes tensors on {}, got {}", op, desc_,
             device_.str(), t.str());
}

void NcclCommunicator::enqueued(cudaStream_t s, const char* op) {
  if (t_group_depth > 0) {
    t_pending.push_back({comm_, s, op});
  } else {
    Watchdog::instance().enqueued(comm_, s, op);
  }
}

void NcclCommunicator::all_reduce(const Tensor& t, ReduceOp op, const Stream& stream) {
  comm_detail::check_all_reduce(*this, t);
  require_device(t, "all_reduce");
  cudaStream_t s = stream_of(stream, "all_reduce");
  if (size_ == 1 || t.numel() == 0) return;
  checked("ncclAllReduce", [&] {
    return ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), nccl_op(op), comm_,
                         s);
  });
  enqueued(s, "all_reduce");
}

void NcclCommunicator::all_gather(const Tensor& out, const Tensor& in, const Stream& stream) {
  comm_detail::check_all_gather(*this, out, in);  // in place: in == out + rank * in.numel()
  require_device(out, "all_gather");
  require_device(in, "all_gather");
  cudaStream_t s = stream_of(stream, "all_gather");
  if (in.numel() == 0) return;
  checked("ncclAllGather", [&] {
    return ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()), nccl_type(in.dtype()), comm_, s);
  });
  enqueued(s, "all_gather");
}

void NcclCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& stream) {
  comm_detail::check_reduce_scatter(*this, out, in);  // in place: out == in + rank * out.numel()
  require_device(out, "reduce_scatter");
  require_device(in, "reduce_scatter");
  cudaStream_t s = stream_of(stream, "reduce_scatter");
  if (out.numel() == 0) return;
  checked("ncclReduceScatter", [&] {
    return ncclReduceScatter(in.data(), out.data(), static_cast<size_t>(out.numel()), nccl_type(in.dtype()),
                             nccl_op(op), comm_, s);
  });
  enqueued(s, "reduce_scatter");
}

void NcclCommunicator::broadcast(const Tensor& t, int root, const Stream& stream) {
  comm_detail::check_broadcast(*this, t, root);
  require_device(t, "broadcast");
  cudaStream_t s = stream_of(stream, "broadcast");
  if (size_ == 1 || t.numel() == 0) return;
  checked("ncclBroadcast", [&] {
    return ncclBroadcast(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), root, comm_, s);
  });
  enqueued(s, "broadcast");
}

void NcclCommunicator::all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) {
  comm_detail::check_all_to_all(*this, out, in);
  require_device(out, "all_to_all");
  require_device(in, "all_to_all");
  cudaStream_t s = stream_of(stream, "all_to_all");
  if (in.numel() == 0) return;
  const size_t chunk = static_cast<size_t>(in.numel() / size_);
  const size_t chunk_bytes = chunk * dtype_size(in.dtype());
  const ncclDataType_t dt = nccl_type(in.dtype());
  const auto* src = static_cast<const char*>(in.data());
  auto* dst = static_cast<char*>(out.data());
  check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
    r = ncclSend(src + p * chunk_bytes, chunk, dt, p, comm_, s);
    if (r == ncclSuccess) r = ncclRecv(dst + p * chunk_bytes, chunk, dt, p, comm_, s);
  }
  const ncclResult_t r_end = guarded("ncclGroupEnd (all_to_all)", [] { return ncclGroupEnd(); });
  check(r, "ncclSend/ncclRecv (all_to_all)");
  check(r_end, "ncclGroupEnd (all_to_all)");
  enqueued(s, "all_to_all");
}

void NcclCommunicator::all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in,
                                   const AllToAllvSplits& send, const Stream& stream) {
  const auto [roff, soff] = comm_detail::check_all_to_allv(*this, out, recv, in, send);
  if (out.numel() > 0) require_device(out, "all_to_allv");
  if (in.numel() > 0) require_device(in, "all_to_allv");
  cudaStream_t s = stream_of(stream, "all_to_allv");
  if (recv.total() == 0 && send.total() == 0) return;
  const size_t es = dtype_size(in.dtype());
  const ncclDataType_t dt = nccl_type(in.dtype());
  const auto* src = static_cast<const char*>(in.data());
  auto* dst = static_cast<char*>(out.data());
  check(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t r = ncclSuccess;
  for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
    if (send.counts[p] > 0)
      r = ncclSend(src + soff[p] * es, static_cast<size_t>(send.counts[p]), dt, p, comm_, s);
    if (r == ncclSuccess && recv.counts[p] > 0)
      r = ncclRecv(dst + roff[p] * es, static_cast<size_t>(recv.counts[p]), dt, p, comm_, s);
  }
  const ncclResult_t r_end = guarded("ncclGroupEnd (all_to_allv)", [] { return ncclGroupEnd(); });
  check(r, "ncclSend/ncclRecv (all_to_allv)");
  check(r_end, "ncclGroupEnd (all_to_allv)");
  enqueued(s, "all_to_allv");
}

void NcclCommunicator::send(const Tensor& t, int peer, const Stream& stream) {
  comm_detail::check_p2p(*this, t, peer, "send");
  require_device(t, "send");
  cudaStream_t s = stream_of(stream, "send");
  checked("ncclSend",
          [&] { return ncclSend(t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm_, s); });
  enqueued(s, "send");
}

void NcclCommunicator::recv(const Tensor& t, int peer, const Stream& stream) {
  comm_detail::check_p2p(*this, t, peer, "recv");
  require_device(t, "recv");
  cudaStream_t s = stream_of(stream, "recv");
  checked("ncclRecv",
          [&] { return ncclRecv(t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm_, s); });
  enqueued(s, "recv");
}

void NcclCommunicator::group_start() {
  check(ncclGroupStart(), "ncclGroupStart");
  ++t_group_depth;
}

void NcclCommunicator::group_end() {
  MT_REQUIRE(t_group_depth > 0, "group_end on {} without a matching group_start", desc_);
  --t_group_depth;
  const ncclResult_t r = guarded("ncclGroupEnd", [] { return ncclGroupEnd(); });
  if (t_group_depth == 0) {
    std::vector<PendingOp> pending;
    pending.swap(t_pending);
    if (r == ncclSuccess) {
      for (const auto& p : pending) Watchdog::instance().enqueued(p.comm, p.stream, p.op);
    }
  }
  check(r, "ncclGroupEnd");
}

void NcclCommunicator::barrier() {
  MT_REQUIRE(t_group_depth == 0, "barrier on {} inside group_start/group_end", desc_);
  if (size_ == 1) return;
  set_current_device(device_);
  checked("ncclAllReduce (barrier)",
          [&] { return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_, barrier_stream_); });
  Watchdog::instance().enqueued(comm_, barrier_stream_, "barrier");
  MT_CUDA_CHECK(cudaStreamSynchronize(barrier_stream_));
}

std::shared_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  set_current_device(device_);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.commName = intern(name);
  ncclComm_t nc = nullptr;
  {
    HostCallGuard guard(fmt::format("ncclCommSplit of {} into '{}'", desc_, name), timeout_s_);
    check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg), "ncclCommSplit");
  }
  if (nc == nullptr) return nullptr;
  return std::shared_ptr<NcclCommunicator>(new NcclCommunicator(nc, device_, name, timeout_s_));
}

}  // namespace mt
