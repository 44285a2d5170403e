// Argument validation for ops/moe.h, then the backend of the tensors' device.
#include "ops/moe.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/stream.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_2d(const Tensor& t, DType dt, int64_t rows, int64_t cols, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == dt && t.ndim() == 2 && t.is_contiguous() && (rows < 0 || t.size(0) == rows) &&
               (cols < 0 || t.size(1) == cols),
           "{}: {} must be a contiguous {} [{}, {}] tensor, got {}", fn, name, dtype_name(dt),
           rows < 0 ? "*" : std::to_string(rows), cols < 0 ? "*" : std::to_string(cols), t.str());
}

// Every non-empty tensor on `ref`'s device, and the stream there too.
void check_devices(const Stream& stream, const Tensor& ref, std::initializer_list<const Tensor*> others,
                   const char* fn) {
  op_checks::check_stream(stream, ref, fn);
  for (const Tensor* t : others)
    MT_CHECK(t->empty() || t->device() == ref.device(), "{}: tensor {} is not on {} like the others", fn, t->str(),
             ref.device().str());
}

// The routing dtype R of logits: fp32 or fp64 (--moe-router-dtype).
void check_router_dtype(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kF64, "{}: {} must be fp32 or fp64 (the routing dtype), got {}",
           fn, name, t.str());
}

void check_scalar(const Tensor& t, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 && t.numel() == 1 && t.is_contiguous(), "{}: {} must be an fp32 [1] tensor, got {}",
           fn, name, t.str());
}

// tokens_per_expert: fp32 [G, E] or [E], G dividing the T tokens.
void check_groups(const Tensor& t, int64_t T, int64_t E, const char* fn) {
  const bool shape = (t.ndim() == 1 && t.size(0) == E) || (t.ndim() == 2 && t.size(1) == E && t.size(0) >= 1);
  MT_CHECK(t.dtype() == DType::kF32 && t.is_contiguous() && shape && T % (t.numel() / E) == 0,
           "{}: tokens_per_expert must be a contiguous fp32 [G, {}] or [{}] tensor with G dividing {} tokens, got {}", fn,
           E, E, T, t.str());
}

void check_options(const MoeRouterOptions& o, int64_t E, const char* fn) {
  MT_CHECK(o.topk >= 1 && o.topk <= E, "{}: top-k {} must be in [1, {}]", fn, o.topk, E);
  if (o.num_groups > 0) {
    MT_CHECK(E % o.num_groups == 0 && o.group_topk >= 1 && o.group_topk <= o.num_groups &&
                 o.topk % o.group_topk == 0 && o.topk / o.group_topk <= E / o.num_groups,
             "{}: {} experts, {} groups, group top-k {}, top-k {} do not form a valid group-limited routing", fn, E,
             o.num_groups, o.group_topk, o.topk);
  }
}

}  // namespace

