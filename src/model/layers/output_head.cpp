#include "model/layers/output_head.h"

#include <algorithm>

#include "ops/cross_entropy.h"
#include "ops/elementwise.h"

namespace mt {

namespace {
/// Opens the head's registry group before its members declare their parameters.
ParamRegistry& head_group(ParamRegistry& reg) {
  reg.begin_group(/*sort_by_sharding=*/false);
  return reg;
}

ColumnParallelLinear::Options output_options(const TransformerConfig& c, int tp, const ParamRef* tied) {
  ColumnParallelLinear::Options o;
  // The last stage's copy of a tied embedding keeps the embedding's name (checkpoints and the
  // embedding-group all-reduce find it by name).
  o.prefix = c.tied_output() ? "embedding.word_embeddings" : "output_layer";
  o.in = c.hidden_size;
  o.out = c.padded_vocab_size(tp);
  o.bias = false;
  o.init_std = c.init_method_std;
  o.shared_weight = tied;
  o.shared_embedding_copy = c.tied_output() && tied == nullptr;
  o.vocab_rows = c.vocab_size;
  return o;
}

const void* scale_ptr(const Tensor& loss_scale) { return loss_scale.empty() ? nullptr : loss_scale.data(); }
}  // namespace

LanguageModelHead::LanguageModelHead(const TransformerConfig& c, const TensorParallelRegion& tp, ParamRegistry& reg,
                                     const ParamRef* tied_weight)
    : LanguageModelHead(c, tp, (head_group(reg), reg), "decoder.final_layernorm", c.tied_output() ? tied_weight : nullptr) {
  MT_CHECK(tied_weight == nullptr || c.tied_output(), "an untied output layer was given the word embedding");
}

LanguageModelHead::LanguageModelHead(const TransformerConfig& c, const TensorParallelRegion& tp, ParamRegistry& reg,
                                     const std::string& norm_prefix, const ParamRef* shared_output)
    : config_(c),
      tp_(tp),
      group_(reg.num_groups() - 1),
      vocab_start_(tp.rank() * (c.padded_vocab_size(tp.size()) / tp.size())),
      valid_cols_(std::clamp<int64_t>(c.vocab_size - vocab_start_, 0, c.padded_vocab_size(tp.size()) / tp.size())),
      final_layernorm_(c, norm_prefix, c.hidden_size, TpGradSum::kSequenceParallel, reg),
      output_layer_(output_options(c, tp.size(), shared_output), tp, reg) {}

Tensor LanguageModelHead::norm_output(int area) const {
  const Tensor full = rows(output_layer_.input_full(area));  // [s·b, h]: gathered under SP
  if (!tp_.sequence_parallel()) return full;
  const int64_t n = full.size(0) / tp_.size();
  return full.slice0(tp_.rank() * n, (tp_.rank() + 1) * n);
}

void LanguageModelHead::plan(BufferPlanner& p, int64_t s, int64_t b, const HeadOptions& o) {
  const int64_t T = s * b, vl = output_layer_.local_out();
  const DType t = p.act_dtype();
  final_layernorm_.plan(p, tp_.local_seq(s) * b);
  output_layer_.plan(p, s, b);
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& H = saved_[a];
  H.ce_max = p.saved(DType::kF32, {T}, "ce_max");
  H.ce_sumexp = p.saved(DType::kF32, {T}, "ce_sumexp");
  H.dln = p.saved(t, {tp_.local_seq(s) * b, config_.hidden_size}, "head dL/d(final norm output)");
  if (o.keep_logits) {
    chunk_rows_ = T;
    H.logits = p.saved(t, {T, vl}, "logits");
  } else {
    const int64_t fit = std::clamp<int64_t>(
        static_cast<int64_t>(o.chunk_bytes / (static_cast<size_t>(vl) * dtype_size(t))), 1, T);
    // As few chunks as fit in chunk_bytes, of equal rows: no small last chunk (an inefficient
    // GEMM) and no scratch beyond what the rows need.
    const int64_t chunks = (T + fit - 1) / fit;
    chunk_rows_ = (T + chunks - 1) / chunks;
    chunk_logits_ = p.scratch("head.chunk_logits", t, {chunk_rows_, vl});
  }
  ce_local_max_ = p.scratch("head.ce_local_max", DType::kF32, {T});
  ce_target_ = p.scratch("head.ce_target", DType::kF32, {T});
  losses_ = p.scratch("head.losses", DType::kF32, {T});
}

Tensor LanguageModelHead::dln_full(const Saved& H) const {
  return tp_.sequence_parallel() ? output_layer_.dgrad_scratch() : H.dln;
}

Tensor LanguageModelHead::logits(int area) const { return saved_.at(static_cast<size_t>(area)).logits; }

void LanguageModelHead::run_chunks(const Saved& H, bool stats, const Tensor& loss_accum, float loss_weight,
                                   const HeadGrad* grad, const Tensor& dx_full, const StepContext& ctx) {
  const Stream& st = ctx.stream;
  const int64_t T = H.ce_max.numel();
  const MicroBatch& mb = ctx.batch;
  check_tensor(mb.labels, DType::kI32, {mb.tokens.size(0), mb.tokens.size(1)}, "labels");
  const Tensor labels = mb.labels.view({T});
  const Tensor mask = mb.loss_mask.empty() ? Tensor() : mb.loss_mask.view({T});
  for (int64_t r0 = 0; r0 < T; r0 += chunk_rows_) {
    const int64_t n = std::min(chunk_rows_, T - r0);
    auto part = [&](const Tensor& v) { return v.empty() ? v : v.flat_range(r0, n); };
    const Tensor logits = H.logits.empty() ? chunk_logits_.slice0(0, n) : H.logits.slice0(r0, r0 + n);
    const Tensor mx = part(H.ce_max), se = part(H.ce_sumexp), tg = part(ce_target_), lab = part(labels),
                 m = part(mask);
    output_layer_.forward_rows(logits, r0, n, ctx);
    // One rank with the gradient: statistics and gradient in one pass over the chunk's logits.
    const bool fused = stats && grad && tp_.size() == 1;
    if (fused) {
      cross_entropy_forward_backward_inplace(mx, se, tg, logits, lab, m, valid_cols_, grad->grad_scale,
                                             grad->loss_scale, st);
    } else if (stats && tp_.size() == 1) {
      cross_entropy_stats(mx, se, tg, logits, lab, 0, valid_cols_, st);
    } else if (stats) {
      // Vocab-parallel cross entropy: three all-reduces of the chunk's rows, never of logits.
      Communicator& tp = tp_.group();
      const Tensor lmax = part(ce_local_max_);
      cross_entropy_stats(lmax, se, tg, logits, lab, vocab_start_, valid_cols_, st);
      copy(mx, lmax, st);
      tp.all_reduce(mx, ReduceOp::kMax, st);
      cross_entropy_rescale_sumexp(se, lmax, mx, st);
      tp.all_reduce(se, ReduceOp::kSum, st);
      tp.all_reduce(tg, ReduceOp::kSum, st);
    }
    if (stats) {
      cross_entropy_loss(part(losses_), mx, se, tg, m, st);
      sum_accumulate(loss_accum, part(losses_), loss_weight, st);
    }
    if (grad) {
      if (!fused)
        cross_entropy_backward_inplace(logits, lab, mx, se, m, vocab_start_, valid_cols_, grad->grad_scale,
                                       grad->loss_scale, st);
      output_layer_.backward_rows(logits, r0, n, dx_full, ctx);
    }
  }
}

void LanguageModelHead::forward(const Tensor& x, const Tensor& loss_accum, float loss_weight, bool compute_loss,
                                const HeadGrad* grad, const StepContext& ctx) {
  Saved& H = saved_.at(static_cast<size_t>(ctx.slot));
  MT_REQUIRE(compute_loss || !H.logits.empty(),
             "the language-model head of a training model computes its loss in chunks of {} rows and keeps no "
             "logits; logits need a model planned with keep_logits (HeadOptions, inference)",
             chunk_rows_);
  MT_CHECK(grad == nullptr || compute_loss, "the head's gradients need the loss");
  final_layernorm_.forward(rows(output_layer_.input(ctx.slot)), rows(x), ctx);
  output_layer_.gather_input(ctx);
  H.has_loss = compute_loss;
  H.has_grad = grad != nullptr;
  H.grad_scale = grad ? grad->grad_scale : 0.f;
  H.loss_scale = grad ? scale_ptr(grad->loss_scale) : nullptr;
  if (!compute_loss) {
    output_layer_.forward_rows(H.logits, 0, H.logits.size(0), ctx);
    return;
  }
  const Tensor dx_full = dln_full(H);
  run_chunks(H, /*stats=*/true, loss_accum, loss_weight, grad, dx_full, ctx);
  if (grad) output_layer_.reduce_input_grad(H.dln, dx_full, ctx);
}

void LanguageModelHead::backward(const Tensor& dx, const Tensor& x, float grad_scale, const Tensor& loss_scale,
                                 const StepContext& ctx, const Tensor& dln_add) {
  const Saved& H = saved_.at(static_cast<size_t>(ctx.slot));
  MT_REQUIRE(H.has_loss, "the language-model head's backward needs a forward that computed the loss");
  if (H.has_grad) {
    MT_REQUIRE(H.grad_scale == grad_scale && H.loss_scale == scale_ptr(loss_scale),
               "the language-model head's forward made its gradients with grad_scale {} and loss scale {}; the "
               "backward asks for grad_scale {} and loss scale {}",
               H.grad_scale, H.loss_scale ? "a device tensor" : "none", grad_scale,
               loss_scale.empty() ? "none" : "another device tensor");
  } else {
    // The forward kept the softmax statistics only: each chunk's logits are computed again.
    const Tensor dx_full = dln_full(H);
    const HeadGrad g{grad_scale, loss_scale};
    run_chunks(H, /*stats=*/false, Tensor(), 0.f, &g, dx_full, ctx);
    output_layer_.reduce_input_grad(H.dln, dx_full, ctx);
  }
  if (!dln_add.empty()) add(H.dln, H.dln, rows(dln_add), ctx.stream);  // e.g. the MTP's gradient of the norm output
  final_layernorm_.backward(rows(dx), H.dln, rows(x), /*accumulate_dx=*/false, ctx);
}

}  // namespace mt
