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
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/device.h"
#include "core/logging.h"
#include "ops/context_attention_impl.h"
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
bool cudnn_attention_forward(const Tensor&, const Tensor&, const Tensor&, const FlashAttentionConfig&, const Stream&) {
  MT_FAIL("cudnn_attention_forward: this build has no cuDNN (MT_WITH_CUDNN is off)");
}
bool cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const FlashAttentionConfig&, const Stream&) {
  MT_FAIL("cudnn_attention_backward: this build has no cuDNN (MT_WITH_CUDNN is off)");
}
bool cudnn_context_applies(const ContextAttentionConfig&, DType, int64_t, int64_t, std::initializer_list<const void*>) {
  return false;
}
bool cudnn_context_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const ContextAttentionConfig&, bool, const Stream&) {
  return false;
}
bool cudnn_context_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, const ContextAttentionConfig&, const Stream&) {
  return false;
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
  // The engine's workspace is scratch of one execution: executions on different streams (thread
  // ranks sharing a GPU, each with its own stream) must not share it. The first stream to execute
  // the plan uses `workspace`; any other gets its own (allocated at its first, eager execution).
  cudaStream_t workspace_stream = nullptr;
  std::map<cudaStream_t, void*> stream_workspaces;
  // grouped queries only: the gathered Q [s, b, h, d] (and, backward, dQ's staging after it); owned
  void* staging = nullptr;
  float scale = 0, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.f;  // by-value scalars
  // Whether the graph has the causal mask, the only user of the -inf scalar: an unmasked graph
  // (context parallelism's full blocks) must not be given that uid in its variant pack (cuDNN
  // refuses the pack: CUDNN_STATUS_BAD_PARAM_NULL_POINTER, isCompatibleVariantPack).
  bool masked = true;
  cudnnHandle_t handle = nullptr;  // of the plan's device (handle_for)
  ~Plan() {
    if (workspace) cudaFree(workspace);
    for (auto& [st, w] : stream_workspaces) cudaFree(w);
    if (staging) cudaFree(staging);
  }
};

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

/// One attention problem as cuDNN sees it: Q [b, h, sq, d], K [b, g, skv, d], V [b, g, skv, dvo],
/// O [b, h, sq, dvo] (h = g · qpg query heads; dvo <= d: V and O are the first dvo channels of their
/// d-channel slots, as MLA packs them), and where each lives. Every tensor is a view of a [rows, b, ...]
/// buffer: width 0 = [rows, b, heads, d] packed (out, dout, a staging buffer), width w > 0 = the
/// slots of [rows, b, g, w, d] (qkv: w = qpg + 2; the CP key/value blocks: w = 2), the pointer
/// giving the slot.
struct Shape {
  int64_t b, h, g, sq, skv, d, dvo;
  cudnnDataType_t io;
  bool causal;                  // top-left causal (sq == skv), else no mask
  int64_t q_w, dq_w, kv_w;      // widths of Q, dQ (0 or, with h == g, w) and of K, V, dK, dV (w > 0)
  int64_t qpg() const { return h / g; }
  Dims strides(int64_t heads, int64_t w) const {
    return w == 0 ? Dims{heads * d, d, b * heads * d, 1} : Dims{g * w * d, w * d, b * g * w * d, 1};
  }
  Dims q_strides() const { return strides(h, q_w); }
  Dims dq_strides() const { return strides(h, dq_w); }
  Dims kv_strides() const { return strides(g, kv_w); }
  Dims out_strides() const { return strides(h, 0); }
  Dims qd() const { return {b, h, sq, d}; }
  Dims kvd() const { return {b, g, skv, d}; }
  Dims vd() const { return {b, g, skv, dvo}; }
  Dims od() const { return {b, h, sq, dvo}; }
  Dims scores() const { return {b, h, sq, skv}; }
  Dims stats() const { return {b, h, sq, 1}; }
  Dims stats_strides() const { return {h * sq, sq, 1, 1}; }
  auto key() const { return std::tuple{static_cast<int>(io), b, h, g, sq, skv, d, dvo, causal, q_w, dq_w, kv_w}; }
};

/// The problem: direction, shape, scale bits, device.
using PlanKey = std::tuple<bool, decltype(std::declval<Shape>().key()), uint32_t, int>;