void moe_topk_routing(const Tensor& probs, const Tensor& top, const Tensor& scores_for_aux, const Tensor& logits,
                      const Tensor& expert_bias, const MoeRouterOptions& o, const Stream& stream) {
  const char* fn = "moe_topk_routing";
  check_router_dtype(logits, fn, "logits");
  check_2d(logits, logits.dtype(), -1, -1, fn, "logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(o, E, fn);
  check_2d(probs, DType::kF32, T, o.topk, fn, "probs");
  check_2d(top, DType::kI32, T, o.topk, fn, "top");
  if (!scores_for_aux.empty()) check_2d(scores_for_aux, logits.dtype(), T, E, fn, "scores_for_aux");
  if (!expert_bias.empty()) {
    MT_CHECK(o.sigmoid, "{}: an expert bias needs the sigmoid score function", fn);
    MT_CHECK(expert_bias.dtype() == DType::kF32 && expert_bias.numel() == E, "{}: expert_bias must be fp32 [{}], got {}",
             fn, E, expert_bias.str());
  }
  check_devices(stream, logits, {&probs, &top, &scores_for_aux, &expert_bias}, fn);
  MT_DISPATCH(logits.device(), moe_topk_routing, probs, top, scores_for_aux, logits, expert_bias, o, stream);
}

void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& o, const Stream& stream) {
  const char* fn = "moe_topk_routing_backward";
  check_router_dtype(logits, fn, "logits");
  check_2d(logits, logits.dtype(), -1, -1, fn, "logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(o, E, fn);
  check_2d(d_logits, logits.dtype(), T, E, fn, "d_logits");
  check_2d(d_probs, DType::kF32, T, o.topk, fn, "d_probs");
  check_2d(top, DType::kI32, T, o.topk, fn, "top");
  check_devices(stream, logits, {&d_logits, &d_probs, &top}, fn);
  MT_DISPATCH(logits.device(), moe_topk_routing_backward, d_logits, d_probs, logits, top, o, stream);
}

void moe_aux_loss(const Tensor& loss, const Tensor& scores, const Tensor& tokens_per_expert, float scale,
                  const Stream& stream) {
  const char* fn = "moe_aux_loss";
  check_scalar(loss, fn, "loss");
  check_router_dtype(scores, fn, "scores");
  check_2d(scores, scores.dtype(), -1, -1, fn, "scores");
  check_groups(tokens_per_expert, scores.size(0), scores.size(1), fn);
  check_devices(stream, scores, {&loss, &tokens_per_expert}, fn);
  MT_DISPATCH(scores.device(), moe_aux_loss, loss, scores, tokens_per_expert, scale, stream);
}

void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& tokens_per_expert,
                             float scale, const Tensor& loss_scale, bool sigmoid, const Stream& stream) {
  const char* fn = "moe_aux_scores_backward";
  check_router_dtype(logits, fn, "logits");
  check_2d(logits, logits.dtype(), -1, -1, fn, "logits");
  check_2d(d_logits, logits.dtype(), logits.size(0), logits.size(1), fn, "d_logits");
  check_groups(tokens_per_expert, logits.size(0), logits.size(1), fn);
  if (!loss_scale.empty()) check_scalar(loss_scale, fn, "loss_scale");
  check_devices(stream, logits, {&d_logits, &tokens_per_expert, &loss_scale}, fn);
  MT_DISPATCH(logits.device(), moe_aux_scores_backward, d_logits, logits, tokens_per_expert, scale, loss_scale, sigmoid,
              stream);
}

void moe_z_loss(const Tensor& loss, const Tensor& d_logits, const Tensor& logits, float scale,
                const Tensor& loss_scale, const Stream& stream) {
  const char* fn = "moe_z_loss";
  check_router_dtype(logits, fn, "logits");
  check_2d(logits, logits.dtype(), -1, -1, fn, "logits");
  MT_CHECK(!loss.empty() || !d_logits.empty(), "{}: neither loss nor d_logits given", fn);
  if (!loss.empty()) check_scalar(loss, fn, "loss");
  if (!d_logits.empty()) check_2d(d_logits, logits.dtype(), logits.size(0), logits.size(1), fn, "d_logits");
  if (!loss_scale.empty()) check_scalar(loss_scale, fn, "loss_scale");
  check_devices(stream, logits, {&loss, &d_logits, &loss_scale}, fn);
  MT_DISPATCH(logits.device(), moe_z_loss, loss, d_logits, logits, scale, loss_scale, stream);
}

void moe_router_logits_fp64(const Tensor& logits, const Tensor& x, const Tensor& w, const Stream& stream) {
  const char* fn = "moe_router_logits_fp64";
  op_checks::check_act(x, fn, "x");
  MT_CHECK(x.ndim() == 2 && x.is_contiguous(), "{}: x must be a contiguous [T, h] tensor, got {}", fn, x.str());
  MT_CHECK(w.dtype() == x.dtype() && w.ndim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
           "{}: w must be a contiguous {} [E, {}] tensor like x, got {}", fn, dtype_name(x.dtype()), x.size(1), w.str());
  check_2d(logits, DType::kF64, x.size(0), w.size(0), fn, "logits");
  check_devices(stream, logits, {&x, &w}, fn);
  MT_DISPATCH(logits.device(), moe_router_logits_fp64, logits, x, w, stream);
}

