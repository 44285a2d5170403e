#include "parallel/mappings.h"

namespace mt {

TensorParallelRegion::TensorParallelRegion(std::shared_ptr<Communicator> tp, bool sequence_parallel)
    : tp_(tp ? std::move(tp) : std::make_shared<SingleRankCommunicator>("tp")),
      size_(tp_->size()),
      rank_(tp_->rank()),
      sp_(sequence_parallel && size_ > 1) {}

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

}  // namespace mt
