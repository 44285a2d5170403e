// The routed experts of the MoE layer (Megatron-Core transformer/moe/experts.py): E_l = E/ep local
// experts per EP rank, each an MLP linear_fc1 -> GELU or SwiGLU -> linear_fc2 split over the expert
// TP group like the dense MLP, run on the rows the token dispatcher brought here, ordered by local
// expert slot (rows [0, R) of the expert-input buffer [R_max, h]; R_max the dispatcher's planned
// worst case). With ECHO the slots E_l .. E_l + S − 1 are clones of other ranks' hot experts
// (EchoClones, model/moe/echo.h), which compute with their home experts' weights.
//
//   SequentialMLP (Megatron's SequentialMLP; the default): one linear_forward / linear_backward per
//     expert over its rows, whose counts the dispatcher read on the host.
//   GroupedMLP (--moe-grouped-gemm; Megatron's GroupedMLP / TEGroupedMLP, TE's GroupedLinear
//     without its tokens_per_expert.cpu() split): the counts stay on the device and each projection
//     is one grouped GEMM over all R_max planned rows (ops/grouped_matmul.h), the experts' weights
//     and main gradients passed as address tables: no host synchronisation (CUDA-graph
//     capturable). Rows [R, R_max) beyond the routed ones: the expert input's are stale (never
//     read: the GEMMs stop at each group's rows), the grouped forward and dgrad write zeros to
//     their outputs' tail, so the activation (GELU / SwiGLU and their backward, run over all R_max
//     rows) sees zeros there and gives zeros (no NaN can arise from stale data), the weight
//     gradients sum over each group's rows only, and the combine (forward and backward) and the
//     dispatch backward address rows through slot_row, which never points past R.
//
// Saved per area: the expert inputs, fc1 outputs, activations (scratch with --recompute-modules
// moe_act: recomputed in the backward) and outputs, [R_max, ·] each. With FP8 (--fp8-format) each
// expert projection has an Fp8Linear (model/fp8/fp8_linear.h: its scaling state and FP8 weight
// copies); SequentialMLP runs it over the expert's ragged row range (padded to 16 rows inside),
// GroupedMLP runs all experts' projections as grouped FP8 GEMMs with per-expert scales
// (model/moe/grouped_fp8_experts.h), the same numerics. Weight gradients accumulate
// (+=) into the fp32 main gradients; the clones' into their scratch, returned to the home experts.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/fp8/fp8_linear.h"
#include "model/moe/echo.h"
#include "model/moe/grouped_fp8_experts.h"
#include "model/moe/token_dispatcher.h"
#include "ops/grouped_matmul.h"

namespace mt {

/// One expert slot's weights (model dtype) and fp32 main gradients: linear_fc1 [(2)f_l, h] and
/// linear_fc2 [h, f_l] (this ETP rank's shards, f_l = f_e/etp).
struct ExpertSlot {
  Tensor w1, w2, g1, g2;
};

/// The expert slots' tensors as address tables on the device (GroupedWeights): all E_l + S slots,
/// or the slots of one chunk.
struct ExpertTables {
  GroupedWeights w1, w2, g1, g2;
};

/// A run of expert slots [first, last) and their rows [row_begin, row_begin + rows) of the expert
/// buffers: one chunk of --overlap-moe-expert-parallel-comm's pipeline, or every slot.
struct ExpertRange {
  int64_t first = 0, last = 0, row_begin = 0, rows = 0;
};

class MoeExperts {
 public:
  /// prefix "decoder.layers.<layer>.mlp.": declares, for each local expert i (global index
  /// ep_rank·E_l + i), "experts.local_experts.<global>.linear_fc1.weight" [(2)f_e/etp, h] and
  /// ".linear_fc2.weight" [h, f_e/etp], sharded over the expert TP group like the dense MLP's (init
  /// σ and σ/√(2L)) and flagged expert (reduced over EDP). num_echo: ECHO's clone slots S (0: off).
  MoeExperts(const TransformerConfig& config, const std::string& prefix, const ExpertParallel& ep, int64_t num_echo,
             ParamRegistry& registry);
  virtual ~MoeExperts() = default;
  MoeExperts(const MoeExperts&) = delete;
  MoeExperts& operator=(const MoeExperts&) = delete;

