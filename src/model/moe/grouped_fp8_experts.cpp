#include "model/moe/grouped_fp8_experts.h"

#include "model/fp8/fp8_model.h"
#include "ops/fp8.h"
#include "ops/fp8_grouped.h"

namespace mt {
namespace {

int64_t round_up_to(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// Row i of a [rows, round_up_to(groups, 4)] fp32 block as G contiguous values.
Tensor group_row(const Tensor& block, int64_t i, int64_t groups) {
  return block.slice0(i, i + 1).view({round_up_to(groups, 4)}).slice0(0, groups);
}

// The one-element state tensors of G linears, which Fp8Model lays out at a constant stride in one
// row of its state block (the experts' columns are consecutive): one [G, 1] view of them.
Tensor strided_values(const std::vector<Tensor>& vals, const char* what) {
  const int64_t G = static_cast<int64_t>(vals.size());
  float* p0 = vals.front().data_as<float>();
  const int64_t stride = G > 1 ? vals[1].data_as<float>() - p0 : 1;
  MT_CHECK(stride > 0, "GroupedFp8Experts: the experts' {} values are not in increasing order", what);
  for (int64_t g = 0; g < G; ++g)
    MT_CHECK(vals[static_cast<size_t>(g)].data_as<float>() == p0 + g * stride,
             "GroupedFp8Experts: expert {}'s {} value is not at stride {} from expert 0's", g, what, stride);
  return Tensor(p0, DType::kF32, vals.front().device(), {G, stride}).slice(1, 0, 1);
}

void reduce_group_max(Communicator* group, const Tensor& t, const Stream& stream) {
  if (group != nullptr && group->size() > 1) group->all_reduce(t, ReduceOp::kMax, stream);
}

// dst [G] contiguous <- src [G, 1] strided, or back.
void copy_values(const Tensor& dst, const Tensor& src, const Stream& stream) {
  const int64_t G = dst.ndim() == 2 ? dst.size(0) : src.size(0);
  const auto as2 = [G](const Tensor& t) { return t.ndim() == 2 ? t : t.view({G, 1}); };
  copy_rows(as2(dst), as2(src), stream);
}

}  // namespace

GroupedFp8Experts::GroupedFp8Experts(const Fp8Model& model, std::vector<Fp8Linear*> fc1, std::vector<Fp8Linear*> fc2,
                                     Communicator* etp)
    : model_(model), groups_(static_cast<int64_t>(fc1.size())) {
  MT_CHECK(!model.settings().blockwise(),
           "GroupedFp8Experts: the blockwise recipe is not built for the grouped expert GEMM");
  MT_CHECK(groups_ > 0 && fc2.size() == fc1.size(), "GroupedFp8Experts: {} fc1 and {} fc2 linears", fc1.size(),
           fc2.size());
  // fc1 is column-parallel over ETP (x replicated, dy feature-sharded); fc2 row-parallel (x
  // feature-sharded, dy replicated): Fp8Groups{nullptr, etp, etp} and {etp, etp, nullptr}.
  fc_[0].linears = std::move(fc1);
  fc_[0].dy_group = etp;
  fc_[1].linears = std::move(fc2);
  fc_[1].x_group = etp;
  for (Proj& p : fc_) {
    p.n = p.linears.front()->out();
    p.k = p.linears.front()->in();
  }
}

GroupedFp8Experts::Proj& GroupedFp8Experts::proj(int fc) {
  MT_CHECK(fc == 1 || fc == 2, "GroupedFp8Experts: projection {} (1 or 2)", fc);
  return fc_[fc - 1];
}

void GroupedFp8Experts::plan(BufferPlanner& planner, int64_t max_rows) {
  // the CUDA grouped FP8 kernels write bf16 (ops/grouped_matmul.h); the CPU emulation fp32
  MT_CHECK(planner.device().is_cpu() || planner.act_dtype() == DType::kBF16,
           "--fp8-format with --moe-grouped-gemm on a GPU needs bf16 activations (--bf16), got {}: the grouped "
           "FP8 expert kernels write bf16; drop --moe-grouped-gemm for {} activations",
           dtype_name(planner.act_dtype()), dtype_name(planner.act_dtype()));
  max_rows_ = max_rows;
  const size_t a = static_cast<size_t>(planner.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  saved_[a] = planner.saved(DType::kF32, {4, round_up_to(groups_, 4)}, "expert FP8 input scales");
  values_ = planner.scratch("moe.fp8.values", DType::kF32, {4, round_up_to(groups_, 4)});
  const DType f = model_.settings().forward_dtype(), g = model_.settings().grad_dtype();
  const int64_t rt = round_up_to(max_rows, 16);
  for (int i = 0; i < 2; ++i) {
    Proj& p = fc_[i];
    const std::string key = "moe.fp8." + std::to_string(i + 1);
    p.xq = planner.scratch(key + ".xq", f, {max_rows, p.k});
    p.x_t = planner.scratch(key + ".x_t", f, {p.k, rt});
    p.dyq = planner.scratch(key + ".dyq", g, {max_rows, p.n});
    p.dyq_t = planner.scratch(key + ".dyq_t", g, {p.n, rt});
  }
}

Tensor GroupedFp8Experts::x_scale(int fc, int slot, int row) const {
  return group_row(saved_.at(static_cast<size_t>(slot)), 2 * (fc - 1) + row, groups_);
}

void GroupedFp8Experts::prepare(Proj& p, const Stream& st) {
  if (p.ready) return;
  std::vector<Tensor> wq, wq_t;
  std::vector<Tensor> v[3][4];  // x, w, dy: amax, scale, scale_inv, record
  for (Fp8Linear* l : p.linears) {
    wq.push_back(l->fp8_weight());
    wq_t.push_back(l->fp8_weight_t());
    const Fp8TensorState* s[3] = {&l->x_state(), &l->w_state(), &l->dy_state()};
    for (int r = 0; r < 3; ++r) {
      v[r][0].push_back(s[r]->amax);
      v[r][1].push_back(s[r]->scale);
      v[r][2].push_back(s[r]->scale_inv);
      v[r][3].push_back(s[r]->record);
    }
  }
  p.wq = GroupedWeights(std::move(wq), st);
  p.wq_t = GroupedWeights(std::move(wq_t), st);
  Values* out[3] = {&p.x, &p.w, &p.dy};
  for (int r = 0; r < 3; ++r) {
    out[r]->amax = strided_values(v[r][0], "amax");
    out[r]->scale = strided_values(v[r][1], "scale");
    out[r]->scale_inv = strided_values(v[r][2], "scale_inv");
    if (model_.settings().delayed()) out[r]->record = strided_values(v[r][3], "amax record");
  }
  p.ready = true;
}

void GroupedFp8Experts::forward(int fc, const Tensor& y, const Tensor& x, const Tensor& counts, int slot,
                                const Stream& st) {
  Proj& p = proj(fc);
  prepare(p, st);
  const Tensor scale = x_scale(fc, slot, 0), scale_inv = x_scale(fc, slot, 1);
  const Tensor amax = group_row(values_, 0, groups_), w_sinv = group_row(values_, 3, groups_);
  Tensor record;
  if (model_.settings().delayed()) {  // the step's scales; the amaxes recorded in training forwards
    copy_values(scale, p.x.scale, st);
    copy_values(scale_inv, p.x.scale_inv, st);
    if (model_.training()) record = p.x.record;
  } else {  // this micro-batch's per-expert amax over x's shards
    fp8_grouped_amax(amax, x, counts, st);
    reduce_group_max(p.x_group, amax, st);
    copy_values(p.x.amax, amax, st);
    fp8_scale_from_amax(scale, scale_inv, amax, model_.settings().forward_dtype(), /*pow2=*/false, 0.f, st);
  }
  const Tensor xq = p.xq.slice0(0, x.size(0));
  fp8_grouped_quantize(xq, Tensor(), x, scale, record, counts, st);
  copy_values(w_sinv, p.w.scale_inv, st);
  grouped_fp8_linear_forward(y, xq, scale_inv, p.wq, w_sinv, counts, st);
}

void GroupedFp8Experts::backward(int fc, const Tensor& dx, const GroupedWeights& dw, const Tensor& dy, const Tensor& x,
                                 const Tensor& counts, int slot, const Stream& st) {
  Proj& p = proj(fc);
  prepare(p, st);
  const int64_t R = dy.size(0);
  const Tensor amax = group_row(values_, 0, groups_), dy_scale = group_row(values_, 1, groups_),
               dy_sinv = group_row(values_, 2, groups_), w_sinv = group_row(values_, 3, groups_);
  if (model_.settings().delayed()) {
    copy_values(dy_scale, p.dy.scale, st);
    copy_values(dy_sinv, p.dy.scale_inv, st);
  } else {
    fp8_grouped_amax(amax, dy, counts, st);
    reduce_group_max(p.dy_group, amax, st);
    fp8_scale_from_amax(dy_scale, dy_sinv, amax, model_.settings().grad_dtype(), /*pow2=*/false, 0.f, st);
    copy_values(p.dy.amax, amax, st);
    copy_values(p.dy.scale, dy_scale, st);
    copy_values(p.dy.scale_inv, dy_sinv, st);
  }
  const bool wgrad = !dw.empty();
  const Tensor dyq = p.dyq.slice0(0, R);
  const Tensor dyq_t = wgrad ? p.dyq_t : Tensor();
  fp8_grouped_quantize(dyq, dyq_t, dy, dy_scale, p.dy.record, counts, st);  // record: delayed only
  copy_values(w_sinv, p.w.scale_inv, st);
  grouped_fp8_linear_forward(dx, dyq, dy_sinv, p.wq_t, w_sinv, counts, st);  // dgrad: dyq · (wᵀ)ᵀ
  if (!wgrad) return;
  fp8_grouped_quantize(Tensor(), p.x_t, x, x_scale(fc, slot, 0), Tensor(), counts, st);
  grouped_fp8_linear_wgrad(dw, p.dyq_t, dy_sinv, p.x_t, x_scale(fc, slot, 1), counts, st);
}

}  // namespace mt