void moe_router_logits_fp64_backward(const Tensor& dx, const Tensor& dw, const Tensor& d_logits, const Tensor& x,
                                     const Tensor& w, const Stream& stream) {
  const char* fn = "moe_router_logits_fp64_backward";
  op_checks::check_act(x, fn, "x");
  MT_CHECK(x.ndim() == 2 && x.is_contiguous(), "{}: x must be a contiguous [T, h] tensor, got {}", fn, x.str());
  MT_CHECK(w.dtype() == x.dtype() && w.ndim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
           "{}: w must be a contiguous {} [E, {}] tensor like x, got {}", fn, dtype_name(x.dtype()), x.size(1), w.str());
  check_2d(d_logits, DType::kF64, x.size(0), w.size(0), fn, "d_logits");
  if (!dx.empty()) check_2d(dx, x.dtype(), x.size(0), x.size(1), fn, "dx");
  if (!dw.empty()) check_2d(dw, DType::kF32, w.size(0), w.size(1), fn, "dw");
  check_devices(stream, d_logits, {&dx, &dw, &x, &w}, fn);
  MT_DISPATCH(d_logits.device(), moe_router_logits_fp64_backward, dx, dw, d_logits, x, w, stream);
}

namespace {
// rows [T, h] of one act dtype like `ref`, contiguous.
void check_gate_rows(const Tensor& t, const Tensor& ref, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == ref.dtype() && t.ndim() == 2 && t.is_contiguous() && t.size(0) == ref.size(0) &&
               t.size(1) == ref.size(1),
           "{}: {} must be a contiguous {} [{}, {}] tensor, got {}", fn, name, dtype_name(ref.dtype()), ref.size(0),
           ref.size(1), t.str());
}
void check_gate_logits(const Tensor& t, int64_t T, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == DType::kF32 && t.ndim() == 1 && t.is_contiguous() && t.size(0) == T,
           "{}: {} must be a contiguous fp32 [{}] tensor, got {}", fn, name, T, t.str());
}
}  // namespace

void moe_shared_gate_forward(const Tensor& y, const Tensor& logits, const Tensor& ys, const Tensor& x, const Tensor& w,
                             const Stream& stream) {
  const char* fn = "moe_shared_gate_forward";
  op_checks::check_act(ys, fn, "ys");
  MT_CHECK(ys.ndim() == 2, "{}: ys must be [T, h], got {}", fn, ys.str());
  check_gate_rows(ys, ys, fn, "ys");
  check_gate_rows(y, ys, fn, "y");
  check_gate_rows(x, ys, fn, "x");
  check_2d(w, ys.dtype(), 1, ys.size(1), fn, "w");
  check_gate_logits(logits, ys.size(0), fn, "logits");
  MT_CHECK(y.data() != ys.data(), "{}: y must not alias ys", fn);
  check_devices(stream, y, {&ys, &logits, &x, &w}, fn);
  MT_DISPATCH(y.device(), moe_shared_gate_forward, y, logits, ys, x, w, stream);
}

