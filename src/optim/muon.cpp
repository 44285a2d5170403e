#include "optim/muon.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <tuple>

#include <fmt/ranges.h>

#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/muon.h"
#include "optim/grad_sync.h"

namespace mt {

namespace {
constexpr float kNsEps = 1e-7f;  // emerging_optimizers newton_schulz's eps

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

namespace {
// One enum's flag spellings, in enum order; parse and name through the same table.
template <typename E, size_t N>
E parse_flag(const char* flag, const std::array<const char*, N>& names, const std::string& s) {
  for (size_t i = 0; i < N; ++i)
    if (s == names[i]) return static_cast<E>(i);
  MT_FAIL("{} '{}' is not one of {}", flag, s, fmt::join(names, ", "));
}
constexpr std::array<const char*, 3> kScaleModes{"spectral", "unit_rms_norm", "shape_scaling"};
constexpr std::array<const char*, 4> kCoefficientTypes{"simple", "quintic", "polar_express", "aol"};
constexpr std::array<const char*, 3> kTpModes{"duplicated", "blockwise", "distributed"};
}  // namespace

MuonScaleMode parse_muon_scale_mode(const std::string& s) {
  return parse_flag<MuonScaleMode>("--muon-scale-mode", kScaleModes, s);
}
MuonCoefficientType parse_muon_coefficient_type(const std::string& s) {
  return parse_flag<MuonCoefficientType>("--muon-coefficient-type", kCoefficientTypes, s);
}
MuonTpMode parse_muon_tp_mode(const std::string& s) { return parse_flag<MuonTpMode>("--muon-tp-mode", kTpModes, s); }
const char* muon_scale_mode_name(MuonScaleMode m) { return kScaleModes.at(static_cast<size_t>(m)); }
const char* muon_coefficient_type_name(MuonCoefficientType t) {
  return kCoefficientTypes.at(static_cast<size_t>(t));
}
const char* muon_tp_mode_name(MuonTpMode m) { return kTpModes.at(static_cast<size_t>(m)); }

std::vector<NsCoeff> ns_coefficients(MuonCoefficientType type, int steps) {
  MT_REQUIRE(steps >= 1, "--muon-num-ns-steps must be >= 1, got {}", steps);
  std::vector<NsCoeff> set;
  switch (type) {
    case MuonCoefficientType::kSimple:
      set = {{3.4445f, -4.7750f, 2.0315f}};
      break;
    case MuonCoefficientType::kQuintic:
      set = {{4.0848f, -6.8946f, 2.9270f},
             {3.9505f, -6.3029f, 2.6377f},
             {3.7418f, -5.5913f, 2.3037f},
             {2.8769f, -3.1427f, 1.2046f},
             {2.8366f, -3.0525f, 1.2012f}};
      break;
    case MuonCoefficientType::kPolarExpress:
      set = {{8.2051f, -22.9019f, 16.4607f}, {4.0664f, -2.8612f, 0.5184f}, {3.9096f, -2.8234f, 0.5250f},
             {3.2856f, -2.4153f, 0.4853f},   {2.2779f, -1.6198f, 0.3985f}, {1.8726f, -1.2307f, 0.3585f},
             {1.8564f, -1.2132f, 0.3568f},   {1.8750f, -1.2500f, 0.3750f}};
      break;
    case MuonCoefficientType::kAol:
      set = {{4.0098f, -7.0585f, 2.4635f},
             {3.4585f, -5.5479f, 2.5959f},
             {2.7573f, -3.2939f, 1.4254f},
             {2.7215f, -3.0494f, 1.3169f}};
      break;
  }
  const int n = static_cast<int>(set.size());
  std::vector<NsCoeff> out;
  if (type == MuonCoefficientType::kSimple) {
    out.assign(static_cast<size_t>(steps), set[0]);
  } else if (type == MuonCoefficientType::kPolarExpress) {
    MT_REQUIRE(steps >= n, "--muon-coefficient-type polar_express needs --muon-num-ns-steps >= {}, got {}", n, steps);
    out = set;
    out.resize(static_cast<size_t>(steps), set.back());
  } else {
    MT_REQUIRE(steps % n == 0, "--muon-coefficient-type {} needs --muon-num-ns-steps a multiple of {}, got {}",
               muon_coefficient_type_name(type), n, steps);
    for (int i = 0; i < steps; ++i) out.push_back(set[static_cast<size_t>(i % n)]);
  }
  return out;
}

double muon_scale_factor(MuonScaleMode mode, int64_t rows, int64_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (mode) {
    case MuonScaleMode::kSpectral: return std::sqrt(std::max(r, c));
    case MuonScaleMode::kUnitRmsNorm: return std::sqrt(r / c);
    case MuonScaleMode::kShapeScaling: return std::sqrt(std::max(1.0, r / c));
  }
  MT_FAIL("muon_scale_factor: invalid MuonScaleMode {}", static_cast<int>(mode));
}

void validate_muon_config(const MuonConfig& c) {
  MT_REQUIRE(c.momentum >= 0.f && c.momentum < 1.f, "--muon-momentum must be in [0, 1), got {}", c.momentum);
  MT_REQUIRE(c.extra_scale_factor >= 0.f, "--muon-extra-scale-factor must be >= 0, got {}", c.extra_scale_factor);
  MT_REQUIRE(c.qkv_q_rows >= 0 && c.qkv_kv_rows >= 0, "MuonConfig: QKV split rows {} / {} must be >= 0", c.qkv_q_rows,
             c.qkv_kv_rows);
  (void)ns_coefficients(c.coefficient_type, c.num_ns_steps);
}

bool is_muon_parameter(const ParamInfo& p) {
  return p.shape.size() == 2 && !p.shared_embedding_copy && p.vocab_rows == 0 &&
         p.name.find("embedding") == std::string::npos && p.name != "output_layer.weight" &&
         !ends_with(p.name, "router.weight");
}

// ---------------------------------------------------------------------------------------------
// NewtonSchulz
// ---------------------------------------------------------------------------------------------

NewtonSchulz::NewtonSchulz(Device device, DType compute, int64_t max_elements, int64_t max_gram, const Stream& stream)
    : compute_(compute), max_elements_(max_elements), max_gram_(max_gram) {
  MT_REQUIRE(compute == DType::kF32 || (compute == DType::kBF16 && device.is_cuda()),
             "NewtonSchulz: compute dtype {} on {} (fp32, or bf16 on CUDA)", dtype_name(compute), device.str());
  const size_t es = dtype_size(compute);
  x_ = Buffer(device, static_cast<size_t>(std::max<int64_t>(max_elements, 1)) * es);
  xn_ = Buffer(device, static_cast<size_t>(std::max<int64_t>(max_elements, 1)) * es);
  a_ = Buffer(device, static_cast<size_t>(std::max<int64_t>(max_gram, 1)) * es);
  b_ = Buffer(device, static_cast<size_t>(std::max<int64_t>(max_gram, 1)) * es);
  norm_ = Buffer(device, static_cast<size_t>(kMuonNormScratch) * 4);
  memset_tensor(norm_.as(DType::kF32, {kMuonNormScratch}), 0, stream);
}

void NewtonSchulz::run(const Tensor& out, const Tensor& g, int64_t rows, int64_t cols,
                       const std::vector<NsCoeff>& coeffs, const Stream& stream, Communicator* group, int split_dim) {
  run_batch({out}, {g}, rows, cols, coeffs, stream, group, split_dim);
}

void NewtonSchulz::run_batch(const std::vector<Tensor>& outs, const std::vector<Tensor>& gs, int64_t rows,
                             int64_t cols, const std::vector<NsCoeff>& coeffs, const Stream& stream,
                             Communicator* group, int split_dim) {
  const int64_t nb = static_cast<int64_t>(gs.size()), n = rows * cols;
  MT_REQUIRE(nb >= 1 && outs.size() == gs.size() && (!group || nb == 1),
             "NewtonSchulz: {} inputs, {} outputs (one with a group)", gs.size(), outs.size());
  for (int64_t i = 0; i < nb; ++i)
    MT_REQUIRE(gs[i].dtype() == DType::kF32 && outs[i].dtype() == DType::kF32 && gs[i].numel() == n &&
                   outs[i].numel() == n,
               "NewtonSchulz: g {} and out {} must be fp32 [{} x {}]", gs[i].str(), outs[i].str(), rows, cols);
  MT_REQUIRE(!group || split_dim == 0 || split_dim == 1, "NewtonSchulz: split_dim {} with a group (0 or 1)",
             split_dim);
  // The Gram matrix of the shorter side; sharded, of the side that is not split (its partial
  // products sum over the shards).
  const bool row_gram = group ? split_dim == 1 : rows <= cols;
  const int64_t k = row_gram ? rows : cols;
  MT_REQUIRE(nb * n <= max_elements_ && nb * k * k <= max_gram_,
             "NewtonSchulz: {} [{} x {}] matrices (Gram {} x {}) exceed the workspace ({} elements, Gram {})", nb,
             rows, cols, k, k, max_elements_, max_gram_);
  const Tensor norm = norm_.as(DType::kF32, {kMuonNormScratch});
  // [batch, r, c]: one strided-batched GEMM per product over equal shapes (ops/matmul.h)
  Tensor x = x_.as(compute_, {nb, rows, cols}), xn = xn_.as(compute_, {nb, rows, cols});
  const Tensor a = a_.as(compute_, {nb, k, k}), b = b_.as(compute_, {nb, k, k});
  for (int64_t i = 0; i < nb; ++i) {
    muon_sumsq(norm, gs[i], stream);
    if (group) group->all_reduce(norm.flat_range(0, 1), ReduceOp::kSum, stream);
    muon_normalize(x.flat_range(i * n, n), gs[i], norm, kNsEps, stream);
  }
  for (const NsCoeff& s : coeffs) {
    if (row_gram) {
      matmul(a, x, x, false, true, 1.f, 0.f, stream);  // A = X X^T
    } else {
      matmul(a, x, x, true, false, 1.f, 0.f, stream);  // A = X^T X
    }
    if (group) group->all_reduce(a, ReduceOp::kSum, stream);
    copy(b, a, stream);
    matmul(b, a, a, false, false, s.c, s.b, stream);  // B = b A + c A A
    copy(xn, x, stream);
    if (row_gram) {
      matmul(xn, b, x, false, false, 1.f, s.a, stream);  // X' = a X + B X
    } else {
      matmul(xn, x, b, false, false, 1.f, s.a, stream);  // X' = a X + X B
    }
    std::swap(x, xn);
  }
  for (int64_t i = 0; i < nb; ++i) {
    const Tensor flat_out = outs[i].flat_range(0, n);
    if (compute_ == DType::kF32) {
      copy(flat_out, x.flat_range(i * n, n), stream);
    } else {
      cast(flat_out, x.flat_range(i * n, n), stream);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// MuonStep
// ---------------------------------------------------------------------------------------------

/// A matrix to orthogonalise: `rows` x `cols` local elements of parameter `param`, taken as
/// `blocks` blocks of `block_rows` consecutive rows starting at row `row0` of every `block_stride`
/// rows (a QKV component) or the whole parameter (blocks = 1, staged = false); split over `tp`
/// along local dimension `split_dim` (-1: not split, or handled blockwise).
struct MuonStep::Unit {
  size_t param = 0;
  int64_t rows = 0, cols = 0;
  int64_t row0 = 0, block_rows = 0, block_stride = 0, blocks = 1;
  bool staged = false;
  int split_dim = -1;
  Communicator* tp = nullptr;
  float scale = 1.f;
};

MuonStep::~MuonStep() = default;

namespace {
// The local dimension a parameter's TP split runs along (0 rows, 1 columns), -1 when not split.
int local_split_dim(const ParamSpec& p) {
  if (!p.tensor_parallel || p.tp_split_dim < 0) return -1;
  // column-parallel weights split their rows (also the gated [parts, out, in] fc1), row-parallel
  // ones their columns (the last global dimension)
  return p.tp_split_dim == static_cast<int>(p.global_shape.size()) - 1 ? 1 : 0;
}
}  // namespace

MuonStep::MuonStep(ParamStore& params, GradSync& sync, const MuonConfig& config, std::shared_ptr<Communicator> tp,
                   std::shared_ptr<Communicator> etp, std::vector<MuonPiece> pieces, const Stream& stream)
    : params_(params), sync_(sync), config_(config), tp_(std::move(tp)), etp_(std::move(etp)),
      pieces_(std::move(pieces)) {
  validate_muon_config(config_);
  coeffs_ = ns_coefficients(config_.coefficient_type, config_.num_ns_steps);
  owner_.assign(params_.size(), -1);
  for (size_t i = 0; i < params_.size(); ++i)
    if (is_muon_parameter(params_.info(i))) muon_params_.push_back(i);
  // Owners: with the distributed optimizer, whole matrices go to data-parallel ranks, largest NS
  // cost (r c min(r, c) of the global matrix) first to the least loaded rank (ties: lowest rank,
  // then parameter order), separately for the dense (DP) and expert (EDP) groups. The same on
  // every rank (global shapes only), so TP peers own the same matrices.
  int my_dense = 0, my_expert = 0;
  std::vector<double> dense_load(1, 0.0), expert_load(1, 0.0);
  if (sync_.distributed()) {
    dense_load.assign(static_cast<size_t>(sync_.dp()->size()), 0.0);
    expert_load.assign(static_cast<size_t>(sync_.edp()->size()), 0.0);
    my_dense = sync_.dp()->rank();
    my_expert = sync_.edp()->rank();
  }
  auto cost = [&](size_t i) {
    const ParamInfo& p = params_.info(i);
    int64_t r = p.shape[0], c = p.shape[1];
    const int split = local_split_dim(p);
    const int64_t tp_size = p.expert ? (etp_ ? etp_->size() : 1) : (tp_ ? tp_->size() : 1);
    if (split == 0) r *= tp_size;
    if (split == 1) c *= tp_size;
    return static_cast<double>(r) * static_cast<double>(c) * static_cast<double>(std::min(r, c));
  };
  std::vector<size_t> order = muon_params_;
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cost(x) > cost(y); });
  for (size_t i : order) {
    std::vector<double>& load = params_.info(i).expert ? expert_load : dense_load;
    const size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += cost(i);
    owner_[i] = static_cast<int>(r);
  }
  for (size_t i : muon_params_)
    if (owner_[i] == (params_.info(i).expert ? my_expert : my_dense)) mine_.push_back(i);
  // Units of the owned matrices and the workspace sizes.
  MuonWorkspace ws;
  for (size_t i : mine_) {
    const ParamInfo& p = params_.info(i);
    Communicator* group = p.expert ? etp_.get() : tp_.get();
    const size_t first = units_.size();
    plan_units(p, i, config_, group ? group->size() : 1, units_, ws);
    for (size_t k = first; k < units_.size(); ++k) units_[k].tp = units_[k].split_dim >= 0 ? group : nullptr;
  }
  batches_ = plan_batches(units_, ws);
  plan_pipeline(my_dense, my_expert);
  const Device dev = params_.device();
  ns_ = std::make_unique<NewtonSchulz>(dev, dev.is_cuda() ? DType::kBF16 : DType::kF32, ws.ns, ws.gram, stream);
  auto f32 = [&](int64_t n) { return Buffer(dev, static_cast<size_t>(std::max<int64_t>(n, 1)) * 4); };
  stage_ = f32(ws.stage);
  gather_ = f32(ws.gather);
  full_ = f32(ws.full);
}

void MuonStep::plan_units(const ParamSpec& p, size_t index, const MuonConfig& config, int tp_size,
                          std::vector<Unit>& units, MuonWorkspace& ws) {
  const int split = tp_size > 1 && config.tp_mode != MuonTpMode::kBlockwise ? local_split_dim(p) : -1;
  const int64_t r = p.shape[0], c = p.shape[1];
  std::vector<Unit> parts;
  const int64_t q = config.qkv_q_rows, kv = config.qkv_kv_rows, group_rows = q + 2 * kv;
  if (config.split_qkv && q > 0 && ends_with(p.name, "self_attention.linear_qkv.weight") && r % group_rows == 0) {
    // Megatron's split_qkv: [groups, q + 2 kv, c] split along dim 1 into Q, K and V.
    const int64_t g = r / group_rows;
    for (const auto& [row0, n] : {std::pair{int64_t{0}, q}, {q, kv}, {q + kv, kv}})
      parts.push_back(Unit{index, g * n, c, row0, n, group_rows, g, true});
  } else {
    parts.push_back(Unit{index, r, c, 0, r, r, 1, false});
  }
  for (Unit& u : parts) {
    u.split_dim = split;
    // The scale of the global matrix (blockwise: of the shard, as Megatron's partition_dim None).
    const int64_t gr = u.rows * (split == 0 ? tp_size : 1), gc = u.cols * (split == 1 ? tp_size : 1);
    u.scale = static_cast<float>(muon_scale_factor(config.scale_mode, gr, gc) * config.extra_scale_factor);
    const int64_t local = u.rows * u.cols;
    if (u.staged) ws.stage = std::max(ws.stage, local);
    if (split >= 0 && config.tp_mode == MuonTpMode::kDuplicated) {
      ws.gather = std::max(ws.gather, local * tp_size);
      if (split == 1) ws.full = std::max(ws.full, local * tp_size);
      ws.ns = std::max(ws.ns, gr * gc);
      ws.gram = std::max(ws.gram, std::min(gr, gc) * std::min(gr, gc));
    } else if (split >= 0) {  // distributed: the Gram matrix of the unsplit side
      ws.ns = std::max(ws.ns, local);
      const int64_t k = split == 1 ? u.rows : u.cols;
      ws.gram = std::max(ws.gram, k * k);
    } else {
      ws.ns = std::max(ws.ns, local);
      ws.gram = std::max(ws.gram, std::min(u.rows, u.cols) * std::min(u.rows, u.cols));
    }
    units.push_back(u);
  }
}

std::vector<std::vector<size_t>> MuonStep::plan_batches(const std::vector<Unit>& units, MuonWorkspace& ws) {
  std::vector<std::vector<size_t>> batches;
  // Batches: the units without a TP collective, grouped by shape (in order), as many per batch as
  // the workspace of the largest matrix holds (the Gram workspace may grow to half of it); the
  // staged ones (QKV components) each get a staging slot.
  const int64_t gram_cap = std::max(ws.gram, ws.ns / 2);
  std::vector<bool> batched(units.size(), false);
  for (size_t i = 0; i < units.size(); ++i) {
    if (batched[i]) continue;
    std::vector<size_t> batch{i};
    batched[i] = true;
    const Unit& u = units[i];
    if (u.split_dim < 0) {
      const int64_t n = u.rows * u.cols, k = std::min(u.rows, u.cols);
      const int64_t most = std::max<int64_t>(1, std::min(ws.ns / n, gram_cap / (k * k)));
      for (size_t j = i + 1; j < units.size() && static_cast<int64_t>(batch.size()) < most; ++j)
        if (!batched[j] && units[j].split_dim < 0 && units[j].rows == u.rows && units[j].cols == u.cols) {
          batch.push_back(j);
          batched[j] = true;
        }
    }
    int64_t staged = 0;
    for (size_t j : batch) staged += units[j].staged ? units[j].rows * units[j].cols : 0;
    ws.stage = std::max(ws.stage, staged);
    const int64_t k = std::min(u.rows, u.cols);
    ws.gram = std::max(ws.gram, static_cast<int64_t>(batch.size()) * k * k);
    batches.push_back(std::move(batch));
  }
  return batches;
}

double MuonStep::ns_step_flops(const Unit& u, const MuonConfig& config, int tp_size) {
  // The matrix NewtonSchulz::run iterates on this rank and its Gram side (as orthogonalise()).
  double r = static_cast<double>(u.rows), c = static_cast<double>(u.cols), k = std::min(r, c);
  if (u.split_dim >= 0 && config.tp_mode == MuonTpMode::kDuplicated) {
    (u.split_dim == 0 ? r : c) *= tp_size;  // the gathered global matrix
    k = std::min(r, c);
  } else if (u.split_dim >= 0) {
    k = u.split_dim == 1 ? r : c;  // distributed: the Gram matrix of the unsplit side
  }
  const double n = r * c / k;
  return 4 * k * k * n + 2 * k * k * k;
}

size_t MuonWorkspace::bytes(DType compute) const {
  const size_t cs = dtype_size(compute);
  auto at_least_1 = [](int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 1)); };
  return 2 * at_least_1(ns) * cs + 2 * at_least_1(gram) * cs + static_cast<size_t>(kMuonNormScratch) * 4 +
         4 * (at_least_1(stage) + at_least_1(gather) + at_least_1(full));
}

MuonMemory muon_memory(const std::vector<ParamSpec>& specs, const MuonConfig& config, int tp, int etp,
                       Device device) {
  MuonMemory m;
  MuonWorkspace ws;
  std::vector<MuonStep::Unit> units;
  for (size_t i = 0; i < specs.size(); ++i) {
    ParamInfo p;
    static_cast<ParamSpec&>(p) = specs[i];
    if (p.global_shape.empty()) p.global_shape = p.shape;
    if (!is_muon_parameter(p)) continue;
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    (p.expert ? m.expert_elements : m.dense_elements) += n;
    const size_t first = units.size();
    const int tp_size = p.expert ? etp : tp;
    MuonStep::plan_units(p, i, config, tp_size, units, ws);
    for (size_t k = first; k < units.size(); ++k)
      (p.expert ? m.expert_ns_flops : m.dense_ns_flops) +=
          config.num_ns_steps * MuonStep::ns_step_flops(units[k], config, tp_size);
  }
  (void)MuonStep::plan_batches(units, ws);
  m.workspace_bytes = ws.bytes(device.is_cuda() ? DType::kBF16 : DType::kF32);
  return m;
}

int MuonStep::last_gather(const std::vector<size_t>& batch, const std::vector<Unit>& units,
                          const std::vector<int>& param_pos) {
  int last = -1;
  for (size_t j : batch) last = std::max(last, param_pos[units[j].param]);
  return last;
}

std::vector<std::vector<size_t>> MuonStep::order_batches(std::vector<std::vector<size_t>> batches,
                                                         const std::vector<Unit>& units,
                                                         const std::vector<int>& param_pos) {
  std::stable_sort(batches.begin(), batches.end(), [&](const auto& x, const auto& y) {
    return last_gather(x, units, param_pos) < last_gather(y, units, param_pos);
  });
  return batches;
}

void MuonStep::plan_pipeline(int my_dense, int my_expert) {
  if (!sync_.distributed()) {  // no traffic of Muon's own: the batches on the compute stream
    for (size_t k = 0; k < batches_.size(); ++k) program_.push_back({Op::kBatch, k});
    return;
  }
  const auto& bks = params_.buckets();
  const Device dev = params_.device();
  // All-gather order: the buckets holding Muon matrices over groups of 2+ ranks, ascending
  // parameters (the last bucket first), the order plan_batches meets them in.
  gather_pos_.assign(bks.size(), -1);
  std::vector<int> param_pos(params_.size(), -1);
  for (size_t b = bks.size(); b-- > 0;) {
    const ParamBucket& bk = bks[b];
    bool muon = false;
    for (size_t i = bk.param_begin; i < bk.param_end; ++i) muon = muon || owner_[i] >= 0;
    if (!muon || sync_.group(bk).size() < 2) continue;
    gather_pos_[b] = static_cast<int>(gather_buckets_.size());
    for (size_t i = bk.param_begin; i < bk.param_end; ++i) param_pos[i] = gather_pos_[b];
    gather_buckets_.push_back(b);
    gathered_.push_back(std::make_unique<Event>(dev));
  }
  batches_ = order_batches(std::move(batches_), units_, param_pos);
  // Estimated finish time of every matrix on its owner (cumulated NS FLOPs of the owner's
  // batches in run order), from global shapes only: the same on every rank. (A rank owning
  // dense and expert matrices runs both in one plan; the estimate plans each kind alone.)
  std::vector<double> finish(params_.size(), 0.0);
  for (const bool expert : {false, true}) {
    Communicator* tp = expert ? etp_.get() : tp_.get();
    const int tp_size = tp ? tp->size() : 1;
    const int owners = (expert ? sync_.edp() : sync_.dp())->size();
    for (int o = 0; o < owners; ++o) {
      std::vector<Unit> units;
      MuonWorkspace ws;
      for (size_t i : muon_params_)
        if (params_.info(i).expert == expert && owner_[i] == o)
          plan_units(params_.info(i), i, config_, tp_size, units, ws);
      double t = 0;
      for (const auto& batch : order_batches(plan_batches(units, ws), units, param_pos)) {
        for (size_t j : batch) t += ns_step_flops(units[j], config_, tp_size);
        for (size_t j : batch) finish[units[j].param] = t;
      }
    }
  }
  // Broadcasts in one global order; a run of one owner's matrices finishing together is a group.
  std::vector<size_t> bc;
  for (size_t i : muon_params_)
    if (sync_.group(bks[params_.bucket_of(i)]).size() > 1) bc.push_back(i);
  auto key = [&](size_t i) { return std::tuple(finish[i], params_.info(i).expert, owner_[i]); };
  std::sort(bc.begin(), bc.end(), [&](size_t x, size_t y) { return std::tuple(key(x), x) < std::tuple(key(y), y); });
  for (size_t n = 0; n < bc.size(); ++n) {
    if (n == 0 || key(bc[n]) != key(bc[n - 1])) bcasts_.push_back({params_.info(bc[n]).expert, owner_[bc[n]], {}});
    bcasts_.back().params.push_back(bc[n]);
  }
  // The program: every all-gather first (they depend on the momentum only), then the batches,
  // each broadcast issued as soon as its matrices' batches are (this rank's) or at once (others').
  std::vector<int> done_at(params_.size(), -1);  // the batch completing each own matrix
  for (size_t k = 0; k < batches_.size(); ++k)
    for (size_t j : batches_[k]) done_at[units_[j].param] = static_cast<int>(k);
  batch_done_.resize(batches_.size());
  for (size_t b : gather_buckets_) program_.push_back({Op::kAllGather, b});
  size_t next = 0;
  int gather_waited = -1, batch_waited = -1;
  auto issue_broadcasts = [&](int done) {  // batches [0, done] issued
    for (; next < bcasts_.size(); ++next) {
      const Broadcast& g = bcasts_[next];
      if (g.root == (g.expert ? my_expert : my_dense)) {
        int need = -1;
        for (size_t i : g.params) need = std::max(need, done_at[i]);
        MT_CHECK(need >= 0, "MuonStep: broadcast of parameter {} from this rank, which orthogonalises it in no batch",
                 g.params[0]);
        if (need > done) return;
        if (need > batch_waited) {
          program_.push_back({Op::kCommWaitsBatch, static_cast<size_t>(need)});
          if (!batch_done_[need]) batch_done_[need] = std::make_unique<Event>(dev);
          batch_waited = need;
        }
      }
      program_.push_back({Op::kBroadcast, next});
    }
  };
  issue_broadcasts(-1);
  for (size_t k = 0; k < batches_.size(); ++k) {
    const int last = last_gather(batches_[k], units_, param_pos);
    if (last > gather_waited) {
      program_.push_back({Op::kComputeWaitsGather, gather_buckets_[static_cast<size_t>(last)]});
      gather_waited = last;
    }
    program_.push_back({Op::kBatch, k});
    issue_broadcasts(static_cast<int>(k));
  }
  issue_broadcasts(static_cast<int>(batches_.size()));
  MT_CHECK(next == bcasts_.size(), "MuonStep: {} of {} broadcasts planned", next, bcasts_.size());
  start_ = std::make_unique<Event>(dev);
  end_ = std::make_unique<Event>(dev);
}

std::vector<size_t> MuonStep::batch_params(size_t k) const {
  MT_REQUIRE(k < batches_.size(), "MuonStep::batch_params: batch {} of {}", k, batches_.size());
  std::vector<size_t> out;
  for (size_t j : batches_[k]) out.push_back(units_[j].param);
  return out;
}

int MuonStep::owner_of(size_t i) const {
  MT_REQUIRE(i < owner_.size() && owner_[i] >= 0, "MuonStep::owner_of: parameter {} is not a Muon parameter", i);
  return owner_[i];
}

void MuonStep::orthogonalise(const Unit& u, const Tensor& grads, const Stream& stream) {
  const ParamInfo& p = params_.info(u.param);
  const int64_t r = u.rows, c = u.cols, n = r * c;
  const Tensor whole = grads.flat_range(p.offset, p.numel);
  // The unit's local matrix, contiguous.
  const Tensor loc = u.staged ? stage_.as(DType::kF32, {n}) : whole;
  if (u.staged) muon_copy_2d(loc, u.block_rows * c, whole.flat_range(u.row0 * c, whole.numel() - u.row0 * c),
                             u.block_stride * c, u.blocks, u.block_rows * c, stream);
  if (!u.tp) {
    ns_->run(loc, loc, r, c, coeffs_, stream);
  } else if (config_.tp_mode == MuonTpMode::kDistributed) {
    ns_->run(loc, loc, r, c, coeffs_, stream, u.tp, u.split_dim);
  } else {  // duplicated: every TP rank orthogonalises the gathered matrix and keeps its shard
    const int tp = u.tp->size(), rank = u.tp->rank();
    const Tensor gathered = gather_.as(DType::kF32, {n * tp});
    u.tp->all_gather(gathered, loc, stream);
    if (u.split_dim == 0) {
      // rank blocks of rows stacked: a row permutation of the global matrix at most (QKV
      // components and the gated fc1 interleave per rank), and NS(P X) = P NS(X)
      ns_->run(gathered, gathered, r * tp, c, coeffs_, stream);
      copy(loc, gathered.flat_range(rank * n, n), stream);
    } else {
      // [tp, r, c] column blocks -> [r, tp c]
      const Tensor full = full_.as(DType::kF32, {n * tp});
      for (int k = 0; k < tp; ++k)
        muon_copy_2d(full.flat_range(k * c, n * tp - k * c), tp * c, gathered.flat_range(k * n, n), c, r, c, stream);
      ns_->run(full, full, r, c * tp, coeffs_, stream);
      muon_copy_2d(loc, c, full.flat_range(rank * c, n * tp - rank * c), tp * c, r, c, stream);
    }
  }
  scale_inplace(loc, u.scale, stream);
  if (u.staged)
    muon_copy_2d(whole.flat_range(u.row0 * c, whole.numel() - u.row0 * c), u.block_stride * c, loc,
                 u.block_rows * c, u.blocks, u.block_rows * c, stream);
}

void MuonStep::orthogonalise_batch(const std::vector<size_t>& batch, const Tensor& grads, const Stream& stream) {
  // Equal shapes, no TP collective: the local matrices (QKV components staged to slots) through
  // one batched iteration, scaled, back in place.
  std::vector<Tensor> mats;
  int64_t slot = 0;
  for (size_t j : batch) {
    const Unit& u = units_[j];
    const ParamInfo& p = params_.info(u.param);
    const int64_t c = u.cols, n = u.rows * c;
    const Tensor whole = grads.flat_range(p.offset, p.numel);
    if (u.staged) {
      const Tensor loc = stage_.as(DType::kF32, {static_cast<int64_t>(stage_.bytes() / 4)}).flat_range(slot, n);
      slot += n;
      muon_copy_2d(loc, u.block_rows * c, whole.flat_range(u.row0 * c, whole.numel() - u.row0 * c),
                   u.block_stride * c, u.blocks, u.block_rows * c, stream);
      mats.push_back(loc);
    } else {
      mats.push_back(whole);
    }
  }
  const Unit& first = units_[batch[0]];
  ns_->run_batch(mats, mats, first.rows, first.cols, coeffs_, stream);
  for (size_t i = 0; i < batch.size(); ++i) {
    const Unit& u = units_[batch[i]];
    scale_inplace(mats[i], u.scale, stream);
    if (u.staged) {
      const ParamInfo& p = params_.info(u.param);
      const Tensor whole = grads.flat_range(p.offset, p.numel);
      const int64_t c = u.cols;
      muon_copy_2d(whole.flat_range(u.row0 * c, whole.numel() - u.row0 * c), u.block_stride * c, mats[i],
                   u.block_rows * c, u.blocks, u.block_rows * c, stream);
    }
  }
}

void MuonStep::step(const Tensor& grads, const Tensor& momentum, const Tensor& scalars, const Stream& stream) {
  // Momentum of the owned elements; U over the gradients.
  for (const MuonPiece& pc : pieces_) {
    const Tensor g = grads.flat_range(pc.begin, pc.n);
    muon_momentum(g, g, momentum.flat_range(pc.state, pc.n), config_.momentum, config_.nesterov, scalars, stream);
  }
  // The program (plan_pipeline): with the distributed optimizer every rank's owned U slices go
  // to every rank of the bucket's group and each orthogonalised matrix from its owner back to
  // the group, on the communication stream beside the batches (CPU: inline, in program order).
  const bool piped = start_ != nullptr;
  const Stream& comm = piped ? sync_.comm_stream() : stream;
  if (piped) {
    start_->record(stream);
    start_->wait(comm);
  }
  const auto& bks = params_.buckets();
  for (const Op& op : program_) {
    switch (op.kind) {
      case Op::kAllGather: {
        const ParamBucket& bk = bks[op.index];
        const ParamStore::Range own = sync_.owned_range(op.index);
        sync_.group(bk).all_gather(grads.flat_range(bk.begin, bk.numel()),
                                   grads.flat_range(own.begin, own.end - own.begin), comm);
        gathered_[static_cast<size_t>(gather_pos_[op.index])]->record(comm);
        break;
      }
      case Op::kComputeWaitsGather:
        gathered_[static_cast<size_t>(gather_pos_[op.index])]->wait(stream);
        break;
      case Op::kBatch: {
        const auto& batch = batches_[op.index];
        if (batch.size() == 1) {
          orthogonalise(units_[batch[0]], grads, stream);
        } else {
          orthogonalise_batch(batch, grads, stream);
        }
        if (piped && batch_done_[op.index]) batch_done_[op.index]->record(stream);
        break;
      }
      case Op::kCommWaitsBatch:
        batch_done_[op.index]->wait(comm);
        break;
      case Op::kBroadcast: {
        const Broadcast& g = bcasts_[op.index];
        Communicator& c = sync_.group(bks[params_.bucket_of(g.params[0])]);
        if (g.params.size() > 1) c.group_start();
        for (size_t i : g.params)
          c.broadcast(grads.flat_range(params_.info(i).offset, params_.info(i).numel), g.root, comm);
        if (g.params.size() > 1) c.group_end();
        break;
      }
    }
  }
  if (piped) {  // the update reads the broadcast gradients
    end_->record(comm);
    end_->wait(stream);
  }
}

}  // namespace mt
