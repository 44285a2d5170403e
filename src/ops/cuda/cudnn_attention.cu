// cuDNN fused attention through the backend graph API: see ops/cuda/cudnn_attention.h.
#include "ops/cuda/cudnn_attention.h"

#include <atomic>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "ops/cuda/common.cuh"

#ifdef MT_WITH_CUDNN
#include <cudnn.h>
#endif

namespace mt::cuda {

namespace {
std::atomic<int64_t> g_executions{0};
}  // namespace

int64_t cudnn_attention_executions() { return g_executions.load(); }

#ifndef MT_WITH_CUDNN

bool cudnn_attention_applies(const FlashAttentionConfig&, DType, std::initializer_list<const void*>) { return false; }
void cudnn_attention_forward(const Tensor&, const Tensor&, const Tensor&, const FlashAttentionConfig&, const Stream&) {
  MT_FAIL("cudnn_attention_forward: this build has no cuDNN (MT_WITH_CUDNN is off)");
}
void cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const FlashAttentionConfig&, const Stream&) {
  MT_FAIL("cudnn_attention_backward: this build has no cuDNN (MT_WITH_CUDNN is off)");
}

#else

namespace {

void cudnn_check(cudnnStatus_t st, const char* what) {
  if (st == CUDNN_STATUS_SUCCESS) return;
  char msg[1024] = {0};
  cudnnGetLastErrorString(msg, sizeof(msg));
  MT_FAIL("cuDNN fused attention: {} failed: {} ({})", what, cudnnGetErrorString(st), msg);
}
#define MT_CUDNN(call) cudnn_check((call), #call)

/// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { MT_CUDNN(cudnnBackendCreateDescriptor(type, &d_)); }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }
  template <typename V>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const V* values) {
    cudnn_check(cudnnBackendSetAttribute(d_, name, type, count, values), "cudnnBackendSetAttribute");
  }
  void set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t v) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }
  void finalize(const char* what) { cudnn_check(cudnnBackendFinalize(d_), what); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::vector<int64_t>;

Dims packed_strides(const Dims& dims) {
  Dims s(dims.size(), 1);
  for (int i = static_cast<int>(dims.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
  return s;
}

/// Tensor uids of the graphs' non-virtual tensors (the variant pack's keys).
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum,
  kScale, kNegInf, kOne,  // by-value scalars
  kFirstVirtual = 100,
};

/// The compute type of every matmul and reduction (cudnn-frontend's FLOAT compute data type).
constexpr cudnnDataType_t kFp32 = CUDNN_DATA_FLOAT;

/// Builds one operation graph: tensors and operations, every descriptor kept alive with the plan.
class GraphBuilder {
 public:
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  bool is_virtual = false, bool by_value = false) {
    auto& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t n = static_cast<int64_t>(dims.size()), align = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, n, dims.data());
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, n, strides.data());
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    t.finalize("tensor descriptor");
    return t.get();
  }
  /// A virtual (graph-internal) tensor; strides packed row-major unless given.
  cudnnBackendDescriptor_t virt(cudnnDataType_t type, const Dims& dims, Dims strides = {}) {
    if (strides.empty()) strides = packed_strides(dims);
    return tensor(next_virtual_++, type, dims, strides, true);
  }
  /// An fp32 scalar passed by value, with the rank of the graph's tensors (pointwise operands must
  /// have equal ranks).
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  /// y = mode(x[, b][, t]); math in `prec`; axis for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t y, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    pw.finalize("pointwise descriptor");
    auto& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get());
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    const float one = 1.f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    push(op, "pointwise operation");
  }
  /// y = mode(x[, b]) into a new virtual fp32 tensor of `dims` (strides packed unless given).
  cudnnBackendDescriptor_t pointwise_to(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x,
                                        cudnnBackendDescriptor_t b, const Dims& dims, const Dims& strides = {}) {
    auto y = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(mode, x, b, y);
    return y;
  }
  /// a·b into a new virtual fp32 tensor of `dims`.
  cudnnBackendDescriptor_t matmul_to(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, const Dims& dims) {
    auto c = virt(CUDNN_DATA_FLOAT, dims);
    matmul(a, b, c);
    return c;
  }
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    auto& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kFp32);
    mm.finalize("matmul descriptor");
    auto& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get());
    push(op, "matmul operation");
  }
  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto& r = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &kFp32);
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    r.finalize("reduction descriptor");
    auto& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r.get());
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    push(op, "reduction operation");
  }
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    push(op, "reshape operation");
  }
  /// Causal mask of scores x [b, h, s_q, s_kv] (top-left diagonal, right bound 0): keeps x where
  /// row >= col, else -inf (scalar kNegInf). Returns the masked tensor.
  cudnnBackendDescriptor_t causal_mask(cudnnBackendDescriptor_t x, const Dims& dims, cudnnBackendDescriptor_t neg_inf) {
    auto row = virt(CUDNN_DATA_INT32, dims), col = virt(CUDNN_DATA_INT32, dims);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, row, nullptr, CUDNN_DATA_FLOAT, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, x, nullptr, col, nullptr, CUDNN_DATA_FLOAT, 3);
    auto keep_mask = virt(CUDNN_DATA_BOOLEAN, dims);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, col, keep_mask, nullptr, CUDNN_DATA_BOOLEAN);
    auto y = virt(CUDNN_DATA_FLOAT, dims);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, x, neg_inf, y, keep_mask);
    return y;
  }

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }
  std::vector<std::unique_ptr<Desc>> take() { return std::move(keep_); }

 private:
  /// Finalizes an operation descriptor and appends it to the graph's operations.
  void push(Desc& op, const char* what) {
    op.finalize(what);
    ops_.push_back(op.get());
  }
  Desc& keep(cudnnBackendDescriptorType_t type) {
    keep_.push_back(std::make_unique<Desc>(type));
    return *keep_.back();
  }
  std::vector<std::unique_ptr<Desc>> keep_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

