// Shared pieces of the data-parallel tests (grad_sync_test, distributed_checkpoint_test and the
// NCCL test): a small GPT-like parameter list with its per-layer index ranges, deterministic
// per-(step, rank) gradients keyed by global element index (layout invariant), a communicator
// that counts the collectives it forwards, and a "backward" that reports gradients ready.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/params.h"
#include "optim/grad_sync.h"
#include "optim/optimizer.h"
#include "testing/testing.h"

namespace mt::ddp_test {

/// The AdamW settings of the data-parallel tests: weight decay, clipping active (gradient norms
/// ~50), and eps 1e-3 so that updates are proportional to gradients (see
/// tests/parallel/parallel_layouts_test.cpp).
inline OptimizerConfig opt_config() {
  OptimizerConfig oc;
  oc.weight_decay = 0.1f;
  oc.clip_grad = 1.0f;
  oc.eps = 1e-3f;
  return oc;
}

/// Parameter ranges [first, end) of one "layer" (param_hooks.h: a layer's params are consecutive).
struct LayerRange {
  size_t first, end;
};

struct Model {
  std::vector<ParamSpec> specs;
  std::vector<LayerRange> layers;  // forward order: embedding, decoder layers, final norm
};

/// The units of one pass over m.layers (forward order, reversed for the backward), each with the
/// pass's next unit ({0, 0} after the last): f(k, unit, next) for k = 0, 1, ...
template <typename F>
void for_each_unit(const Model& m, bool backward, F&& f) {
  const size_t n = m.layers.size();
  const auto at = [&](size_t k) { return m.layers[backward ? n - 1 - k : k]; };
  for (size_t k = 0; k < n; ++k) f(k, at(k), k + 1 < n ? at(k + 1) : LayerRange{0, 0});
}

/// A GPT-shaped list: word embedding [V, h] (vocab-parallel with tp > 1), per layer a norm weight
/// [h] (replicated, no decay), QKV weight [3h, h] and bias [3h] (column-parallel), fc1 weight
/// [f, h] (column-parallel) and bias, and the final norm. Sizes are odd on purpose so that the
/// alignment padding is exercised. shared_copy: a last parameter flagged shared_embedding_copy.
inline Model gpt_like(int num_layers, int tp = 1, int tp_rank = 0, bool shared_copy = false) {
  const int64_t h = 16, V = 40, f = 38;
  Model m;
  auto add = [&](const std::string& name, std::vector<int64_t> gshape, bool split, bool decay, InitKind init) {
    ParamSpec p;
    p.name = name;
    p.global_shape = gshape;
    p.shape = gshape;
    p.weight_decay = decay;
    p.init = init;
    p.init_std = 0.2f;
    p.tensor_parallel = split && tp > 1;
    if (p.tensor_parallel) {  // split the rows (column-parallel / vocab-parallel); 1-D: one row
      p.shape[0] = gshape[0] / tp;
      p.shard_offset.assign(gshape.size(), 0);
      p.shard_offset[0] = tp_rank * p.shape[0];
    }
    m.specs.push_back(p);
  };
  size_t first = 0;
  add("embedding.word_embeddings.weight", {V, h}, true, true, InitKind::kNormal);
  m.layers.push_back({first, m.specs.size()});
  for (int l = 0; l < num_layers; ++l) {
    first = m.specs.size();
    const std::string pre = "decoder.layers." + std::to_string(l) + ".";
    add(pre + "input_layernorm.weight", {h}, false, false, InitKind::kOnes);
    add(pre + "self_attention.linear_qkv.weight", {3 * h, h}, true, true, InitKind::kNormal);
    add(pre + "self_attention.linear_qkv.bias", {3 * h}, true, false, InitKind::kZeros);
    add(pre + "mlp.linear_fc1.weight", {f, h}, true, true, InitKind::kNormal);
    add(pre + "mlp.linear_fc1.bias", {f}, true, false, InitKind::kNormal);
    m.layers.push_back({first, m.specs.size()});
  }
  first = m.specs.size();
  add("decoder.final_layernorm.weight", {h}, false, false, InitKind::kOnes);
  if (shared_copy) {
    add("output_layer.weight", {V, h}, true, true, InitKind::kNormal);
    m.specs.back().shared_embedding_copy = true;
  }
  m.layers.push_back({first, m.specs.size()});
  return m;
}

/// Gradient of global element `g` of parameter `name` on data-parallel rank `rank` at `step`:
/// a hash mapped to [-1, 1) (never all zero), salted with the run's test seed.
inline float grad_value(int step, int rank, const std::string& name, int64_t g) {
  uint64_t x = testing::test_seed() ^ (static_cast<uint64_t>(step) << 56) ^ (static_cast<uint64_t>(rank) << 48) ^
               static_cast<uint64_t>(g);
  for (char c : name) x = (x ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  x += 0x9e3779b97f4a7c15ULL;  // splitmix64 finaliser
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ULL << 24) * 2.0 - 1.0);
}

/// Global flat index of local element e of a parameter (its shard box).
inline int64_t global_index(const ParamInfo& p, int64_t e) { return p.box.global_index(e); }

