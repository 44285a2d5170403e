#include "model/moe/experts.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "model/fp8/fp8_model.h"
#include "model/layers/mlp.h"
#include "model/layers/parallel_params.h"
#include "model/moe/moe_utils.h"
#include "ops/gelu.h"
#include "ops/matmul.h"
#include "ops/swiglu.h"

namespace mt {

MoeExperts::MoeExperts(const TransformerConfig& c, const std::string& p, const ExpertParallel& ep, int64_t num_echo,
                       ParamRegistry& reg)
    : gated_(c.gated_linear_unit),
      recompute_act_(c.selective_recompute().moe_act),
      hidden_(c.hidden_size),
      num_local_(c.num_moe_experts / std::max(ep.ep_size, 1)),
      num_echo_(num_echo),
      local_ffn_(c.moe_ffn() / std::max(ep.etp_size, 1)) {
  const int64_t first_expert = static_cast<int64_t>(ep.ep_rank) * num_local_, h = c.hidden_size;
  experts_.resize(static_cast<size_t>(num_local_));
  const float out_std = c.init_method_std / std::sqrt(2.0f * static_cast<float>(c.num_layers));
  for (int64_t i = 0; i < num_local_; ++i) {
    const std::string e = fmt::format("{}experts.local_experts.{}.", p, first_expert + i);
    ParamSpec fc1 = column_parallel_weight(e + "linear_fc1.weight", c.moe_ffn(), h, c.init_method_std, ep.etp_size,
                                           ep.etp_rank, gated_ ? 2 : 1);
    ParamSpec fc2 = row_parallel_weight(e + "linear_fc2.weight", h, c.moe_ffn(), out_std, ep.etp_size, ep.etp_rank);
    fc1.expert = fc2.expert = true;
    reg.declare(std::move(fc1), &experts_[static_cast<size_t>(i)].fc1);
    reg.declare(std::move(fc2), &experts_[static_cast<size_t>(i)].fc2);
  }
  if (num_echo_ > 0)
    clones_ = std::make_unique<EchoClones>(ep, num_local_, num_echo_, c.moe_received_token_capacity > 0);
  etp_ = ep.etp_group.get();
  if (Fp8Model* f = reg.fp8(); f && f->layer_on(Fp8Model::decoder_layer(p))) {
    fp8_model_ = f;
    // columns of every global expert (the same in every EP layout); fc1 like a column-parallel
    // linear over ETP (x replicated), fc2 like a row-parallel one (dy replicated)
    const int64_t layer = Fp8Model::decoder_layer(p), base = f->reserve(layer, 2 * c.num_moe_experts);
    Communicator* etp = ep.etp_group.get();
    for (int64_t i = 0; i < num_local_; ++i) {
      Expert& ex = experts_[static_cast<size_t>(i)];
      const std::string e = fmt::format("{}experts.local_experts.{}.", p, first_expert + i);
      const int64_t col = base + 2 * (first_expert + i);
      ex.fp8_fc1 = f->make_linear(layer, col, e + "linear_fc1", &ex.fc1, (gated_ ? 2 : 1) * local_ffn_, h,
                                  Fp8Groups{nullptr, etp, etp});
      ex.fp8_fc2 = f->make_linear(layer, col + 1, e + "linear_fc2", &ex.fc2, h, local_ffn_, Fp8Groups{etp, etp, nullptr});
    }
  }
}

Fp8Linear* MoeExperts::fp8(int64_t e, int fc) const {
  if (e >= num_local_) return nullptr;  // ECHO clone slots (not with FP8)
  const Expert& ex = experts_[static_cast<size_t>(e)];
  return fc == 1 ? ex.fp8_fc1.get() : ex.fp8_fc2.get();
}

void MoeExperts::plan_fp8(BufferPlanner& p, int64_t max_rows) {
  for (Expert& ex : experts_)  // each expert's rows vary per dispatch (padded to 16 inside)
    for (Fp8Linear* l : {ex.fp8_fc1.get(), ex.fp8_fc2.get()})
      l->plan(p, max_rows, /*save_input=*/false, /*variable_rows=*/true);
}

void MoeExperts::plan(BufferPlanner& p, int64_t max_rows, bool save_output) {
  const DType t = p.act_dtype();
  const int64_t h = hidden_, f1 = (gated_ ? 2 : 1) * local_ffn_, f2 = local_ffn_;
  max_rows_ = max_rows;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  sv.xp = p.saved(t, {max_rows, h}, "expert inputs");
  sv.pre = p.saved(t, {max_rows, f1}, "expert fc1 outputs");
  // --recompute-modules moe_act: one scratch, the activation again in the backward
  sv.act = recompute_act_ ? p.scratch("moe.act", t, {max_rows, f2}) : p.saved(t, {max_rows, f2}, "expert activations");
  // kept for the backward only where the dispatcher's combine_backward reads them (allgather)
  sv.out = save_output ? p.saved(t, {max_rows, h}, "expert outputs") : p.scratch("moe.out", t, {max_rows, h});
  if (clones_) clones_->plan(p, f1, f2, h);  // the clones' weights and gradients: fetched per use (scratch)
  if (fp8_model_) plan_fp8(p, max_rows);
  d_out_ = p.scratch("moe.d_out", t, {max_rows, h});
  d_act_ = p.scratch("moe.d_act", t, {max_rows, f2});
  d_pre_ = p.scratch("moe.d_pre", t, {max_rows, f1});
  d_xp_ = p.scratch("moe.d_xp", t, {max_rows, h});
}

Tensor MoeExperts::forward(MoeExpertCounts counts, const MoeTokenDispatcher& d, int slot, const Stream& st) {
  begin_forward(std::move(counts), d, slot, st);
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  compute_forward(sv, all(sv), st);
  return output(slot);
}

void MoeExperts::claim(bool grads) const {
  if (experts_.empty()) return;
  const ParamStore& store = *experts_.front().fc1.store;
  if (!store.params_staged() && !store.grads_staged()) return;
  for (const Expert& ex : experts_) {
    (void)ex.fc1.value();
    (void)ex.fc2.value();
    if (!grads) continue;
    (void)ex.fc1.grad();
    (void)ex.fc2.grad();
  }
}

void MoeExperts::begin_forward(MoeExpertCounts counts, const MoeTokenDispatcher& d, int slot, const Stream& st) {
  claim(/*grads=*/false);
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  sv.counts = counts.device;
  sv.counts_host = std::move(counts.host);
  sv.rows = rows_of(sv);
  sv.slot = slot;
  if (clones_) clones_->fetch_weights(d, slot, *this, st);  // the home experts' weights into the clone slots
}

void MoeExperts::forward_range(int slot, const ExpertRange& r, const Stream& st) {
  compute_forward(saved_.at(static_cast<size_t>(slot)), r, st);
}

Tensor MoeExperts::output(int slot) const {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  return row_range(sv.out, 0, sv.rows);
}

void MoeExperts::prepare_backward(const MoeTokenDispatcher& d, int slot, const Stream& st) {
  claim(/*grads=*/true);
  if (!clones_) return;
  clones_->fetch_weights(d, slot, *this, st);  // the clones' weights again (scratch), their gradients from zero
  clones_->zero_grads(st);
}

Tensor MoeExperts::output_grad(int slot) const {
  return row_range(d_out_, 0, saved_.at(static_cast<size_t>(slot)).rows);
}

Tensor MoeExperts::input_grad(int slot) const { return row_range(d_xp_, 0, saved_.at(static_cast<size_t>(slot)).rows); }

Tensor MoeExperts::backward(const MoeTokenDispatcher& d, int slot, const Stream& st) {
  claim(/*grads=*/true);
  Saved& sv = saved_.at(static_cast<size_t>(slot));
  compute_backward(sv, all(sv), /*wgrad=*/true, st);
  return finish_backward(d, slot, st);
}

void MoeExperts::backward_range(int slot, const ExpertRange& r, bool wgrad, const Stream& st) {
  claim(/*grads=*/true);
  compute_backward(saved_.at(static_cast<size_t>(slot)), r, wgrad, st);
}

void MoeExperts::wgrad_range(int slot, const ExpertRange& r, const Stream& st) {
  claim(/*grads=*/true);
  compute_wgrad(saved_.at(static_cast<size_t>(slot)), r, st);
}

Tensor MoeExperts::finish_backward(const MoeTokenDispatcher& d, int slot, const Stream& st) {
  if (clones_) clones_->return_grads(d, slot, *this, st);  // the clones' weight gradients added to their home experts
  return input_grad(slot);
}

ExpertSlot MoeExperts::expert(int64_t e) const {
  if (e < num_local_) {
    const Expert& ex = experts_[static_cast<size_t>(e)];
    // the gradients' addresses: bound by claim() in the backward, not here (the forward builds the
    // tables)
    return {ex.fc1.value(), ex.fc2.value(), ex.fc1.grad_view(), ex.fc2.grad_view()};
  }
  const int64_t j = e - num_local_;  // ECHO clone slot
  return {clones_->w1(j), clones_->w2(j), clones_->g1(j), clones_->g2(j)};
}

const ExpertTables& MoeExperts::tables(const Stream& st) {
  if (tables_) return *tables_;
  std::vector<Tensor> w1, w2, g1, g2;
  for (int64_t e = 0; e < num_slots(); ++e) {
    const ExpertSlot ex = expert(e);
    w1.push_back(ex.w1);
    w2.push_back(ex.w2);
    g1.push_back(ex.g1);
    g2.push_back(ex.g2);
  }
  tables_ = std::make_unique<ExpertTables>(ExpertTables{GroupedWeights(std::move(w1), st),
                                                        GroupedWeights(std::move(w2), st),
                                                        GroupedWeights(std::move(g1), st),
                                                        GroupedWeights(std::move(g2), st)});
  return *tables_;
}

const ExpertTables& MoeExperts::tables(int64_t first, int64_t last, const Stream& st) {
  if (first == 0 && last == num_slots()) return tables(st);
  MT_CHECK(first >= 0 && first < last && last <= num_slots(), "MoeExperts: expert slots [{}, {}) of {}", first, last,
           num_slots());
  std::unique_ptr<ExpertTables>& t = range_tables_[{first, last}];
  if (t) return *t;
  std::vector<Tensor> w1, w2, g1, g2;
  for (int64_t e = first; e < last; ++e) {
    const ExpertSlot ex = expert(e);
    w1.push_back(ex.w1);
    w2.push_back(ex.w2);
    g1.push_back(ex.g1);
    g2.push_back(ex.g2);
  }
  t = std::make_unique<ExpertTables>(ExpertTables{GroupedWeights(std::move(w1), st), GroupedWeights(std::move(w2), st),
                                                  GroupedWeights(std::move(g1), st), GroupedWeights(std::move(g2), st)});
  return *t;
}

// ---------------------------------------------------------------------------------------------
// SequentialMLP
// ---------------------------------------------------------------------------------------------

int64_t SequentialMLP::rows_of(const Saved& sv) const {
  return std::accumulate(sv.counts_host.begin(), sv.counts_host.end(), int64_t{0});
}

// Calls fn(e, expert, slice) for every slot e of `r` with rows in this dispatch, in slot order;
// slice(t) is that slot's row range [off, off + n) of a [R_max, ·] buffer.
template <typename Fn>
void SequentialMLP::for_each_expert(const Saved& sv, const ExpertRange& r, Fn&& fn) const {
  int64_t off = r.row_begin;
  for (int64_t e = r.first; e < r.last; ++e) {
    const int64_t n = sv.counts_host[static_cast<size_t>(e)];
    if (n > 0) fn(e, expert(e), [off, n](const Tensor& t) { return row_range(t, off, n); });
    off += n;
  }
}

namespace {
// One expert projection y = x wᵀ (GELU epilogue with pre_gelu): FP8 when the layer runs FP8.
void project(Fp8Linear* fp8, const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& pre_gelu, int slot,
             const Stream& st) {
  if (fp8) {
    fp8->forward(y, x, Tensor(), pre_gelu, slot, st);
  } else {
    linear_forward(y, x, w, Tensor(), pre_gelu, st);
  }
}
// Its backward: dx = dy w, dw += dyᵀ x.
void project_backward(Fp8Linear* fp8, const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, int slot, const Stream& st) {
  if (fp8) {
    fp8->backward({dx, dw, GradWrite::kAccumulate, Tensor(), Tensor(), Tensor()}, dy, x, slot, st);
  } else {
    linear_backward(dx, dw, Tensor(), dy, x, w, st);
  }
}
}  // namespace

void SequentialMLP::compute_forward(Saved& sv, const ExpertRange& r, const Stream& st) {
  for_each_expert(sv, r, [&](int64_t e, const ExpertSlot& ex, const auto& slice) {
    const Tensor xe = slice(sv.xp), pre = slice(sv.pre), act = slice(sv.act);
    if (gated_) {
      project(fp8(e, 1), pre, xe, ex.w1, Tensor(), sv.slot, st);
      mlp_activation(act, pre, true, st);
    } else {
      project(fp8(e, 1), act, xe, ex.w1, pre, sv.slot, st);  // GELU epilogue
    }
    project(fp8(e, 2), slice(sv.out), act, ex.w2, Tensor(), sv.slot, st);
  });
}

void SequentialMLP::compute_backward(Saved& sv, const ExpertRange& r, bool wgrad, const Stream& st) {
  for_each_expert(sv, r, [&](int64_t e, const ExpertSlot& ex, const auto& slice) {
    const Tensor xe = slice(sv.xp), pre = slice(sv.pre), act = slice(sv.act);
    const Tensor dact = slice(d_act_), dpre = slice(d_pre_);
    if (recompute_act_) mlp_activation(act, pre, gated_, st);
    // the input and weight gradients are separate GEMMs: the same bits with the weight's later
    project_backward(fp8(e, 2), dact, wgrad ? ex.g2 : Tensor(), slice(d_out_), act, ex.w2, sv.slot, st);
    if (gated_) {
      swiglu_backward(dpre, dact, pre, st);
    } else {
      gelu_backward(dpre, dact, pre, st);
    }
    project_backward(fp8(e, 1), slice(d_xp_), wgrad ? ex.g1 : Tensor(), dpre, xe, ex.w1, sv.slot, st);
  });
}

// Only with --delay-wgrad-compute, which FP8 refuses (TransformerConfig::validate): plain GEMMs.
void SequentialMLP::compute_wgrad(Saved& sv, const ExpertRange& r, const Stream& st) {
  for_each_expert(sv, r, [&](int64_t e, const ExpertSlot& ex, const auto& slice) {
    MT_CHECK(fp8(e, 1) == nullptr, "SequentialMLP: delayed weight gradients of FP8 experts are not supported");
    linear_backward(Tensor(), ex.g2, Tensor(), slice(d_out_), slice(sv.act), ex.w2, st);
    linear_backward(Tensor(), ex.g1, Tensor(), slice(d_pre_), slice(sv.xp), ex.w1, st);
  });
}

// ---------------------------------------------------------------------------------------------
// GroupedMLP
// ---------------------------------------------------------------------------------------------

void GroupedMLP::plan_fp8(BufferPlanner& p, int64_t max_rows) {
  if (!fp8_) {
    std::vector<Fp8Linear*> fc1, fc2;
    for (int64_t e = 0; e < num_local(); ++e) {
      fc1.push_back(fp8(e, 1));
      fc2.push_back(fp8(e, 2));
    }
    fp8_ = std::make_unique<GroupedFp8Experts>(*fp8_model_, std::move(fc1), std::move(fc2), etp_);
  }
  fp8_->plan(p, max_rows);
}

void GroupedMLP::check_fp8_range(const Saved& sv, const ExpertRange& r) const {
  MT_CHECK(r.first == 0 && r.last == num_slots() && r.row_begin == 0 && r.rows == sv.rows,
           "GroupedMLP: FP8 experts run every slot at once, got slots [{}, {}) rows [{}, +{})", r.first, r.last,
           r.row_begin, r.rows);
}

// With every slot (all()) the calls cover the whole [R_max, ·] buffers; a chunk's cover its rows.
void GroupedMLP::compute_forward(Saved& sv, const ExpertRange& r, const Stream& st) {
  const Tensor counts = sv.counts.slice0(r.first, r.last);
  const auto rr = [&](const Tensor& x) { return row_range(x, r.row_begin, r.rows); };
  // Rows beyond Σ counts: the GEMMs write zeros there, so the activation gives zeros too.
  if (fp8_) {
    check_fp8_range(sv, r);
    fp8_->forward(1, sv.pre, sv.xp, counts, sv.slot, st);
    mlp_activation(sv.act, sv.pre, gated_, st);
    fp8_->forward(2, sv.out, sv.act, counts, sv.slot, st);
    return;
  }
  const ExpertTables& t = tables(r.first, r.last, st);
  grouped_linear_forward(rr(sv.pre), rr(sv.xp), t.w1, counts, st);
  mlp_activation(rr(sv.act), rr(sv.pre), gated_, st);
  grouped_linear_forward(rr(sv.out), rr(sv.act), t.w2, counts, st);
}

void GroupedMLP::compute_backward(Saved& sv, const ExpertRange& r, bool wgrad, const Stream& st) {
  const ExpertTables& t = tables(r.first, r.last, st);
  const Tensor counts = sv.counts.slice0(r.first, r.last);
  const auto rr = [&](const Tensor& x) { return row_range(x, r.row_begin, r.rows); };
  // d_out_ rows beyond Σ counts are stale (combine_backward writes the routed rows only) and never
  // read; the dgrads write zeros to their tails, so the activation backward gives zeros there.
  if (recompute_act_) mlp_activation(rr(sv.act), rr(sv.pre), gated_, st);
  if (fp8_) {
    check_fp8_range(sv, r);
    const GroupedWeights none;
    fp8_->backward(2, d_act_, wgrad ? t.g2 : none, d_out_, sv.act, counts, sv.slot, st);
  } else {
    grouped_linear_dgrad(rr(d_act_), rr(d_out_), t.w2, counts, st);
    if (wgrad) grouped_linear_wgrad(t.g2, rr(d_out_), rr(sv.act), counts, st);
  }
  if (gated_) {
    swiglu_backward(rr(d_pre_), rr(d_act_), rr(sv.pre), st);
  } else {
    gelu_backward(rr(d_pre_), rr(d_act_), rr(sv.pre), st);
  }
  if (fp8_) {
    const GroupedWeights none;
    fp8_->backward(1, d_xp_, wgrad ? t.g1 : none, d_pre_, sv.xp, counts, sv.slot, st);
    return;
  }
  grouped_linear_dgrad(rr(d_xp_), rr(d_pre_), t.w1, counts, st);
  if (wgrad) grouped_linear_wgrad(t.g1, rr(d_pre_), rr(sv.xp), counts, st);
}

// Only with --delay-wgrad-compute, which FP8 refuses (TransformerConfig::validate).
void GroupedMLP::compute_wgrad(Saved& sv, const ExpertRange& r, const Stream& st) {
  MT_CHECK(!fp8_, "GroupedMLP: delayed weight gradients of FP8 experts are not supported");
  const ExpertTables& t = tables(r.first, r.last, st);
  const Tensor counts = sv.counts.slice0(r.first, r.last);
  const auto rr = [&](const Tensor& x) { return row_range(x, r.row_begin, r.rows); };
  grouped_linear_wgrad(t.g2, rr(d_out_), rr(sv.act), counts, st);
  grouped_linear_wgrad(t.g1, rr(d_pre_), rr(sv.xp), counts, st);
}

std::unique_ptr<MoeExperts> make_moe_experts(const TransformerConfig& c, const std::string& prefix,
                                             const ExpertParallel& ep, int64_t num_echo, ParamRegistry& reg) {
  if (c.moe_grouped_gemm) return std::make_unique<GroupedMLP>(c, prefix, ep, num_echo, reg);
  return std::make_unique<SequentialMLP>(c, prefix, ep, num_echo, reg);
}

}  // namespace mt