/// Kᵀ (or Vᵀ) as the B operand: dims [b, g, d, skv], strides of K with the last two swapped.
Dims transposed(Dims st) {
  std::swap(st[2], st[3]);
  return st;
}

std::unique_ptr<Plan> build_forward(const Shape& sh, float scale, cudnnHandle_t h) {
  auto p = std::make_unique<Plan>();
  p->scale = scale;
  p->masked = sh.causal;
  GraphBuilder g;
  const Dims ks = sh.kv_strides();
  auto q = g.tensor(kQ, sh.io, sh.qd(), sh.q_strides());
  auto kt = g.tensor(kK, sh.io, {sh.b, sh.g, sh.d, sh.skv}, transposed(ks));
  auto v = g.tensor(kV, sh.io, sh.vd(), ks);
  auto o = g.tensor(kO, sh.io, sh.od(), sh.out_strides());
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto sc = g.scalar(kScale), ninf = sh.causal ? g.scalar(kNegInf) : nullptr;
  auto s0 = g.matmul_to(q, kt, sh.scores());
  auto s1 = g.pointwise_to(CUDNN_POINTWISE_MUL, s0, sc, sh.scores());
  auto s2 = sh.causal ? g.causal_mask(s1, sh.scores(), ninf) : s1;
  auto mx = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s2, mx);
  auto sub = g.pointwise_to(CUDNN_POINTWISE_SUB, s2, mx, sh.scores());
  auto ex = g.pointwise_to(CUDNN_POINTWISE_EXP, sub, nullptr, sh.scores());
  auto sum = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum);
  auto lg = g.pointwise_to(CUDNN_POINTWISE_LOG, sum, nullptr, sh.stats(), sh.stats_strides());
  g.pointwise(CUDNN_POINTWISE_ADD, mx, lg, stats);
  auto prob = g.virt(sh.io, sh.scores());
  g.pointwise(CUDNN_POINTWISE_DIV, ex, sum, prob);
  g.matmul(prob, v, o);
  finalize_plan(*p, h, g);
  return p;
}

/// dK = dSᵀ·Q (width d) or dV = Pᵀ·dO (width dvo) into `out` [b, g, skv, width]; with grouped
/// queries the product is per query head ([b, h, skv, width], virtual, io dtype) and summed over
/// each group's heads by a reduction.
void kv_grad(GraphBuilder& g, const Shape& sh, cudnnBackendDescriptor_t a_t, cudnnBackendDescriptor_t b,
             cudnnBackendDescriptor_t out, int64_t width) {
  if (sh.qpg() == 1) {
    g.matmul(a_t, b, out);
    return;
  }
  auto full = g.virt(sh.io, {sh.b, sh.h, sh.skv, width});
  g.matmul(a_t, b, full);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
}

