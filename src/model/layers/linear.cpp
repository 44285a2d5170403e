#include "model/layers/linear.h"

#include "model/fp8/fp8_model.h"
#include "model/layers/parallel_params.h"
#include "ops/fp8_fused.h"
#include "ops/matmul.h"

namespace mt {

namespace {
std::string last_component(const std::string& prefix) {
  const size_t dot = prefix.rfind('.');
  return dot == std::string::npos ? prefix : prefix.substr(dot + 1);
}

/// dst[k] += Σ_i src[i, k] (dst fp32 [k], src [m, k] in the act dtype), by the column sum that
/// gelu_linear_backward runs after its dgrad GEMM (ops/matmul.h; the same kernel, so the same
/// bits): linear_backward's bias gradient alone. With dx and dw empty it reads neither x nor w,
/// so views of src with the shapes it checks ([m, 1] and [k, 1]) stand in for them.
void add_column_sums(const Tensor& dst, const Tensor& src, const Stream& stream) {
  const int64_t m = src.size(0), k = src.size(1);
  const Tensor flat = src.view({m * k});
  linear_backward(Tensor(), Tensor(), dst, src, flat.slice0(0, m).view({m, 1}), flat.slice0(0, k).view({k, 1}),
                  stream);
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// ColumnParallelLinear
// ---------------------------------------------------------------------------------------------

ColumnParallelLinear::ColumnParallelLinear(const Options& o, const TensorParallelRegion& tp, ParamRegistry& reg)
    : tp_(tp),
      in_(o.in),
      out_(o.out),
      parts_(o.parts),
      role_(last_component(o.prefix)),
      recompute_input_(o.recompute_input),
      has_bias_(o.bias),
      weight_ptr_(o.shared_weight ? o.shared_weight : &weight_) {
  if (!o.shared_weight) {
    ParamSpec w = column_parallel_weight(o.prefix + ".weight", out_, in_, o.init_std, tp.size(), tp.rank(), parts_);
    w.shared_embedding_copy = o.shared_embedding_copy;
    w.vocab_rows = o.vocab_rows;
    w.grad_overwrite = true;  // written by backward / backward_rows only, every step
    reg.declare(std::move(w), &weight_);
  }
  if (o.bias) reg.declare(column_parallel_bias(o.prefix + ".bias", out_, tp.size(), tp.rank(), parts_), &bias_);
  if (reg.fp8() && !o.shared_weight) fp8_ = reg.fp8()->tp_linear(o.prefix, /*row=*/false, &weight_, local_out(), in_);
}

void ColumnParallelLinear::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  // FP8: the quantised transposed input is saved instead (Fp8Linear::plan)
  saved_[a] = recompute_input_ || fp8_ ? p.scratch(role_ + ".input", t, {s, b, in_})
                                       : p.saved(t, {s, b, in_}, "column-parallel input");
  const int64_t blocks = tp_.sequence_parallel() ? tp_.size() : 1;  // the GEMM's row blocks (all_gather_gemm)
  if (fp8_) fp8_->plan(p, s * b, /*save_input=*/!recompute_input_, /*variable_rows=*/false, blocks);
  const int64_t sl = tp_.local_seq(s);
  input_local_ = tp_.sequence_parallel() ? p.scratch("column_parallel.input_local", t, {sl, b, in_}) : Tensor();
  dx_full_ = p.scratch("column_parallel.dx", t, {s, b, in_});
  dx_local_ = tp_.sequence_parallel() ? p.scratch("column_parallel.dx_local", t, {sl, b, in_}) : dx_full_;
}

Tensor ColumnParallelLinear::input(int area) const {
  return tp_.sequence_parallel() ? input_local_ : saved_.at(static_cast<size_t>(area));
}

void ColumnParallelLinear::restore_input(const StepContext& ctx) {
  MT_CHECK(recompute_input_, "{}: restore_input without recompute_input", role_);
  tp_.enter_forward(saved_.at(static_cast<size_t>(ctx.slot)), input_local_, ctx.stream);
}

Fp8Linear::FusedInput ColumnParallelLinear::fp8_input(int64_t rows, int area) {
  MT_CHECK(fuses_fp8_input(rows), "{}: the producer cannot write the FP8 input of {} rows", role_, rows);
  fp8_input_ready_ = true;
  return fp8_->fused_input(rows, area);
}

Fp8Linear::FusedGrad ColumnParallelLinear::fp8_grad(int64_t rows, bool consumer_sums_bias) {
  MT_CHECK(fuses_fp8_grad(rows, consumer_sums_bias),
           "{}: the consumer cannot write the FP8 output gradient of {} rows{}", role_, rows,
           has_bias_ && !consumer_sums_bias ? " (the layer has a bias and the consumer does not sum its gradient)"
                                            : "");
  fp8_grad_ready_ = true;
  return fp8_->fused_grad(rows);
}

void ColumnParallelLinear::forward(const Tensor& y, const StepContext& ctx, const Tensor& pre_gelu, bool gather) {
  const Tensor& x = saved_.at(static_cast<size_t>(ctx.slot));
  const int64_t n = local_out();
  const Tensor y2 = y.view({y.numel() / n, n});
  const Tensor pre2 = pre_gelu.empty() ? Tensor() : pre_gelu.view({pre_gelu.numel() / n, n});
  const Tensor bias = value_or_empty(bias_);
  if (fp8_input_ready_) {  // the producer wrote the FP8 input (no sequence parallelism: nothing to gather)
    fp8_input_ready_ = false;
    fp8_->forward_fused(y2, bias, pre2, ctx.slot, ctx.stream);
    return;
  }
  // FP8: x's scale first (from this rank's sequence shard when the input is gathered block by
  // block), the saved x_t from the whole gathered input after
  const bool shard = gather && tp_.sequence_parallel();
  if (fp8_) fp8_->begin_forward(rows(shard ? input_local_ : x), shard, ctx.slot, ctx.stream);
  const bool fp8_gather = fp8_ && shard && fp8_->gathers_fp8();  // the input all-gathered in FP8 (docs/fp8.md)
  // y rows [first, first + count) from those rows of the gathered input (all of them at once
  // unless --tp-comm-overlap pipelines the all-gather with the GEMM)
  auto gemm = [&](const Tensor& x_rows, int64_t first) {
    const int64_t end = first + x_rows.size(0);
    const Tensor pre_rows = pre2.empty() ? Tensor() : pre2.slice0(first, end);
    if (fp8_gather) {
      fp8_->forward_fp8_rows(y2.slice0(first, end), x_rows, first, bias, pre_rows, ctx.slot, ctx.stream);
    } else if (fp8_) {
      fp8_->forward_rows(y2.slice0(first, end), x_rows, first, bias, pre_rows, ctx.slot, ctx.stream);
    } else {
      linear_forward(y2.slice0(first, end), x_rows, weight().value(), bias, pre_rows, ctx.stream);
    }
  };
  if (fp8_gather) {
    const auto [full, local] = fp8_->quantize_shard(rows(input_local_), ctx.slot, ctx.stream);
    tp_.all_gather_gemm(full, local, gemm, ctx.stream);
    fp8_->end_forward_fp8(ctx.slot, ctx.stream);
    return;
  }
  if (gather) {
    tp_.all_gather_gemm(x, input_local_, gemm, ctx.stream);
  } else {
    gemm(rows(x), 0);
  }
  if (fp8_) fp8_->end_forward(rows(x), ctx.slot, ctx.stream);
}

Tensor ColumnParallelLinear::gather_input(const StepContext& ctx) {
  const Tensor& x = saved_.at(static_cast<size_t>(ctx.slot));
  tp_.enter_forward(x, input_local_, ctx.stream);
  return rows(x);
}

void ColumnParallelLinear::forward_rows(const Tensor& y, int64_t first, int64_t count, const StepContext& ctx) {
  MT_CHECK(!fp8_, "{}: forward_rows has no FP8 path (the LM head stays in higher precision)", role_);
  const Tensor x = rows(saved_.at(static_cast<size_t>(ctx.slot)));
  linear_forward(y, x.slice0(first, first + count), weight().value(), value_or_empty(bias_), Tensor(), ctx.stream);
}

void ColumnParallelLinear::backward_rows(const Tensor& dy, int64_t first, int64_t count, const Tensor& dx_full,
                                         const StepContext& ctx) {
  const Tensor x = rows(saved_.at(static_cast<size_t>(ctx.slot)));
  linear_backward(dx_full.slice0(first, first + count), weight().grad(), grad_or_empty(bias_), dy,
                  x.slice0(first, first + count), weight().value(), ctx.stream, weight().grad_write());
}

void ColumnParallelLinear::reduce_input_grad(const Tensor& dx_local, const Tensor& dx_full,
                                             const StepContext& ctx) const {
  tp_.enter_backward(dx_local, dx_full, ctx.stream);
}

Tensor ColumnParallelLinear::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer,
                                      bool bias_grad_done) {
  const Tensor x = rows(saved_.at(static_cast<size_t>(ctx.slot)));
  const Tensor dw = weight().grad(), db = bias_grad_done ? Tensor() : grad_or_empty(bias_);
  const Tensor dy2 = dy.view({dy.numel() / local_out(), local_out()});
  // dgrad of rows [first, first + count) into dx_rows; the TP reduction of dx follows (in pieces
  // pipelined with these GEMMs under --tp-comm-overlap), the weight gradient runs before it ends
  // (FP8: never deferred)
  // (fp8_grad: the consumer wrote the FP8 dy and began the backward)
  if (fp8_ && !fp8_grad_ready_) fp8_->begin_backward(dy2, /*shard=*/false, ctx.stream);
  fp8_grad_ready_ = false;
  auto dgrad = [&](const Tensor& dx_rows, int64_t first) {
    const int64_t end = first + dx_rows.size(0);
    if (fp8_) {
      fp8_->dgrad_rows(dx_rows, dy2.slice0(first, end), first, Tensor(), ctx.stream);
    } else {
      linear_backward(dx_rows, Tensor(), Tensor(), dy2.slice0(first, end), x.slice0(first, end), weight().value(),
                      ctx.stream);
    }
  };
  auto wgrad = [&] {
    if (fp8_) {
      fp8_->wgrad(dw, weight().grad_write(), db, dy2, x, ctx.slot, ctx.stream);
    } else if (defer) {
      defer->add(dw, db, dy2, x, weight().value(), weight().grad_write());
    } else {
      linear_backward(Tensor(), dw, db, dy2, x, weight().value(), ctx.stream, weight().grad_write());
    }
  };
  tp_.gemm_reduce_scatter(dx_local_, dx_full_, dgrad, wgrad, ctx.stream);
  return dx_local_;
}

// ---------------------------------------------------------------------------------------------
// RowParallelLinear
// ---------------------------------------------------------------------------------------------

RowParallelLinear::RowParallelLinear(const Options& o, const TensorParallelRegion& tp, ParamRegistry& reg)
    : tp_(tp),
      in_(o.in),
      out_(o.out),
      role_(last_component(o.prefix)),
      recompute_input_(o.recompute_input),
      fp8_save_input_(o.fp8_save_input) {
  ParamSpec w = row_parallel_weight(o.prefix + ".weight", out_, in_, o.init_std, tp.size(), tp.rank());
  w.grad_overwrite = true;  // written by backward only, every step
  reg.declare(std::move(w), &weight_);
  if (o.bias)
    reg.declare(replicated_param(o.prefix + ".bias", {out_}, InitKind::kZeros, 0.f, TpGradSum::kSequenceParallel),
                &bias_);
  if (reg.fp8()) fp8_ = reg.fp8()->tp_linear(o.prefix, /*row=*/true, &weight_, out_, in_ / tp.size());
}

void RowParallelLinear::plan(BufferPlanner& p, int64_t s, int64_t b) {
  const DType t = p.act_dtype();
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  const int64_t in_l = in_ / tp_.size(), sl = tp_.local_seq(s);
  // FP8 with fp8_save_input: the quantised transposed input is saved instead (Fp8Linear::plan)
  saved_[a] = recompute_input_ || fp8_saves_input() ? p.scratch(role_ + ".input", t, {s, b, in_l})
                                                    : p.saved(t, {s, b, in_l}, "row-parallel input");
  if (fp8_)
    fp8_->plan(p, s * b, /*save_input=*/fp8_saves_input(), /*variable_rows=*/false,
               tp_.sequence_parallel() ? tp_.size() : 1, /*gathered_input=*/false);
  out_full_ = p.scratch("row_parallel.out", t, {s, b, out_});
  out_local_ = tp_.sequence_parallel() ? p.scratch("row_parallel.out_local", t, {sl, b, out_}) : out_full_;
  dy_full_ = tp_.sequence_parallel() ? p.scratch("row_parallel.dy", t, {s, b, out_}) : Tensor();
  dx_ = p.scratch(role_ + ".dx", t, {s, b, in_l});
}

Fp8Linear::FusedInput RowParallelLinear::fp8_input(int64_t rows, int area) {
  MT_CHECK(fuses_fp8_input(rows), "{}: the producer cannot write the FP8 input of {} rows", role_, rows);
  fp8_input_ready_ = true;
  return fp8_->fused_input(rows, area, /*transposed=*/true);
}

Tensor RowParallelLinear::forward(const StepContext& ctx, const ResidualAdd* add) {
  const Tensor& x = saved_.at(static_cast<size_t>(ctx.slot));
  const bool fused = fp8_input_ready_;  // the producer wrote the FP8 input (one row block)
  fp8_input_ready_ = false;
  if (add) {
    MT_CHECK(fuses_residual(), "{}: the residual add cannot be fused under tensor parallelism", role_);
    if (fused) {
      fp8_->forward_fused_add(rows(add->out), value_or_empty(bias_), rows(add->residual), ctx.slot, ctx.stream);
    } else if (fp8_) {
      fp8_->forward_add(rows(add->out), rows(x), value_or_empty(bias_), rows(add->residual), ctx.slot, ctx.stream);
    } else {
      linear_forward_add(rows(add->out), rows(x), weight_.value(), value_or_empty(bias_), rows(add->residual),
                         ctx.stream);
    }
    return add->out;
  }
  const Tensor x2 = rows(x);
  if (fp8_ && !fused) fp8_->begin_forward(x2, /*shard=*/false, ctx.slot, ctx.stream);
  auto gemm = [&](const Tensor& out_rows, int64_t first) {  // partial sums of rows [first, first + count)
    const Tensor x_rows = x2.slice0(first, first + out_rows.size(0));
    if (fused) {  // one block of all rows (no sequence parallelism)
      fp8_->forward_fused(out_rows, Tensor(), Tensor(), ctx.slot, ctx.stream);
    } else if (fp8_) {
      fp8_->forward_rows(out_rows, x_rows, first, Tensor(), Tensor(), ctx.slot, ctx.stream);
    } else {
      linear_forward(out_rows, x_rows, weight_.value(), Tensor(), Tensor(), ctx.stream);
    }
  };
  tp_.gemm_reduce_scatter(out_local_, out_full_, gemm, {}, ctx.stream);
  if (fp8_ && !fused) fp8_->end_forward(x2, ctx.slot, ctx.stream);
  return out_local_;
}

Tensor RowParallelLinear::backward(const Tensor& dy, const StepContext& ctx, WgradDeferral* defer,
                                   const GeluInput* gelu) {
  const Tensor x = rows(saved_.at(static_cast<size_t>(ctx.slot)));
  const Tensor dy_full = tp_.sequence_parallel() ? dy_full_ : dy;
  const GradWrite dw_write = weight_.grad_write();  // taken now, also for the deferred GEMM
  const Tensor dx = rows(dx_), pre = gelu ? rows(gelu->pre) : Tensor();
  // FP8: dy's scale first (from this rank's sequence shard under sequence parallelism)
  if (fp8_) fp8_->begin_backward(rows(dy), /*shard=*/tp_.sequence_parallel(), ctx.stream);
  // dgrad of rows [first, first + count) from those rows of the gathered output gradient (all of
  // them at once unless --tp-comm-overlap pipelines the all-gather with the GEMM); with `gelu` the
  // GELU backward rides on it (bf16: the GEMM's epilogue) and the producer's bias gradient follows
  // over all rows, as gelu_linear_backward computes it (FP8: both after the GEMMs, in one pass —
  // the pass that the MLP's fused path runs with FP8 output, so that the two give the same bits)
  auto dgrad = [&](const Tensor& dy_rows, int64_t first) {
    const int64_t end = first + dy_rows.size(0);
    if (fp8_) {
      fp8_->dgrad_rows(dx.slice0(first, end), dy_rows, first, Tensor(), ctx.stream);
    } else if (gelu) {
      gelu_linear_backward(dx.slice0(first, end), Tensor(), Tensor(), Tensor(), dy_rows, x.slice0(first, end),
                           pre.slice0(first, end), weight_.value(), ctx.stream);
    } else {
      linear_backward(dx.slice0(first, end), Tensor(), Tensor(), dy_rows, x.slice0(first, end), weight_.value(),
                      ctx.stream);
    }
  };
  tp_.all_gather_gemm(dy_full, dy, dgrad, ctx.stream);
  if (gelu && fp8_) {  // the GELU backward and the producer's bias gradient in one pass over all rows
    fp8_gelu_backward(dx, Tensor(), Tensor(), gelu->dbias, dx, pre, Tensor(), Tensor(), ctx.stream);
  } else if (gelu && !gelu->dbias.empty()) {
    add_column_sums(gelu->dbias, dx, ctx.stream);
  }
  if (fp8_) {  // the weight gradient now (never deferred)
    fp8_->wgrad(weight_.grad(), dw_write, Tensor(), rows(dy_full), x, ctx.slot, ctx.stream);
  } else if (defer) {
    defer->add(weight_.grad(), Tensor(), rows(dy_full), x, weight_.value(), dw_write);
  } else {
    linear_backward(Tensor(), weight_.grad(), Tensor(), rows(dy_full), x, weight_.value(), ctx.stream, dw_write);
  }
  return dx_;
}

}  // namespace mt
