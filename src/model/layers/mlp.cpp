#include "model/layers/mlp.h"

#include <cmath>

#include "ops/fp8_fused.h"

namespace mt {

namespace {
std::string mlp_prefix(int64_t layer) { return fmt::format("decoder.layers.{}.mlp", layer); }

ColumnParallelLinear::Options fc1_options(const TransformerConfig& c, const std::string& prefix, int64_t ffn,
                                          const MLP::Recompute& r) {
  ColumnParallelLinear::Options o;
  o.prefix = prefix + ".linear_fc1";
  o.in = c.hidden_size;
  o.out = ffn;
  o.parts = mlp_activation_kind(c.activation()).fc1_parts;
  o.bias = c.add_bias_linear;
  o.init_std = c.init_method_std;
  o.recompute_input = r.input;
  return o;
}

RowParallelLinear::Options fc2_options(const TransformerConfig& c, const std::string& prefix, int64_t ffn,
                                       const MLP::Recompute& r) {
  RowParallelLinear::Options o;
  o.prefix = prefix + ".linear_fc2";
  o.in = ffn;
  o.out = c.hidden_size;
  o.bias = c.add_bias_linear;
  o.init_std = c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  o.recompute_input = r.mlp || r.act;
  o.fp8_save_input = true;  // only its weight gradient reads the activation in the backward
  return o;
}

MLP::Recompute dense_recompute(const TransformerConfig& c) {
  const RecomputeModules m = c.selective_recompute();
  return MLP::Recompute{m.layernorm, m.mlp, m.mlp_act};
}
}  // namespace

void mlp_activation(const Tensor& act, const Tensor& pre, bool gated, const Stream& stream) {
  mlp_activation_kind(mlp_activation_of(gated)).forward(act, pre, stream);
}

MLP::MLP(const TransformerConfig& c, int64_t layer, const TensorParallelRegion& tp, ParamRegistry& reg)
    : MLP(c, mlp_prefix(layer), c.ffn(), tp, reg, dense_recompute(c)) {}

MLP::MLP(const TransformerConfig& c, const std::string& prefix, int64_t ffn, const TensorParallelRegion& tp,
         ParamRegistry& reg, Recompute recompute)
    : act_(mlp_activation_kind(c.activation())),
      recompute_(recompute),
      local_ffn_(ffn / tp.size()),
      linear_fc1_(fc1_options(c, prefix, ffn, recompute), tp, reg),
      linear_fc2_(fc2_options(c, prefix, ffn, recompute), tp, reg) {}

void MLP::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  linear_fc1_.plan(p, s, b);
  const size_t a = static_cast<size_t>(p.area());
  if (pre_.size() <= a) pre_.resize(a + 1);
  const std::vector<int64_t> pre_shape{s, b, act_.fc1_parts * local_ffn_};
  pre_[a] = recompute_.mlp ? p.scratch("mlp.pre", t, pre_shape) : p.saved(t, pre_shape, "fc1 output before the activation");
  linear_fc2_.plan(p, s, b);
  d_pre_ = act_.gelu_epilogue ? Tensor() : p.scratch("mlp.d_pre", t, pre_shape);
}

void MLP::forward_fc1(const StepContext& ctx, bool gather) {
  const Tensor& pre = pre_.at(static_cast<size_t>(ctx.slot));
  const Tensor act = linear_fc2_.input(ctx.slot);
  if (act_.gelu_epilogue) {
    linear_fc1_.forward(act, ctx, /*pre_gelu=*/pre, gather);  // GELU in the GEMM epilogue
  } else {
    linear_fc1_.forward(pre, ctx, Tensor(), gather);
    act_.forward(act, pre, ctx.stream);
  }
}