std::unique_ptr<Plan> build_backward(const Shape& sh, float scale, cudnnHandle_t h) {
  auto p = std::make_unique<Plan>();
  p->scale = scale;
  p->masked = sh.causal;
  GraphBuilder g;
  const Dims ks = sh.kv_strides(), os = sh.out_strides();
  const Dims kvt{sh.b, sh.g, sh.d, sh.skv}, vt_dims{sh.b, sh.g, sh.dvo, sh.skv};
  const Dims sst{sh.b, sh.h, sh.skv, sh.sq};                                // [b, h, skv, sq] (transposed scores)
  const Dims sst_strides{sh.h * sh.sq * sh.skv, sh.sq * sh.skv, 1, sh.skv};  // ... as a view of [b, h, sq, skv]
  auto q = g.tensor(kQ, sh.io, sh.qd(), sh.q_strides());
  auto kt = g.tensor(kK, sh.io, kvt, transposed(ks));
  auto vt = g.tensor(kV, sh.io, vt_dims, transposed(ks));
  auto o = g.tensor(kO, sh.io, sh.od(), os);
  auto dout = g.tensor(kDO, sh.io, sh.od(), os);
  auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto dq = g.tensor(kDQ, sh.io, sh.qd(), sh.dq_strides());
  auto dk = g.tensor(kDK, sh.io, sh.kvd(), ks);
  auto dv = g.tensor(kDV, sh.io, sh.vd(), ks);
  auto softmax_sum = g.tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  auto dq_accum = g.tensor(kDQAccum, CUDNN_DATA_FLOAT, sh.qd(), packed_strides(sh.qd()));
  auto sc = g.scalar(kScale), ninf = sh.causal ? g.scalar(kNegInf) : nullptr, one = g.scalar(kOne);

  // softmax_sum = rowsum(dO ∘ O)
  auto dox = g.pointwise_to(CUDNN_POINTWISE_MUL, dout, o, sh.od(),
                            {sh.h * sh.sq * sh.dvo, sh.sq * sh.dvo, sh.h * sh.dvo, 1});
  auto rs = g.virt(CUDNN_DATA_FLOAT, sh.stats(), sh.stats_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dox, rs);
  g.pointwise(CUDNN_POINTWISE_MUL, rs, one, softmax_sum);
  // P = exp(S · scale − Stats), masked
  auto s0 = g.matmul_to(q, kt, sh.scores());
  auto s1 = g.pointwise_to(CUDNN_POINTWISE_MUL, s0, sc, sh.scores());
  auto s2 = g.pointwise_to(CUDNN_POINTWISE_SUB, s1, stats, sh.scores());
  auto s3 = sh.causal ? g.causal_mask(s2, sh.scores(), ninf) : s2;
  auto prob = g.pointwise_to(CUDNN_POINTWISE_EXP, s3, nullptr, sh.scores());
  // dV = Pᵀ dO
  auto pt = g.virt(sh.io, sst, sst_strides);
  g.reshape(prob, pt);
  kv_grad(g, sh, pt, dout, dv, sh.dvo);
  // dS = P ∘ (dO Vᵀ − softmax_sum) · scale
  auto dp = g.matmul_to(dout, vt, sh.scores());
  auto t0 = g.pointwise_to(CUDNN_POINTWISE_SUB, dp, softmax_sum, sh.scores());
  auto t1 = g.pointwise_to(CUDNN_POINTWISE_MUL, t0, prob, sh.scores());
  auto ds = g.pointwise_to(CUDNN_POINTWISE_MUL, t1, sc, sh.scores());
  // dK = dSᵀ Q
  auto dst = g.virt(sh.io, sst, sst_strides);
  g.reshape(ds, dst);
  kv_grad(g, sh, dst, q, dk, sh.d);
  // dQ = dS K (fp32 accumulator, then converted)
  auto kr = g.virt(CUDNN_DATA_FLOAT, sh.kvd(), ks);
  g.reshape(kt, kr);
  g.matmul(ds, kr, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, dq);
  finalize_plan(*p, h, g);
  return p;
}

/// The cached plan of one problem; staging_bytes > 0: the plan also owns a staging buffer of that
/// size (the one-GPU path's gathered Q and dQ), allocated with it. may_fail: a problem no engine
/// supports returns nullptr (remembered, with one warning) instead of raising the error.
Plan* plan_for(bool backward, const Shape& sh, float scale, size_t staging_bytes = 0, bool may_fail = false) {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  const PlanKey key{backward, sh.key(), scale_bits, device};
  static std::mutex m;
  static std::map<PlanKey, std::unique_ptr<Plan>> plans;  // nullptr: no engine (may_fail)
  std::lock_guard<std::mutex> lock(m);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second.get();
  cudnnHandle_t h = handle_for(device);
  std::unique_ptr<Plan> p;
  try {
    p = backward ? build_backward(sh, scale, h) : build_forward(sh, scale, h);
  } catch (const Error& e) {
    if (!may_fail) throw;
    log_warn("cuDNN fused attention: no {} plan for sq={} sk={} b={} heads={}/{} d={} d_v={} {}; the "
             "FlashAttention-2 kernels run it instead ({})",
             backward ? "backward" : "forward", sh.sq, sh.skv, sh.b, sh.h, sh.g, sh.d, sh.dvo,
             sh.causal ? "causal" : "full", e.what());
    return plans.emplace(key, nullptr).first->second.get();
  }
  p->handle = h;
  if (staging_bytes > 0) MT_CUDA_CHECK(cudaMalloc(&p->staging, staging_bytes));
  return plans.emplace(key, std::move(p)).first->second.get();
}

