// Argument validation and backend dispatch for ops/fp8_matmul.h.
#include "ops/fp8_matmul.h"

#include <cstdint>

#include "ops/cuda/cublaslt_gemm.h"
#include "ops/dispatch.h"
#include "ops/op_checks.h"

namespace mt {
namespace {

const char* scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensor: return "tensorwise";
    case Fp8Scaling::kBlock1x128: return "1x128";
    case Fp8Scaling::kBlock128x128: return "128x128";
  }
  return "?";
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// An operand: FP8 [rows, k] contiguous, 16-byte aligned (when not empty), with its scales; returns rows.
int64_t check_operand(const Fp8Operand& o, int64_t k, const char* name) {
  const Tensor& t = o.data;
  MT_CHECK(is_fp8(t.dtype()) && t.ndim() == 2 && t.is_contiguous(),
           "fp8_matmul: {}.data must be a contiguous fp8_e4m3/fp8_e5m2 [rows, k] matrix, got {}", name, t.str());
  MT_CHECK(t.size(1) == k, "fp8_matmul: {}.data {} must have k = {} columns (both operands are K-major)", name,
           t.shape_str(), k);
  MT_CHECK(t.numel() == 0 || aligned16(t.data()),
           "fp8_matmul: {}.data {} must be 16-byte aligned (cuBLASLt's FP8 rule)", name, t.str());
  const std::vector<int64_t> want = fp8_scale_shape(o.scaling, t.size(0), k);
  MT_CHECK(o.scale_inv.dtype() == DType::kF32 && o.scale_inv.is_contiguous() && !o.scale_inv.empty() &&
               (o.scaling == Fp8Scaling::kTensor ? o.scale_inv.numel() == 1 : o.scale_inv.shape() == want),
           "fp8_matmul: {}.scale_inv {} must be contiguous fp32 of {} scaling for a [{}, {}] operand ({} element(s))",
           name, o.scale_inv.str(), scaling_name(o.scaling), t.size(0), k,
           o.scaling == Fp8Scaling::kTensor ? int64_t{1} : want[0] * want[1]);
  MT_CHECK(o.scaling == Fp8Scaling::kTensor || aligned16(o.scale_inv.data()),
           "fp8_matmul: {}.scale_inv {} must be 16-byte aligned", name, o.scale_inv.str());
  return t.size(0);
}

cuda::GemmScaleMode scale_mode(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::kTensor: return cuda::GemmScaleMode::kScalar;
    case Fp8Scaling::kBlock1x128: return cuda::GemmScaleMode::kVec128;
    case Fp8Scaling::kBlock128x128: return cuda::GemmScaleMode::kBlk128x128;
  }
  MT_FAIL("fp8_matmul: unknown scaling {}", static_cast<int>(s));
}

}  // namespace

bool fp8_bias_epilogue(const Tensor& d, const Tensor& bias) {
  return !bias.empty() && (d.dtype() == DType::kBF16 || d.dtype() == DType::kF16) && aligned16(bias.data());
}

cuda::GemmDesc fp8_gemm_desc(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate,
                             bool fast_accum, const Tensor& c, const Tensor& bias) {
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  const bool separate_c = accumulate && !c.empty() && c.data() != d.data();
  cuda::GemmDesc g = cuda::contiguous_gemm(1, m, n, k, /*trans_a=*/false, /*trans_b=*/true, a.data.dtype(), d.dtype(),
                                           a.data.data(), b.data.data(), separate_c ? c.data() : d.data(), 1.f,
                                           accumulate ? 1.f : 0.f);
  if (separate_c) g.d = d.data();
  g.fp8.b_type = b.data.dtype();
  g.fp8.a_scale = a.scale_inv.data_as<float>();
  g.fp8.b_scale = b.scale_inv.data_as<float>();
  g.fp8.a_mode = scale_mode(a.scaling);
  g.fp8.b_mode = scale_mode(b.scaling);
  g.fp8.fast_accum = fast_accum;
  if (!bias.empty()) {
    g.epilogue = cuda::GemmEpilogue::kBias;
    g.bias = bias.data();
  }
  return g;
}

