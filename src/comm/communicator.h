// Communicator: the collective interface every parallel layer talks to (docs/architecture.md
// "Contracts"; PyTorch c10d's Backend role). Stream-ordered: on CUDA a collective is enqueued on
// the given stream and the call returns without waiting; on CPU it has completed on return.
// Errors throw mt::Error naming the rank and the group. A peer that dies makes the others fail
// within the timeout (--distributed-timeout-minutes) instead of hanging.
// Backends: single-rank (size-1 groups that do nothing; this file), in-process threads
// (comm/thread_comm.h, tests), MPI (CPU tensors) and NCCL (CUDA tensors) in comm/mpi, comm/nccl.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

enum class ReduceOp { kSum, kMax, kMin };

/// The per-rank pieces of one side of Communicator::all_to_allv: counts[r] elements at element
/// offset offsets[r] (rank r of the group). offsets empty = packed (exclusive prefix sums).
struct AllToAllvSplits {
  std::vector<int64_t> counts;
  std::vector<int64_t> offsets;
  /// offsets, or the packed offsets when none are given.
  std::vector<int64_t> resolved_offsets() const;
  int64_t total() const;  ///< sum of counts
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Group name for messages, e.g. "tp", "dp", "world".
  virtual const std::string& name() const = 0;

  /// In place: t = op over ranks of t. fp32/bf16/fp16/int32 tensors.
  virtual void all_reduce(const Tensor& t, ReduceOp op, const Stream& stream) = 0;
  /// out = concatenation over ranks (rank order) of `in`; out.numel() == size() * in.numel().
  /// `in` may alias the rank's slice of `out` (in-place all-gather).
  virtual void all_gather(const Tensor& out, const Tensor& in, const Stream& stream) = 0;
  /// out = this rank's chunk (rank order) of (op over ranks of in); in.numel() == size() *
  /// out.numel(). `out` may alias the rank's chunk of `in`.
  virtual void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& stream) = 0;
  /// t = root's t.
  virtual void broadcast(const Tensor& t, int root, const Stream& stream) = 0;
  /// Equal splits: chunk j of `in` goes to rank j, chunk i of `out` comes from rank i.
  virtual void all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) = 0;
  /// Variable splits (MPI_Alltoallv; Megatron's all_to_all with input/output split sizes): this
  /// rank sends in[send.offsets[j], + send.counts[j]) to rank j and receives rank i's piece into
  /// out[recv.offsets[i], + recv.counts[i]). Counts and offsets are host values in elements of the
  /// tensors' (common) dtype, one per rank of the group; zero counts are allowed (the peer is
  /// skipped), empty offsets mean packed pieces (exclusive prefix sums of the counts). Receive
  /// pieces must not overlap one another; send pieces may (sending the same rows to several
  /// ranks: an all-gather of unequal sizes). `in` and `out` must not overlap. Collective: rank i's
  /// send.counts[j] must equal rank j's recv.counts[i] (the caller exchanges the counts first,
  /// e.g. with a fixed-size all_gather or all_to_all; the thread backend checks it, MPI fails on a
  /// receive that is too small, NCCL does not check). Errors (mt::Error naming group and rank,
  /// before any communication): dtype or contiguity mismatch, counts/offsets of the wrong length,
  /// negative, out of the tensors' range, overlapping receive pieces; MPI: a count or offset
  /// beyond INT_MAX elements.
  virtual void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in,
                           const AllToAllvSplits& send, const Stream& stream) = 0;
  /// Point-to-point (pipeline parallelism). Between group_start() and group_end() sends and
  /// receives are batched and cannot deadlock against each other (NCCL group semantics; MPI:
  /// non-blocking operations completed at group_end).
  virtual void send(const Tensor& t, int peer, const Stream& stream) = 0;
  virtual void recv(const Tensor& t, int peer, const Stream& stream) = 0;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  /// Host barrier over the group (waits for the group's streams' queued work to be issued,
  /// not necessarily finished).
  virtual void barrier() = 0;
  /// Collective over this group: ranks passing the same color form a new group, ordered by
  /// key (then by rank). color < 0: this rank joins no group and gets nullptr.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name) = 0;
};

