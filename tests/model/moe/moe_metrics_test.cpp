// The MoE part of the training log line (model/moe/moe_metrics.h): the world sums of the ranks'
// statistics (thread ranks) and the formatted averages against hand-computed values.
#include <gtest/gtest.h>

#include <mutex>

#include "comm/thread_comm.h"
#include "model/moe/moe_metrics.h"

namespace mt {
namespace {

// 4 layers, MoE in layers 1 and 3, 4 experts, aux_loss and z-loss on.
TransformerConfig moe_config() {
  TransformerConfig c;
  c.num_layers = 4;
  c.num_moe_experts = 4;
  c.moe_layer_pattern = parse_moe_layer_freq("[0,1]*2", 4);
  c.moe_aux_loss_coeff = {0.1f};
  c.moe_z_loss_coeff = 0.01f;
  return c;
}

// Per layer: [aux, seq_aux, global_aux, z, counts of 4 experts].
std::vector<double> stats(double aux1, double z1, std::vector<double> c1, double aux3, double z3,
                          std::vector<double> c3) {
  std::vector<double> v(4 * 8, 0.0);
  v[8 + 0] = aux1;
  v[8 + 3] = z1;
  for (size_t e = 0; e < 4; ++e) v[8 + 4 + e] = c1[e];
  v[24 + 0] = aux3;
  v[24 + 3] = z3;
  for (size_t e = 0; e < 4; ++e) v[24 + 4 + e] = c3[e];
  return v;
}

TEST(MoeMetrics, FormatsTheAveragesOverLayersAndIterations) {
  TransformerConfig c = moe_config();
  MoeWorldStatistics s;
  // over 2 iterations: layer 1 aux 0.2, z 0.02, tokens 12/20/28/44; layer 3 aux 0.6, z 0.06, 24 each
  s.layers = stats(0.2, 0.02, {12, 20, 28, 44}, 0.6, 0.06, {24, 24, 24, 24});
  // per iteration: aux (0.1 + 0.3) / 2 layers = 0.2, z (0.01 + 0.03) / 2 = 0.02; tokens 6..22 and 12;
  // mean (52 + 48) / 8 = 12.5; imbalance of layer 1: 22·4 / 52 = 1.692
  EXPECT_EQ(format_moe_statistics(c, s, 2, 1, 1),
            " load_balancing_loss: 2.000000E-01 | z_loss: 2.000000E-02 | tokens per expert min/max/mean: 6/22/12.5 | "
            "expert imbalance: 1.692 |");
  // counted over TP × CP = 2: half the tokens (the mean 6.25 prints as 6.2: round half to even); per
  // layer with --moe-per-layer-logging
  c.moe_per_layer_logging = true;
  EXPECT_EQ(format_moe_statistics(c, s, 2, 2, 1),
            " load_balancing_loss: 2.000000E-01 | z_loss: 2.000000E-02 | tokens per expert min/max/mean: 3/11/6.2 | "
            "expert imbalance: 1.692 | load_balancing_loss layer 1: 1.000000E-01 | z_loss layer 1: 1.000000E-02 | "
            "expert imbalance layer 1: 1.692 | load_balancing_loss layer 3: 3.000000E-01 | z_loss layer 3: "
            "3.000000E-02 | expert imbalance layer 3: 1.000 |");
  // the alltoall dispatcher: the largest receive, ECHO's reroutes per layer and iteration counted
  // once per EP member; with static receive blocks the overflow instead
  c.moe_per_layer_logging = false;
  c.moe_token_dispatcher_type = MoeDispatcher::kAllToAll;
  c.moe_enable_echo = true;
  s.max_received = 77;
  s.rerouted = 24;  // / ep 2 / 2 iterations / 2 layers = 3
  s.overflowed = 5;
  const std::string base = format_moe_statistics(c, s, 2, 1, 2);
  EXPECT_NE(base.find(" max tokens received per EP rank: 77 | ECHO rerouted tokens per layer: 3.0 |"),
            std::string::npos)
      << base;
  c.moe_received_token_capacity = 100;
  const std::string fixed = format_moe_statistics(c, s, 2, 1, 2);
  EXPECT_NE(fixed.find(" tokens overflowed at the received capacity: 2.5 |"), std::string::npos) << fixed;
  EXPECT_EQ(fixed.find("ECHO"), std::string::npos) << fixed;
  s.echo_bytes = 3 << 20;  // ECHO's used-slot transfers: MiB per iteration over the world
  const std::string peers = format_moe_statistics(c, s, 2, 1, 2);
  EXPECT_NE(peers.find(" ECHO clone MiB sent per iteration: 1.500 |"), std::string::npos) << peers;
  s.echo_bytes = 0;
  // a type that is off is not named; Megatron's names of the others
  c = moe_config();
  c.moe_router_load_balancing_type = {MoeLoadBalancing::kSeqAuxLoss, MoeLoadBalancing::kGlobalAuxLoss};
  c.moe_aux_loss_coeff = {0.f, 0.1f};
  c.moe_z_loss_coeff = 0;
  s.layers[8 + 2] = 0.4;
  const std::string global = format_moe_statistics(c, s, 2, 1, 1);
  EXPECT_EQ(global.rfind(" global_load_balancing_loss: 1.000000E-01 | tokens per expert", 0), 0u) << global;
}

// The ranks' values (rounded to fp32) summed in rank order; the alltoall counts gathered (sum,
// max, sum) on every rank alike.
TEST(MoeMetrics, GathersTheWorldSums) {
  TransformerConfig c = moe_config();
  c.moe_token_dispatcher_type = MoeDispatcher::kAllToAll;
  std::vector<MoeWorldStatistics> got(3);
  std::mutex mu;
  run_thread_ranks(3, [&](int rank, std::shared_ptr<Communicator> world) {
    Stream st(Device::cpu());
    const double r = rank + 1;
    const std::vector<double> local = stats(0.1 * r, 0.01, {r, 2 * r, 0, 1}, 1.0 / 3.0, 0, {1, 1, 1, 1});
    MoeDispatchStats d;
    d.rerouted = rank;
    d.max_received = 10 * (rank == 1 ? 5 : 1);
    d.overflowed = 2;
    d.echo_bytes = 100 * rank;
    const MoeWorldStatistics s = gather_moe_statistics(c, local, d, *world, st);
    std::lock_guard<std::mutex> lock(mu);
    got[static_cast<size_t>(rank)] = s;
  });
  const double third = static_cast<double>(1.0f / 3.0f);
  for (const MoeWorldStatistics& s : got) {
    ASSERT_EQ(s.layers.size(), 32u);
    EXPECT_EQ(s.layers[8], static_cast<double>(0.1f) + static_cast<double>(0.2f) + static_cast<double>(0.3f));
    EXPECT_EQ(s.layers[8 + 4], 6.0);
    EXPECT_EQ(s.layers[8 + 5], 12.0);
    EXPECT_EQ(s.layers[24], third + third + third);
    EXPECT_EQ(s.layers[0], 0.0);  // dense layer
    EXPECT_EQ(s.rerouted, 3);
    EXPECT_EQ(s.max_received, 50);
    EXPECT_EQ(s.overflowed, 6);
    EXPECT_EQ(s.echo_bytes, 300);
  }
}

}  // namespace
}  // namespace mt