void moe_shared_gate_backward(const Tensor& d_ys, const Tensor& d_logits, const Tensor& dx, const Tensor& dw,
                              const Tensor& dy, const Tensor& ys, const Tensor& x, const Tensor& w,
                              const Tensor& logits, const Stream& stream) {
  const char* fn = "moe_shared_gate_backward";
  op_checks::check_act(ys, fn, "ys");
  MT_CHECK(ys.ndim() == 2, "{}: ys must be [T, h], got {}", fn, ys.str());
  check_gate_rows(ys, ys, fn, "ys");
  check_gate_rows(dy, ys, fn, "dy");
  check_gate_rows(d_ys, ys, fn, "d_ys");
  check_gate_rows(x, ys, fn, "x");
  if (!dx.empty()) check_gate_rows(dx, ys, fn, "dx");
  check_2d(w, ys.dtype(), 1, ys.size(1), fn, "w");
  check_2d(dw, DType::kF32, 1, ys.size(1), fn, "dw");
  check_gate_logits(logits, ys.size(0), fn, "logits");
  check_gate_logits(d_logits, ys.size(0), fn, "d_logits");
  check_devices(stream, ys, {&d_ys, &d_logits, &dw, &dy, &x, &w, &logits}, fn);
  if (!dx.empty()) check_devices(stream, ys, {&dx}, fn);
  MT_DISPATCH(ys.device(), moe_shared_gate_backward, d_ys, d_logits, dx, dw, dy, ys, x, w, logits, stream);
}

void moe_shared_gate_backward_dx(const Tensor& dx, const Tensor& d_logits, const Tensor& w, const Stream& stream) {
  const char* fn = "moe_shared_gate_backward_dx";
  op_checks::check_act(dx, fn, "dx");
  MT_CHECK(dx.ndim() == 2, "{}: dx must be [T, h], got {}", fn, dx.str());
  check_gate_rows(dx, dx, fn, "dx");
  check_2d(w, dx.dtype(), 1, dx.size(1), fn, "w");
  check_gate_logits(d_logits, dx.size(0), fn, "d_logits");
  check_devices(stream, dx, {&d_logits, &w}, fn);
  MT_DISPATCH(dx.device(), moe_shared_gate_backward_dx, dx, d_logits, w, stream);
}

void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream& stream) {
  const char* fn = "moe_tokens_per_expert";
  MT_CHECK(counts.dtype() == DType::kF32 && counts.is_contiguous() && counts.ndim() >= 1 && counts.ndim() <= 2,
           "{}: counts must be a contiguous fp32 [G, E] or [E] tensor, got {}", fn, counts.str());
  MT_CHECK(top.dtype() == DType::kI32 && top.is_contiguous() && top.ndim() == 2 &&
               top.size(0) % (counts.numel() / counts.size(-1)) == 0,
           "{}: top must be a contiguous int32 [T, k] tensor with T a multiple of the {} groups of counts {}, got {}", fn,
           counts.numel() / counts.size(-1), counts.str(), top.str());
  check_devices(stream, top, {&counts}, fn);
  MT_DISPATCH(top.device(), moe_tokens_per_expert, counts, top, stream);
}

void moe_global_tokens_per_expert(const Tensor& average, const Tensor& accumulator, const Tensor& counts,
                                  const Stream& stream) {
  const char* fn = "moe_global_tokens_per_expert";
  MT_CHECK(average.dtype() == DType::kF32 && average.ndim() == 1 && average.is_contiguous(),
           "{}: average must be a contiguous fp32 [E] tensor, got {}", fn, average.str());
  op_checks::check_like(counts, average, fn, "counts", "average");
  MT_CHECK(accumulator.dtype() == DType::kF32 && accumulator.ndim() == 1 && accumulator.is_contiguous() &&
               accumulator.numel() == average.numel() + 1,
           "{}: accumulator must be a contiguous fp32 [E + 1] tensor (E = {}), got {}", fn, average.numel(),
           accumulator.str());
  check_devices(stream, average, {&accumulator, &counts}, fn);
  MT_DISPATCH(average.device(), moe_global_tokens_per_expert, average, accumulator, counts, stream);
}

void moe_expert_bias_update(const Tensor& expert_bias, const Tensor& tokens_per_expert, float rate,
                            const Stream& stream) {
  const char* fn = "moe_expert_bias_update";
  MT_CHECK(expert_bias.dtype() == DType::kF32 && expert_bias.ndim() == 1 && expert_bias.is_contiguous(),
           "{}: expert_bias must be a contiguous fp32 [E] tensor, got {}", fn, expert_bias.str());
  op_checks::check_like(tokens_per_expert, expert_bias, fn, "tokens_per_expert", "expert_bias");
  check_devices(stream, expert_bias, {&tokens_per_expert}, fn);
  MT_DISPATCH(expert_bias.device(), moe_expert_bias_update, expert_bias, tokens_per_expert, rate, stream);
}

