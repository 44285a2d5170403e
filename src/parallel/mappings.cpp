#include "parallel/mappings.h"

#include <array>

#include "comm/rank_order_sum.h"

namespace mt {

struct TensorParallelRegion::Overlap {
  std::unique_ptr<Stream> comm;               // the communication stream
  std::unique_ptr<Event> start, done;         // compute -> comm, comm -> compute
  std::vector<std::unique_ptr<Event>> steps;  // steps[i]: step i's transfer (gather) / block (reduce)
};

TensorParallelRegion::TensorParallelRegion(std::shared_ptr<Communicator> tp, bool sequence_parallel,
                                           bool tp_comm_overlap)
    : tp_(tp ? std::move(tp) : std::make_shared<SingleRankCommunicator>("tp")),
      size_(tp_->size()),
      rank_(tp_->rank()),
      sp_(sequence_parallel && size_ > 1) {
  if (!tp_comm_overlap) return;
  MT_REQUIRE(sp_,
             "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1, got sequence "
             "parallelism {} with tensor parallel size {} (Megatron-LM: tensor parallel communication/GEMM overlap "
             "can happen only when sequence parallelism is enabled)",
             sequence_parallel ? "on" : "off", size_);
  MT_REQUIRE(size_ <= kMaxOverlapRanks, "--tp-comm-overlap supports up to {} tensor-parallel ranks, got {}",
             kMaxOverlapRanks, size_);
  overlap_ = std::make_shared<Overlap>();
}

TensorParallelRegion::Overlap& TensorParallelRegion::overlap(const Stream& stream) const {
  Overlap& o = *overlap_;
  if (!o.comm) {
    o.comm = std::make_unique<Stream>(stream.device());
    o.start = std::make_unique<Event>(stream.device());
    o.done = std::make_unique<Event>(stream.device());
    for (int i = 0; i < size_; ++i) o.steps.push_back(std::make_unique<Event>(stream.device()));
  }
  MT_CHECK(o.comm->device() == stream.device(), "--tp-comm-overlap: the region's stream is on {}, the call's on {}",
           o.comm->device().str(), stream.device().str());
  return o;
}

TensorParallelRegion TensorParallelRegion::layout_only(int size, int rank, bool sequence_parallel) {
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "tensor-parallel rank {} of {}", rank, size);
  TensorParallelRegion r(std::make_shared<SingleRankCommunicator>("tp(layout only)"), false);
  r.tp_ = nullptr;
  r.size_ = size;
  r.rank_ = rank;
  r.sp_ = sequence_parallel && size > 1;
  return r;
}

int64_t TensorParallelRegion::local_seq(int64_t s) const {
  if (!sp_) return s;
  MT_REQUIRE(s % size_ == 0, "--sequence-parallel needs --seq-length {} divisible by tensor parallel size {}", s,
             size_);
  return s / size_;
}

Communicator& TensorParallelRegion::group() const {
  MT_CHECK(tp_ != nullptr, "a layout-only tensor-parallel region has no communicator");
  return *tp_;
}

void TensorParallelRegion::enter_forward(const Tensor& full, const Tensor& local, const Stream& stream) const {
  if (sp_) group().all_gather(full, local, stream);
}

void TensorParallelRegion::enter_backward(const Tensor& local, const Tensor& full, const Stream& stream) const {
  if (sp_) {
    group().reduce_scatter(local, full, ReduceOp::kSum, stream);
  } else if (size_ > 1) {
    group().all_reduce(full, ReduceOp::kSum, stream);
  }
}

void TensorParallelRegion::exit_forward(const Tensor& local, const Tensor& full, const Stream& stream) const {
  enter_backward(local, full, stream);  // the same collective: g forward is f backward
}

void TensorParallelRegion::exit_backward(const Tensor& full, const Tensor& local, const Stream& stream) const {
  enter_forward(full, local, stream);
}

void TensorParallelRegion::all_reduce_grads(const Tensor& grads, const Stream& stream) const {
  if (size_ > 1) group().all_reduce(grads, ReduceOp::kSum, stream);
}

namespace {
/// The [rows, n] view of a contiguous [..., n] tensor.
Tensor as_rows(const Tensor& t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }
}  // namespace

