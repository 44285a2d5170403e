#include "ops/cuda/cublaslt_gemm.h"

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"

namespace mt::cuda {
namespace {

cudaDataType_t lt_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
    case DType::kF8E4M3: return CUDA_R_8F_E4M3;
    case DType::kF8E5M2: return CUDA_R_8F_E5M2;
    default: MT_FAIL("gemm: unsupported dtype {}", dtype_name(t));
  }
}

/// Largest power of two <= 256 dividing the pointer and (for batched problems) the batch stride
/// in bytes: what cuBLASLt may assume about every matrix of the batch.
uint32_t alignment_of(const void* p, int64_t stride_elems, DType t, int64_t batch) {
  uint64_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uint64_t>(stride_elems) * dtype_size(t);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a >>= 1;
  return a;
}

int32_t lt_scale_mode(GemmScaleMode m) {
  switch (m) {
    case GemmScaleMode::kScalar: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
#if CUBLAS_VERSION >= 120900
    case GemmScaleMode::kVec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case GemmScaleMode::kBlk128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
#endif
    default: break;
  }
  MT_FAIL("gemm: FP8 block scaling needs cuBLAS >= 12.9 (built with {})", CUBLAS_VERSION);
}

constexpr int kKeyLen = 30;
struct GemmKey {
  std::array<int64_t, kKeyLen> v{};
  bool operator==(const GemmKey&) const = default;
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (int64_t x : k.v) {
      h ^= static_cast<uint64_t>(x) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

struct Alignments {
  uint32_t a, b, c, bias, aux;
};

/// The plan cache's bucket of a varying size: exact up to 128, above it rounded up to a quarter of
/// its octave (129..160 -> 160, ..., 8193..10240 -> 10240). The MoE experts' GEMMs have a new row
/// count (m, or the reduction size k of the weight gradient) almost every call; one plan, its
/// algorithm chosen for the first size seen, serves every size of its bucket (the layouts are
/// resized per call), so the heuristic is not queried on every call and the cache stays bounded.
int64_t size_bucket(int64_t x) {
  if (x <= 128) return x;
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  const int64_t step = p / 4;
  return (x + step - 1) / step * step;
}

GemmKey make_key(const GemmDesc& g, cublasLtHandle_t lt, int device, const Alignments& al) {
  GemmKey k;
  const bool bucketed = g.batch == 1;  // batched problems keep exact sizes (strides follow them)
  k.v = {reinterpret_cast<int64_t>(lt), device, bucketed ? size_bucket(g.m) : g.m, g.n,
         bucketed ? size_bucket(g.k) : g.k, g.batch, g.trans_a, g.trans_b,
         static_cast<int64_t>(g.ab_type), static_cast<int64_t>(g.c_type), g.lda, g.ldb, g.ldc,
         g.batch > 1 ? g.stride_a : 0, g.batch > 1 ? g.stride_b : 0, g.batch > 1 ? g.stride_c : 0,
         static_cast<int64_t>(g.epilogue), g.bias != nullptr, g.aux != nullptr, g.ld_aux, al.a, al.b, al.c, al.bias,
         al.aux, static_cast<int64_t>(g.fp8.b_type), static_cast<int64_t>(g.fp8.a_mode),
         static_cast<int64_t>(g.fp8.b_mode), g.fp8.fast_accum, 0};
  return k;
}

/// Descriptors, layouts and the chosen algorithm of one problem (RAII).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLASLt's A (= our B), B (= our A), C = D
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  cublasStatus_t heuristic_status = CUBLAS_STATUS_SUCCESS;
  int64_t m = 0, k = 0;  // the sizes the layouts hold now (the plan serves a bucket of them)

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

struct PreferenceGuard {
  cublasLtMatmulPreference_t p = nullptr;
  ~PreferenceGuard() {
    if (p) cublasLtMatmulPreferenceDestroy(p);
  }
};

cublasLtMatrixLayout_t make_layout(DType t, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  cublasLtMatrixLayout_t l = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, lt_type(t), static_cast<uint64_t>(rows), static_cast<uint64_t>(cols),
                                             ld));
  if (batch > 1) {
    int32_t count = static_cast<int32_t>(batch);
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    MT_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return l;
}

void set_pointers(const GemmPlan& plan, const GemmDesc& g) {
  if (g.bias) {
    const void* bias = g.bias;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (g.bias_grad) {
    void* bg = g.bias_grad;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bg, sizeof(bg)));
  }
  if (g.epilogue == GemmEpilogue::kGeluAux || g.epilogue == GemmEpilogue::kDGelu) {
    void* aux = g.aux;
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  }
  if (is_fp8(g.ab_type)) {  // swapped operands: cuBLASLt's A is our B
    const void* sa = g.fp8.b_scale;
    const void* sb = g.fp8.a_scale;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
}

std::unique_ptr<GemmPlan> make_plan(const GemmDesc& g, cublasLtHandle_t lt, const Alignments& al) {
  auto plan = std::make_unique<GemmPlan>();
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's A is our B.
  int32_t ta = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  int32_t tb = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  uint32_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  if (g.epilogue == GemmEpilogue::kBias) epi = CUBLASLT_EPILOGUE_BIAS;
  if (g.epilogue == GemmEpilogue::kGeluAux) epi = g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  if (g.epilogue == GemmEpilogue::kBgradA) epi = CUBLASLT_EPILOGUE_BGRADB;  // cuBLASLt's B is our A
  if (g.epilogue == GemmEpilogue::kDGelu) epi = CUBLASLT_EPILOGUE_DGELU;
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (g.bias && is_fp8(g.ab_type)) {  // an FP8 GEMM's bias is of D's type (bf16 / fp16 only here)
    int32_t bias_type = lt_type(g.c_type);
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (g.bias_grad) {
    int32_t bias_type = CUDA_R_32F;
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (g.epilogue == GemmEpilogue::kGeluAux || g.epilogue == GemmEpilogue::kDGelu) {
    int64_t ld_aux = g.ld_aux;
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld_aux, sizeof(ld_aux)));
  }
  if (is_fp8(g.ab_type)) {  // scale modes (swapped operands) and fast accumulation
    int32_t mode_a = lt_scale_mode(g.fp8.b_mode), mode_b = lt_scale_mode(g.fp8.a_mode);
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    MT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
    int8_t fast = g.fp8.fast_accum ? 1 : 0;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  set_pointers(*plan, g);  // the heuristic reads the pointers' alignment

  plan->la = make_layout(gemm_b_type(g), g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.ldb, g.batch, g.stride_b);
  plan->lb = make_layout(g.ab_type, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.lda, g.batch, g.stride_a);
  plan->lc = make_layout(g.c_type, g.n, g.m, g.ldc, g.batch, g.stride_c);
  plan->m = g.m;
  plan->k = g.k;

  PreferenceGuard pref;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.p));
  uint64_t ws = CudaStreamResources::kWorkspaceBytes;
  MT_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  uint32_t align_a = al.b, align_b = al.a, align_c = al.c;  // swapped operands
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                       sizeof(align_a)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                       sizeof(align_b)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                       sizeof(align_c)));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                       sizeof(align_c)));

  auto query = [&]() {
    cublasLtMatmulHeuristicResult_t res{};
    int returned = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->la, plan->lb, plan->lc, plan->lc, pref.p, 1,
                                                       &res, &returned);
    plan->heuristic_status = st;
    if (st == CUBLAS_STATUS_SUCCESS && returned > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
      plan->algo = res.algo;
      plan->found = true;
    }
  };
  if (g.c_type != DType::kF32) {
    // 16-bit outputs: split-K partial sums must be reduced in fp32 (the compute type), not in
    // the output type, to honour "fp32 accumulation". Falls back to any scheme if none exists.
    uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                         sizeof(mask)));
    query();
    if (!plan->found) {
      mask = CUBLASLT_REDUCTION_SCHEME_MASK;
      MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask,
                                                           sizeof(mask)));
      query();
    }
  } else {
    query();
  }
  return plan;
}