namespace {
// The arguments of moe_routing_map and moe_routing_map_device.
void check_routing_map(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts, const Tensor& top,
                       int64_t first_expert, int64_t num_local, const char* fn, const Stream& stream) {
  MT_CHECK(top.dtype() == DType::kI32 && top.is_contiguous(), "{}: top must be contiguous int32, got {}", fn, top.str());
  MT_CHECK(row_index.dtype() == DType::kI32 && row_index.is_contiguous(), "{}: row_index must be contiguous int32, got {}",
           fn, row_index.str());
  MT_CHECK(slot_row.dtype() == DType::kI32 && slot_row.is_contiguous() && slot_row.numel() == top.numel(),
           "{}: slot_row must be contiguous int32 with {} entries, got {}", fn, top.numel(), slot_row.str());
  MT_CHECK(counts.dtype() == DType::kI32 && counts.numel() == num_local && counts.is_contiguous(),
           "{}: counts must be int32 [{}], got {}", fn, num_local, counts.str());
  MT_CHECK(first_expert >= 0 && num_local >= 1, "{}: local experts [{}, {}) are empty or negative", fn, first_expert,
           first_expert + num_local);
  check_devices(stream, top, {&row_index, &slot_row, &counts}, fn);
}
}  // namespace

std::vector<int64_t> moe_routing_map(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts,
                                     const Tensor& top, int64_t first_expert, int64_t num_local,
                                     const Stream& stream) {
  const char* fn = "moe_routing_map";
  check_routing_map(row_index, slot_row, counts, top, first_expert, num_local, fn, stream);
  if (top.device().is_cpu()) return cpu::moe_routing_map(row_index, slot_row, counts, top, first_expert, num_local, stream);
#ifdef MT_WITH_CUDA
  return cuda::moe_routing_map(row_index, slot_row, counts, top, first_expert, num_local, stream);
#else
  no_cuda_backend(fn);
#endif
}

void moe_routing_map_device(const Tensor& row_index, const Tensor& slot_row, const Tensor& counts, const Tensor& top,
                            int64_t first_expert, int64_t num_local, const Stream& stream) {
  const char* fn = "moe_routing_map_device";
  check_routing_map(row_index, slot_row, counts, top, first_expert, num_local, fn, stream);
  MT_DISPATCH(top.device(), moe_routing_map_device, row_index, slot_row, counts, top, first_expert, num_local, stream);
}

namespace {
// rows [R, h] and x [N, h] of one activation dtype; `index` int32 with at least `need` entries.
void check_rows(const Tensor& rows, const Tensor& x, const Tensor& index, int64_t need, const char* fn,
                const char* rname, const char* xname, const char* iname, const Stream& stream) {
  op_checks::check_act(x, fn, xname);
  MT_CHECK(rows.ndim() == 2 && x.ndim() == 2 && rows.size(1) == x.size(1) && rows.dtype() == x.dtype() &&
               rows.is_contiguous(),
           "{}: {} {} and {} {} must be contiguous [*, h] tensors of one dtype", fn, rname, rows.str(), xname, x.str());
  MT_CHECK(index.dtype() == DType::kI32 && index.is_contiguous() && index.numel() >= need,
           "{}: {} {} must be contiguous int32 with at least {} entries", fn, iname, index.str(), need);
  check_devices(stream, x, {&rows, &index}, fn);
}
void check_topk(int64_t topk, const Tensor& slot_row, int64_t n, const char* fn) {
  MT_CHECK(topk >= 1 && slot_row.numel() == n * topk, "{}: slot_row {} must hold {} x top-k {} entries", fn,
           slot_row.str(), n, topk);
}
}  // namespace

