// One linear layer's GEMMs in FP8 (docs/fp8.md; Transformer Engine's Linear as Megatron-Core's
// TELinear drives it): the per-tensor scaling state of its input x, weight w and output gradient
// dy, their quantisation (cast + transpose: Hopper's FP8 GEMMs read K-major operands only), and
// the three GEMMs through fp8_matmul:
//   fprop  y[m, out]  = x · wᵀ          (a = xq [m, in],      b = wq [out, in])
//   dgrad  dx[m, in]  = dy · w          (a = dyq [m, out],    b = wq_t [in, out])
//   wgrad  dw[out, in] (+)= dyᵀ · x     (a = dyq_t [out, m],  b = x_t [in, m]; into the fp32 main_grad)
// The MoE experts call forward / backward in place of their bf16 GEMMs. ColumnParallelLinear and
// RowParallelLinear run the phases inside the tensor-parallel region's all_gather_gemm /
// gemm_reduce_scatter (parallel/mappings.h), which call the GEMM once per TP block of rows under
// sequence parallelism and pipeline it with the collective under --tp-comm-overlap:
//   begin_forward (x's scale: current scaling's amax over the whole x, or over this rank's
//   sequence-parallel shard reduced over the TP group as well — the same value), forward_rows per
//   block (quantise those rows, GEMM, epilogue), end_forward (the saved x_t from the whole x when
//   the blocks could not write it); begin_backward, dgrad_rows per block, wgrad.
// Quantisation is elementwise with the tensor's scale (1x128 tiles lie within a row), so a block's
// FP8 rows are those of the whole tensor bit for bit.
//
// Scales (Fp8Settings::recipe):
//   tensorwise (current scaling): amax of the tensor, all-reduced (MAX) over the ranks holding its
//     other shards (Fp8Groups), then scale = fp8_max / amax; the x scale of each forward is kept in
//     the activation area for its backward;
//   delayed: the scale of the amax history (Fp8Model::finish_step), the tensor's amax recorded
//     into the history's row 0 while it is quantised (training forwards and every backward);
//   blockwise: 1x128 tiles for x and dy (both directions), 128x128 blocks for w, scales from each
//     block's amax (powers of two), no reduction, no state.
// Weights are quantised once per step (Fp8Model::quantize_weights, before the layer's first forward
// of the step) into persistent copies w and w_t. The input: with save_input (plan) the forward
// keeps x_t [in, m] in FP8 as the saved activation instead of the bf16 x (half its memory); else
// the backward quantises x_t again from the bf16 input the owner keeps, with the forward's scale.
//
// Row counts m that are not multiples of 16 (an MoE expert's tokens; cuBLASLt's FP8 rule) run
// through padded scratch: x and dy copied with zero rows appended, outputs copied back (Megatron
// pads expert tokens instead: --moe-router-padding-for-fp8). No allocation, no host
// synchronisation; every scale is read from device memory (capturable in CUDA graphs).
#pragma once
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/fp8/fp8_recipe.h"
#include "model/module.h"
#include "ops/fp8_matmul.h"

namespace mt {

class Fp8Model;

/// The ranks holding the other shards of a linear layer's x, w and dy (docs/fp8.md "Layout
/// invariance"): a tensor's current-scaling amax is all-reduced (MAX) over its group; nullptr or a
/// one-rank group: this rank holds the whole tensor (or a replica of it).
/// x_shard / dy_shard: the group over which the amax of this rank's sequence-parallel shard of x
/// / dy is reduced when the owner gathers the tensor only block by block (TP x CP).
struct Fp8Groups {
  Communicator* x = nullptr;
  Communicator* w = nullptr;
  Communicator* dy = nullptr;
  Communicator* x_shard = nullptr;
  Communicator* dy_shard = nullptr;
};

/// One FP8 tensor's scaling state: fp32 one-element views into Fp8Model's state buffer, each 16-byte
/// aligned (the GEMMs read scale_inv in place: cuBLASLt's rule for scale pointers).
/// amax: the last all-reduced amax (current scaling); scale / scale_inv: the quantisation scale
/// and its inverse (current scaling: of the last quantisation; delayed: of this step); record:
/// the amax history's row 0 (delayed; empty otherwise).
struct Fp8TensorState {
  Tensor amax, scale, scale_inv, record;
};

class Fp8Linear {
 public:
  /// name: the layer's parameter prefix (for messages); weight: the owner's weight ([out, in],
  /// model dtype; bound before the first quantisation); out, in: this rank's weight shard, both
  /// multiples of 16. in_params: wq and wq_t live in the bytes of the weight's bf16 storage
  /// (Fp8Model::weights_in_params; in_params()). Errors: mt::Error naming the layer and sizes otherwise.
  Fp8Linear(const Fp8Model& model, std::string name, const ParamRef* weight, int64_t out, int64_t in, Fp8Groups groups,
            bool in_params = false);
  Fp8Linear(const Fp8Linear&) = delete;
  Fp8Linear& operator=(const Fp8Linear&) = delete;

