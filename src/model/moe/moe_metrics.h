// The MoE part of the training log line (Megatron-Core's track_moe_metrics,
// megatron/core/transformer/moe/moe_utils.py): the load-balancing losses of each type that is on
// (under Megatron's names load_balancing_loss, seq_load_balancing_loss,
// global_load_balancing_loss) and the z-loss, averaged over the MoE layers and the iterations since
// the last log line; the tokens routed per expert and iteration (min / max / mean over the experts
// of every MoE layer) and the worst layer's imbalance (max / mean over its experts); the alltoall
// dispatcher's counts (largest receive, received-capacity overflow, ECHO reroutes); per layer with
// --moe-per-layer-logging. GPTModel::log_statistics gathers this rank's statistics and formats them
// here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/moe/token_dispatcher.h"
#include "model/transformer_config.h"

namespace mt {

/// The MoE statistics of the world since the last log line.
struct MoeWorldStatistics {
  /// Per global layer l the P = kMoeStatLosses + E values at [l·P, (l + 1)·P) (the layout of
  /// GPTModel::moe_loss_stats), summed over every rank of the world in rank order (each rank's
  /// values rounded to fp32 first).
  std::vector<double> layers;
  /// alltoall dispatcher only (zeros otherwise): ECHO reroutes and received-capacity overflows
  /// summed over the world, the largest receive of any rank.
  int64_t rerouted = 0, max_received = 0, overflowed = 0;
  /// ECHO's used-slot transfers: the bytes of clone weights and gradients written, over the world.
  int64_t echo_bytes = 0;
};

/// Sums this rank's statistics (`local`: GPTModel::moe_loss_stats; `dispatch`: its dispatchers')
/// over `world`. Collective over `world` (host all-gathers; synchronises `stream`): every rank
/// calls it with the same config.
MoeWorldStatistics gather_moe_statistics(const TransformerConfig& cfg, const std::vector<double>& local,
                                         const MoeDispatchStats& dispatch, Communicator& world,
                                         const Stream& stream);

/// The log-line fragment (" load_balancing_loss: 1.234567E-02 | ... |") of `stats` over
/// `iterations` iterations. tp_cp: the TP × CP size (the token counts are counted once per rank of
/// that group); ep: the expert-model-parallel size (ECHO's reroutes are counted once per EP member).
/// Per layer too when cfg.moe_per_layer_logging. Pure (no communication).
std::string format_moe_statistics(const TransformerConfig& cfg, const MoeWorldStatistics& stats, int64_t iterations,
                                  int tp_cp, int ep);

}  // namespace mt