  /// Plans the open area's saved tensors and the scratch for up to `max_rows` = R_max rows.
  /// save_output: whether the output rows (output()) are kept until the backward (the dispatcher's
  /// combine_backward reads them); else they are scratch, valid until the layer's forward ends (the
  /// combine's read).
  void plan(BufferPlanner& planner, int64_t max_rows, bool save_output = true);
  /// The expert-input rows xp [R_max, h] of area `slot`, which the dispatcher's dispatch() fills.
  Tensor input(int slot) const { return saved_.at(static_cast<size_t>(slot)).xp; }
  /// Runs the experts on the rows of `counts` (from dispatch(); with ECHO the clones' weights are
  /// fetched first, by the dispatcher's placement of `slot`). Returns the output rows the
  /// combine reads (output(slot)). Collective over the EP group with ECHO.
  Tensor forward(MoeExpertCounts counts, const MoeTokenDispatcher& dispatcher, int slot, const Stream& stream);
  /// forward() in parts, for the chunked pipeline (--overlap-moe-expert-parallel-comm, host
  /// counts): begin_forward() takes the counts and fetches the clones' weights (collective over
  /// the EP group with ECHO), then forward_range() runs the slots of one chunk on their rows; the
  /// chunks together compute what forward() does, bitwise (every slot's GEMMs see the same rows).
  void begin_forward(MoeExpertCounts counts, const MoeTokenDispatcher& dispatcher, int slot, const Stream& stream);
  void forward_range(int slot, const ExpertRange& range, const Stream& stream);
  /// The forward's output rows [R, h] (SequentialMLP) or [R_max, h] (GroupedMLP).
  Tensor output(int slot) const;
  /// Before the combine backward: with ECHO the clones' weights fetched again and their gradients
  /// zeroed (the clone buffers are scratch). Collective over the EP group with ECHO.
  void prepare_backward(const MoeTokenDispatcher& dispatcher, int slot, const Stream& stream);
  /// Where the combine backward writes the output rows' gradients (rows as output()).
  Tensor output_grad(int slot) const;
  /// Where the backward writes the input rows' gradients (rows as output()), which the dispatch
  /// backward reads.
  Tensor input_grad(int slot) const;
  /// The experts' backward from output_grad(): the weight gradients (+=; the clones' returned to
  /// their home experts), and returns the input rows' gradients (rows as output()), which the
  /// dispatch backward reads.
  Tensor backward(const MoeTokenDispatcher& dispatcher, int slot, const Stream& stream);
  /// backward() in parts (the chunked pipeline): backward_range() computes the input gradients of
  /// one chunk's rows and, with `wgrad`, its slots' weight gradients; wgrad_range() the weight
  /// gradients alone (--delay-wgrad-compute: after every chunk's input gradients, their inputs
  /// untouched meanwhile); finish_backward() returns the clones' gradients (collective over the
  /// EP group with ECHO) and the input rows' gradients.
  void backward_range(int slot, const ExpertRange& range, bool wgrad, const Stream& stream);
  void wgrad_range(int slot, const ExpertRange& range, const Stream& stream);
  Tensor finish_backward(const MoeTokenDispatcher& dispatcher, int slot, const Stream& stream);

  /// Expert slot e < E_l + S: a local expert, or ECHO clone slot e − E_l (valid after a fetch).
  ExpertSlot expert(int64_t e) const;
  int64_t num_local() const { return num_local_; }
  int64_t num_slots() const { return num_local_ + num_echo_; }
  /// The address tables of all slots, built on first use (the ParamStore's and the scratch's
  /// addresses are fixed once planned).
  const ExpertTables& tables(const Stream& stream);
  /// The tables of slots [first, last) (all of them: tables()), built on first use.
  const ExpertTables& tables(int64_t first, int64_t last, const Stream& stream);

 protected:
  struct Saved {
    Tensor xp, pre, act, out;          // [R_max, h], [R_max, (2)f_l], [R_max, f_l], [R_max, h]
    std::vector<int64_t> counts_host;  // the forward's rows per expert slot (from the dispatcher)
    int slot = 0;                      // the area (the FP8 linears' saved scales)
    Tensor counts;                     // the same, int32 [E_l + S] on the device
    int64_t rows = 0;                  // the rows the experts compute and the combine reads
  };
  // The rows of a dispatch the experts compute: Σ of the host counts, or all R_max planned rows.
  virtual int64_t rows_of(const Saved& sv) const = 0;
  // The forward, backward (input gradients; weight gradients with `wgrad`) and weight gradients of
  // the slots of `r` on their rows.
  virtual void compute_forward(Saved& sv, const ExpertRange& r, const Stream& st) = 0;
  virtual void compute_backward(Saved& sv, const ExpertRange& r, bool wgrad, const Stream& st) = 0;
  virtual void compute_wgrad(Saved& sv, const ExpertRange& r, const Stream& st) = 0;
  // Every slot and the rows a dispatch computes.
  ExpertRange all(const Saved& sv) const { return {0, num_slots(), 0, sv.rows}; }