void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream& stream) {
  check_rows(rows, x, row_index, rows.size(0), "moe_permute", "rows", "x", "row_index", stream);
  MT_CHECK(topk >= 1, "moe_permute: top-k {} must be >= 1", topk);
  MT_DISPATCH(x.device(), moe_permute, rows, x, row_index, topk, stream);
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& slot_row, int64_t topk,
                          const Stream& stream) {
  const char* fn = "moe_permute_backward";
  check_rows(d_rows, dx, slot_row, 0, fn, "d_rows", "dx", "slot_row", stream);
  check_topk(topk, slot_row, dx.size(0), fn);
  MT_DISPATCH(dx.device(), moe_permute_backward, dx, d_rows, slot_row, topk, stream);
}

void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& slot_row,
                   const Stream& stream) {
  const char* fn = "moe_unpermute";
  check_rows(rows, y, slot_row, 0, fn, "rows", "y", "slot_row", stream);
  check_2d(probs, DType::kF32, y.size(0), -1, fn, "probs");
  check_topk(probs.size(1), slot_row, y.size(0), fn);
  check_devices(stream, y, {&probs}, fn);
  MT_DISPATCH(y.device(), moe_unpermute, y, rows, probs, slot_row, stream);
}

void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Tensor& slot_row,
                            const Stream& stream) {
  const char* fn = "moe_unpermute_backward";
  check_rows(rows, dy, row_index, rows.size(0), fn, "rows", "dy", "row_index", stream);
  op_checks::check_like(d_rows, rows, fn, "d_rows", "rows");
  check_2d(probs, DType::kF32, dy.size(0), -1, fn, "probs");
  check_2d(d_probs, DType::kF32, dy.size(0), probs.size(1), fn, "d_probs");
  check_topk(probs.size(1), slot_row, dy.size(0), fn);
  MT_CHECK(slot_row.dtype() == DType::kI32 && slot_row.is_contiguous(), "{}: slot_row must be contiguous int32, got {}",
           fn, slot_row.str());
  check_devices(stream, dy, {&d_rows, &probs, &d_probs, &slot_row}, fn);
  MT_DISPATCH(dy.device(), moe_unpermute_backward, d_rows, d_probs, dy, rows, probs, row_index, slot_row, stream);
}

int64_t moe_expert_capacity(int64_t tokens, int64_t topk, int64_t num_experts, double factor) {
  MT_CHECK(factor > 0 && std::isfinite(factor), "moe_expert_capacity: capacity factor must be positive, got {}", factor);
  MT_CHECK(tokens >= 1 && topk >= 1 && num_experts >= 1, "moe_expert_capacity: tokens {}, top-k {}, experts {}", tokens,
           topk, num_experts);
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * topk) / static_cast<double>(num_experts) * factor));
}

void moe_capacity_drop(const Tensor& kept, const Tensor& kept_counts, const Tensor& top, const Tensor& probs,
                       int64_t capacity, bool by_probs, const Stream& stream) {
  const char* fn = "moe_capacity_drop";
  check_2d(top, DType::kI32, -1, -1, fn, "top");
  check_2d(kept, DType::kI32, top.size(0), top.size(1), fn, "kept");
  check_2d(probs, DType::kF32, top.size(0), top.size(1), fn, "probs");
  MT_CHECK(kept_counts.dtype() == DType::kF32 && kept_counts.ndim() == 1 && kept_counts.is_contiguous() &&
               kept_counts.numel() >= 1,
           "{}: kept_counts must be a contiguous fp32 [E] tensor, got {}", fn, kept_counts.str());
  MT_CHECK(capacity >= 0, "{}: capacity {} must be >= 0", fn, capacity);
  MT_CHECK(kept.data() != top.data(), "{}: kept must not alias top", fn);
  check_devices(stream, top, {&kept, &probs, &kept_counts}, fn);
  MT_DISPATCH(top.device(), moe_capacity_drop, kept, kept_counts, top, probs, capacity, by_probs, stream);
}

