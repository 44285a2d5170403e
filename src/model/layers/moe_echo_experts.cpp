#include "model/layers/moe_echo_experts.h"

#include <algorithm>

#include "core/check.h"
#include "ops/elementwise.h"

namespace mt {
namespace {

// Every expert / buffer list: `n` entries of W contiguous tensors shaped like ref[w] (dtype `dt`,
// or ref's dtype when dt is null).
void check_lists(const std::vector<std::vector<Tensor>>& lists, size_t n, const std::vector<Tensor>& ref,
                 const DType* dt, const char* fn, const char* name) {
  MT_CHECK(lists.size() == n, "{}: {} has {} entries, expected {}", fn, name, lists.size(), n);
  for (size_t i = 0; i < n; ++i) {
    MT_CHECK(lists[i].size() == ref.size(), "{}: {}[{}] has {} tensors, expected {}", fn, name, i, lists[i].size(),
             ref.size());
    for (size_t w = 0; w < ref.size(); ++w) {
      const Tensor& t = lists[i][w];
      MT_CHECK(t.is_contiguous() && t.shape() == ref[w].shape() && t.dtype() == (dt ? *dt : ref[w].dtype()),
               "{}: {}[{}][{}] {} must be contiguous, shaped like {}{}", fn, name, i, w, t.str(), ref[w].str(),
               dt ? " in fp32" : "");
    }
  }
}

void check_group(const Communicator& g, const EchoPlacement& p, const char* fn) {
  p.validate();
  MT_CHECK(g.size() == p.ep, "{}: group {} has {} ranks but the placement {} EP ranks", fn, g.name(), g.size(), p.ep);
}

}  // namespace

void EchoPlacement::validate() const {
  MT_CHECK(ep >= 1 && num_experts >= 1 && num_experts % ep == 0 && num_echo >= 1 &&
               static_cast<int64_t>(clone_expert.size()) == ep * num_echo,
           "EchoPlacement: {} experts, {} EP ranks, {} echo slots per rank and {} slot entries do not fit", num_experts,
           ep, num_echo, clone_expert.size());
  for (int64_t s = 0; s < ep * num_echo; ++s) {
    const int64_t e = clone_expert[static_cast<size_t>(s)];
    if (e < 0) continue;
    MT_CHECK(e < num_experts, "EchoPlacement: slot {} clones expert {} of {}", s, e, num_experts);
    MT_CHECK(home_rank(s) != clone_rank(s), "EchoPlacement: slot {} on EP rank {} clones its own expert {}", s,
             clone_rank(s), e);
  }
}

EchoPlacement echo_placement_sync(const Tensor& clone_expert, int64_t num_experts, int64_t ep, const Stream& stream) {
  MT_CHECK(clone_expert.dtype() == DType::kI32 && clone_expert.ndim() == 1 && clone_expert.is_contiguous() && ep >= 1 &&
               clone_expert.numel() % ep == 0 && clone_expert.numel() >= ep,
           "echo_placement_sync: clone_expert must be a contiguous int32 [ep·S] tensor for {} EP ranks, got {}", ep,
           clone_expert.str());
  std::vector<int32_t> host(static_cast<size_t>(clone_expert.numel()));
  copy_bytes(host.data(), Device::cpu(), clone_expert.data(), clone_expert.device(), host.size() * 4, stream);
  stream.synchronize();
  EchoPlacement p{num_experts, ep, clone_expert.numel() / ep, std::vector<int64_t>(host.begin(), host.end())};
  p.validate();
  return p;
}

void echo_dispatch_weights(Communicator& g, const EchoPlacement& p, const std::vector<std::vector<Tensor>>& local,
                           const std::vector<std::vector<Tensor>>& clones, const Stream& stream) {
  const char* fn = "echo_dispatch_weights";
  check_group(g, p, fn);
  const auto L = static_cast<size_t>(p.local_experts()), S = static_cast<size_t>(p.num_echo);
  MT_CHECK(!local.empty() && !local[0].empty(), "{}: no local expert tensors", fn);
  check_lists(local, L, local[0], nullptr, fn, "local");
  check_lists(clones, S, local[0], nullptr, fn, "clones");
  const int64_t me = g.rank();
  g.group_start();
  for (int64_t s = 0; s < p.ep * p.num_echo; ++s) {
    if (!p.used(s)) continue;
    const int64_t home = p.home_rank(s), dest = p.clone_rank(s);
    const auto l = static_cast<size_t>(p.clone_expert[static_cast<size_t>(s)] % p.local_experts());
    for (size_t w = 0; w < local[0].size(); ++w) {
      if (me == home) g.send(local[l][w], static_cast<int>(dest), stream);
      if (me == dest) g.recv(clones[static_cast<size_t>(s) % S][w], static_cast<int>(home), stream);
    }
  }
  g.group_end();
}

void echo_return_gradients(Communicator& g, const EchoPlacement& p, const std::vector<std::vector<Tensor>>& clone_grads,
                           const std::vector<std::vector<Tensor>>& main_grads, const Tensor& scratch,
                           const Stream& stream) {
  const char* fn = "echo_return_gradients";
  check_group(g, p, fn);
  const auto L = static_cast<size_t>(p.local_experts()), S = static_cast<size_t>(p.num_echo);
  MT_CHECK(!main_grads.empty() && !main_grads[0].empty(), "{}: no main gradient tensors", fn);
  const DType f32 = DType::kF32;
  check_lists(main_grads, L, main_grads[0], &f32, fn, "main_grads");
  check_lists(clone_grads, S, main_grads[0], &f32, fn, "clone_grads");
  int64_t per_expert = 0;
  for (const Tensor& t : main_grads[0]) per_expert += t.numel();
  MT_CHECK(scratch.dtype() == f32 && scratch.is_contiguous() && scratch.numel() >= per_expert,
           "{}: scratch {} must be a contiguous fp32 tensor of at least {} elements (one expert)", fn, scratch.str(),
           per_expert);
  const int64_t cap = scratch.numel() / per_expert;  // experts received per round (same on every rank)
  const int64_t me = g.rank(), NS = p.ep * p.num_echo;
  std::vector<char> done(static_cast<size_t>(NS), 0);
  for (int64_t s = 0; s < NS; ++s) done[static_cast<size_t>(s)] = !p.used(s);
  // Rounds, identical on every rank: the pending slots in order, at most `cap` per home rank.
  while (std::find(done.begin(), done.end(), 0) != done.end()) {
    std::vector<int64_t> round, piece;  // slots of this round, and each one's scratch piece at its home
    std::vector<int64_t> taken(static_cast<size_t>(p.ep), 0);
    for (int64_t s = 0; s < NS; ++s) {
      if (done[static_cast<size_t>(s)] || taken[static_cast<size_t>(p.home_rank(s))] >= cap) continue;
      round.push_back(s);
      piece.push_back(taken[static_cast<size_t>(p.home_rank(s))]++);
      done[static_cast<size_t>(s)] = 1;
    }
    // The received gradients of slot i of the round, tensor w: a view of scratch.
    const auto part = [&](size_t i, size_t w) {
      int64_t off = piece[i] * per_expert;
      for (size_t v = 0; v < w; ++v) off += main_grads[0][v].numel();
      return scratch.flat_range(off, main_grads[0][w].numel()).view(main_grads[0][w].shape());
    };
    g.group_start();
    for (size_t i = 0; i < round.size(); ++i) {
      const int64_t s = round[i], home = p.home_rank(s), src = p.clone_rank(s);
      for (size_t w = 0; w < main_grads[0].size(); ++w) {
        if (me == src) g.send(clone_grads[static_cast<size_t>(s) % S][w], static_cast<int>(home), stream);
        if (me == home) g.recv(part(i, w), static_cast<int>(src), stream);
      }
    }
    g.group_end();
    for (size_t i = 0; i < round.size(); ++i) {  // += in slot order: deterministic
      const int64_t s = round[i];
      if (me != p.home_rank(s)) continue;
      const auto l = static_cast<size_t>(p.clone_expert[static_cast<size_t>(s)] % p.local_experts());
      for (size_t w = 0; w < main_grads[0].size(); ++w) add(main_grads[l][w], main_grads[l][w], part(i, w), stream);
    }
  }
}

}  // namespace mt
