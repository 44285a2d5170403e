// Tensor-parallel linear layers (Megatron-Core tensor_parallel/layers.py; Shoeybi et al. 2019 §3).
// Shapes: s sequence, s_l = s/tp with sequence parallelism (else s), b micro-batch.
//
// ColumnParallelLinear: y = x Wᵀ (+ b), W [parts·out, in] split by output rows over TP (each of the
// `parts` stacked blocks split, for the gated SwiGLU fc1). Its input enters the TP region here
// (TensorParallelRegion::enter_*): the producer writes x [s_l, b, in] into input(area); forward
// gathers it into the saved [s, b, in] it multiplies (the same memory without SP).
//
// RowParallelLinear: y = x Wᵀ, W [out, in] split by input columns; its input [s, b, in/tp] is
// inside the TP region (written by the producer into input(area) and saved for the weight
// gradient); the partial products leave the region here (all-reduce, or reduce-scatter with SP).
// Its bias [out] is replicated and NOT added here (Megatron's skip_bias_add): the caller fuses it
// into bias-dropout-add.
//
// The sequence-parallel collectives run together with the GEMM beside them
// (TensorParallelRegion::all_gather_gemm: the input all-gather with the forward GEMM, the output
// gradient's all-gather with the dgrad GEMM; gemm_reduce_scatter: the output reduce-scatter with
// the forward GEMM, the input gradient's with the dgrad GEMM, the wgrad GEMM before its end), so
// that --tp-comm-overlap pipelines them block by block; the results are those of one GEMM.
//
// With FP8 (--fp8-format; docs/fp8.md) a decoder layer's linear runs its three GEMMs through an
// Fp8Linear (model/fp8/fp8_linear.h), block by block inside the same collectives (with or
// without --tp-comm-overlap): a ColumnParallelLinear then saves its input quantised and
// transposed (FP8 [in, s·b]) instead of the bf16 one, and so does a RowParallelLinear with
// Options::fp8_save_input (linear_fc2); otherwise it keeps its bf16 input (the core attention's
// backward reads linear_proj's) and quantises it again in the backward; the weight gradients are
// never deferred.
//
// Scratch is shared by role across layers (docs/architecture.md): the gathered output-gradient
// of every RowParallelLinear and the input-gradient of every ColumnParallelLinear share one
// buffer each, a RowParallelLinear's input-gradient is shared per role (prefix's last
// component, e.g. "linear_proj").
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/fp8/fp8_linear.h"
#include "model/module.h"
#include "parallel/mappings.h"

namespace mt {

class ColumnParallelLinear {
 public:
  struct Options {
    std::string prefix;      ///< e.g. "decoder.layers.0.self_attention.linear_qkv"
    int64_t in = 0, out = 0;  ///< global sizes of one block
    int64_t parts = 1;        ///< stacked blocks split separately (2 for a gated fc1)
    bool bias = true;
    float init_std = 0.02f;
    /// Use this weight instead of declaring one (the output layer tied to the word embedding).
    const ParamRef* shared_weight = nullptr;
    /// Declare the weight flagged shared_embedding_copy (the last pipeline stage's copy of a tied
    /// word embedding; model/params.h).
    bool shared_embedding_copy = false;
    /// > 0: the output rows are the padded vocabulary, of which this many are real (ParamSpec).
    int64_t vocab_rows = 0;
    /// The input is not saved (selective recompute of the producing norm, --recompute-modules
    /// layernorm): input_full is scratch shared by the layers of this role (prefix's last
    /// component), valid from the forward to the GEMM, and in the backward once the producer has
    /// written input() again and restore_input() has run.
    bool recompute_input = false;
  };
  ColumnParallelLinear(const Options& o, const TensorParallelRegion& tp, ParamRegistry& registry);
  ColumnParallelLinear(const ColumnParallelLinear&) = delete;
  ColumnParallelLinear& operator=(const ColumnParallelLinear&) = delete;