  const std::string& name() const { return name_; }
  int64_t out() const { return out_; }
  int64_t in() const { return in_; }

  /// In the open area: the x scale (tensorwise) and, with save_input, x_t [in, max_rows] (blockwise
  /// with its 1x128 scales) kept from the forward to the backward; the shared FP8 scratch (keys
  /// "fp8.*", the shared experts' under overlap their own: Fp8Model::scratch_prefix) for up to
  /// max_rows rows. variable_rows: forward / backward may get any m <= max_rows (padded to 16);
  /// else exactly max_rows, which must be a multiple of 16. row_blocks: the TP
  /// blocks forward_rows / dgrad_rows are called with (the TP size under sequence parallelism),
  /// each max_rows / row_blocks rows, a multiple of 16. gathered_input: the owner gathers x over
  /// those blocks (a ColumnParallelLinear under SP; not a RowParallelLinear, whose blocks split its
  /// output): only then can the gather run in FP8 (gathers_fp8). Errors: mt::Error naming the rows
  /// otherwise, or save_input with variable_rows.
  void plan(BufferPlanner& planner, int64_t max_rows, bool save_input, bool variable_rows = false,
            int64_t row_blocks = 1, bool gathered_input = true);
  /// Persistent: the FP8 weight copies wq [out, in] and wq_t [in, out] (blockwise: with their
  /// 128x128 scales). Called once per planning pass by Fp8Model::plan. in_params: wq and wq_t are
  /// the weight's own bf16 storage instead (2 bytes an element: wq its first out·in bytes, wq_t the
  /// rest), bound here once the weight is (nothing planned for them). Errors: mt::Error when such a
  /// weight is not bf16 [out, in].
  void plan_weights(BufferPlanner& planner);
  /// wq and wq_t live in the weight's parameter storage, which then holds FP8 bytes once the weight
  /// is quantised (the optimizer's bf16 write of the weight is overwritten by the next quantisation):
  /// no bf16 copy of the weight is kept. The weight is quantised from its fp32 main parameters,
  /// each rounded to bf16 first as the optimizer rounds it (in one pass: fp8_quantize_bf16_rounded;
  /// blockwise, or a sharded main's first quantisation, through Fp8Model::stage_weight), so that the
  /// FP8 bytes are those of quantising the bf16 weight (docs/fp8.md "Memory").
  bool in_params() const { return in_params_; }
  /// Whether this rank holds the weight's whole fp32 main parameters (not sharded by the
  /// distributed optimizer, not remainders). Requires the weight bound.
  bool main_whole() const;
  /// The state views of x, w and dy (Fp8Model::plan).
  void bind_state(const Fp8TensorState& x, const Fp8TensorState& w, const Fp8TensorState& dy);
  /// The bound state views of x, w and dy, and the transposed FP8 weight copy wq_t [in, out]: the
  /// grouped expert MLP (model/moe/grouped_fp8_experts.h) runs its experts' GEMMs on them itself.
  const Fp8TensorState& x_state() const { return x_; }
  const Fp8TensorState& w_state() const { return w_; }
  const Fp8TensorState& dy_state() const { return dy_; }
  const Tensor& fp8_weight_t() const { return wq_t_; }