/// A group of one rank: reductions and broadcasts are no-ops, gathers/scatters are copies.
class SingleRankCommunicator final : public Communicator {
 public:
  explicit SingleRankCommunicator(std::string name = "world") : name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  void all_reduce(const Tensor&, ReduceOp, const Stream&) override {}
  void all_gather(const Tensor& out, const Tensor& in, const Stream& stream) override;
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp, const Stream& stream) override;
  void broadcast(const Tensor&, int, const Stream&) override {}
  void all_to_all(const Tensor& out, const Tensor& in, const Stream& stream) override;
  void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in, const AllToAllvSplits& send,
                   const Stream& stream) override;
  void send(const Tensor&, int peer, const Stream&) override;
  void recv(const Tensor&, int peer, const Stream&) override;
  void group_start() override {}
  void group_end() override {}
  void barrier() override {}
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override;

 private:
  std::string name_;
};

/// Base of communicator decorators (instrumentation in tests and benchmarks: counting, timing):
/// every call goes to `inner`; a subclass overrides what it observes. split() splits `inner`
/// and passes the result through wrap(), so communicators split from a decorated one (e.g. the
/// one GradSync takes for overlapped reductions) are decorated too.
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  void all_reduce(const Tensor& t, ReduceOp op, const Stream& s) override { inner_->all_reduce(t, op, s); }
  void all_gather(const Tensor& out, const Tensor& in, const Stream& s) override { inner_->all_gather(out, in, s); }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& s) override {
    inner_->reduce_scatter(out, in, op, s);
  }
  void broadcast(const Tensor& t, int root, const Stream& s) override { inner_->broadcast(t, root, s); }
  void all_to_all(const Tensor& out, const Tensor& in, const Stream& s) override { inner_->all_to_all(out, in, s); }
  void all_to_allv(const Tensor& out, const AllToAllvSplits& recv, const Tensor& in, const AllToAllvSplits& send,
                   const Stream& s) override {
    inner_->all_to_allv(out, recv, in, send, s);
  }
  void send(const Tensor& t, int peer, const Stream& s) override { inner_->send(t, peer, s); }
  void recv(const Tensor& t, int peer, const Stream& s) override { inner_->recv(t, peer, s); }
  void group_start() override { inner_->group_start(); }
  void group_end() override { inner_->group_end(); }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name) override {
    auto c = inner_->split(color, key, name);
    return c ? wrap(std::move(c)) : nullptr;
  }

 protected:
  /// The decorator of a communicator split from this one.
  virtual std::shared_ptr<Communicator> wrap(std::shared_ptr<Communicator> split) = 0;
  Communicator& inner() const { return *inner_; }

 private:
  std::shared_ptr<Communicator> inner_;
};

/// Every rank's `bytes` bytes of host data `mine`, in rank order (size · bytes bytes): an
/// all-gather through a temporary buffer on stream.device(), then a host wait for `stream`.
/// Collective over `comm`; for setup and logging, not the training step (it allocates and
/// synchronizes). A group of one rank returns a copy of `mine`.
std::vector<char> all_gather_host(Communicator& comm, const void* mine, size_t bytes, const Stream& stream);

/// The process groups a model and trainer are handed (never globals; docs/architecture.md principle 2),
/// as Megatron-Core's parallel_state names them. All size-1 in single-device training.
struct ProcessGroups {
  std::shared_ptr<Communicator> world, tp, cp, dp, pp, tp_cp, dp_cp, mp, ep, etp, edp, embedding;
  /// MoE: expert tensor × expert model parallel (the token dispatch group) and that × pipeline
  /// (the expert gradient norm), from the expert grid.
  std::shared_ptr<Communicator> etp_ep, etp_ep_pp;
  static ProcessGroups single();
};

}  // namespace mt