void execute(Plan& p, const Stream& stream, std::vector<int64_t> uids, std::vector<void*> ptrs) {
  cudnnHandle_t h = p.handle;
  // The handle is shared by the plans of a device: its stream and the launch are one step, so that
  // threads driving one GPU (thread ranks in the tests) never launch on each other's streams.
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  MT_CUDNN(cudnnSetStream(h, cu(stream)));
  uids.push_back(kScale);
  ptrs.push_back(&p.scale);
  if (p.masked) {
    uids.push_back(kNegInf);
    ptrs.push_back(&p.neg_inf);
  }
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data());
  void* ws = p.workspace;
  if (p.workspace_bytes > 0) {
    const cudaStream_t s = cu(stream);
    if (p.workspace_stream == nullptr) p.workspace_stream = s;
    if (s != p.workspace_stream) {
      auto it = p.stream_workspaces.find(s);
      if (it == p.stream_workspaces.end()) {
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        MT_CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
        MT_CHECK(cap == cudaStreamCaptureStatusNone,
                 "cuDNN fused attention: a second stream's first execution of a plan is inside a CUDA graph capture "
                 "(its {}-byte workspace cannot be allocated there): run the step eagerly once first",
                 p.workspace_bytes);
        void* w = nullptr;
        MT_CUDA_CHECK(cudaMalloc(&w, static_cast<size_t>(p.workspace_bytes)));
        it = p.stream_workspaces.emplace(s, w).first;
      }
      ws = it->second;
    }
  }
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  pack.finalize("variant pack");
  MT_CUDNN(cudnnBackendExecute(h, p.plan->get(), pack.get()));
  g_executions.fetch_add(1);
}

cudnnDataType_t io_type(DType t) { return t == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF; }

/// The one-GPU causal self-attention: Q, K, V in qkv (Q gathered into the plan's staging buffer
/// with grouped queries), dQ, dK, dV in dqkv likewise.
Shape shape_of(const FlashAttentionConfig& cfg, DType dtype) {
  const int64_t w = cfg.queries_per_group + 2, qw = cfg.queries_per_group == 1 ? w : 0;
  return Shape{cfg.batch, cfg.heads(), cfg.groups, cfg.seq, cfg.seq, cfg.head_dim, cfg.v_dim(), io_type(dtype),
               true, qw, qw, w};
}

/// The one-GPU cases that engines may lack (head dims over 128, Hopper and newer only; d_v < d):
/// a plan that no engine supports falls back to the FlashAttention-2 kernels instead of failing.
bool may_lack_engine(const Shape& sh) { return sh.d > 128 || sh.dvo != sh.d; }

/// Hopper or newer (the head dims up to 256 of cuDNN's support matrix), per device, cached.
/// Zeroes bytes [from, to) of `rows` rows `pitch` bytes apart starting at `base` (one 2-D memset).
void zero_columns(void* base, int64_t rows, size_t pitch, size_t from, size_t to, const Stream& stream) {
  if (rows <= 0 || to <= from) return;
  MT_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(base) + from, pitch, 0, to - from, static_cast<size_t>(rows),
                                  cu(stream)));
}

bool sm90_or_newer() {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  return compute_capability(Device::cuda(device)) >= 90;
}

/// cuDNN's head dims (its support matrix): a multiple of 8 up to 128, up to 256 on Hopper and newer.
bool head_dim_supported(int64_t d) { return d % 8 == 0 && d <= 256 && (d <= 128 || sm90_or_newer()); }

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

/// The query slots of the sq query rows of qkv (sq · b · g groups' rows).
void query_slots(bool gather, void* packed, void* qkv, const Shape& sh, const Stream& stream) {
  const int64_t rows = sh.sq * sh.b * sh.g, vecs = sh.d / 8, n = rows * sh.qpg() * vecs;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65535));
  const auto kernel = gather ? query_slots_kernel<true> : query_slots_kernel<false>;
  kernel<<<blocks, 256, 0, cu(stream)>>>(static_cast<uint4*>(packed), static_cast<uint4*>(qkv), rows,
                                         static_cast<int>(sh.qpg()), static_cast<int>(vecs));
  MT_CUDA_CHECK_LAUNCH();
}