  /// Quantises the weight into wq and wq_t with this step's scale (tensorwise: from its amax over
  /// the weight's shards; delayed: recorded when `record`). Fp8Model::quantize_weights calls it
  /// before the layer's first forward of a step. in_params: from the fp32 main parameters rounded
  /// to bf16 (main_whole; fp8_quantize_bf16_rounded, blockwise staged: Fp8Model::stage_weight), else
  /// from a staged copy of the bf16 storage (freshly initialised or loaded).
  void quantize_weight(bool record, const Stream& stream);

  // --- --fp8-param-gather (per-tensor recipes; optim/grad_sync.h drives these, docs/fp8.md) ---
  /// The weight's ParamStore index. Errors: mt::Error when the weight is not bound.
  size_t weight_index() const;
  /// The persistent FP8 weight wq [out, in] that the distributed optimizer's FP8 all-gather fills.
  const Tensor& fp8_weight() const { return wq_; }
  /// The values this rank quantises of the flat elements [begin, begin + n) of the weight
  /// (row-major [out, in]), its owned slice: in_params, the fp32 main parameters `main` ([n], this
  /// rank's shard of them); else the model-dtype weight (main unused).
  Tensor weight_piece(const Tensor& main, int64_t begin, int64_t n) const;
  /// amax (fp32, one element) = max |w| over a piece (weight_piece). From fp32 main parameters of
  /// a bf16 weight it is the amax of the fp32 values: set_weight_scale rounds it to bf16, which
  /// gives the amax of the rounded values (rounding is monotonic and symmetric).
  void weight_piece_amax(const Tensor& amax, const Tensor& piece, const Stream& stream) const;
  /// Tensorwise: the weight's amax (fp32, one element: the slices' amaxes all-reduced MAX over the
  /// weight's DP (x CP) and TP ranks; in_params rounded to bf16 here) becomes the state's amax,
  /// scale and scale_inv, as quantize_weight sets them from the whole weight. Delayed: nothing (the
  /// step's stored scale).
  void set_weight_scale(const Tensor& amax, const Stream& stream);
  /// q (FP8 [n], the forward dtype) = a piece (weight_piece, [n]) quantised with the weight's
  /// scale, the bytes quantize_weight writes there (in_params: the fp32 values rounded to bf16 in
  /// the quantiser's pass, fp8_quantize_bf16_rounded; delayed: their amax recorded into the
  /// history's row 0, the stage's MAX reduction making it the whole weight's).
  void quantize_weight_piece(const Tensor& q, const Tensor& piece, const Stream& stream);
  /// After the all-gather filled wq: wq_t = wqᵀ from the gathered bytes (per-tensor: the bytes of
  /// quantising wᵀ).
  void finish_weight_gather(const Stream& stream);