/// One built graph: its descriptors, the execution plan and the engine's workspace.
struct Plan {
  std::vector<std::unique_ptr<Desc>> descs;
  std::unique_ptr<Desc> graph, plan;
  int64_t workspace_bytes = 0;
  void* workspace = nullptr;  // device; owned (cudaMalloc once, when the plan is built)
  // grouped queries only: the gathered Q [s, b, h, d] (and, backward, dQ's staging after it); owned
  void* staging = nullptr;
  float scale = 0, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.f;  // by-value scalars
  cudnnHandle_t handle = nullptr;  // of the plan's device (handle_for)
  ~Plan() {
    if (workspace) cudaFree(workspace);
    if (staging) cudaFree(staging);
  }
};

/// The problem: direction, dtype, b, n, g, s, d, scale bits, device.
using PlanKey = std::tuple<bool, int, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t, int>;

cudnnHandle_t handle_for(int device) {
  static std::mutex m;
  static std::map<int, cudnnHandle_t> handles;
  std::lock_guard<std::mutex> lock(m);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  MT_CUDNN(cudnnCreate(&h));
  handles.emplace(device, h);
  return h;
}

/// Heuristics (mode A, then the fallback list) and the first engine configuration whose execution
/// plan finalizes.
void finalize_plan(Plan& p, cudnnHandle_t h, GraphBuilder& gb) {
  p.graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  const auto& ops = gb.ops();
  p.graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  p.graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
               ops.data());
  p.graph->finalize("operation graph");
  p.descs = gb.take();
  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, p.graph->get());
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) continue;
    int64_t count = 0;
    MT_CUDNN(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                      &count, nullptr));
    if (count <= 0) continue;
    std::vector<std::unique_ptr<Desc>> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    MT_CUDNN(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                      &got, raw.data()));
    for (int64_t i = 0; i < got; ++i) {
      auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
      plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[i]);
      const cudnnStatus_t st = cudnnBackendFinalize(plan->get());
      if (st != CUDNN_STATUS_SUCCESS) {
        char msg[512] = {0};
        cudnnGetLastErrorString(msg, sizeof(msg));
        tried += fmt::format("\n  heuristic {} config {}: {} {}", static_cast<int>(mode), i, cudnnGetErrorString(st),
                             msg);
        continue;
      }
      MT_CUDNN(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                        nullptr, &p.workspace_bytes));
      if (p.workspace_bytes > 0) MT_CUDA_CHECK(cudaMalloc(&p.workspace, static_cast<size_t>(p.workspace_bytes)));
      p.plan = std::move(plan);
      return;
    }
  }
  MT_FAIL("cuDNN fused attention: no engine supports this attention graph (cuDNN {}):{}", cudnnGetVersion(),
          tried.empty() ? std::string(" the heuristics returned no configuration") : tried);
}