void TensorParallelRegion::all_gather_gemm(const Tensor& full, const Tensor& local, const RowGemm& gemm,
                                           const Stream& stream) const {
  const Tensor f = as_rows(full);
  if (!sp_) {
    gemm(f, 0);
    return;
  }
  const Tensor l = as_rows(local);
  const int64_t m = l.size(0);
  MT_CHECK(f.size(0) == m * size_ && f.size(1) == l.size(1), "all_gather_gemm: full {} is not {} x local {}",
           full.str(), size_, local.str());
  auto block = [&](int r) { return f.slice0(r * m, (r + 1) * m); };
  auto from = [&](int i) { return (rank_ + size_ - i) % size_; };  // whose block comes in step i
  if (!comm_overlap()) {
    group().all_gather(full, local, stream);
    gemm(l, rank_ * m);
    for (int i = 1; i < size_; ++i) gemm(block(from(i)), from(i) * m);
    return;
  }
  Overlap& o = overlap(stream);
  Communicator& c = group();
  o.start->record(stream);  // local is written
  o.start->wait(*o.comm);
  for (int i = 1; i < size_; ++i) {
    c.group_start();
    c.send(l, (rank_ + i) % size_, *o.comm);
    c.recv(block(from(i)), from(i), *o.comm);
    c.group_end();
    o.steps[static_cast<size_t>(i)]->record(*o.comm);
  }
  copy(block(rank_), l, *o.comm);  // this rank's block of the gathered input (read after the call)
  o.done->record(*o.comm);
  gemm(l, rank_ * m);
  for (int i = 1; i < size_; ++i) {
    o.steps[static_cast<size_t>(i)]->wait(stream);
    gemm(block(from(i)), from(i) * m);
  }
  o.done->wait(stream);
}

void TensorParallelRegion::gemm_reduce_scatter(const Tensor& local, const Tensor& full, const RowGemm& gemm,
                                               const std::function<void()>& tail, const Stream& stream) const {
  const Tensor f = as_rows(full);
  if (!sp_) {
    gemm(f, 0);
    if (tail) tail();
    exit_forward(local, full, stream);  // the all-reduce over TP (nothing on one rank)
    return;
  }
  const Tensor l = as_rows(local);
  const int64_t m = l.size(0);
  MT_CHECK(f.size(0) == m * size_ && f.size(1) == l.size(1), "gemm_reduce_scatter: full {} is not {} x local {}",
           full.str(), size_, local.str());
  auto block = [&](int r) { return f.slice0(r * m, (r + 1) * m); };
  if (!comm_overlap()) {
    for (int i = 1; i < size_; ++i) gemm(block((rank_ + i) % size_), (rank_ + i) % size_ * m);
    gemm(block(rank_), rank_ * m);
    if (tail) tail();
    group().reduce_scatter(local, full, ReduceOp::kSum, stream);
    return;
  }
  Overlap& o = overlap(stream);
  Communicator& c = group();
  std::array<Tensor, kMaxOverlapRanks> pieces;  // the partial sums of this rank's rows, by rank
  pieces[static_cast<size_t>(rank_)] = block(rank_);
  for (int i = 1; i < size_; ++i) {
    const int to = (rank_ + i) % size_, from = (rank_ + size_ - i) % size_;
    // Where rank `from`'s piece lands: local (step 1), then the block sent in the step before
    // (the communication stream has completed that send).
    const Tensor slot = i == 1 ? l : block((rank_ + i - 1) % size_);
    gemm(block(to), to * m);
    o.steps[static_cast<size_t>(i)]->record(stream);
    o.steps[static_cast<size_t>(i)]->wait(*o.comm);
    c.group_start();
    c.send(block(to), to, *o.comm);
    c.recv(slot, from, *o.comm);
    c.group_end();
    pieces[static_cast<size_t>(from)] = slot;
  }
  gemm(block(rank_), rank_ * m);
  if (tail) tail();
  o.done->record(*o.comm);
  o.done->wait(stream);
  rank_order_sum(l, pieces.data(), size_, stream);
}

}  // namespace mt
