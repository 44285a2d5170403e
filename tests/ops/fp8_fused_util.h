// Helpers of the fused FP8 quantisation tests (fp8_fused_test.cpp, fp8_fused_cuda_test.cpp): one
// run of RMSNorm, SwiGLU, SwiGLU's backward, GELU or GELU's backward (with the bias gradient) with
// FP8 output, fused (ops/fp8_fused.h) or unfused (the op, then fp8_quantize of its output), on any
// device and act dtype, outputs poisoned before the call.
#pragma once
#include <cstdint>
#include <vector>

#include "fp8_test_util.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_epilogue.h"
#include "ops/fp8_fused.h"
#include "ops/gelu.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"
#include "testing/testing.h"

namespace mt::fp8_fused_test {

using testing::make_tensor;
using testing::OwnedTensor;
using testing::to_host;

/// The outputs of one run: y (act dtype, as floats; the backward's dx; empty where the fused op
/// does not write it), rstd (RMSNorm), q and q_t (FP8 bytes; q_t: all but RMSNorm), amax record;
/// pre after the GELU forward (unchanged), the GELU backward's bias gradient (from 0.5).
struct Outputs {
  std::vector<float> y, rstd, amax, pre, dbias;
  std::vector<uint8_t> q, qt;
};

struct Inputs {
  std::vector<float> x, weight;  // weight: RMSNorm only
  std::vector<float> dy;         // the backward's output gradient [rows, cols] (SwiGLU: the first half)
  float scale = 1.f;             // the quantisation scale
  float amax0 = -1.f;            // the amax record's value before the call; < 0: no record
};

enum class Op { kRmsNorm, kSwiglu, kSwigluGrad, kGelu, kGeluGrad };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::kRmsNorm: return "rmsnorm";
    case Op::kSwiglu: return "swiglu";
    case Op::kSwigluGrad: return "swiglu backward";
    case Op::kGelu: return "gelu";
    case Op::kGeluGrad: return "gelu backward";
  }
  return "?";
}

inline bool is_gelu(Op op) { return op == Op::kGelu || op == Op::kGeluGrad; }