void fp8_matmul(const Tensor& d, const Fp8Operand& a, const Fp8Operand& b, bool accumulate, bool fast_accum,
                const Stream& stream, const Tensor& c, const Tensor& bias) {
  MT_CHECK(d.ndim() == 2 && d.is_contiguous(), "fp8_matmul: d {} must be a contiguous [m, n] matrix", d.str());
  MT_CHECK(d.dtype() == DType::kF32 || (d.dtype() == DType::kBF16 && !d.device().is_cpu()),
           "fp8_matmul: d {} must be fp32 (or bf16 on CUDA)", d.str());
  MT_CHECK(a.data.ndim() == 2, "fp8_matmul: a.data {} must be 2-D", a.data.str());
  const int64_t k = a.data.size(1);
  const int64_t m = check_operand(a, k, "a"), n = check_operand(b, k, "b");
  MT_CHECK(d.size(0) == m && d.size(1) == n, "fp8_matmul: d {} must be [{}, {}] (a {}, b {})", d.shape_str(), m, n,
           a.data.shape_str(), b.data.shape_str());
  MT_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0,
           "fp8_matmul: m={} n={} k={} must be multiples of 16 (cuBLASLt's FP8 alignment; pad the tokens)", m, n, k);
  MT_CHECK(d.numel() == 0 || aligned16(d.data()), "fp8_matmul: d {} must be 16-byte aligned", d.str());
  MT_CHECK(!(a.data.dtype() == DType::kF8E5M2 && b.data.dtype() == DType::kF8E5M2),
           "fp8_matmul: a and b are both fp8_e5m2 (cuBLASLt has no e5m2 x e5m2 GEMM; e5m2 is for gradients only)");
  const bool a_block = a.scaling != Fp8Scaling::kTensor, b_block = b.scaling != Fp8Scaling::kTensor;
  MT_CHECK(a_block == b_block, "fp8_matmul: a is {} but b is {}: both tensorwise or both blockwise",
           scaling_name(a.scaling), scaling_name(b.scaling));
  MT_CHECK(!(a.scaling == Fp8Scaling::kBlock128x128 && b.scaling == Fp8Scaling::kBlock128x128),
           "fp8_matmul: a and b are both 128x128-block scaled (cuBLASLt has 1x128 x 1x128, 1x128 x 128x128 and "
           "128x128 x 1x128 only)");
  // cuBLASLt's block-scaled kernels round the product before adding a bf16 C (0.06 off at 8 on an
  // H200, fp8_cuda_test): d + product in one rounding is the tensorwise kernels' only
  MT_CHECK(!accumulate || !a_block || d.dtype() == DType::kF32,
           "fp8_matmul: accumulate into a {} d needs tensorwise scaling (blockwise: fp32 d only)",
           dtype_name(d.dtype()));
  MT_CHECK(!fast_accum || !a_block,
           "fp8_matmul: fast_accum applies to tensorwise scaling only (blockwise GEMMs "
           "always promote the partial sums)");
  if (!c.empty()) {
    MT_CHECK(accumulate, "fp8_matmul: an addend c {} needs accumulate", c.str());
    MT_CHECK(c.dtype() == d.dtype() && c.shape() == d.shape() && c.is_contiguous() &&
                 (c.numel() == 0 || aligned16(c.data())),
             "fp8_matmul: the addend c {} must be contiguous, 16-byte aligned and like d {}", c.str(), d.str());
    check_same_device({&d, &c});
  }
  if (!bias.empty()) {
    MT_CHECK(!a_block, "fp8_matmul: a bias epilogue needs tensorwise scaling, got {} x {}", scaling_name(a.scaling),
             scaling_name(b.scaling));
    MT_CHECK(bias.dtype() == d.dtype() && bias.ndim() == 1 && bias.size(0) == n && bias.is_contiguous(),
             "fp8_matmul: bias {} must be a contiguous [{}] of d's dtype {}", bias.str(), n, dtype_name(d.dtype()));
    check_same_device({&d, &bias});
  }
  // cuBLASLt's view of the problem, checked on every backend (what a GPU run would reject); the
  // bias as the CUDA backend would pass it
  if (m > 0 && n > 0 && k > 0)
    cuda::check_gemm_desc(
        fp8_gemm_desc(d, a, b, accumulate, fast_accum, c, fp8_bias_epilogue(d, bias) ? bias : Tensor()));
  check_same_device({&d, &a.data, &a.scale_inv, &b.data, &b.scale_inv});
  op_checks::check_stream(stream, d, "fp8_matmul");
  MT_DISPATCH(d.device(), fp8_matmul, d, a, b, accumulate, fast_accum, stream, c, bias);
}

}  // namespace mt
