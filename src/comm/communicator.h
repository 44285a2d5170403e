// Communicator: the collective interface every parallel layer talks to (DESIGN.md
// "Contracts"; PyTorch c10d's Backend role). Stream-ordered; errors throw mt::Error naming the
// rank and the group. Backends: single-rank (size-1 groups that do nothing; this file), NCCL and
// MPI (distributed-runtime issue).
#pragma once
#include <memory>
#include <string>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt {

enum class ReduceOp { kSum, kMax, kMin };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  ///< group name, e.g. "tp", "dp"

  /// In place: t = op over ranks of t.
  virtual void all_reduce(const Tensor& t, ReduceOp op, const Stream& stream) = 0;
  /// out = concatenation over ranks (rank order) of `in`; out.numel() == size() * in.numel().
  virtual void all_gather(const Tensor& out, const Tensor& in, const Stream& stream) = 0;
  /// out = rank's chunk of (op over ranks of in); in.numel() == size() * out.numel().
  virtual void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& stream) = 0;
  /// t = root's t.
  virtual void broadcast(const Tensor& t, int root, const Stream& stream) = 0;
  virtual void barrier() = 0;
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
  void barrier() override {}

 private:
  std::string name_;
};

/// The process groups a model and trainer are handed (never globals; DESIGN.md principle 2).
/// All are size-1 in single-device training.
struct ProcessGroups {
  std::shared_ptr<Communicator> world, tp, dp, pp;
  static ProcessGroups single();
};

}  // namespace mt