// --- context-parallel blocks: the LSE layout [sq, b, n] of ops/context_attention.h against
// cuDNN's statistics [b, n, sq], the block output merged by the LSE, dQ and dK/dV added ---

/// Per query row (i, bn) of lse [sq, B·n]: lse (and out) from cuDNN's block (stats [B·n, sq],
/// blk [sq, B·n, d]): merge = false: lse = stats (out already written by cuDNN); merge = true:
/// lse' = log(e^lse + e^stats), out' = out·e^(lse−lse') + blk·e^(stats−lse'), fp32 math, rows
/// with no earlier result (lse −inf) taking the block's. One thread per row (it reads the old
/// LSE before it writes the new one), 16 bytes at a time.
template <typename T>
__global__ void merge_block_kernel(T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ blk,
                                   const float* __restrict__ stats, int64_t sq, int64_t bn, int vecs, bool merge) {
  const int64_t rows = sq * bn;
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = r / bn, j = r % bn;
    const float lb = stats[j * sq + i];
    if (!merge) {
      lse[r] = lb;
      continue;
    }
    const float old = lse[r];
    if (lb == -INFINITY) continue;  // nothing visible in this block
    float ln = lb, wo = 0.f, wb = 1.f;
    if (old != -INFINITY) {
      ln = fmaxf(old, lb) + log1pf(expf(-fabsf(old - lb)));
      wo = expf(old - ln);
      wb = expf(lb - ln);
    }
    uint4* o = reinterpret_cast<uint4*>(out + r * vecs * 8);
    const uint4* b = reinterpret_cast<const uint4*>(blk + r * vecs * 8);
    for (int v = 0; v < vecs; ++v) {
      uint4 ov = o[v];
      const uint4 bv = b[v];
      T* oe = reinterpret_cast<T*>(&ov);
      const T* be = reinterpret_cast<const T*>(&bv);
#pragma unroll
      for (int e = 0; e < 8; ++e) oe[e] = from_f<T>(to_f(oe[e]) * wo + to_f(be[e]) * wb);
      o[v] = ov;
    }
    lse[r] = ln;
  }
}

/// stats [B·n, sq] <- lse [sq, B·n] (the merged LSE as cuDNN's backward reads it).
__global__ void stats_from_lse_kernel(float* __restrict__ stats, const float* __restrict__ lse, int64_t sq,
                                      int64_t bn) {
  const int64_t n = sq * bn;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = k / sq, i = k % sq;  // stats index k = j·sq + i: coalesced writes
    stats[k] = lse[i * bn + j];
  }
}

/// dst[r, :len] += src[r, :len] for rows r (row strides in elements; len, strides multiples of 8;
/// 16-byte aligned), fp32 math: cuDNN's dQ into the query slots of dqkv, its dK/dV into dkv.
template <typename T>
__global__ void add_rows_kernel(T* __restrict__ dst, int64_t dst_stride, const T* __restrict__ src,
                                int64_t src_stride, int64_t rows, int vecs) {
  const int64_t n = rows * vecs;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = k / vecs, v = k % vecs;
    uint4* d = reinterpret_cast<uint4*>(dst + r * dst_stride) + v;
    const uint4 sv = reinterpret_cast<const uint4*>(src + r * src_stride)[v];
    uint4 dv = *d;
    T* de = reinterpret_cast<T*>(&dv);
    const T* se = reinterpret_cast<const T*>(&sv);
#pragma unroll
    for (int e = 0; e < 8; ++e) de[e] = from_f<T>(to_f(de[e]) + to_f(se[e]));
    *d = dv;
  }
}

template <typename F>
void dispatch_half(DType t, F&& f) {
  if (t == DType::kBF16) f(static_cast<__nv_bfloat16*>(nullptr));
  else f(static_cast<__half*>(nullptr));
}

void add_rows(DType t, void* dst, int64_t dst_stride, const void* src, int64_t src_stride, int64_t rows, int64_t len,
              const Stream& stream) {
  dispatch_half(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const int vecs = static_cast<int>(len / 8);
    add_rows_kernel<T><<<grid_for(rows * vecs, 256), 256, 0, cu(stream)>>>(
        static_cast<T*>(dst), dst_stride, static_cast<const T*>(src), src_stride, rows, vecs);
  });
  MT_CUDA_CHECK_LAUNCH();
}