/// x: [rows, cols] (SwiGLU: [rows, 2f], cols = 2f; the GELU ops: pre); the op in act dtype `act`,
/// FP8 output `fp8`. variant: RMSNorm with zero-centred gamma, the GELU backward without the bias
/// gradient. write_y = false: the fused SwiGLU / GELU forward
/// without y, the fused GELU backward without dx (the bytes must not change); the fused SwiGLU
/// backward never writes dx.
inline Outputs run(Op op, bool fused, const Inputs& in, int64_t rows, int64_t cols, DType act, DType fp8,
                   Device dev, const Stream& st, bool variant = false, bool write_y = true) {
  const bool zero_centered_gamma = variant;
  const int64_t ycols = op == Op::kSwiglu ? cols / 2 : cols;
  const OwnedTensor x = make_tensor(in.x, act, dev, {rows, cols}, st);
  const OwnedTensor y(act, dev, {rows, ycols}), rstd(DType::kF32, dev, {rows});
  const OwnedTensor q(fp8, dev, {rows, ycols}), qt(fp8, dev, {ycols, rows});
  const Tensor q_t = op == Op::kRmsNorm ? Tensor() : qt.t;  // the norm writes q only
  const OwnedTensor scale = make_tensor({in.scale}, DType::kF32, dev, {1}, st);
  const OwnedTensor amax = make_tensor({in.amax0 < 0 ? 0.f : in.amax0}, DType::kF32, dev, {1}, st);
  const Tensor rec = in.amax0 < 0 ? Tensor() : amax.t;
  testing::poison(y, st);
  testing::poison(rstd, st);
  fp8_test::poison_bytes(q, st);
  fp8_test::poison_bytes(qt, st);
  const bool y_written = !(fused && (op == Op::kSwigluGrad || !write_y));
  Outputs o;
  if (is_gelu(op)) {
    const OwnedTensor db = make_tensor(std::vector<float>(static_cast<size_t>(cols), 0.5f), DType::kF32, dev, {cols},
                                       st);
    const Tensor dbias = variant ? Tensor() : db.t;
    const Tensor yw = y_written ? y.t : Tensor();
    if (op == Op::kGelu && fused) {
      fp8_gelu_forward(yw, q, q_t, x, scale, rec, st);
    } else if (op == Op::kGelu) {
      fp8_bias_gelu(x, Tensor(), y, st);
      fp8_quantize(q, q_t, y, scale, rec, st);
    } else {
      const OwnedTensor dy = make_tensor(in.dy, act, dev, {rows, cols}, st);
      if (fused) {
        fp8_gelu_backward(yw, q, q_t, dbias, dy, x, scale, rec, st);
      } else {
        gelu_backward(y, dy, x, st);
        if (!dbias.empty()) bias_dropout_add_backward(Tensor(), dbias, y, 0.f, DropoutKey{}, 0, st);
        fp8_quantize(q, q_t, y, scale, rec, st);
      }
    }
    if (op == Op::kGelu) o.pre = to_host(x, st);
    if (op == Op::kGeluGrad && !dbias.empty()) o.dbias = to_host(db, st);
  } else if (op == Op::kSwigluGrad) {
    const std::vector<float> dyh(in.dy.begin(), in.dy.begin() + rows * cols / 2);
    const OwnedTensor dy = make_tensor(dyh, act, dev, {rows, cols / 2}, st);
    if (fused) {
      fp8_swiglu_backward(q, q_t, dy, x, scale, rec, st);
    } else {
      swiglu_backward(y, dy, x, st);
      fp8_quantize(q, q_t, y, scale, rec, st);
    }
  } else if (op == Op::kRmsNorm) {
    const OwnedTensor w = make_tensor(in.weight, act, dev, {cols}, st);
    if (fused) {
      fp8_rmsnorm_forward(y, q, rstd, x, w, 1e-5f, scale, rec, st, zero_centered_gamma);
    } else {
      rmsnorm_forward(y, rstd, x, w, 1e-5f, st, zero_centered_gamma);
      fp8_quantize(q, Tensor(), y, scale, rec, st);
    }
  } else if (fused) {
    fp8_swiglu_forward(write_y ? y.t : Tensor(), q, q_t, x, scale, rec, st);
  } else {
    swiglu_forward(y, x, st);
    fp8_quantize(q, q_t, y, scale, rec, st);
  }
  if (y_written) o.y = to_host(y, st);
  if (op == Op::kRmsNorm) o.rstd = to_host(rstd, st);
  o.q = fp8_test::to_bytes(q, st);
  if (!q_t.empty()) o.qt = fp8_test::to_bytes(qt, st);
  o.amax = to_host(amax, st);
  return o;
}

/// Random inputs with a scale that saturates some elements (the largest |y| times scale above the
/// FP8 maximum) and, with nan_row, a NaN in row 0 (RMSNorm: the whole row NaN; SwiGLU: one element).
inline Inputs inputs(int64_t rows, int64_t cols, DType fp8, float amax0, bool nan_row) {
  Inputs in;
  in.x = testing::randn(rows * cols, 2.f);
  in.weight = testing::randn(cols, 0.5f);
  if (nan_row && rows > 1) in.x[1] = std::numeric_limits<float>::quiet_NaN();
  // Saturation by construction, not by chance: the last row's columns 0 and cols/2 at 20 (SwiGLU:
  // silu(20)·20 = 400; RMSNorm: 20 / rms >= 2.7 for cols >= 16, times weight 2) exceed 3.
  in.x[(rows - 1) * cols] = in.x[(rows - 1) * cols + cols / 2] = 20.f;
  in.weight[0] = 2.f;
  in.dy = testing::randn(rows * cols, 2.f);
  in.dy[(rows - 1) * cols / 2] = 20.f;  // the backward saturates too: dy · silu(20) = 400
  in.dy[(rows - 1) * cols] = 20.f;      // ... the GELU's: dy · gelu'(20) = 20
  in.scale = fp8_max(fp8) / 3.f;  // |y| > 3 saturates
  in.amax0 = amax0;
  return in;
}

}  // namespace mt::fp8_fused_test