  /// fprop: y [m, out] = x [m, in] · wᵀ (+ bias [out]); with pre_gelu ([m, out], y's shape):
  /// pre_gelu = x · wᵀ + bias and y = gelu(pre_gelu) (ops/fp8_epilogue.h). The per-tensor recipes
  /// add the bias in the GEMM's epilogue (one rounding: fp8_matmul's bias), blockwise in a pass
  /// after it. x, y, bias, pre_gelu of the act dtype, 2-D views. slot: the activation area
  /// (plan's). Delayed scaling records x's amax in training forwards (Fp8Model::training). The
  /// three phases below over all m rows.
  void forward(const Tensor& y, const Tensor& x, const Tensor& bias, const Tensor& pre_gelu, int slot,
               const Stream& stream);
  /// Forward, phase 1: x [rows, in] is the whole input (shard = false) or this rank's
  /// sequence-parallel shard of it (shard = true: the layer's m is plan's max_rows); current
  /// scaling takes the scale of this micro-batch from its amax, reduced over groups.x (x_shard).
  void begin_forward(const Tensor& x, bool shard, int slot, const Stream& stream);
  /// Phase 2, per block: y [rows, out] = the forward of x [rows, in], the input rows [first,
  /// first + rows) (bias, pre_gelu as forward, those rows). Blocks start at multiples of 16.
  void forward_rows(const Tensor& y, const Tensor& x, int64_t first, const Tensor& bias, const Tensor& pre_gelu,
                    int slot, const Stream& stream);
  /// Phase 3, after every block: x [m, in] the whole input; with save_input, x_t quantised from it
  /// unless one block covered all rows (then it was written in that block's pass).
  void end_forward(const Tensor& x, int slot, const Stream& stream);
  /// Under sequence parallelism: whether the forward all-gathers x in FP8 (Transformer Engine's FP8
  /// all-gather of a sequence-parallel input: half the bytes of bf16) — per-tensor scaling with the
  /// transposed input saved (plan's save_input) and a gathered input (plan's gathered_input). Blockwise keeps the bf16 gather: x_t's 1x128 tiles
  /// run along the tokens, across the shards, and are quantised from the high-precision x.
  bool gathers_fp8() const;
  /// The FP8 gather, after begin_forward(x_local, shard = true): quantises this rank's shard
  /// x_local [m / row_blocks, in] with the tensor's scale (delayed: its amax recorded in training
  /// forwards; the stage's MAX reduction makes it the whole tensor's) into the FP8 `local`; returns
  /// {full, local}: full = the FP8 x [m, in] the all-gather fills (TensorParallelRegion::
  /// all_gather_gemm), local = this rank's block of it. The bytes are those the bf16 gather would
  /// quantise (elementwise, one scale). Errors: mt::Error unless gathers_fp8 and planned with
  /// row_blocks > 1, or on a wrong shape.
  std::pair<Tensor, Tensor> quantize_shard(const Tensor& x_local, int slot, const Stream& stream);
  /// Phase 2 of the FP8 gather, per block: y [rows, out] = the forward of the gathered FP8 rows
  /// q [rows, in] (input rows [first, first + rows)); bias, pre_gelu as forward_rows.
  void forward_fp8_rows(const Tensor& y, const Tensor& q, int64_t first, const Tensor& bias, const Tensor& pre_gelu,
                        int slot, const Stream& stream);
  /// Phase 3 of the FP8 gather, after every block: the saved x_t = the gathered bytes transposed
  /// (per-tensor scaling: the bytes of quantising xᵀ).
  void end_forward_fp8(int slot, const Stream& stream);
  const Fp8Settings& settings() const;
  /// What a fused producer of x (ops/fp8_fused.h: the norm or the activation before this linear)
  /// writes under delayed scaling: xq [m, in] (this linear's FP8 scratch), with `transposed` and
  /// plan's save_input also x_t [in, m] (the saved transposed input of `slot`; else empty: the
  /// forward transposes xq), the step's scale of x and its amax record (empty outside training
  /// forwards). Starts a forward of m rows (as begin_forward). Errors: mt::Error unless delayed
  /// scaling, m a multiple of 16 within plan's rows and one row block.
  struct FusedInput {
    Tensor xq, x_t, scale, record;
  };
  FusedInput fused_input(int64_t m, int slot, bool transposed = false);
  /// Whether a producer can write fused_input(m) in a forward of m rows: delayed scaling, one row
  /// block (no sequence parallelism) and m as fused_input requires (the owner decides whether its
  /// producer does: Fp8Settings::fused_norm / fused_activation). Otherwise the forward quantises
  /// the producer's output itself.
  bool takes_fused_input(int64_t m) const;
  /// What a fused producer of dy (ops/fp8_fused.h fp8_swiglu_backward: the activation after this
  /// linear) writes under delayed scaling: dyq [m, out] and dyq_t [out, m] (this linear's FP8
  /// scratch), dy's scale of the step and its amax record. Starts a backward of m rows in place of
  /// begin_backward: dgrad_rows and wgrad then multiply those bytes (their dy argument gives only
  /// the shape; its values are not read) and wgrad takes no bias gradient. Errors: mt::Error
  /// unless takes_fused_grad(m).
  struct FusedGrad {
    Tensor dyq, dyq_t, scale, record;
  };
  FusedGrad fused_grad(int64_t m);
  /// Whether a producer can write fused_grad(m): delayed scaling and the planned fixed row count m
  /// (any row blocks: dgrad_rows slices the whole quantised dy).
  bool takes_fused_grad(int64_t m) const;
  /// How many forwards took a fused producer's input (fused_input calls; tests).
  int64_t fused_inputs() const { return fused_inputs_; }
  /// How many backwards took a fused producer's dy (fused_grad calls; tests).
  int64_t fused_grads() const { return fused_grads_; }
  /// After the producer filled fused_input(m).xq: the forward of those bytes (y, bias, pre_gelu as
  /// forward) and, with save_input, the saved x_t = the bytes transposed unless the producer wrote
  /// it (fused_input's transposed) — bitwise forward() of the producer's stored output (docs/fp8.md
  /// "Fused quantisation").
  void forward_fused(const Tensor& y, const Tensor& bias, const Tensor& pre_gelu, int slot, const Stream& stream);
  /// forward_add (out = residual + (x · wᵀ + bias)) of the bytes fused_input(m).xq: bitwise
  /// forward_add of the producer's stored output.
  void forward_fused_add(const Tensor& out, const Tensor& bias, const Tensor& residual, int slot,
                         const Stream& stream);
  /// The block's residual add fused after the GEMM (RowParallelLinear without a TP reduction):
  /// out [m, out] = residual + (x · wᵀ + bias); out may not alias x or residual. Per-tensor
  /// recipes with m a multiple of 16: the residual is the GEMM's C and the bias its epilogue, out =
  /// (residual + x · wᵀ) + bias in one rounding; otherwise a separate add after the GEMM.
  void forward_add(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual, int slot,
                   const Stream& stream);
  /// What backward writes. dx [m, in]: dy · w (overwrite; empty: not computed). dw fp32 [out, in]:
  /// dyᵀ · x written or added as dw_write says (empty: not computed). dbias fp32 [out] += Σ_m dy
  /// (empty: none). gelu_pre [m, in] (the input was gelu(gelu_pre): dx becomes dL/dpre, and
  /// gelu_dbias fp32 [in] += Σ_m dL/dpre when given).
  struct Grads {
    Tensor dx, dw;
    GradWrite dw_write = GradWrite::kAccumulate;
    Tensor dbias, gelu_pre, gelu_dbias;
  };
  /// dgrad and wgrad from dy [m, out] (act dtype). x [m, in]: the forward's bf16 input, read only
  /// when plan's save_input was off (then quantised again with the forward's scale). The phases
  /// below over all m rows.
  void backward(const Grads& g, const Tensor& dy, const Tensor& x, int slot, const Stream& stream);
  /// Backward, phase 1: dy [rows, out] the whole output gradient or this rank's sequence-parallel
  /// shard of it (shard, as begin_forward); current scaling takes dy's scale.
  void begin_backward(const Tensor& dy, bool shard, const Stream& stream);
  /// Phase 2, per block: dx [rows, in] = dy [rows, out] · w for the rows [first, first + rows);
  /// with gelu_pre ([rows, in]) dx becomes dL/dpre. Delayed scaling records dy's amax.
  void dgrad_rows(const Tensor& dx, const Tensor& dy, int64_t first, const Tensor& gelu_pre, const Stream& stream);
  /// Phase 3: dw (+)= dyᵀ · x from the whole dy [m, out] (and x [m, in] without save_input), as
  /// Grads says; dbias += Σ_m dy. Without dgrad_rows before it, dy's amax is recorded here.
  void wgrad(const Tensor& dw, GradWrite dw_write, const Tensor& dbias, const Tensor& dy, const Tensor& x, int slot,
             const Stream& stream);