/// A context block as cuDNN sees it: Q in qkv (w = qpg + 2) or gathered (grouped queries), K and V
/// in kv (w = 2), dQ always staged (it is added to the caller's), the mask from cfg.block.
Shape context_shape(const ContextAttentionConfig& c, DType dtype, int64_t sq, int64_t sk) {
  const int64_t qw = c.queries_per_group == 1 ? 3 : 0;
  return Shape{c.batch, c.heads(), c.groups, sq, sk, c.head_dim, c.head_dim, io_type(dtype),
               c.block == ContextBlockMask::kCausal, qw, 0, 2};
}

}  // namespace

bool cudnn_attention_applies(const FlashAttentionConfig& cfg, DType dtype, std::initializer_list<const void*> ptrs) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (!cfg.doc_start.empty() || cfg.dropout_p > 0 || cfg.deterministic) return false;
  if (!head_dim_supported(cfg.head_dim) || cfg.v_dim() % 8 != 0 || cfg.v_dim() > cfg.head_dim) return false;
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

bool cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const FlashAttentionConfig& cfg,
                             const Stream& stream) {
  const Shape sh = shape_of(cfg, qkv.dtype());
  const size_t staging = sh.qpg() > 1 ? static_cast<size_t>(sh.b * sh.h * sh.sq * sh.d) * 2 : 0;
  Plan* plan = plan_for(false, sh, cfg.softmax_scale, staging, may_lack_engine(sh));
  if (plan == nullptr) return false;
  Plan& p = *plan;
  char* base = static_cast<char*>(qkv.data());
  const size_t e = dtype_size(qkv.dtype()), d = static_cast<size_t>(sh.d), q = static_cast<size_t>(sh.qpg());
  // d_v < d: cuDNN writes the first d_v channels of each head; the others are zero, as the other
  // backends compute them from the zero value channels (only those columns are cleared).
  if (sh.dvo != sh.d) zero_columns(out.data(), out.numel() / sh.d, d * e, static_cast<size_t>(sh.dvo) * e, d * e, stream);
  void* qptr = base;
  if (sh.qpg() > 1) {
    query_slots(true, p.staging, base, sh, stream);
    qptr = p.staging;
  }
  execute(p, stream, {kQ, kK, kV, kO, kStats},
          {qptr, base + q * d * e, base + (q + 1) * d * e, out.data(), lse.data()});
  return true;
}

bool cudnn_attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& qkv, const Tensor& workspace, const FlashAttentionConfig& cfg,
                              const Stream& stream) {
  const Shape sh = shape_of(cfg, qkv.dtype());
  const size_t rows = static_cast<size_t>(sh.b * sh.h * sh.sq);
  const size_t e = dtype_size(qkv.dtype()), d = static_cast<size_t>(sh.d), q = static_cast<size_t>(sh.qpg());
  Plan* plan = plan_for(true, sh, cfg.softmax_scale, sh.qpg() > 1 ? 2 * rows * d * 2 : 0, may_lack_engine(sh));
  if (plan == nullptr) return false;
  Plan& p = *plan;
  // d_v < d: dV's channels beyond d_v are zero (cuDNN writes dQ, dK and the first d_v of dV): the
  // value slot's columns [d_v, d) of every (position, sample, group) row of dqkv [s, b, g, qpg + 2, d]
  if (sh.dvo != sh.d)
    zero_columns(static_cast<char*>(dqkv.data()) + (q + 1) * d * e, dqkv.numel() / ((q + 2) * d), (q + 2) * d * e,
                 static_cast<size_t>(sh.dvo) * e, d * e, stream);
  char* base = static_cast<char*>(qkv.data());
  char* dbase = static_cast<char*>(dqkv.data());
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
  return true;
}

