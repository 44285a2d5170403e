// Argument validation for ops/moe.h; CPU backend only so far.
#include "ops/moe.h"

#include "core/check.h"

namespace mt {
namespace {

void check_2d(const Tensor& t, DType dt, int64_t rows, int64_t cols, const char* fn, const char* name) {
  MT_CHECK(t.dtype() == dt && t.ndim() == 2 && t.is_contiguous() && (rows < 0 || t.size(0) == rows) &&
               (cols < 0 || t.size(1) == cols),
           "{}: {} must be a contiguous {} [{}, {}] tensor, got {}", fn, name, dtype_name(dt),
           rows < 0 ? "*" : std::to_string(rows), cols < 0 ? "*" : std::to_string(cols), t.str());
}

void check_cpu(const Tensor& t, const char* fn) {
  MT_CHECK(t.device().is_cpu(), "{}: the MoE kernels run on the CPU only so far (got {})", fn, t.str());
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
  check_2d(logits, DType::kF32, -1, -1, fn, "logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(o, E, fn);
  check_2d(probs, DType::kF32, T, o.topk, fn, "probs");
  check_2d(top, DType::kI32, T, o.topk, fn, "top");
  if (!scores_for_aux.empty()) check_2d(scores_for_aux, DType::kF32, T, E, fn, "scores_for_aux");
  if (!expert_bias.empty()) {
    MT_CHECK(o.sigmoid, "{}: an expert bias needs the sigmoid score function", fn);
    MT_CHECK(expert_bias.dtype() == DType::kF32 && expert_bias.numel() == E, "{}: expert_bias must be fp32 [{}], got {}",
             fn, E, expert_bias.str());
  }
  check_cpu(logits, fn);
  cpu::moe_topk_routing(probs, top, scores_for_aux, logits, expert_bias, o, stream);
}

void moe_topk_routing_backward(const Tensor& d_logits, const Tensor& d_probs, const Tensor& logits, const Tensor& top,
                               const MoeRouterOptions& o, const Stream& stream) {
  const char* fn = "moe_topk_routing_backward";
  check_2d(logits, DType::kF32, -1, -1, fn, "logits");
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(o, E, fn);
  check_2d(d_logits, DType::kF32, T, E, fn, "d_logits");
  check_2d(d_probs, DType::kF32, T, o.topk, fn, "d_probs");
  check_2d(top, DType::kI32, T, o.topk, fn, "top");
  check_cpu(logits, fn);
  cpu::moe_topk_routing_backward(d_logits, d_probs, logits, top, o, stream);
}

void moe_aux_scores_backward(const Tensor& d_logits, const Tensor& logits, const Tensor& coef, bool sigmoid,
                             const Stream& stream) {
  const char* fn = "moe_aux_scores_backward";
  check_2d(logits, DType::kF32, -1, -1, fn, "logits");
  check_2d(d_logits, DType::kF32, logits.size(0), logits.size(1), fn, "d_logits");
  MT_CHECK(coef.dtype() == DType::kF32 && coef.numel() == logits.size(1), "{}: coef must be fp32 [{}], got {}", fn,
           logits.size(1), coef.str());
  check_cpu(logits, fn);
  cpu::moe_aux_scores_backward(d_logits, logits, coef, sigmoid, stream);
}

double moe_z_loss(const Tensor& logits, const Tensor& d_logits, float scale, const Stream& stream) {
  const char* fn = "moe_z_loss";
  check_2d(logits, DType::kF32, -1, -1, fn, "logits");
  if (!d_logits.empty()) check_2d(d_logits, DType::kF32, logits.size(0), logits.size(1), fn, "d_logits");
  check_cpu(logits, fn);
  return cpu::moe_z_loss(logits, d_logits, scale, stream);
}

void moe_tokens_per_expert(const Tensor& counts, const Tensor& top, const Stream& stream) {
  const char* fn = "moe_tokens_per_expert";
  MT_CHECK(counts.dtype() == DType::kF32 && counts.is_contiguous(), "{}: counts must be contiguous fp32, got {}", fn,
           counts.str());
  MT_CHECK(top.dtype() == DType::kI32 && top.is_contiguous(), "{}: top must be contiguous int32, got {}", fn, top.str());
  check_cpu(top, fn);
  cpu::moe_tokens_per_expert(counts, top, stream);
}

int64_t moe_routing_map(const Tensor& row_index, const Tensor& counts, const Tensor& top, int64_t first_expert,
                        int64_t num_local, const Stream& stream) {
  const char* fn = "moe_routing_map";
  MT_CHECK(top.dtype() == DType::kI32 && top.is_contiguous(), "{}: top must be contiguous int32, got {}", fn, top.str());
  MT_CHECK(row_index.dtype() == DType::kI32 && row_index.is_contiguous(), "{}: row_index must be contiguous int32, got {}",
           fn, row_index.str());
  MT_CHECK(counts.dtype() == DType::kI32 && counts.numel() == num_local, "{}: counts must be int32 [{}], got {}", fn,
           num_local, counts.str());
  MT_CHECK(first_expert >= 0 && num_local >= 1, "{}: local experts [{}, {}) are empty or negative", fn, first_expert,
           first_expert + num_local);
  check_cpu(top, fn);
  return cpu::moe_routing_map(row_index, counts, top, first_expert, num_local, stream);
}

namespace {
void check_rows(const Tensor& rows, const Tensor& x, const Tensor& row_index, const char* fn, const char* rname,
                const char* xname) {
  MT_CHECK(rows.ndim() == 2 && x.ndim() == 2 && rows.size(1) == x.size(1) && rows.dtype() == x.dtype() &&
               rows.is_contiguous() && x.is_contiguous(),
           "{}: {} {} and {} {} must be contiguous [*, h] tensors of one dtype", fn, rname, rows.str(), xname, x.str());
  MT_CHECK(row_index.dtype() == DType::kI32 && row_index.numel() >= rows.size(0),
           "{}: row_index {} must be int32 with at least {} entries", fn, row_index.str(), rows.size(0));
  check_cpu(x, fn);
}
}  // namespace

void moe_permute(const Tensor& rows, const Tensor& x, const Tensor& row_index, int64_t topk, const Stream& stream) {
  check_rows(rows, x, row_index, "moe_permute", "rows", "x");
  cpu::moe_permute(rows, x, row_index, topk, stream);
}

void moe_permute_backward(const Tensor& dx, const Tensor& d_rows, const Tensor& row_index, int64_t topk,
                          const Stream& stream) {
  check_rows(d_rows, dx, row_index, "moe_permute_backward", "d_rows", "dx");
  cpu::moe_permute_backward(dx, d_rows, row_index, topk, stream);
}

void moe_unpermute(const Tensor& y, const Tensor& rows, const Tensor& probs, const Tensor& row_index,
                   const Stream& stream) {
  const char* fn = "moe_unpermute";
  check_rows(rows, y, row_index, fn, "rows", "y");
  check_2d(probs, DType::kF32, y.size(0), -1, fn, "probs");
  cpu::moe_unpermute(y, rows, probs, row_index, stream);
}

void moe_unpermute_backward(const Tensor& d_rows, const Tensor& d_probs, const Tensor& dy, const Tensor& rows,
                            const Tensor& probs, const Tensor& row_index, const Stream& stream) {
  const char* fn = "moe_unpermute_backward";
  check_rows(rows, dy, row_index, fn, "rows", "dy");
  MT_CHECK(d_rows.shape() == rows.shape() && d_rows.dtype() == rows.dtype(), "{}: d_rows {} must match rows {}", fn,
           d_rows.str(), rows.str());
  check_2d(probs, DType::kF32, dy.size(0), -1, fn, "probs");
  check_2d(d_probs, DType::kF32, dy.size(0), probs.size(1), fn, "d_probs");
  cpu::moe_unpermute_backward(d_rows, d_probs, dy, rows, probs, row_index, stream);
}

}  // namespace mt
