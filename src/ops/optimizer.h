// Optimizer-step ops that keep the whole step on the device (no host sync, docs/architecture.md
// principle 5): gradient norm, found-inf, clipping coefficient, AdamW, and Megatron's
// DynamicGradScaler update, all reading and writing one small device-resident struct.
//
// Order inside a training step (after the backward of the last micro-batch):
//   grad_sumsq_accumulate(...) for every gradient chunk   [+ all-reduce grad_sumsq over MP later]
//   optimizer_prepare(...)            -> grad_norm, found_inf, clip_coeff, step += !found_inf
//   adamw_multi_step(...) over every run of parameters    -> no-op when found_inf
//   loss_scaler_update(...)          -> new scale, skipped count; resets grad_sumsq
#pragma once
#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// Number of blocks (and fp32 partial sums) of the CUDA grad_sumsq_accumulate reduction.
inline constexpr int kGradSumsqBlocks = 512;

/// Device-resident scalars of the optimizer and the loss scaler. Plain data: lives in a
/// Buffer of sizeof(OptimizerScalars) bytes on the training device; the host reads it with a
/// copy at log intervals only.
struct OptimizerScalars {
  float grad_sumsq = 0.f;      ///< sum of squares of the unscaled gradients (this step)
  float grad_norm = 0.f;       ///< sqrt(grad_sumsq), valid after optimizer_prepare
  float clip_coeff = 1.f;      ///< min(1, clip_grad / (grad_norm + 1e-6)) or 1
  float loss_scale = 1.f;      ///< current loss scale
  int32_t found_inf = 0;       ///< this step had a non-finite gradient (step skipped)
  int32_t step = 0;            ///< AdamW step count: number of applied (non-skipped) steps
  int32_t growth_tracker = 0;  ///< clean steps since the last scale change (DynamicGradScaler)
  int32_t hysteresis_tracker = 2;
  int32_t skipped_iters = 0;   ///< cumulative number of skipped steps
  int32_t pad_ = 0;
  /// Scratch of the CUDA grad_sumsq_accumulate: one partial sum per block of its fixed grid,
  /// then added to grad_sumsq in a fixed order (deterministic, and no allocation in the op).
  /// Meaningless outside that op; the CPU backend does not touch it.
  float sumsq_partials[kGradSumsqBlocks] = {};
};

struct LossScalerConfig {
  bool dynamic = false;          ///< --fp16 without --loss-scale
  float initial_scale = 1.f;     ///< --initial-loss-scale (2^32 default for fp16) or --loss-scale
  float min_scale = 1.f;         ///< --min-loss-scale
  float growth_factor = 2.f;
  float backoff_factor = 0.5f;
  int32_t growth_interval = 1000;  ///< --loss-scale-window
  int32_t hysteresis = 2;          ///< --hysteresis
};

struct AdamWHyper {
  float lr = 0.f;
  /// When set: the learning rate is read from this fp32 on the scalars' device when the step
  /// runs (instead of `lr`), so that a captured step (CUDA graph) uses each step's rate
  /// (docs/architecture.md principle 8). CPU: host memory.
  const float* lr_ptr = nullptr;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;  ///< decoupled (Loshchilov & Hutter 2019): p -= lr * wd * p
  /// The gradient buffer already holds the update (Muon's scaled orthogonalised momentum,
  /// optim/muon.h): p = p - lr * (grad + wd * p), with no loss-scale, clipping or moments (exp_avg
  /// and exp_avg_sq are left as they are). Same storage variants and found_inf skip as AdamW.
  bool precomputed_update = false;
};

/// Host-side initial value of the struct for a scaler configuration.
OptimizerScalars initial_optimizer_scalars(const LossScalerConfig& cfg);

/// scalars->grad_sumsq += sum_i (grads[i] * (1 / loss_scale))^2. grads: fp32 [n]. Deterministic
/// (CUDA: fixed grid of kGradSumsqBlocks blocks, partials in the struct, fixed-order final sum;
/// so calls on one scalars tensor must be ordered on one stream). `scalars` is a uint8 tensor
/// of sizeof(OptimizerScalars) bytes on the grads' device. Errors (all ops here): mt::Error on
/// a wrong scalars size/dtype, a dtype/shape/device mismatch or a stream on another device.
void grad_sumsq_accumulate(const Tensor& scalars, const Tensor& grads, const Stream& stream);

/// grad_norm = sqrt(grad_sumsq) (+inf or a canonical NaN when not finite, so that CPU and CUDA
/// give identical bits); found_inf = !isfinite(grad_sumsq); clip_coeff =
/// (clip_grad > 0 ? min(1, clip_grad / (grad_norm + 1e-6)) : 1); step += !found_inf.
void optimizer_prepare(const Tensor& scalars, float clip_grad, const Stream& stream);

/// AdamW (Loshchilov & Hutter 2019, as torch.optim.AdamW / Megatron's FusedAdam with
/// adam_w_mode): with g = grad * (1 / loss_scale) * clip_coeff and t = step (>= 1: call
/// optimizer_prepare first; the CPU backend checks it), bias corrections 1 - b^t computed in
/// double and rounded to fp32 (as apex's multi_tensor_adam),
///   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
///   p = p - lr * ( (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * p )
/// Skipped entirely (nothing written) when found_inf. main, grad, exp_avg, exp_avg_sq: fp32
/// [n]; model_param: bf16/fp16 [n] copy written as round(p), or empty (fp32 training, where
/// the main parameters are the model parameters).
/// Remainder storage (--use-precision-aware-optimizer; Megatron's store_param_remainders,
/// TransformerEngine FusedAdam): main_param int16 [n] holds the remainders and model_param (bf16
/// [n], required) the high bits of the fp32 main parameters; p = merge_param_remainders'
/// value, updated exactly as above (the same bits as the fp32 path), written back split
/// (split_param_remainders: the bf16 copy rounds ties away from zero instead of to even).
/// Errors: mt::Error for an int16 main_param without a bf16 model_param.
void adamw_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& model_param, const AdamWHyper& hyper, const Tensor& scalars, const Stream& stream);

