#include "model/moe/moe_metrics.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>

namespace mt {

MoeWorldStatistics gather_moe_statistics(const TransformerConfig& cfg, const std::vector<double>& local,
                                         const MoeDispatchStats& dispatch, Communicator& world,
                                         const Stream& stream) {
  MoeWorldStatistics out;
  const size_t bytes = local.size() * sizeof(float);
  const std::vector<float> mine(local.begin(), local.end());
  const std::vector<char> all = all_gather_host(world, mine.data(), bytes, stream);
  out.layers.assign(local.size(), 0.0);  // summed over the ranks in rank order
  for (int r = 0; r < world.size(); ++r) {
    const float* row = reinterpret_cast<const float*>(all.data() + static_cast<size_t>(r) * bytes);
    for (size_t i = 0; i < out.layers.size(); ++i) out.layers[i] += row[i];
  }
  if (cfg.moe_token_dispatcher_type != MoeDispatcher::kAllToAll) return out;
  // The alltoall dispatcher's counts are known on every rank of an EP group alike: the largest
  // receive over the world; ECHO's rerouted slots summed over the world count each EP group's total
  // once per member.
  const int64_t v[4] = {dispatch.rerouted, dispatch.max_received, dispatch.overflowed, dispatch.echo_bytes};
  const std::vector<char> d = all_gather_host(world, v, sizeof(v), stream);
  for (int r = 0; r < world.size(); ++r) {
    const int64_t* row = reinterpret_cast<const int64_t*>(d.data() + static_cast<size_t>(r) * sizeof(v));
    out.rerouted += row[0];
    out.max_received = std::max(out.max_received, row[1]);
    out.overflowed += row[2];
    out.echo_bytes += row[3];
  }
  return out;
}

std::string format_moe_statistics(const TransformerConfig& cfg, const MoeWorldStatistics& stats, int64_t iterations,
                                  int tp_cp, int ep) {
  const bool z = cfg.moe_z_loss_coeff > 0;
  std::vector<MoeLoadBalancing> lb_types;  // the types on, in the order given
  for (MoeLoadBalancing t : cfg.moe_router_load_balancing_type)
    if (cfg.moe_aux_loss_on(t)) lb_types.push_back(t);
  const int64_t E = cfg.num_moe_experts;
  const size_t per = static_cast<size_t>(kMoeStatLosses + E);
  double lb[kMoeStatZLoss] = {}, zl = 0, lo = std::numeric_limits<double>::infinity(), hi = 0, sum = 0, worst = 0;
  std::string layers;
  const double n = static_cast<double>(std::max<int64_t>(iterations, 1));
  int64_t moe_layers = 0;  // the decoder's and the MTP layers' (Megatron tracks both)
  for (int64_t l = 0; l < cfg.num_layers_with_mtp(); ++l) {
    if (!cfg.is_moe_layer(l)) continue;
    ++moe_layers;
    const double* v = stats.layers.data() + per * static_cast<size_t>(l);
    const double b = v[kMoeStatZLoss] / n;
    for (MoeLoadBalancing t : lb_types) lb[static_cast<int>(t)] += v[static_cast<int>(t)] / n;
    zl += b;
    double lmax = 0, lsum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double c = v[kMoeStatLosses + e] / tp_cp / n;  // tokens per iteration (each counted over TP × CP)
      lo = std::min(lo, c);
      lmax = std::max(lmax, c);
      lsum += c;
    }
    hi = std::max(hi, lmax);
    sum += lsum;
    const double imbalance = lsum > 0 ? lmax * static_cast<double>(E) / lsum : 0.0;
    worst = std::max(worst, imbalance);
    if (cfg.moe_per_layer_logging) {
      for (MoeLoadBalancing t : lb_types)
        layers += fmt::format(" {} layer {}: {:.6E} |", moe_load_balancing_loss_name(t), l, v[static_cast<int>(t)] / n);
      if (z) layers += fmt::format(" z_loss layer {}: {:.6E} |", l, b);
      layers += fmt::format(" expert imbalance layer {}: {:.3f} |", l, imbalance);
    }
  }
  const double L = static_cast<double>(std::max<int64_t>(moe_layers, 1));
  std::string out;
  for (MoeLoadBalancing t : lb_types)
    out += fmt::format(" {}: {:.6E} |", moe_load_balancing_loss_name(t), lb[static_cast<int>(t)] / L);
  if (z) out += fmt::format(" z_loss: {:.6E} |", zl / L);
  if (sum > 0)
    out += fmt::format(" tokens per expert min/max/mean: {:.0f}/{:.0f}/{:.1f} | expert imbalance: {:.3f} |", lo, hi,
                       sum / (L * static_cast<double>(E)), worst);
  if (cfg.moe_token_dispatcher_type == MoeDispatcher::kAllToAll) {
    if (cfg.moe_received_token_capacity > 0) {  // the static receive blocks: counted drops, per iteration
      out += fmt::format(" tokens overflowed at the received capacity: {:.1f} |",
                         static_cast<double>(stats.overflowed) / n);
    } else {
      out += fmt::format(" max tokens received per EP rank: {} |", stats.max_received);
    }
    if (cfg.moe_enable_echo && cfg.moe_received_token_capacity == 0)  // counted from the host counts only
      out += fmt::format(" ECHO rerouted tokens per layer: {:.1f} |",
                         static_cast<double>(stats.rerouted) / std::max(ep, 1) / n / L);
    if (stats.echo_bytes > 0)  // the used-slot transfers (EchoPeers): weights and gradients, all ranks
      out += fmt::format(" ECHO clone MiB sent per iteration: {:.3f} |",
                         static_cast<double>(stats.echo_bytes) / (1 << 20) / n);
  }
  return out + layers;
}

}  // namespace mt