  /// Local expert e's FP8 projection (fc 1 or 2), or nullptr when the layer runs bf16.
  Fp8Linear* fp8(int64_t e, int fc) const;
  /// Plans the FP8 projections' buffers in the open area (plan()): each expert's Fp8Linear for
  /// up to max_rows rows (SequentialMLP; GroupedMLP overrides it).
  virtual void plan_fp8(BufferPlanner& planner, int64_t max_rows);

  bool gated_;
  bool recompute_act_;  // --recompute-modules moe_act: sv.act is scratch, recomputed in the backward
  int64_t max_rows_ = 0;
  Tensor d_out_, d_act_, d_pre_, d_xp_;  // scratch [R_max, ·]
  const Fp8Model* fp8_model_ = nullptr;  // with FP8 experts
  Communicator* etp_ = nullptr;          // the expert TP group

 private:
  struct Expert {
    ParamRef fc1, fc2;  // [(2)f_l, h], [h, f_l]
    std::unique_ptr<Fp8Linear> fp8_fc1, fp8_fc2;  // FP8 (nullptr: bf16)
  };
  int64_t hidden_, num_local_, num_echo_, local_ffn_;
  std::vector<Expert> experts_;
  std::unique_ptr<EchoClones> clones_;  // with ECHO
  std::unique_ptr<ExpertTables> tables_;
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<ExpertTables>> range_tables_;  // (first, last)
  std::vector<Saved> saved_;  // per area
  // Asks the ParamStore for every local expert's parameters (and with `grads` their gradients)
  // when they are staged (--data-parallel-sharding-strategy optim_grads / optim_grads_params):
  // an mt::Error when the layer's expert buckets are not gathered, and the gradients bind the
  // layer's expert gradient slot (an mt::Error when another MoE layer holds it). The grouped GEMMs
  // and ECHO read the cached tables(), whose addresses the store keeps fixed (docs/fsdp.md
  // "Expert buckets"), and would otherwise never ask.
  void claim(bool grads) const;
};

/// Megatron's SequentialMLP: one GEMM per expert slot and projection over its host row range.
class SequentialMLP final : public MoeExperts {
 public:
  using MoeExperts::MoeExperts;

 private:
  int64_t rows_of(const Saved& sv) const override;
  void compute_forward(Saved& sv, const ExpertRange& r, const Stream& st) override;
  void compute_backward(Saved& sv, const ExpertRange& r, bool wgrad, const Stream& st) override;
  void compute_wgrad(Saved& sv, const ExpertRange& r, const Stream& st) override;
  template <typename Fn>
  void for_each_expert(const Saved& sv, const ExpertRange& r, Fn&& fn) const;
};

/// Megatron's GroupedMLP / TEGroupedMLP (--moe-grouped-gemm): one grouped GEMM per projection over
/// all R_max rows with the device counts; with FP8 the grouped FP8 GEMMs (GroupedFp8Experts, every
/// slot at once: --overlap-moe-expert-parallel-comm's chunks are refused with FP8 here).
class GroupedMLP final : public MoeExperts {
 public:
  using MoeExperts::MoeExperts;

 private:
  int64_t rows_of(const Saved&) const override { return max_rows_; }
  void plan_fp8(BufferPlanner& planner, int64_t max_rows) override;
  void compute_forward(Saved& sv, const ExpertRange& r, const Stream& st) override;
  void compute_backward(Saved& sv, const ExpertRange& r, bool wgrad, const Stream& st) override;
  void compute_wgrad(Saved& sv, const ExpertRange& r, const Stream& st) override;
  void check_fp8_range(const Saved& sv, const ExpertRange& r) const;
  std::unique_ptr<GroupedFp8Experts> fp8_;  // FP8 (nullptr: bf16)
};

/// The experts of --moe-grouped-gemm: GroupedMLP, else SequentialMLP.
std::unique_ptr<MoeExperts> make_moe_experts(const TransformerConfig& config, const std::string& prefix,
                                             const ExpertParallel& ep, int64_t num_echo, ParamRegistry& registry);

}  // namespace mt
