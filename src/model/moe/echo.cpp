#include "model/moe/echo.h"

#include <algorithm>
#include <atomic>

#include "core/check.h"
#include "core/logging.h"
#include "model/moe/experts.h"
#include "model/moe/moe_utils.h"
#include "ops/elementwise.h"
#include "ops/moe.h"
#include "ops/moe_echo.h"
#include "ops/moe_echo_exchange.h"

namespace mt {
// ---------------------------------------------------------------------------------------------
// EchoRouter
// ---------------------------------------------------------------------------------------------

EchoRouter::EchoRouter(const ExpertParallel& ep, int64_t num_experts, int64_t num_echo)
    : ep_(ep), E_(num_experts), S_(num_echo), P_(group_size(ep.ep_group)), Q_(group_size(ep.etp_group)) {}

void EchoRouter::plan(BufferPlanner& p, int64_t slots) {
  const int64_t NS = P_ * S_;
  row_index_ = p.scratch("moe.echo.row_index", DType::kI32, {slots});  // the histogram's by-products
  slot_row_ = p.scratch("moe.echo.slot_row", DType::kI32, {slots});
  counts_ = p.scratch("moe.echo.counts", DType::kI32, {E_});
  counts_ep_ = p.scratch("moe.echo.counts_ep", DType::kI32, {P_, E_});
  if (Q_ > 1) counts_grid_ = p.scratch("moe.echo.counts_grid", DType::kI32, {Q_ * P_, E_});
  clone_quota_ = p.scratch("moe.echo.clone_quota", DType::kI32, {NS});
  quota_ = p.scratch("moe.echo.quota", DType::kI32, {Q_ * P_, NS});
  rerouted_ = p.scratch("moe.echo.rerouted", DType::kI32, {slots});
}

void EchoRouter::reroute(const Tensor& top_v, const Tensor& clone_expert, const Tensor& top, const Stream& st) const {
  // int32 histogram over the home experts
  moe_routing_map_device(row_index_, slot_row_, counts_, top, 0, E_, st);
  if (P_ > 1) {
    ep_.ep_group->all_gather(counts_ep_, counts_, st);
  } else {
    copy(counts_ep_.view({E_}), counts_, st);
  }
  Tensor counts = counts_ep_;  // [Q·P, E]: every source of the grid
  if (Q_ > 1) {
    ep_.etp_group->all_gather(counts_grid_, counts_ep_, st);
    counts = counts_grid_;
  }
  moe_echo_plan(clone_expert, clone_quota_, quota_, counts, P_, S_, st);
  const int64_t i = ep_.etp_group ? ep_.etp_group->rank() : 0, j = ep_.ep_group ? ep_.ep_group->rank() : 0;
  const int64_t r = i * P_ + j;  // this rank's source row
  const Tensor rerouted = rerouted_.view(top.shape());
  moe_echo_reroute(rerouted, top, clone_expert, quota_.slice0(r, r + 1).view({P_ * S_}), E_, st);
  moe_echo_virtual_experts(top_v, rerouted, E_, P_, S_, st);
}

// ---------------------------------------------------------------------------------------------
// EchoClones
// ---------------------------------------------------------------------------------------------

EchoClones::EchoClones(const ExpertParallel& ep, int64_t num_local, int64_t num_echo, bool device_exchange)
    : ep_(ep), num_local_(num_local), num_echo_(num_echo), device_exchange_(device_exchange) {}

void EchoClones::plan(BufferPlanner& p, int64_t f1, int64_t f2, int64_t h) {
  const DType t = p.act_dtype();
  const int64_t S = num_echo_;
  sizes_ = EchoPeers::Sizes{S, f1, h, h, f2, t};
  device_ = p.device();
  if (device_exchange_ && ep_.ep_group) {
    std::string why;
    use_peers_ = EchoPeers::available(ep_, p.device(), &why);  // the same answer on every EP rank
    static std::atomic<bool> logged{false};  // once per process (the models of a run plan alike)
    if (ep_.ep_rank == 0 && ep_.etp_rank == 0 && !logged.exchange(true)) {
      if (use_peers_) {
        log_info("> ECHO: clone weights and gradients written straight into the EP ranks' memory, used slots only");
      } else {
        log_info("> ECHO: clone weights and gradients through fixed all-to-alls of {} expert blocks: {}",
                 ep_.ep_size * S, why);
      }
    }
  }
  if (!use_peers_) {  // with the used-slot transfers the clones' weights live in EchoPeers' buffer
    w1_ = p.scratch("moe.echo.w1", t, {S, f1, h});
    w2_ = p.scratch("moe.echo.w2", t, {S, h, f2});
  }
  g1_ = p.scratch("moe.echo.g1", DType::kF32, {S, f1, h});
  g2_ = p.scratch("moe.echo.g2", DType::kF32, {S, h, f2});
  ret_ = p.scratch("moe.echo.ret", DType::kF32, {f1 * h + h * f2});
  if (!device_exchange_) return;
  const int64_t NS = static_cast<int64_t>(ep_.ep_size) * S;
  const Tensor idx = p.scratch("moe.echo.x.index", DType::kI32, {3 * NS + S});
  x_.w_send = idx.slice0(0, NS);
  x_.g_send = idx.slice0(NS, 2 * NS);
  x_.g_acc = idx.slice0(2 * NS, 3 * NS);
  x_.w_recv = idx.slice0(3 * NS, 3 * NS + S);
  if (use_peers_) return;
  x_.send1 = p.scratch("moe.echo.x.send1", t, {NS, f1, h});
  x_.recv1 = p.scratch("moe.echo.x.recv1", t, {NS, f1, h});
  x_.send2 = p.scratch("moe.echo.x.send2", t, {NS, h, f2});
  x_.recv2 = p.scratch("moe.echo.x.recv2", t, {NS, h, f2});
  x_.gsend1 = p.scratch("moe.echo.x.gsend1", DType::kF32, {NS, f1, h});
  x_.grecv1 = p.scratch("moe.echo.x.grecv1", DType::kF32, {NS, f1, h});
  x_.gsend2 = p.scratch("moe.echo.x.gsend2", DType::kF32, {NS, h, f2});
  x_.grecv2 = p.scratch("moe.echo.x.grecv2", DType::kF32, {NS, h, f2});
}

void EchoClones::ensure_peers() {
  if (peers_) return;
  MoeShared& shared = *ep_.shared;
  if (!shared.echo_peers) shared.echo_peers = EchoPeers::create(ep_, device_, sizes_);  // collective over EP
  MT_CHECK(shared.echo_peers->sizes() == sizes_,
           "ECHO: the MoE layers' expert shapes differ ({} slots of [{}, {}] / [{}, {}] against [{}, {}] / [{}, {}])",
           sizes_.num_echo, sizes_.n1, sizes_.k1, sizes_.n2, sizes_.k2, shared.echo_peers->sizes().n1,
           shared.echo_peers->sizes().k1, shared.echo_peers->sizes().n2, shared.echo_peers->sizes().k2);
  peers_ = shared.echo_peers;
  w1_ = peers_->clone_w1();  // the clones compute with the weights their home ranks write here
  w2_ = peers_->clone_w2();
}

void EchoClones::fetch_weights(const MoeTokenDispatcher& d, int slot, MoeExperts& experts, const Stream& st) {
  if (const Tensor ce = d.echo_clone_expert(slot); !ce.empty()) {
    if (use_peers_) ensure_peers();  // before the experts' tables take the clones' addresses
    // capturable: the indices from the plan on the device; then the used-slot transfers, or
    // fixed-size all-to-alls of P·S expert blocks packed and unpacked on the device
    const ExpertTables& t = experts.tables(st);
    moe_echo_exchange_index(x_.w_send, x_.w_recv, x_.g_send, x_.g_acc, ce, ep_.ep_rank, num_local_, num_echo_, st);
    if (peers_) {  // the used slots only, straight into the clone ranks' buffers (w1_ / w2_ there)
      peers_->put_weights(t.w1, t.w2, x_.w_send, st);  // (its indices name local experts only)
      return;
    }
    moe_echo_gather_experts(x_.send1, t.w1, x_.w_send, st);
    moe_echo_gather_experts(x_.send2, t.w2, x_.w_send, st);
    ep_.ep_group->all_to_all(x_.recv1, x_.send1, st);
    ep_.ep_group->all_to_all(x_.recv2, x_.send2, st);
    moe_echo_gather_blocks(w1_, x_.recv1, x_.w_recv, st);
    moe_echo_gather_blocks(w2_, x_.recv2, x_.w_recv, st);
    return;
  }
  const EchoPlacement* placement = d.echo_placement(slot);
  if (!placement) return;
  std::vector<std::vector<Tensor>> local, clones;
  for (int64_t e = 0; e < experts.num_slots(); ++e) {
    const ExpertSlot ex = experts.expert(e);
    (e < num_local_ ? local : clones).push_back({ex.w1, ex.w2});
  }
  echo_dispatch_weights(*ep_.ep_group, *placement, local, clones, st);
}

void EchoClones::zero_grads(const Stream& st) {
  fill(g1_, 0.f, st);
  fill(g2_, 0.f, st);
}

void EchoClones::return_grads(const MoeTokenDispatcher& d, int slot, MoeExperts& experts, const Stream& st) {
  if (const Tensor ce = d.echo_clone_expert(slot); !ce.empty()) {
    // the indices of fetch_weights (this backward's refetch computed them for this slot)
    const ExpertTables& t = experts.tables(st);
    Tensor recv1 = x_.grecv1, recv2 = x_.grecv2;
    if (peers_) {  // the used clones' gradients only, straight into their home ranks' buffers
      peers_->put_grads(g1_, g2_, x_.g_send, st);
      recv1 = peers_->grads_in1();
      recv2 = peers_->grads_in2();
    } else {
      moe_echo_gather_blocks(x_.gsend1, g1_, x_.g_send, st);
      moe_echo_gather_blocks(x_.gsend2, g2_, x_.g_send, st);
      ep_.ep_group->all_to_all(x_.grecv1, x_.gsend1, st);
      ep_.ep_group->all_to_all(x_.grecv2, x_.gsend2, st);
    }
    moe_echo_accumulate_experts(t.g1, recv1, x_.g_acc, st);  // slots in order: deterministic
    moe_echo_accumulate_experts(t.g2, recv2, x_.g_acc, st);
    return;
  }
  const EchoPlacement* placement = d.echo_placement(slot);
  if (!placement) return;
  std::vector<std::vector<Tensor>> main, clones;
  for (int64_t e = 0; e < experts.num_slots(); ++e) {
    const ExpertSlot ex = experts.expert(e);
    (e < num_local_ ? main : clones).push_back({ex.g1, ex.g2});
  }
  echo_return_gradients(*ep_.ep_group, *placement, clones, main, ret_, st);
}

// ---------------------------------------------------------------------------------------------
// Host-placement transfers
// ---------------------------------------------------------------------------------------------

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