struct Shape {
  int64_t b, h, g, s, d;  // h query heads, g key/value heads (h = g · qpg)
  cudnnDataType_t io;
  int64_t qpg() const { return h / g; }
  // [b, heads, s, d] strides: K and V in qkv [s, b, g, qpg + 2, d]; Q in qkv when qpg == 1, else
  // gathered into [s, b, h, d] (the layout of out, dout and dQ's staging buffer); stats [b, h, s, 1].
  Dims kv_strides() const { return {g * (qpg() + 2) * d, (qpg() + 2) * d, b * g * (qpg() + 2) * d, 1}; }
  Dims out_strides() const { return {h * d, d, b * h * d, 1}; }
  Dims q_strides() const { return qpg() == 1 ? kv_strides() : out_strides(); }
  Dims qd() const { return {b, h, s, d}; }
  Dims kvd() const { return {b, g, s, d}; }
  Dims bhss() const { return {b, h, s, s}; }
  Dims stats() const { return {b, h, s, 1}; }
  Dims stats_strides() const { return {h * s, s, 1, 1}; }
};

/// Kᵀ (or Vᵀ) as the B operand: dims [b, g, d, s], strides of K with the last two swapped.
Dims transposed(Dims st) {
  std::swap(st[2], st[3]);
  return st;
}

std::unique_ptr<Plan> build_forward(const Shape& sh, float scale, cudnnHandle_t h) {
  auto p = std::make_unique<Plan>();
  p->scale = scale;
  GraphBuilder g;
  const Dims ks = sh.kv_strides();
  auto q = g.tensor(kQ, sh.io, sh.qd(), sh.q_strides());
  auto kt = g.tensor(kK, sh.io, {sh.b, sh.g, sh.d, sh.s}, transposed(ks));
  auto v = g.tensor(kV, sh.io, sh.kvd(), ks);
  auto o = g.tensor(kO, sh.io, sh.qd(), sh.out_strides());
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto sc = g.scalar(kScale), ninf = g.scalar(kNegInf);
  auto s0 = g.matmul_to(q, kt, sh.bhss());
  auto s1 = g.pointwise_to(CUDNN_POINTWISE_MUL, s0, sc, sh.bhss());
  auto s2 = g.causal_mask(s1, sh.bhss(), ninf);
  auto mx = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s2, mx);
  auto sub = g.pointwise_to(CUDNN_POINTWISE_SUB, s2, mx, sh.bhss());
  auto ex = g.pointwise_to(CUDNN_POINTWISE_EXP, sub, nullptr, sh.bhss());
  auto sum = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  auto lg = g.pointwise_to(CUDNN_POINTWISE_LOG, sum, nullptr, sh.stats(), sh.stats_strides());
  g.pointwise(CUDNN_POINTWISE_ADD, mx, lg, stats);
  auto prob = g.virt(sh.io, sh.bhss());
  g.pointwise(CUDNN_POINTWISE_DIV, ex, sum, prob);
  g.matmul(prob, v, o);
  finalize_plan(*p, h, g);
  return p;
}