bool cudnn_context_applies(const ContextAttentionConfig& c, DType dtype, int64_t sq, int64_t sk,
                           std::initializer_list<const void*> ptrs) {
  if (!c.cudnn || c.block == ContextBlockMask::kPositions) return false;
  if (c.block == ContextBlockMask::kCausal && sq != sk) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (!c.doc_start.empty() || c.dropout_p > 0 || c.deterministic) return false;
  if (!head_dim_supported(c.head_dim)) return false;
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

bool cudnn_context_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                           const Tensor& workspace, const ContextAttentionConfig& c, bool merge,
                           const Stream& stream) {
  const int64_t sq = qkv.size(0), sk = kv.size(0);
  const Shape sh = context_shape(c, qkv.dtype(), sq, sk);
  const ContextAttentionWorkspace w = context_attention_forward_layout(c, sq);
  Plan* plan = plan_for(false, sh, c.softmax_scale, 0, true);
  if (plan == nullptr) return false;
  Plan& p = *plan;
  char* ws = static_cast<char*>(workspace.data());
  char* kvp = static_cast<char*>(kv.data());
  const size_t head = static_cast<size_t>(c.head_dim) * dtype_size(qkv.dtype());
  void* qptr = qkv.data();
  if (sh.qpg() > 1) {
    qptr = ws + w.q;
    query_slots(true, qptr, qkv.data(), sh, stream);
  }
  void* o = merge ? ws + w.out : out.data();
  float* stats = reinterpret_cast<float*>(ws + w.stats);
  execute(p, stream, {kQ, kK, kV, kO, kStats}, {qptr, kvp, kvp + head, o, stats});
  const int64_t bn = c.batch * c.heads();
  dispatch_half(qkv.dtype(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    merge_block_kernel<T><<<grid_for(sq * bn, 128), 128, 0, cu(stream)>>>(
        static_cast<T*>(out.data()), lse.data_as<float>(), static_cast<const T*>(o), stats, sq, bn,
        static_cast<int>(c.head_dim / 8), merge);
  });
  MT_CUDA_CHECK_LAUNCH();
  return true;
}

bool cudnn_context_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& out,
                            const Tensor& lse, const Tensor& qkv, const Tensor& kv, const Tensor& workspace,
                            const ContextAttentionConfig& c, const Stream& stream) {
  const int64_t sq = qkv.size(0), sk = kv.size(0), d = c.head_dim, bn = c.batch * c.heads();
  const Shape sh = context_shape(c, qkv.dtype(), sq, sk);
  const ContextAttentionWorkspace w = context_attention_backward_layout(c, sq, sk);
  Plan* plan = plan_for(true, sh, c.softmax_scale, 0, true);
  if (plan == nullptr) return false;
  Plan& p = *plan;
  char* ws = static_cast<char*>(workspace.data());
  char* kvp = static_cast<char*>(kv.data());
  const size_t head = static_cast<size_t>(d) * dtype_size(qkv.dtype());
  float* stats = reinterpret_cast<float*>(ws + w.stats);
  stats_from_lse_kernel<<<grid_for(sq * bn, 256), 256, 0, cu(stream)>>>(stats, lse.data_as<float>(), sq, bn);
  MT_CUDA_CHECK_LAUNCH();
  void* dq_accum = ws + w.dq_accum;
  if (cudnnGetVersion() < 90600)  // as cudnn_attention_backward
    MT_CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, static_cast<size_t>(sq * bn * d) * sizeof(float), cu(stream)));
  void* qptr = qkv.data();
  if (sh.qpg() > 1) {
    qptr = ws + w.q;
    query_slots(true, qptr, qkv.data(), sh, stream);
  }
  char* dq = ws + w.dq;
  char* dkv_stage = ws + w.dkv;
  execute(p, stream, {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kSoftmaxSum, kDQAccum, kOne},
          {qptr, kvp, kvp + head, out.data(), dout.data(), stats, dq, dkv_stage, dkv_stage + head, ws + w.delta,
           dq_accum, &p.one});
  // dQ [sq·b·g rows of qpg heads] into the query slots of dqkv [.., g, qpg + 2, d]; dK/dV into dkv.
  const int64_t qpg = c.queries_per_group;
  add_rows(qkv.dtype(), dqkv.data(), (qpg + 2) * d, dq, qpg * d, sq * c.batch * c.groups, qpg * d, stream);
  add_rows(qkv.dtype(), dkv.data(), 2 * d, dkv_stage, 2 * d, sk * c.batch * c.groups, 2 * d, stream);
  return true;
}

#endif  // MT_WITH_CUDNN

}  // namespace mt::cuda