/// Local gradient of parameter i of `P` for (step, rank); the sum over `ranks` ranks (fp32,
/// in rank order, as the thread communicator reduces) when ranks > 0 and rank < 0.
/// rank < 0: the sum over `ranks` ranks in the order the reductions take it: rank order within
/// each of `instances` instances of contiguous ranks, then the instances' sums in order (hybrid
/// sharding's reduce-scatter within an instance and all-reduce across instances); `only_instance`
/// >= 0: that instance's sum alone (what a skipped cross-instance all-reduce would leave).
inline std::vector<float> local_grad(const ParamStore& P, size_t i, int step, int rank, int ranks = 0,
                                     int instances = 1, int only_instance = -1) {
  const ParamInfo& p = P.info(i);
  std::vector<float> g(static_cast<size_t>(p.numel));
  const int n = ranks / std::max(instances, 1);
  for (int64_t e = 0; e < p.numel; ++e) {
    const int64_t gi = global_index(p, e);
    if (rank >= 0) {
      g[e] = grad_value(step, rank, p.name, gi);
      continue;
    }
    float total = 0;
    for (int k = 0; k < instances; ++k) {
      if (only_instance >= 0 && k != only_instance) continue;
      float a = grad_value(step, k * n, p.name, gi);
      for (int r = k * n + 1; r < (k + 1) * n; ++r) a += grad_value(step, r, p.name, gi);
      total = k == 0 || only_instance >= 0 ? a : total + a;
    }
    g[e] = total;
  }
  return g;
}

/// Accumulates (+=, as a backward does) this rank's gradients of parameters [first, end).
inline void accumulate_grads(const ParamStore& P, size_t first, size_t end, int step, int rank, const Stream& st) {
  for (size_t i = first; i < end; ++i) {
    std::vector<float> g = testing::to_host(P.grad(i), st);
    const std::vector<float> add = local_grad(P, i, step, rank);
    for (size_t e = 0; e < g.size(); ++e) g[e] += add[e];
    testing::upload(P.grad(i), g, st);
  }
}

/// How the simulated backward reports gradients.
enum class Pattern {
  kInOrder,    // every layer, last to first, right after its gradients are produced
  kLateNever,  // final norm reported last, one layer in two calls, layer 1 never reported
  kNone,       // no hook calls at all (a model not wired to the hooks)
};

/// Produces this rank's gradients layer by layer in reverse order (as a backward) and reports
/// them to `hooks` according to `pattern`. Returns the parameters never reported.
inline std::vector<size_t> backward(const Model& m, const ParamStore& P, ParamGradHooks& hooks, Pattern pattern,
                                    int step, int rank, const Stream& st) {
  std::vector<size_t> never;
  const size_t L = m.layers.size();
  for (size_t k = L; k-- > 0;) {
    const LayerRange r = m.layers[k];
    accumulate_grads(P, r.first, r.end, step, rank, st);
    if (pattern == Pattern::kNone) continue;
    if (pattern == Pattern::kInOrder) {
      hooks.grads_ready(r.first, r.end, st);
      continue;
    }
    if (k == L - 1) continue;  // final layer: reported at the end
    if (k == 1) {
      for (size_t i = r.first; i < r.end; ++i) never.push_back(i);
      continue;
    }
    if (k == 2 && r.end - r.first >= 2) {  // two calls, the second half first
      const size_t mid = (r.first + r.end) / 2;
      hooks.grads_ready(mid, r.end, st);
      hooks.grads_ready(r.first, mid, st);
      continue;
    }
    hooks.grads_ready(r.first, r.end, st);
  }
  if (pattern == Pattern::kLateNever) hooks.grads_ready(m.layers[L - 1].first, m.layers[L - 1].end, st);
  if (pattern == Pattern::kNone)
    for (size_t i = 0; i < P.size(); ++i) never.push_back(i);
  return never;
}

/// Forwards to another communicator and counts the bucket collectives (more than one element)
/// it sees: reductions (all_reduce / reduce_scatter) and all-gathers. Communicators split from it
/// (GradSync takes its own with overlap) count into the same counters.
class CountingCommunicator final : public ForwardingCommunicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner, CountingCommunicator* root = nullptr)
      : ForwardingCommunicator(std::move(inner)), root_(root ? root : this) {}
  void all_reduce(const Tensor& t, ReduceOp op, const Stream& s) override {
    if (root_->drop_replica_all_reduce && name().size() > 9 && name().substr(name().size() - 9) == "-replicas")
      return;  // a negative control: GradSync's cross-instance all-reduce skipped
    if (t.numel() > 1) ++root_->reductions;
    inner().all_reduce(t, op, s);
  }
  void all_gather(const Tensor& out, const Tensor& in, const Stream& s) override {
    if (out.numel() > 1) ++root_->gathers;
    inner().all_gather(out, in, s);
  }
  void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, const Stream& s) override {
    if (in.numel() > 1) ++root_->reductions;
    inner().reduce_scatter(out, in, op, s);
  }
  int reductions = 0, gathers = 0;
  bool drop_replica_all_reduce = false;  // set on the root: all-reduces over "*-replicas" groups do nothing

 protected:
  std::shared_ptr<Communicator> wrap(std::shared_ptr<Communicator> split) override {
    return std::make_shared<CountingCommunicator>(std::move(split), root_);
  }

 private:
  CountingCommunicator* root_;
};

}  // namespace mt::ddp_test