/// dK = dSᵀ·Q (or dV = Pᵀ·dO) into `out` [b, g, s, d]; with grouped queries the product is per
/// query head ([b, h, s, d], virtual, io dtype) and summed over each group's heads by a reduction.
void kv_grad(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t a_t, cudnnBackendDescriptor_t b,
             cudnnBackendDescriptor_t out) {
  if (sh.qpg() == 1) {
    g.matmul(a_t, b, out);
    return;
  }
  auto full = g.virt(sh.io, sh.qd());
  g.matmul(a_t, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

std::unique_ptr<Plan> build_backward(const Shape& sh, float scale, cudnnHandle_t h) {
  auto p = std::make_unique<Plan>();
  p->scale = scale;
  GraphBuilder g;
  const Dims ks = sh.kv_strides(), qs = sh.q_strides(), os = sh.out_strides();
  const Dims kvt{sh.b, sh.g, sh.d, sh.s};
  const Dims sst{sh.b, sh.h, sh.s, sh.s};                            // [b, h, s_kv, s_q] (transposed scores)
  const Dims sst_strides{sh.h * sh.s * sh.s, sh.s * sh.s, 1, sh.s};  // ... as a view of [b, h, s_q, s_kv]
  auto q = g.tensor(kQ, sh.io, sh.qd(), qs);
  auto kt = g.tensor(kK, sh.io, kvt, transposed(ks));
  auto vt = g.tensor(kV, sh.io, kvt, transposed(ks));
  auto o = g.tensor(kO, sh.io, sh.qd(), os);
  auto dout = g.tensor(kDO, sh.io, sh.qd(), os);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto dq = g.tensor(kDQ, sh.io, sh.qd(), qs);
  auto dk = g.tensor(kDK, sh.io, sh.kvd(), ks);
  auto dv = g.tensor(kDV, sh.io, sh.kvd(), ks);
  auto softmax_sum = g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto dq_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, sh.qd(), packed_strides(sh.qd()));
  auto sc = g.scalar(kScale), ninf = g.scalar(kNegInf), one = g.scalar(kOne);

  // softmax_sum = rowsum(dO ∘ O)
  auto dox =
      g.pointwise_to(CUDNN_POINTWISE_MUL, dout, o, sh.qd(), {sh.h * sh.s * sh.d, sh.s * sh.d, sh.h * sh.d, 1});
  auto rs = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dox, rs);
  g.pointwise(CUDNN_POINTWISE_MUL, rs, one, softmax_sum);
  // P = exp(S · scale − Stats), masked
  auto s0 = g.matmul_to(q, kt, sh.bhss());
  auto s1 = g.pointwise_to(CUDNN_POINTWISE_MUL, s0, sc, sh.bhss());
  auto s2 = g.pointwise_to(CUDNN_POINTWISE_SUB, s1, stats, sh.bhss());
  auto s3 = g.causal_mask(s2, sh.bhss(), ninf);
  auto prob = g.pointwise_to(CUDNN_POINTWISE_EXP, s3, nullptr, sh.bhss());
  // dV = Pᵀ dO
  auto pt = g.virt(sh.io, sst, sst_strides);
  g.reshape(prob, pt);
  kv_grad(g, sh, pt, dout, dv);
  // dS = P ∘ (dO Vᵀ − softmax_sum) · scale
  auto dp = g.matmul_to(dout, vt, sh.bhss());
  auto t0 = g.pointwise_to(CUDNN_POINTWISE_SUB, dp, softmax_sum, sh.bhss());
  auto t1 = g.pointwise_to(CUDNN_POINTWISE_MUL, t0, prob, sh.bhss());
  auto ds = g.pointwise_to(CUDNN_POINTWISE_MUL, t1, sc, sh.bhss());
  // dK = dSᵀ Q
  auto dst = g.virt(sh.io, sst, sst_strides);
  g.reshape(ds, dst);
  kv_grad(g, sh, dst, q, dk);
  // dQ = dS K (fp32 accumulator, then converted)
  auto kr = g.virt(CUDNN_DATA_FLOAT, sh.kvd(), ks);
  g.reshape(kt, kr);
  g.matmul(ds, kr, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, dq);
  finalize_plan(*p, h, g);
  return p;
}

Plan& plan_for(bool backward, const Shape& sh, float scale) {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  const PlanKey key{backward, static_cast<int>(sh.io), sh.b, sh.h, sh.g, sh.s, sh.d, scale_bits, device};
  static std::mutex m;
  static std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::lock_guard<std::mutex> lock(m);
  auto it = plans.find(key);
  if (it != plans.end()) return *it->second;
  cudnnHandle_t h = handle_for(device);
  auto p = backward ? build_backward(sh, scale, h) : build_forward(sh, scale, h);
  p->handle = h;
  if (sh.qpg() > 1) {
    const size_t one = static_cast<size_t>(sh.b * sh.h * sh.s * sh.d) * 2;  // 16-bit elements
    MT_CUDA_CHECK(cudaMalloc(&p->staging, backward ? 2 * one : one));
  }
  return *plans.emplace(key, std::move(p)).first->second;
}

void execute(Plan& p, const Stream& stream, std::vector<int64_t> uids, std::vector<void*> ptrs) {
  cudnnHandle_t h = p.handle;
  MT_CUDNN(cudnnSetStream(h, cu(stream)));
  uids.insert(uids.end(), {kScale, kNegInf});
  ptrs.insert(ptrs.end(), {&p.scale, &p.neg_inf});
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &p.workspace);
  pack.finalize("variant pack");
  MT_CUDNN(cudnnBackendExecute(h, p.plan->get(), pack.get()));
  g_executions.fetch_add(1);
}