void moe_sort_chunks(const Tensor& out, const Tensor& in, const std::vector<int64_t>& split_sizes,
                     const std::vector<int64_t>& order, const Stream& stream) {
  const char* fn = "moe_sort_chunks";
  MT_CHECK(in.ndim() == 2 && out.ndim() == 2 && in.is_contiguous() && out.is_contiguous() &&
               in.dtype() == out.dtype() && in.size(0) == out.size(0) && in.size(1) == out.size(1),
           "{}: out {} and in {} must be contiguous [R, h] tensors of one dtype and shape", fn, out.str(), in.str());
  MT_CHECK(in.dtype() == DType::kF32 || in.dtype() == DType::kBF16 || in.dtype() == DType::kF16,
           "{}: dtype {} is not a float dtype", fn, dtype_name(in.dtype()));
  MT_CHECK(split_sizes.size() == order.size(), "{}: {} split sizes but {} order entries", fn, split_sizes.size(),
           order.size());
  int64_t total = 0;
  for (int64_t n : split_sizes) {
    MT_CHECK(n >= 0, "{}: negative chunk size {}", fn, n);
    total += n;
  }
  MT_CHECK(total == in.size(0), "{}: the chunk sizes sum to {} rows but in {} has {}", fn, total, in.str(),
           in.size(0));
  std::vector<char> seen(order.size(), 0);
  for (int64_t c : order) {
    MT_CHECK(c >= 0 && c < static_cast<int64_t>(order.size()) && !seen[static_cast<size_t>(c)],
             "{}: order is not a permutation of 0..{} (entry {})", fn, static_cast<int64_t>(order.size()) - 1, c);
    seen[static_cast<size_t>(c)] = 1;
  }
  MT_CHECK(in.nbytes() == 0 || (static_cast<const char*>(out.data()) + out.nbytes() <= in.data() ||
                                static_cast<const char*>(in.data()) + in.nbytes() <= out.data()),
           "{}: out {} overlaps in {}", fn, out.str(), in.str());
  check_devices(stream, in, {&out}, fn);
  // One stream-ordered copy per non-empty chunk, on any device (CUDA: device-to-device
  // cudaMemcpyAsync; a fused kernel would save the C launches).
  const size_t row_bytes = static_cast<size_t>(in.size(1)) * dtype_size(in.dtype());
  std::vector<int64_t> start(split_sizes.size(), 0);  // first row of each input chunk
  for (size_t c = 1; c < split_sizes.size(); ++c) start[c] = start[c - 1] + split_sizes[c - 1];
  const char* src = static_cast<const char*>(in.data());
  char* dst = static_cast<char*>(out.data());
  size_t at = 0;  // output row
  for (int64_t c : order) {
    const auto n = static_cast<size_t>(split_sizes[static_cast<size_t>(c)]);
    if (n == 0) continue;
    copy_bytes(dst + at * row_bytes, out.device(), src + static_cast<size_t>(start[static_cast<size_t>(c)]) * row_bytes,
               in.device(), n * row_bytes, stream);
    at += n;
  }
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> moe_sort_chunks_inverse(const std::vector<int64_t>& split_sizes,
                                                                              const std::vector<int64_t>& order) {
  MT_CHECK(split_sizes.size() == order.size(), "moe_sort_chunks_inverse: {} split sizes but {} order entries",
           split_sizes.size(), order.size());
  const size_t C = order.size();
  std::vector<int64_t> sizes(C), inverse(C);
  for (size_t i = 0; i < C; ++i) {
    const auto c = static_cast<size_t>(order[i]);
    MT_CHECK(c < C, "moe_sort_chunks_inverse: order entry {} out of range [0, {})", order[i], C);
    sizes[i] = split_sizes[c];
    inverse[c] = static_cast<int64_t>(i);
  }
  return {std::move(sizes), std::move(inverse)};
}

}  // namespace mt