  /// Plans the saved gathered input [s, b, in] in the open area (scratch with recompute_input)
  /// and the shared scratch.
  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  bool recomputes_input() const { return recompute_input_; }
  /// Recompute (recompute_input): after the producer wrote input(area) again in the backward,
  /// the gathered input again (the sequence-parallel all-gather; nothing without SP).
  void restore_input(const StepContext& ctx);
  /// Where the producer writes this layer's input [s_l, b, in] for `area`.
  Tensor input(int area) const;
  /// The gathered input [s, b, in] of `area` (valid after forward).
  Tensor input_full(int area) const { return saved_.at(static_cast<size_t>(area)); }
  /// Delayed-scaling FP8 (docs/fp8.md "Fused quantisation"): whether the producer of input()
  /// (the RMSNorm) writes this layer's FP8 input in its own pass for a forward of `rows` = s·b rows
  /// — Fp8Settings::fused_norm, Fp8Linear::takes_fused_input and the input saved in FP8 (not
  /// recomputed: the recomputing backward re-runs the producer alone). Otherwise forward
  /// quantises input() itself.
  bool fuses_fp8_input(int64_t rows) const {
    return fp8_ && fp8_->settings().fused_norm && !recompute_input_ && fp8_->takes_fused_input(rows);
  }
  /// Where that producer writes (Fp8Linear::fused_input of `rows` rows), besides input(area);
  /// the next forward multiplies those bytes. Errors: mt::Error unless fuses_fp8_input(rows).
  Fp8Linear::FusedInput fp8_input(int64_t rows, int area);
  /// Delayed-scaling FP8: whether the consumer of this layer's output (the SwiGLU or the GELU
  /// after linear_fc1) writes the FP8 output gradient in its backward pass (Fp8Settings::
  /// fused_activation, Fp8Linear::takes_fused_grad) — with a bias only when the consumer sums its
  /// gradient too (consumer_sums_bias: fp8_gelu_backward; backward is then called with
  /// bias_grad_done), since no high-precision dy is left to sum.
  bool fuses_fp8_grad(int64_t rows, bool consumer_sums_bias = false) const {
    return fp8_ && fp8_->settings().fused_activation && (!has_bias_ || consumer_sums_bias) &&
           fp8_->takes_fused_grad(rows);
  }
  /// Where that consumer writes dy (Fp8Linear::fused_grad of `rows` rows); the next backward
  /// multiplies those bytes (its dy argument gives the shape only). Errors: mt::Error unless
  /// fuses_fp8_grad(rows, consumer_sums_bias).
  Fp8Linear::FusedGrad fp8_grad(int64_t rows, bool consumer_sums_bias = false);
  /// y [s, b, parts·out/tp] = x Wᵀ (+ b); with pre_gelu given (same shape), the GELU epilogue:
  /// pre_gelu = x Wᵀ + b, y = gelu(pre_gelu) (ops/matmul.h). gather = false: the gathered
  /// input is already in place (a recomputing backward re-running the GEMM).
  void forward(const Tensor& y, const StepContext& ctx, const Tensor& pre_gelu = Tensor(), bool gather = true);
  /// From dy [s, b, parts·out/tp]: returns dL/dx [s_l, b, in] (a scratch view, valid until the next
  /// ColumnParallelLinear backward); dW (+= dyᵀ x) and db (+= Σ dy) now, or appended to `defer`.
  /// bias_grad_done: db was already accumulated by the consumer's fused backward
  /// (RowParallelLinear::backward with GeluInput), so it is left alone here.
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer = nullptr,
                  bool bias_grad_done = false);
  const ParamRef& weight() const { return *weight_ptr_; }
  const ParamRef& bias() const { return bias_; }
  int64_t local_out() const { return parts_ * out_ / tp_.size(); }

