#include "comm/mpi/mpi_communicator.h"

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/comm_util.h"
#include "core/dtype.h"

namespace mt {

namespace {

using comm_detail::describe;

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", rc);
  return std::string(buf, static_cast<size_t>(len));
}

// Set when a collective timed out: its requests are abandoned and the peers may be gone, so
// MPI_Comm_free / MPI_Finalize (which can wait for peers) are skipped; the process exits without
// finalizing and mpirun stops the job.
std::atomic<bool> g_mpi_failed{false};

// Finalizes MPI at exit when this process initialized it (function-local static: destroyed
// after main returns).
struct MpiRuntimeState {
  bool we_initialized = false;
  ~MpiRuntimeState() {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (we_initialized && init && !fin && !g_mpi_failed.load()) MPI_Finalize();
  }
};

MpiRuntimeState& runtime_state() {
  static MpiRuntimeState s;
  return s;
}

std::mutex& runtime_mutex() {
  static std::mutex m;
  return m;
}

/// Element type for data movement (no arithmetic): bf16/fp16 travel as 16-bit integers.
MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kBF16: return MPI_UINT16_T;
    case DType::kF16: return MPI_UINT16_T;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU8: return MPI_UINT8_T;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI16: return MPI_INT16_T;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

bool is_half(DType t) { return t == DType::kBF16 || t == DType::kF16; }

void half_to_f32(const void* src, DType t, float* dst, int64_t n) {
  const auto* s = static_cast<const uint16_t*>(src);
  if (t == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_f32(s[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_bits_to_f32(s[i]);
  }
}

void f32_to_half(const float* src, DType t, void* dst, int64_t n) {
  auto* d = static_cast<uint16_t*>(dst);
  if (t == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16_bits(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_bits(src[i]);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MpiRuntime
// ---------------------------------------------------------------------------------------------

void MpiRuntime::ensure_initialized() {
  std::lock_guard<std::mutex> lock(runtime_mutex());
  MpiRuntimeState& s = runtime_state();
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  MT_REQUIRE(!fin, "MPI was already finalized in this process; it cannot be initialized again");
  if (init) return;
  int rc = MPI_Init(nullptr, nullptr);
  MT_REQUIRE(rc == MPI_SUCCESS, "MPI_Init failed: {}", mpi_error_string(rc));
  s.we_initialized = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

bool MpiRuntime::initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

void MpiRuntime::skip_finalize() { g_mpi_failed.store(true); }

bool MpiRuntime::launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

int MpiRuntime::world_rank() {
  ensure_initialized();
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int MpiRuntime::world_size() {
  ensure_initialized();
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// ---------------------------------------------------------------------------------------------
// MpiCommunicator
// ---------------------------------------------------------------------------------------------

std::shared_ptr<MpiCommunicator> MpiCommunicator::world(double timeout_s, const std::string& name) {
  MpiRuntime::ensure_initialized();
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  MT_REQUIRE(rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: {}", mpi_error_string(rc));
  return std::make_shared<MpiCommunicator>(dup, name, timeout_s);
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s)
    : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s) {
  MT_CHECK(comm_ != MPI_COMM_NULL, "MpiCommunicator '{}' needs a valid MPI_Comm", name_);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  if (comm_ != MPI_COMM_NULL && MpiRuntime::initialized() && !g_mpi_failed.load()) MPI_Comm_free(&comm_);
}

void MpiCommunicator::check(int rc, const char* call) const {
  if (rc != MPI_SUCCESS) [[unlikely]] {
    MT_FAIL("MPI error in {} on {}: {}", call, describe(*this), mpi_error_string(rc));
  }
}

void MpiCommunicator::require_cpu(const Tensor& t, const char* op) const {
  MT_REQUIRE(t.device().is_cpu(), "{} on {}: the MPI backend takes CPU tensors, got {} (CUDA tensors use NCCL)", op,
             describe(*this), t.str());
  MT_REQUIRE(t.numel() <= INT_MAX, "{} on {}: {} has more than INT_MAX elements", op, describe(*this), t.str());
}

void MpiCommunicator::wait_all(std::vector<MPI_Request>& reqs, const char* op) {
  if (reqs.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  for (long spins = 0;; ++spins) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), op);
    if (done) {
      reqs.clear();
      return;
    }
    if (spins < 64) continue;  // short operations: pure spinning
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_s_ > 0 && waited > timeout_s_) {
      reqs.clear();  // the requests are abandoned: this communicator is unusable after the error
      g_mpi_failed.store(true);
      MT_FAIL(
          "MPI {} on {} did not complete within {:.1f} s (--distributed-timeout-minutes={:.3g}): a peer rank has "
          "died or is stuck outside this collective",
          op, describe(*this), timeout_s_, timeout_s_ / 60.0);
    }
    // Oversubscribed CPU runs: leave the core to the ranks that still compute.
    if (waited > 0.5) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } else {
      std::this_thread::yield();
    }
  }
}

void MpiCommunicator::wait_one(MPI_Request req, const char* op) {
  std::vector<MPI_Request> reqs{req};
  wait_all(reqs, op);
}

void* MpiCommunicator::scratch(int which, size_t bytes) {
  auto& s = scratch_[which];
  if (s.size() < bytes) s.resize(bytes);
  return s.data();
}

void MpiCommunicator::all_reduce(const Tensor& t, ReduceOp op, const Stream&) {
  comm_detail::check_all_reduce(*this, t);
  require_cpu(t, "all_reduce");
  if (size_ == 1 || t.numel() == 0) return;
  const int n = static_cast<int>(t.numel());
  MPI_Request req;
  if (is_half(t.dtype())) {
    auto* f = static_cast<float*>(scratch(0, t.numel() * sizeof(float)));
    half_to_f32(t.data(), t.dtype(), f, n);
    check(MPI_Iallreduce(MPI_IN_PLACE, f, n, MPI_FLOAT, mpi_op(op), comm_, &req), "MPI_Iallreduce");
    wait_one(req, "all_reduce");
    f32_to_half(f, t.dtype(), t.data(), n);
    return;
  }
  check(MPI_Iallreduce(MPI_IN_PLACE, t.data(), n, mpi_type(t.dtype()), mpi_op(op), comm_, &req), "MPI_Iallreduce");
  wait_one(req, "all_reduce");
}

void MpiCommunicator::all_gather(const Tensor& out, const Tensor& in, const Stream&) {
  const bool in_place = comm_detail::check_all_gather(*this, out, in);
  require_cpu(out, "all_gather");
  require_cpu(in, "all_gather");
  if (in.numel() == 0) return;
  if (size_ == 1) {
    if (!in_place) std::memcpy(out.data(), in.data(), in.nbytes());
    return;
  }
  const int n = static_cast<int>(in.numel());
  MPI_Datatype dt = mpi_type(in.dtype());
  MPI_Request req;
  check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data(), n, dt, out.data(), n, dt, comm_, &req),
        "MPI_Iallgather");
  wait_one(req, "all_gather");
}

void MpiCommunicator::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream&) {
  const bool in_place = comm_detail::check_reduce_scatter(*this, out, in);
  require_cpu(out, "reduce_scatter");
  require_cpu(in, "reduce_scatter");
  if (out.numel() == 0) return;
  if (size_ == 1) {
    if (!in_place) std::memcpy(out.data(), in.data(), out.nbytes());
    return;
  }
  const int n = static_cast<int>(out.numel());
  MPI_Request req;
  if (is_half(in.dtype())) {
    auto* fin = static_cast<float*>(scratch(0, in.numel() * sizeof(float)));
    auto* fout = static_cast<float*>(scratch(1, out.numel() * sizeof(float)));
    half_to_f32(in.data(), in.dtype(), fin, in.numel());
    check(MPI_Ireduce_scatter_block(fin, fout, n, MPI_FLOAT, mpi_op(op), comm_, &req), "MPI_Ireduce_scatter_block");
    wait_one(req, "reduce_scatter");
    f32_to_half(fout, out.dtype(), out.data(), n);
    return;
  }
  // MPI forbids aliasing send and receive buffers: the in-place case receives into scratch.
  void* recv = in_place ? scratch(1, out.nbytes()) : out.data();
  check(MPI_Ireduce_scatter_block(in.data(), recv, n, mpi_type(in.dtype()), mpi_op(op), comm_, &req),
        "MPI_Ireduce_scatter_block");
  wait_one(req, "reduce_scatter");
  if (in_place) std::memcpy(out.data(), recv, out.nbytes());
}

void MpiCommunicator::broadcast(const Tensor& t, int root, const Stream&) {
  comm_detail::check_broadcast(*this, t, root);
  require_cpu(t, "broadcast");
  if (size_ == 1 || t.numel() == 0) return;
  MPI_Request req;
  check(MPI_Ibcast(t.data(), static_cast<int>(t.numel()), mpi_type(t.dtype()), root, comm_, &req), "MPI_Ibcast");
  wait_one(req, "broadcast");
}

void MpiCommunicator::all_to_all(const Tensor& out, const Tensor& in, const Stream&) {
  comm_detail::check_all_to_all(*this, out, in);
  require_cpu(out, "all_to_all");
  require_cpu(in, "all_to_all");
  if (in.numel() == 0) return;
  if (size_ == 1) {
    std::memcpy(out.data(), in.data(), in.nbytes());
    return;
  }
  const int chunk = static_cast<int>(in.numel() / size_);
  MPI_Datatype dt = mpi_type(in.dtype());
  MPI_Request req;
  check(MPI_Ialltoall(in.data(), chunk, dt, out.data(), chunk, dt, comm_, &req), "MPI_Ialltoall");
  wait_one(req, "all_to_all");
}

void MpiCommunicator::all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in,
                                  const AllToAllvSplits& send, const Stream&) {
  const auto [roff, soff] = comm_detail::check_all_to_allv(*this, out, recv, in, send);
  MT_REQUIRE(out.device().is_cpu() && in.device().is_cpu(),
             "all_to_allv on {}: the MPI backend takes CPU tensors, got {} and {} (CUDA tensors use NCCL)",
             describe(*this), out.str(), in.str());
  // MPI_Alltoallv takes int counts and displacements (in elements of the datatype).
  auto to_int = [&](int64_t v, int64_t end, const char* side, int peer) {
    MT_REQUIRE(end <= INT_MAX,
               "all_to_allv on {}: the {} piece of rank {} ends at element {} (count {}), beyond MPI's int range "
               "(INT_MAX = {}): split the exchange",
               describe(*this), side, peer, end, end - v, INT_MAX);
    return static_cast<int>(v);
  };
  std::vector<int> rc(size_), rd(size_), sc(size_), sd(size_);
  for (int r = 0; r < size_; ++r) {
    rc[r] = to_int(recv.counts[r], roff[r] + recv.counts[r], "receive", r);
    rd[r] = to_int(roff[r], roff[r] + recv.counts[r], "receive", r);
    sc[r] = to_int(send.counts[r], soff[r] + send.counts[r], "send", r);
    sd[r] = to_int(soff[r], soff[r] + send.counts[r], "send", r);
  }
  MPI_Datatype dt = mpi_type(in.dtype());
  MPI_Request req;
  check(MPI_Ialltoallv(in.data(), sc.data(), sd.data(), dt, out.data(), rc.data(), rd.data(), dt, comm_, &req),
        "MPI_Ialltoallv");
  wait_one(req, "all_to_allv");
}

void MpiCommunicator::p2p(const Tensor& t, int peer, bool is_send) {
  const char* op = is_send ? "send" : "recv";
  comm_detail::check_p2p(*this, t, peer, op);
  require_cpu(t, op);
  MPI_Request req;
  const int n = static_cast<int>(t.numel());
  constexpr int kTag = 0;  // messages between a pair of ranks stay in order (MPI non-overtaking)
  if (is_send) {
    check(MPI_Isend(t.data(), n, mpi_type(t.dtype()), peer, kTag, comm_, &req), "MPI_Isend");
  } else {
    check(MPI_Irecv(t.data(), n, mpi_type(t.dtype()), peer, kTag, comm_, &req), "MPI_Irecv");
  }
  if (group_depth_ > 0) {
    pending_.push_back(req);
  } else {
    wait_one(req, op);
  }
}

void MpiCommunicator::send(const Tensor& t, int peer, const Stream&) { p2p(t, peer, true); }
void MpiCommunicator::recv(const Tensor& t, int peer, const Stream&) { p2p(t, peer, false); }

void MpiCommunicator::group_start() { ++group_depth_; }

void MpiCommunicator::group_end() {
  MT_REQUIRE(group_depth_ > 0, "group_end on {} without a matching group_start", describe(*this));
  if (--group_depth_ == 0) wait_all(pending_, "group_end (batched send/recv)");
}

void MpiCommunicator::barrier() {
  if (size_ == 1) return;
  MPI_Request req;
  check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier");
  wait_one(req, "barrier");
}

std::shared_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  MPI_Comm nc = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &nc), "MPI_Comm_split");
  if (nc == MPI_COMM_NULL) return nullptr;
  return std::make_shared<MpiCommunicator>(nc, name, timeout_s_);
}

}  // namespace mt
