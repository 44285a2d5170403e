// FP8 for the grouped expert MLP (--moe-grouped-gemm with --fp8-format tensorwise|delayed;
// docs/fp8.md "The MoE experts' grouped GEMM"): each projection (linear_fc1, linear_fc2) of all
// local experts as one grouped FP8 GEMM (ops/grouped_matmul.h grouped_fp8_linear_forward /
// _wgrad) with one scale per expert, the per-expert row counts read on the device (no host
// synchronisation; CUDA-graph capturable, as the bf16 grouped path).
//
// The numerics are the sequential FP8 experts' (SequentialMLP with an Fp8Linear per expert
// projection), per expert: the same scaling state (each expert projection's Fp8Linear keeps its
// x / w / dy columns of Fp8Model's state, read and written here in place through strided [G, 1]
// views), the same weight copies (Fp8Model::quantize_weights quantises every expert's weight into
// its Fp8Linear's wq / wq_t, as before), the same per-expert scales:
//   tensorwise: amax of the expert's rows (ops/fp8_grouped.h fp8_grouped_amax), all-reduced MAX
//     over the expert TP group for fc2's x and fc1's dy (the feature-sharded tensors), as
//     Fp8Linear's groups; the x scales kept per activation area for the backward;
//   delayed: the step's scales of the state, the amaxes recorded into the history's row 0 while
//     quantising (x in training forwards, dy in every backward).
// x and dy are quantised per expert (fp8_grouped_quantize; dy e5m2 with hybrid); fprop xq · wqᵀ,
// dgrad dyq · wq_t (wᵀ), wgrad dyq_tᵀ · x_t (x quantised again in the backward from the bf16
// input the experts keep, with the forward's scale, as Fp8Linear without save_input).
// Differences from the sequential path: an expert with no rows gets amax 0 and scale 1 in the
// current-scaling state rows (the sequential path skips it and leaves the last values; current
// scaling carries nothing from one tensor to the next, so no result changes); on CUDA the fprop
// accumulates without cuBLASLt's fast-accumulation mode (the grouped kernels promote every
// partial sum), within the FP8 GEMM tolerance. Blockwise scaling is refused by TransformerConfig.
#pragma once
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/fp8/fp8_linear.h"
#include "model/module.h"
#include "ops/grouped_matmul.h"

namespace mt {

class Fp8Model;

class GroupedFp8Experts {
 public:
  /// fc1, fc2: the local experts' Fp8Linear of each projection (G = E_l each, in expert order;
  /// their state bound by Fp8Model::plan before the first forward). etp: the expert TP group.
  /// Errors: mt::Error for the blockwise recipe, an empty or mismatched list.
  GroupedFp8Experts(const Fp8Model& model, std::vector<Fp8Linear*> fc1, std::vector<Fp8Linear*> fc2,
                    Communicator* etp);

  /// Plans, in the open area, the x scales kept for the backward, and the scratch: the FP8 x / dy
  /// of both projections [R_max, ·], their transposes [·, pad16(R_max)], per-expert values.
  /// Errors: mt::Error for non-bf16 activations on a GPU (the grouped FP8 kernels write bf16).
  void plan(BufferPlanner& planner, int64_t max_rows);
  /// Projection fc (1 or 2): y [R_max, n] = the grouped FP8 product of x [R_max, k] (act dtype)
  /// with the experts' FP8 weights, rows per expert from counts (int32 [G], device); y's tail
  /// rows zero. slot: the activation area.
  void forward(int fc, const Tensor& y, const Tensor& x, const Tensor& counts, int slot, const Stream& stream);
  /// Its backward from dy [R_max, n]: dx [R_max, k] = dy · w per expert (overwrite, tail zero);
  /// with a non-empty dw (the experts' fp32 main gradients) dw_g += dyᵀ · x over expert g's rows,
  /// x the forward's input (quantised again with the forward's scale).
  void backward(int fc, const Tensor& dx, const GroupedWeights& dw, const Tensor& dy, const Tensor& x,
                const Tensor& counts, int slot, const Stream& stream);

 private:
  struct Values {  // strided [G, 1] views of the experts' state (record: delayed scaling only)
    Tensor amax, scale, scale_inv, record;
  };
  struct Proj {
    std::vector<Fp8Linear*> linears;
    Communicator* x_group = nullptr;   // current scaling: the x amax's reduction group
    Communicator* dy_group = nullptr;  // ... dy's
    int64_t n = 0, k = 0;
    bool ready = false;                // the tables below built (first use, after planning)
    GroupedWeights wq, wq_t;
    Values x, w, dy;
    Tensor xq, x_t, dyq, dyq_t;        // scratch
  };
  Proj& proj(int fc);
  void prepare(Proj& p, const Stream& stream);
  // The saved x scale (row 0) and scale_inv (row 1) of projection fc in area slot: fp32 [G].
  Tensor x_scale(int fc, int slot, int row) const;

  const Fp8Model& model_;
  int64_t groups_ = 0, max_rows_ = 0;
  Proj fc_[2];
  std::vector<Tensor> saved_;  // per area: fp32 [4, pad4(G)] (fc1 scale, scale_inv, fc2 scale, scale_inv)
  Tensor values_;              // scratch fp32 [4, pad4(G)]: amax, dy scale, dy scale_inv, w scale_inv
};

}  // namespace mt