  // The same computation in pieces of rows (the language-model head's chunks of the vocabulary
  // GEMM, model/layers/output_head.h): gather_input once, then any row ranges, then the dx reduction.
  /// The gathered input [s·b, in] of the context's area (the f operator / SP all-gather runs here).
  Tensor gather_input(const StepContext& ctx);
  /// y [count, parts·out/tp] = x[first, first + count) Wᵀ (+ b) of the gathered input.
  void forward_rows(const Tensor& y, int64_t first, int64_t count, const StepContext& ctx);
  /// From dy [count, parts·out/tp] of those rows: dx_full[first, first + count) = dy W (overwrite;
  /// dx_full [s·b, in], e.g. dgrad_scratch()) and dW (+ db) += dyᵀ x_rows (+ Σ dy).
  void backward_rows(const Tensor& dy, int64_t first, int64_t count, const Tensor& dx_full, const StepContext& ctx);
  /// dx_local [s_l·b, in] from the rows' dx_full [s·b, in]: the TP all-reduce (dx_local may alias
  /// dx_full) or, with SP, the reduce-scatter (the f operator's backward).
  void reduce_input_grad(const Tensor& dx_local, const Tensor& dx_full, const StepContext& ctx) const;
  /// The layer's dx scratch [s·b, in] (shared by the column-parallel layers).
  Tensor dgrad_scratch() const { return rows(dx_full_); }

 private:
  const TensorParallelRegion& tp_;
  int64_t in_, out_, parts_;
  std::string role_;
  bool recompute_input_;
  bool has_bias_;
  ParamRef weight_, bias_;
  const ParamRef* weight_ptr_;
  std::vector<Tensor> saved_;  // per area: the gathered input [s, b, in] (recompute_input: one scratch)
  Tensor input_local_;         // SP: [s_l, b, in] scratch the producer writes
  Tensor dx_full_, dx_local_;  // [s, b, in], [s_l, b, in] (same memory without SP)
  std::unique_ptr<Fp8Linear> fp8_;  // FP8 GEMMs (nullptr: bf16)
  bool fp8_input_ready_ = false;    // fp8_input was written for the next forward
  bool fp8_grad_ready_ = false;     // fp8_grad was written for the next backward
};

/// The residual add of a transformer block (TransformerLayer), fused into the block's output
/// projection when there is no dropout: out = residual + (y + bias), all [s_l, b, h].
struct ResidualAdd {
  Tensor out, residual;
};

class RowParallelLinear {
 public:
  struct Options {
    std::string prefix;       ///< e.g. "decoder.layers.0.self_attention.linear_proj"
    int64_t in = 0, out = 0;  ///< global sizes
    bool bias = true;         ///< declare the (replicated, skip-add) bias
    float init_std = 0.02f;
    /// The input is not saved (selective recompute of the producing activation, --recompute-modules
    /// mlp / mlp_act): input() is scratch shared by the layers of this role, which the producer
    /// must write again before backward.
    bool recompute_input = false;
    /// FP8: nothing but this layer's weight gradient reads the input in the backward (linear_fc2;
    /// not linear_proj, whose input the core attention's backward reads), so the FP8 transposed
    /// input is saved for it instead (written in the forward's cast + transpose or by the fused
    /// SwiGLU) and the bf16 input() is scratch. Ignored without FP8 or with recompute_input.
    bool fp8_save_input = false;
  };
  RowParallelLinear(const Options& o, const TensorParallelRegion& tp, ParamRegistry& registry);
  RowParallelLinear(const RowParallelLinear&) = delete;
  RowParallelLinear& operator=(const RowParallelLinear&) = delete;