void set_dims(cublasLtMatrixLayout_t l, int64_t rows, int64_t cols) {
  const uint64_t r = static_cast<uint64_t>(rows), c = static_cast<uint64_t>(cols);
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof(r)));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof(c)));
}

/// Resizes a bucket's plan to this call's m and k (the same layouts as make_plan would build).
void resize(GemmPlan& plan, const GemmDesc& g) {
  if (plan.m == g.m && plan.k == g.k) return;
  set_dims(plan.la, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k);
  set_dims(plan.lb, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m);
  set_dims(plan.lc, g.n, g.m);
  plan.m = g.m;
  plan.k = g.k;
}

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash>& cache() {
  static std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash> c;
  return c;
}

/// Looks up (or builds) the plan and enqueues the GEMM; false when no algorithm exists, with the
/// heuristic's status in *status.
bool run_gemm(const GemmDesc& g, const Stream& stream, int* status) {
  check_gemm_desc(g);
  CudaStreamResources* res = stream.cuda();
  MT_CHECK(res != nullptr, "{}: needs a CUDA stream, got {}", describe_gemm(g), stream.device().str());
  Alignments al{alignment_of(g.a, g.stride_a, g.ab_type, g.batch), alignment_of(g.b, g.stride_b, gemm_b_type(g), g.batch),
                std::min(alignment_of(g.c, g.stride_c, g.c_type, g.batch),
                         g.d ? alignment_of(g.d, g.stride_c, g.c_type, g.batch) : 256u),
                g.bias ? alignment_of(g.bias, 0, g.c_type, 1) : g.bias_grad ? alignment_of(g.bias_grad, 0, DType::kF32, 1) : 0u,
                g.aux ? alignment_of(g.aux, 0, g.c_type, 1) : 0u};
  GemmKey key = make_key(g, res->lt, res->device.index, al);
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& c = cache();
  auto it = c.find(key);
  if (it == c.end()) it = c.emplace(key, make_plan(g, res->lt, al)).first;
  GemmPlan* plan = it->second.get();
  const bool planned_here = plan->m == g.m && plan->k == g.k;
  resize(*plan, g);
  *status = static_cast<int>(plan->heuristic_status);
  if (!plan->found) {
    if (planned_here) return false;
    it->second = make_plan(g, res->lt, al);  // the bucket's first size had no algorithm: this one?
    plan = it->second.get();
    *status = static_cast<int>(plan->heuristic_status);
    if (!plan->found) return false;
  }
  set_pointers(*plan, g);
  // The lock also covers the enqueue, since the cached descriptor carries this call's pointers.
  auto enqueue = [&] {
    return cublasLtMatmul(res->lt, plan->op, &g.alpha, g.b, plan->la, g.a, plan->lb, &g.beta, g.c, plan->lc,
                          g.d ? g.d : g.c, plan->lc, &plan->algo, res->workspace, CudaStreamResources::kWorkspaceBytes,
                          res->stream);
  };
  cublasStatus_t st = enqueue();
  if (st != CUBLAS_STATUS_SUCCESS && !planned_here) {
    // The algorithm chosen for another size of the bucket does not take this one: plan it anew
    // (the bucket keeps the new plan).
    it->second = make_plan(g, res->lt, al);
    plan = it->second.get();
    *status = static_cast<int>(plan->heuristic_status);
    if (!plan->found) return false;
    set_pointers(*plan, g);
    st = enqueue();
  }
  MT_CUBLAS_CHECK(st);
  return true;
}

}  // namespace

bool try_gemm(const GemmDesc& g, const Stream& stream) {
  int status = 0;
  return run_gemm(g, stream, &status);
}

void gemm(const GemmDesc& g, const Stream& stream) {
  int status = 0;
  if (run_gemm(g, stream, &status)) return;
  MT_FAIL("cuBLASLt has no algorithm for {} (heuristic status {})", describe_gemm(g), status);
}

}  // namespace mt::cuda