 private:
  struct Saved {
    Tensor x_scale;     // tensorwise: fp32 [2] = the forward's x scale_inv (first: 16-byte aligned) and scale
    Tensor x_t, x_t_s;  // save_input: FP8 [in, m] (blockwise: its 1x128 scales)
  };
  // The quantised operand views of m rows, over the shared scratch.
  struct Scratch {
    Tensor xq, xq_s, x_t, x_t_s, dyq, dyq_s, dyq_t, dyq_t_s;
    Tensor pad_x, pad_y, pad_dy, pad_dx;  // variable_rows: [max_pad, in / out] act dtype
    Tensor xq_local;                      // gathers_fp8 under SP: this rank's FP8 shard of x
  };
  Fp8Scaling act_scaling() const;
  Fp8Scaling weight_scaling() const;
  // The quantised rows [first, first + rows) of x (grad = false) or dy in the scratch of m rows:
  // q, its 1x128 scales (blockwise: the block's own, packed block after block), and when the block
  // is all m rows (whole) the transposed buffers too (dy only: x_t goes to the saved area).
  struct Block {
    Tensor q, q_s, q_t, q_t_s;
    bool whole = false;
  };
  Block block(int64_t rows, int64_t first, int64_t m, bool grad) const;
  // An activation or gradient [m, cols] into q (rowwise) and / or q_t (transposed): blockwise with
  // its own 1x128 tiles, else with the device scale, recording the amax into `record` (delayed).
  void quantize_act(const Tensor& q, const Tensor& q_s, const Tensor& q_t, const Tensor& q_t_s, const Tensor& x,
                    const Tensor& scale, const Tensor& record, const Stream& stream) const;
  // Quantises x [m, in] into xq (and x_t when given) with the recipe and the scale of begin_forward
  // (tensorwise: slot's; delayed: the state's; blockwise: its own block scales into xq_s / x_t_s).
  void quantize_x(const Tensor& xq, const Tensor& xq_s, const Tensor& x_t, const Tensor& x_t_s, const Tensor& x,
                  const Saved& sv, bool record, const Stream& stream);
  Fp8Operand x_t_operand(const Saved& sv, const Tensor& x_t, const Tensor& x_t_s) const;
  Fp8Operand weight_operand(bool transposed) const;
  // The fprop GEMM of a block (a: its quantised rows) and its epilogue (bias, GELU).
  // residual: y = residual + the product (+ bias) in the GEMM (cuBLASLt's C; per-tensor, no pre_gelu).
  void fprop(const Tensor& y, const Fp8Operand& a, const Tensor& bias, const Tensor& pre_gelu, const Stream& stream,
             const Tensor& residual = Tensor());
  // forward_rows, the product written (residual empty) or added to the residual.
  void forward_rows_into(const Tensor& y, const Tensor& x, int64_t first, const Tensor& bias, const Tensor& pre_gelu,
                         int slot, const Stream& stream, const Tensor& residual);
  // Quantises dy [m, out] into dyq and / or dyq_t with begin_backward's scale.
  void quantize_dy(const Tensor& dyq, const Tensor& dyq_s, const Tensor& dyq_t, const Tensor& dyq_t_s,
                   const Tensor& dy, bool record, const Stream& stream);
  Scratch views(int64_t m) const;

  const Fp8Model& model_;
  std::string name_;
  const ParamRef* weight_;
  int64_t out_, in_;
  Fp8Groups groups_;
  Fp8TensorState x_, w_, dy_;
  bool save_input_ = false, variable_rows_ = false, gathered_input_ = true;
  int64_t max_rows_ = 0, row_blocks_ = 1;
  // the phases' state: rows of the current forward / backward, which transposes are written,
  // whether dy's delayed-scaling amax is recorded
  int64_t fwd_rows_ = 0, bwd_rows_ = 0;
  bool x_t_ready_ = false, dy_t_ready_ = false, dy_recorded_ = false;
  bool dy_fused_ = false;  // this backward's dyq / dyq_t were written by a producer (fused_grad)
  int64_t fused_inputs_ = 0, fused_grads_ = 0;
  bool in_params_ = false;
  std::vector<Saved> saved_;  // per area
  Tensor wq_, wq_t_, wq_s_, wq_t_s_;
  Scratch scratch_;  // planned at max_rows (padded), viewed per call
};

}  // namespace mt