/// One run of elements of a multi-tensor AdamW step: flat elements [param, param + n) of the
/// model-parameter copy, [grad, grad + n) of the gradients (grad < 0: = param; a sharded
/// gradient, --data-parallel-sharding-strategy optim_grads, is indexed like the moments),
/// [main, main + n) of the fp32 main parameters and [state, state + n) of the moments; decay != 0
/// applies AdamWHyper::weight_decay, else none.
struct AdamWRun {
  int64_t param = 0, main = 0, state = 0, n = 0;
  int32_t decay = 0;
  int32_t pad_ = 0;
  int64_t grad = -1;
};

/// Elements per chunk of an AdamWPlan (one CUDA block each; a multiple of 4, so that a chunk
/// keeps its run's 16-byte alignment).
inline constexpr int64_t kAdamWChunk = 8192;

/// The runs of adamw_multi_step, planned once (outside the training step): validated, cut into
/// chunks of at most kAdamWChunk elements, and copied to `device` (host memory on the CPU).
/// Errors: mt::Error for a negative offset or size, or overlapping runs of the main parameters.
class AdamWPlan {
 public:
  AdamWPlan() = default;
  AdamWPlan(const std::vector<AdamWRun>& runs, Device device, const Stream& stream);
  /// Chunk records (AdamWRun) as a uint8 tensor on the plan's device.
  Tensor table() const;
  const std::vector<AdamWRun>& chunks() const { return chunks_; }
  int64_t param_end() const { return param_end_; }  ///< largest param + n
  int64_t grad_end() const { return grad_end_; }    ///< largest grad + n
  int64_t main_end() const { return main_end_; }
  int64_t state_end() const { return state_end_; }

 private:
  std::vector<AdamWRun> chunks_;
  Buffer table_;
  int64_t param_end_ = 0, grad_end_ = 0, main_end_ = 0, state_end_ = 0;
};

/// adamw_step over every run of `plan` in one launch (multi-tensor apply, as apex's
/// multi_tensor_adam): each chunk gets exactly adamw_step's per-element update (the same bits),
/// with weight decay where its run has decay. main_param, grad, exp_avg, exp_avg_sq: fp32 flat
/// buffers covering the plan's main / param / state ranges; model_param: bf16/fp16 covering the
/// param ranges, or empty. With remainder storage (see adamw_step) main_param is int16 covering
/// the main ranges and model_param bf16. Skipped (nothing written) when found_inf. Errors: as
/// adamw_step, and a buffer shorter than the plan's ranges or a plan on another device.
void adamw_multi_step(const Tensor& main_param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                      const Tensor& model_param, const AdamWPlan& plan, const AdamWHyper& hyper,
                      const Tensor& scalars, const Stream& stream);

/// fp32 main parameters stored as bf16 model parameters plus int16 remainders (Megatron's
/// --use-precision-aware-optimizer with bf16 and fp32 main parameters: optimizer_config.py
/// store_param_remainders, TransformerEngine's FusedAdam): per element, with u the fp32 bits,
/// model = (u >> 16) + (low 16 bits >= 0x8000) and remainder = (int16)(u & 0xFFFF)
/// (ops/optimizer_math.h split_f32_remainder). The bf16 value is the fp32 one rounded to nearest
/// with ties away from zero: it differs from cast()'s round-to-nearest-even only at exact ties.
/// main_param: fp32 [n] (read); model_param: bf16 [n] (written); remainders: int16 [n] (written)
/// or empty (only the bf16 rounding is written). Errors: mt::Error on a dtype, size or device
/// mismatch or a stream on another device.
void split_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream);
/// The inverse of split_param_remainders, exact for every fp32 value: main_param fp32 [n]
/// (written) from model_param bf16 [n] and remainders int16 [n] (read). Errors: as the split.
void merge_param_remainders(const Tensor& main_param, const Tensor& model_param, const Tensor& remainders,
                            const Stream& stream);

/// Megatron's DynamicGradScaler.update(found_inf) (megatron/core/optimizer/grad_scaler.py) when
/// cfg.dynamic:
///   found_inf: growth_tracker = 0; hysteresis_tracker -= 1;
///              if hysteresis_tracker <= 0: loss_scale = max(loss_scale * backoff, min_scale)
///   else:      growth_tracker += 1; if growth_tracker == growth_interval:
///              growth_tracker = 0; hysteresis_tracker = hysteresis; loss_scale *= growth
/// (overflows accumulate in hysteresis_tracker across clean steps until the next growth).
/// Always: skipped_iters += found_inf, grad_sumsq = 0 (ready for the next step).
void loss_scaler_update(const Tensor& scalars, const LossScalerConfig& cfg, const Stream& stream);

MT_OP_BACKENDS(grad_sumsq_accumulate)
MT_OP_BACKENDS(optimizer_prepare)
MT_OP_BACKENDS(adamw_step)
MT_OP_BACKENDS(adamw_multi_step)
MT_OP_BACKENDS(loss_scaler_update)
MT_OP_BACKENDS(split_param_remainders)
MT_OP_BACKENDS(merge_param_remainders)

}  // namespace mt
