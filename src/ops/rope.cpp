// Argument validation and backend dispatch for ops/rope.h.
#include "ops/rope.h"

#include <cmath>

#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

void check_rope(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream,
                const char* fn, const char* name) {
  op_checks::check_act(qkv, fn, name);
  MT_CHECK(cfg.queries_per_group >= 1, "{}: queries_per_group={} must be >= 1", fn, cfg.queries_per_group);
  MT_CHECK(qkv.ndim() == 5 && qkv.size(3) == cfg.queries_per_group + 2,
           "{}: {} {} must be [s, b, g, qpg + 2, d] with qpg = queries_per_group = {}", fn, name, qkv.str(),
           cfg.queries_per_group);
  const int64_t d = qkv.size(4);
  MT_CHECK(cfg.rotary_dim >= 2 && cfg.rotary_dim % 2 == 0 && cfg.rotary_dim <= d,
           "{}: rotary_dim={} must be even, >= 2 and <= head dim d={} ({} {})", fn, cfg.rotary_dim, d, name,
           qkv.str());
  MT_CHECK(cfg.base > 0.f && std::isfinite(cfg.base), "{}: base={} must be a positive finite number", fn, cfg.base);
  if (cfg.yarn.on)
    MT_CHECK(cfg.yarn.factor > 0 && cfg.yarn.original_max_positions > 0 && cfg.yarn.beta_fast > cfg.yarn.beta_slow &&
                 cfg.yarn.beta_slow > 0,
             "{}: YaRN needs factor > 0 (got {}), original max positions > 0 (got {}) and beta_fast > beta_slow > 0 "
             "(got {}, {})",
             fn, cfg.yarn.factor, cfg.yarn.original_max_positions, cfg.yarn.beta_fast, cfg.yarn.beta_slow);
  if (!positions.empty()) {
    MT_CHECK(positions.dtype() == DType::kI32 && positions.is_contiguous() && positions.ndim() == 2 &&
                 positions.size(0) == qkv.size(0) && positions.size(1) == qkv.size(1),
             "{}: positions {} must be an empty tensor or a contiguous int32 [s, b] = [{}, {}] tensor ({} {})", fn,
             positions.str(), qkv.size(0), qkv.size(1), name, qkv.str());
    MT_CHECK(positions.device() == qkv.device(), "{}: positions {} and {} {} on different devices", fn,
             positions.str(), name, qkv.str());
  }
  MT_CHECK(stream.device().type == qkv.device().type, "{}: stream on {} but {} {}", fn, stream.device().str(), name,
           qkv.str());
}

}  // namespace

void rope_forward(const Tensor& qkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  check_rope(qkv, positions, cfg, stream, "rope_forward", "qkv");
  MT_DISPATCH(qkv.device(), rope_forward, qkv, positions, cfg, stream);
}

void rope_backward(const Tensor& dqkv, const Tensor& positions, const RopeConfig& cfg, const Stream& stream) {
  check_rope(dqkv, positions, cfg, stream, "rope_backward", "dqkv");
  MT_DISPATCH(dqkv.device(), rope_backward, dqkv, positions, cfg, stream);
}

}  // namespace mt