Shape shape_of(const FlashAttentionConfig& cfg, DType dtype) {
  return Shape{cfg.batch, cfg.heads(), cfg.groups, cfg.seq, cfg.head_dim,
               dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF};
}

/// Grouped queries: the qpg query slots of each (position, sample, group) of qkv [s, b, g, qpg + 2,
/// d] to or from [s, b, g·qpg, d], 16 bytes per thread (d % 8 == 0, 16-byte aligned pointers).
template <bool kGather>
__global__ void query_slots_kernel(uint4* __restrict__ packed, uint4* __restrict__ qkv, int64_t groups_rows,
                                   int qpg, int vecs_per_head) {
  const int64_t per_row = static_cast<int64_t>(qpg) * vecs_per_head;
  const int64_t n = groups_rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, e = i % per_row;  // e = slot · vecs_per_head + vec
    uint4* src_dst = qkv + row * (per_row + 2 * vecs_per_head) + e;
    if constexpr (kGather) packed[i] = *src_dst;
    else *src_dst = packed[i];
  }
}

void query_slots(bool gather, void* packed, void* qkv, const Shape& sh, const Stream& stream) {
  const int64_t rows = sh.s * sh.b * sh.g, vecs = sh.d / 8, n = rows * sh.qpg() * vecs;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  const auto kernel = gather ? query_slots_kernel<true> : query_slots_kernel<false>;
  kernel<<<blocks, 256, 0, cu(stream)>>>(static_cast<uint4*>(packed), static_cast<uint4*>(qkv), rows,
                                         static_cast<int>(sh.qpg()), static_cast<int>(vecs));
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool cudnn_attention_applies(const FlashAttentionConfig& cfg, DType dtype, std::initializer_list<const void*> ptrs) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (!cfg.doc_start.empty() || cfg.dropout_p > 0 || cfg.deterministic) return false;
  if (cfg.head_dim % 8 != 0 || cfg.head_dim > 128) return false;
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

void cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  const Shape sh = shape_of(cfg, qkv.dtype());
  Plan& p = plan_for(false, sh, cfg.softmax_scale);
  char* base = static_cast<char*>(qkv.data());
  const size_t e = dtype_size(qkv.dtype()), d = static_cast<size_t>(sh.d), q = static_cast<size_t>(sh.qpg());
  void* qptr = base;
  if (sh.qpg() > 1) {
    query_slots(true, p.staging, base, sh, stream);
    qptr = p.staging;
  }
  execute(p, stream, {kQ, kK, kV, kO, kStats},
          {qptr, base + q * d * e, base + (q + 1) * d * e, out.data(), lse.data()});
}

void cudnn_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  const Shape sh = shape_of(cfg, qkv.dtype());
  Plan& p = plan_for(true, sh, cfg.softmax_scale);
  char* base = static_cast<char*>(qkv.data());
  char* dbase = static_cast<char*>(dqkv.data());
  const size_t e = dtype_size(qkv.dtype()), d = static_cast<size_t>(sh.d), q = static_cast<size_t>(sh.qpg());
  const size_t rows = static_cast<size_t>(sh.b * sh.h * sh.s);
  char* ws = static_cast<char*>(workspace.data());
  void* softmax_sum = ws;
  void* dq_accum = ws + flash_attention_dq_accum_offset(cfg);
  // cuDNN >= 9.6 zeroes the dQ accumulator itself (cudnn-frontend memsets it only before 9.6).
  if (cudnnGetVersion() < 90600)
    MT_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, rows * d * sizeof(float), cu(stream)));
  void *qptr = base, *dqptr = dbase;
  if (sh.qpg() > 1) {
    qptr = p.staging;
    dqptr = static_cast<char*>(p.staging) + rows * d * e;
    query_slots(true, qptr, base, sh, stream);
  }
  execute(p, stream, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kOne},
          {qptr, base + q * d * e, base + (q + 1) * d * e, out.data(), dout.data(), lse.data(), dqptr,
           dbase + q * d * e, dbase + (q + 1) * d * e, softmax_sum, dq_accum, &p.one});
  if (sh.qpg() > 1) query_slots(false, dqptr, dbase, sh, stream);
}

#endif  // MT_WITH_CUDNN

}  // namespace mt::cuda