Tensor MLP::forward(const StepContext& ctx, const ResidualAdd* add) {
  const Tensor& pre = pre_.at(static_cast<size_t>(ctx.slot));
  const int64_t m = pre.numel() / pre.size(-1);
  const bool swiglu = act_.kind == MlpActivation::kSwiGLU;
  if ((swiglu || act_.gelu_epilogue) && linear_fc2_.fuses_fp8_input(m)) {
    // the SwiGLU (or the GELU, from fc1's output with its bias added in fc1's GEMM epilogue) writes
    // fc2's FP8 input and its saved transpose in one pass, and no bf16 output: fc2 multiplies the
    // bytes, and where it saves no FP8 input (mlp / mlp_act recompute) the backward writes the
    // activation again before fc2's weight gradient reads it
    linear_fc1_.forward(pre, ctx);
    const Fp8Linear::FusedInput q = linear_fc2_.fp8_input(m, ctx.slot);
    if (swiglu) {
      fp8_swiglu_forward(Tensor(), q.xq, q.x_t, rows(pre), q.scale, q.record, ctx.stream);
    } else {
      fp8_gelu_forward(Tensor(), q.xq, q.x_t, rows(pre), q.scale, q.record, ctx.stream);
    }
  } else {
    forward_fc1(ctx, /*gather=*/true);
  }
  return linear_fc2_.forward(ctx, add);
}

Tensor MLP::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer) {
  const Tensor& pre = pre_.at(static_cast<size_t>(ctx.slot));
  // Selective recompute: what the forward did not keep, again. The scratch written here is read
  // by linear_fc2's weight gradient below (never deferred) and, for the input, by linear_fc1's,
  // which may be deferred: nothing of another layer runs before a deferral does (GPTModel defers
  // only the first layer's, past the embedding backward), and the scratch keys are this role's.
  if (recompute_.mlp) {
    forward_fc1(ctx, /*gather=*/false);  // the gathered input is saved, or restored by the layer
  } else if (recompute_.act) {  // from the kept fc1 output (GELU: rounded; the forward's epilogue used fp32)
    act_.forward(linear_fc2_.input(ctx.slot), pre, ctx.stream);
  }
  const int64_t m = pre.numel() / pre.size(-1);
  const bool gelu = act_.gelu_epilogue, swiglu = act_.kind == MlpActivation::kSwiGLU;
  if ((swiglu || gelu) && linear_fc1_.fuses_fp8_grad(m, /*consumer_sums_bias=*/gelu)) {
    // the SwiGLU's (or the GELU's, with fc1's bias gradient) backward writes fc1's FP8 output
    // gradient and its transpose in one pass, no bf16 gradient (fc1's backward takes its argument
    // for the shape only: d_pre_, or the GELU's d_act of the same shape)
    const Tensor d_act = linear_fc2_.backward(dy, ctx);
    const Fp8Linear::FusedGrad g = linear_fc1_.fp8_grad(m, /*consumer_sums_bias=*/gelu);
    if (gelu) {
      fp8_gelu_backward(Tensor(), g.dyq, g.dyq_t, grad_or_empty(linear_fc1_.bias()), rows(d_act), rows(pre), g.scale,
                        g.record, ctx.stream);
    } else {
      fp8_swiglu_backward(g.dyq, g.dyq_t, rows(d_act), rows(pre), g.scale, g.record, ctx.stream);
    }
    return linear_fc1_.backward(gelu ? d_act : d_pre_, ctx, defer, /*bias_grad_done=*/gelu);
  }
  if (gelu) {
    // fc2's dgrad applies the GELU backward and takes fc1's bias gradient (one fused GEMM on CUDA)
    const RowParallelLinear::GeluInput gelu{pre, grad_or_empty(linear_fc1_.bias())};
    const Tensor d_pre = linear_fc2_.backward(dy, ctx, nullptr, &gelu);
    return linear_fc1_.backward(d_pre, ctx, defer, /*bias_grad_done=*/true);
  }
  const Tensor d_act = linear_fc2_.backward(dy, ctx);
  act_.backward(d_pre_, d_act, pre, ctx.stream);
  return linear_fc1_.backward(d_pre_, ctx, defer);
}

}  // namespace mt