  /// Plans the saved input [s, b, in/tp] in the open area (scratch with recompute_input or
  /// fp8_saves_input) and the shared scratch.
  void plan(BufferPlanner& planner, int64_t s, int64_t b);
  /// Where the producer writes this layer's input [s, b, in/tp] for `area` (saved unless
  /// recompute_input or fp8_saves_input).
  Tensor input(int area) const { return saved_.at(static_cast<size_t>(area)); }
  /// Delayed-scaling FP8 (docs/fp8.md "Fused quantisation"): whether the producer of input()
  /// (the SwiGLU) writes this layer's FP8 input in its own pass for a forward of `rows` = s·b rows
  /// (Fp8Settings::fused_activation, Fp8Linear::takes_fused_input).
  bool fuses_fp8_input(int64_t rows) const {
    return fp8_ && fp8_->settings().fused_activation && fp8_->takes_fused_input(rows);
  }
  /// Whether the FP8 transposed input is saved (Options::fp8_save_input, not recomputed): then
  /// the backward does not read the bf16 input().
  bool fp8_saves_input() const { return fp8_ && fp8_save_input_ && !recompute_input_; }
  /// Where that producer writes (Fp8Linear::fused_input of `rows` rows, with the saved x_t of
  /// `area` when fp8_saves_input): the next forward multiplies those bytes; the producer writes
  /// input(area) too unless fp8_saves_input. Errors: mt::Error unless fuses_fp8_input(rows).
  Fp8Linear::FusedInput fp8_input(int64_t rows, int area);
  /// Returns y [s_l, b, out] = reduce over TP of x Wᵀ, without the bias (a scratch view, valid
  /// until the next RowParallelLinear forward). With `add` (only when fuses_residual()): writes
  /// and returns add->out = add->residual + (x Wᵀ + bias) (ops/matmul.h linear_forward_add).
  Tensor forward(const StepContext& ctx, const ResidualAdd* add = nullptr);
  /// Whether forward takes a ResidualAdd: no tensor-parallel reduction follows the GEMM (TP 1).
  bool fuses_residual() const { return tp_.size() == 1; }
  /// The input of this layer was gelu(pre) (an MLP's fc2 after fc1 and the GELU): pre [s, b, in/tp]
  /// (the input's shape and dtype) and the producer's bias gradient (fp32 [in/tp]; empty when the
  /// producer has no bias).
  struct GeluInput {
    Tensor pre, dbias;
  };
  /// From dy [s_l, b, out]: returns dL/dx [s, b, in/tp] (a scratch view of this role); dW += dyᵀ x
  /// now or appended to `defer` (then dy's gathered copy must stay intact until it runs). With
  /// `gelu`: returns dL/dpre instead, and adds Σ dL/dpre to gelu->dbias (bf16: ops/matmul.h
  /// gelu_linear_backward, the GELU backward and the producer's bias gradient in the dgrad GEMM;
  /// FP8: fp8_gelu_backward after the dgrad GEMMs, the order the MLP's fused path shares).
  Tensor backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer = nullptr,
                  const GeluInput* gelu = nullptr);
  const ParamRef& weight() const { return weight_; }
  /// The bias [out] (unbound when the layer has none).
  const ParamRef& bias() const { return bias_; }

 private:
  const TensorParallelRegion& tp_;
  int64_t in_, out_;
  std::string role_;
  bool recompute_input_, fp8_save_input_;
  ParamRef weight_, bias_;
  std::vector<Tensor> saved_;   // per area: input [s, b, in/tp] (recompute_input: one scratch)
  Tensor out_full_, out_local_;  // [s, b, out], [s_l, b, out] (same memory without SP)
  Tensor dy_full_;               // SP: the gathered output gradient [s, b, out]
  Tensor dx_;                    // [s, b, in/tp]
  std::unique_ptr<Fp8Linear> fp8_;  // FP8 GEMMs (nullptr: bf16)
  bool fp8_input_ready_ = false;    // fp8_input was written for the next forward
};

/// A bias to add, or an empty tensor when the parameter is not declared.
inline Tensor value_or_empty(const ParamRef& p) { return p.bound() ? p.value() : Tensor(); }
inline Tensor grad_or_empty(const ParamRef& p) { return p.bound() ? p.grad() : Tensor(); }

}  // namespace mt
