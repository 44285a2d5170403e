// The variation-point tables of model/variants.h: every kind round-trips through its name (and
// alias), an unknown name is refused with every accepted name listed, every kind builds its
// implementation and that implementation is the kind's (checked against float64 references
// written here, one per kind name: a kind without one fails), and a norm kind's name in checkpoint
// metadata is its own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "model/gpt_model.h"
#include "model/layers/attention.h"
#include "model/layers/norm.h"
#include "model/specs.h"
#include "model/variants.h"
#include "ops/elementwise.h"
#include "testing/testing.h"
#include "train/checkpoint.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using testing::OwnedTensor;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Every table: entry i is enum value i, names and aliases are unique, name -> kind -> name
// round-trips (aliases too), an unknown name is refused naming the flag, the value and every
// accepted name, and the --help text names every kind.
template <class Entry, class Kind>
void check_names(std::span<const Entry> table, Kind (*parse)(const std::string&), const char* (*name)(Kind),
                 const std::string& help, const std::string& flag) {
  ASSERT_FALSE(table.empty()) << flag;
  std::set<std::string> seen;
  for (size_t i = 0; i < table.size(); ++i) {
    const Entry& e = table[i];
    SCOPED_TRACE(fmt::format("{} {}", flag, e.names.name));
    EXPECT_EQ(static_cast<size_t>(e.kind), i) << "tables are in enum order";
    EXPECT_TRUE(seen.insert(e.names.name).second) << "name listed twice";
    EXPECT_EQ(parse(e.names.name), e.kind);
    EXPECT_STREQ(name(e.kind), e.names.name);
    EXPECT_STREQ(name(parse(name(e.kind))), e.names.name);
    if (e.names.alias != nullptr) {
      EXPECT_TRUE(seen.insert(e.names.alias).second) << "alias listed twice";
      EXPECT_EQ(parse(e.names.alias), e.kind);
    }
    EXPECT_NE(std::string(e.names.help), "");
    if (!help.empty()) EXPECT_NE(help.find(std::string(e.names.name) + (e.names.alias ? " (" : ":")), std::string::npos)
        << help;
  }
  const std::string err = error_of([&] { parse("no-such-kind"); });
  EXPECT_NE(err.find(flag + " 'no-such-kind' is not supported: expected "), std::string::npos) << err;
  for (const std::string& n : seen) EXPECT_NE(err.find(n), std::string::npos) << n << " missing from: " << err;
  // A value past the table (an enum value added without an entry) is an error, not a default.
  const std::string missing = error_of([&] { name(static_cast<Kind>(table.size())); });
  EXPECT_NE(missing.find("has no entry in its table"), std::string::npos) << missing;
}

TEST(Variants, EveryKindRoundTripsThroughItsName) {
  check_names(norm_kinds(), &parse_normalization, &normalization_name, normalization_help(), "--normalization");
  check_names(position_embedding_kinds(), &parse_position_embedding_type, &position_embedding_type_name,
              position_embedding_type_help(), "--position-embedding-type");
  check_names(attention_backend_kinds(), &parse_attention_backend, &attention_backend_name, attention_backend_help(),
              "--attention-backend");
  check_names(mlp_activation_kinds(), &parse_mlp_activation, &mlp_activation_name, std::string(), "MLP activation");
  EXPECT_EQ(parse_attention_backend("unfused"), AttentionBackend::kLocal);  // Megatron's other spelling
  const std::string err = error_of([] { parse_normalization("BatchNorm"); });
  EXPECT_NE(err.find("--normalization 'BatchNorm' is not supported: expected LayerNorm or RMSNorm"), std::string::npos)
      << err;
  const std::string err2 = error_of([] { parse_attention_backend("flex"); });
  EXPECT_NE(err2.find("--attention-backend 'flex' is not supported: expected auto, flash, fused or local (unfused)"),
            std::string::npos)
      << err2;
}

// --- norms --------------------------------------------------------------------------------------

/// y = norm(x) per row in float64, by kind name.
using NormRef = std::function<std::vector<double>(const std::vector<double>& x, const std::vector<double>& w,
                                                  const std::vector<double>& b, int64_t rows, int64_t h, double eps)>;

const std::map<std::string, NormRef>& norm_references() {
  static const std::map<std::string, NormRef> refs{
      {"LayerNorm",
       [](const auto& x, const auto& w, const auto& b, int64_t rows, int64_t h, double eps) {
         std::vector<double> y(x.size());
         for (int64_t r = 0; r < rows; ++r) {
           double mean = 0, var = 0;
           for (int64_t c = 0; c < h; ++c) mean += x[r * h + c] / h;
           for (int64_t c = 0; c < h; ++c) var += (x[r * h + c] - mean) * (x[r * h + c] - mean) / h;
           for (int64_t c = 0; c < h; ++c) y[r * h + c] = (x[r * h + c] - mean) / std::sqrt(var + eps) * w[c] + b[c];
         }
         return y;
       }},
      {"RMSNorm",
       [](const auto& x, const auto& w, const auto&, int64_t rows, int64_t h, double eps) {
         std::vector<double> y(x.size());
         for (int64_t r = 0; r < rows; ++r) {
           double ms = 0;
           for (int64_t c = 0; c < h; ++c) ms += x[r * h + c] * x[r * h + c] / h;
           for (int64_t c = 0; c < h; ++c) y[r * h + c] = x[r * h + c] / std::sqrt(ms + eps) * w[c];
         }
         return y;
       }},
  };
  return refs;
}

std::vector<double> to_f64(const std::vector<float>& v) { return {v.begin(), v.end()}; }

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Each norm kind builds the Norm module: its parameters (weight, and a bias exactly when the kind
// has one), its forward against the kind's float64 formula, and its backward (weight and bias
// gradients, dx against central differences of the formula).
TEST(Variants, EveryNormKindBuildsItsNorm) {
  const int64_t rows = 3, h = 8;
  const double eps = 1e-5;
  for (const NormKind& kind : norm_kinds()) {
    SCOPED_TRACE(kind.names.name);
    const auto ref_it = norm_references().find(kind.names.name);
    ASSERT_NE(ref_it, norm_references().end()) << "no float64 reference for this norm kind in variants_test.cpp";
    const NormRef& ref = ref_it->second;
    TransformerConfig c;
    c.normalization = kind.kind;
    c.norm_epsilon = static_cast<float>(eps);
    Stream st;
    ParamRegistry reg;
    reg.begin_group(false);
    Norm norm(c, "n", h, TpGradSum::kSequenceParallel, reg);
    const std::vector<ParamSpec> specs = reg.specs();
    ASSERT_EQ(specs.size(), kind.has_bias ? 2u : 1u);
    EXPECT_EQ(specs[0].name, "n.weight");
    if (kind.has_bias) EXPECT_EQ(specs[1].name, "n.bias");
    EXPECT_EQ(static_cast<int64_t>(specs.size()), kind.params_per_channel());
    ParamStore store(specs, DType::kF32, Device::cpu());
    reg.bind(store);
    const std::vector<float> w = testing::randn(h), b = kind.has_bias ? testing::randn(h) : std::vector<float>(h, 0.f);
    testing::upload(store.param(0), w, st);
    if (kind.has_bias) testing::upload(store.param(1), b, st);
    BufferPlanner planner(Device::cpu(), DType::kF32);
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      norm.plan(planner, rows);
      planner.close_area();
      if (pass == 0) planner.materialize();
    }
    const std::vector<float> xv = testing::randn(rows * h), dyv = testing::randn(rows * h);
    OwnedTensor x = testing::make_tensor(xv, DType::kF32, Device::cpu(), {rows, h}, st);
    OwnedTensor y(DType::kF32, Device::cpu(), {rows, h});
    OwnedTensor dy = testing::make_tensor(dyv, DType::kF32, Device::cpu(), {rows, h}, st);
    OwnedTensor dx(DType::kF32, Device::cpu(), {rows, h});
    testing::poison(y.t, st);
    testing::poison(dx.t, st);
    const MicroBatch mb{};
    const DropoutContext dc{};
    const StepContext ctx{mb, dc, 0, st};
    norm.forward(y.t, x.t, ctx);
    const std::vector<double> yr = ref(to_f64(xv), to_f64(w), to_f64(b), rows, h, eps);
    EXPECT_LT(max_abs_diff(testing::to_host(y.t, st), yr), 1e-5);
    // Backward of L = Σ dy ∘ y: dweight = Σ_rows dy ∘ xhat (the formula with weight 1, bias 0),
    // dbias = Σ_rows dy, dx by central differences of the formula.
    store.zero_grads(st);
    norm.backward(dx.t, dy.t, x.t, /*accumulate_dx=*/false, ctx);
    const std::vector<double> xhat = ref(to_f64(xv), std::vector<double>(h, 1.0), std::vector<double>(h, 0.0), rows, h, eps);
    std::vector<double> dw(h, 0), db(h, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < h; ++k) {
        dw[k] += dyv[r * h + k] * xhat[r * h + k];
        db[k] += dyv[r * h + k];
      }
    EXPECT_LT(max_abs_diff(testing::to_host(store.grad(0), st), dw), 1e-4);
    if (kind.has_bias) EXPECT_LT(max_abs_diff(testing::to_host(store.grad(1), st), db), 1e-4);
    std::vector<double> x64 = to_f64(xv), dxr(x64.size());
    const auto objective = [&] {
      const std::vector<double> yy = ref(x64, to_f64(w), to_f64(b), rows, h, eps);
      double l = 0;
      for (size_t j = 0; j < yy.size(); ++j) l += yy[j] * dyv[j];
      return l;
    };
    for (size_t i = 0; i < x64.size(); ++i) dxr[i] = testing::finite_diff(objective, x64, i, 1e-6);
    EXPECT_LT(max_abs_diff(testing::to_host(dx.t, st), dxr), 1e-4);
  }
}

/// A tiny GPT on the CPU for the whole-model checks below.
TransformerConfig tiny_config() {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 16;
  c.num_attention_heads = 4;
  c.seq_length = 6;
  c.max_position_embeddings = 8;
  c.vocab_size = 37;
  c.make_vocab_size_divisible_by = 8;
  c.hidden_dropout = c.attention_dropout = 0.f;
  c.init_method_std = 0.15f;
  return c;
}

int64_t numel_of(const std::vector<ParamSpec>& specs) {
  int64_t n = 0;
  for (const ParamSpec& s : specs) {
    int64_t k = 1;
    for (int64_t d : s.shape) k *= d;
    n += k;
  }
  return n;
}

bool has_param(const std::vector<ParamSpec>& specs, const std::string& name) {
  for (const ParamSpec& s : specs)
    if (s.name == name) return true;
  return false;
}

/// The evaluation loss of one micro-batch (fixed tokens, weights from seed 11), and the model's
/// resolved attention backend name.
double tiny_loss(const TransformerConfig& c, std::string* backend = nullptr) {
  Stream st;
  GPTModel model(c, 2, DType::kF32, Device::cpu(), ProcessGroups::single());
  model.params().initialize(11, st);
  std::vector<int32_t> tok(static_cast<size_t>(c.seq_length * 2)), lab(tok.size());
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<int32_t>((7 * i + 3) % static_cast<size_t>(c.vocab_size));
    lab[i] = static_cast<int32_t>((5 * i + 1) % static_cast<size_t>(c.vocab_size));
  }
  OwnedTensor tokens = testing::make_int_tensor(tok, Device::cpu(), {c.seq_length, 2}, st);
  OwnedTensor labels = testing::make_int_tensor(lab, Device::cpu(), {c.seq_length, 2}, st);
  OwnedTensor loss(DType::kF32, Device::cpu(), {1});
  fill(loss.t, 0.f, st);
  const MicroBatch mb{tokens.t, labels.t, Tensor()};
  model.forward(mb, DropoutContext{1, 1, 0, false}, loss.t, 1.0f / static_cast<float>(c.seq_length * 2), st);
  if (backend != nullptr) *backend = model.attention_backend();
  return testing::to_host(loss.t, st)[0];
}

// A norm kind's name in checkpoint metadata is its own, and reads back as the same kind; the
// model declares its norms' parameters as the kind says and num_parameters counts them.
TEST(Variants, NormKindCheckpointNameIsItsOwn) {
  for (const NormKind& kind : norm_kinds()) {
    SCOPED_TRACE(kind.names.name);
    TransformerConfig c = tiny_config();
    c.normalization = kind.kind;
    const std::vector<ParamSpec> specs = GPTModel::param_specs(c);
    EXPECT_TRUE(has_param(specs, "decoder.final_layernorm.weight"));
    EXPECT_EQ(has_param(specs, "decoder.final_layernorm.bias"), kind.has_bias);
    EXPECT_EQ(has_param(specs, "decoder.layers.1.input_layernorm.bias"), kind.has_bias);
    EXPECT_EQ(numel_of(specs), c.num_parameters());
    EXPECT_TRUE(std::isfinite(tiny_loss(c)));
    const fs::path dir = fs::temp_directory_path() / fmt::format("mt_variants_{}_{}", kind.names.name, ::getpid());
    fs::remove_all(dir);
    {
      Stream st;
      ParamStore P(specs, DType::kF32, Device::cpu());
      P.initialize(3, st);
      CheckpointState cs;
      cs.iteration = 1;
      cs.model = c;
      const CheckpointWriter w{.world = std::make_shared<SingleRankCommunicator>()};
      save_checkpoint(dir.string(), cs, P, nullptr, w, st);
    }
    std::ifstream f(dir / "iter_0000001" / "metadata.json");
    const nlohmann::json meta = nlohmann::json::parse(f);
    EXPECT_EQ(meta.at("model").at("normalization").get<std::string>(), kind.names.name);
    EXPECT_EQ(meta.at("model").at("position_embedding_type").get<std::string>(),
              position_embedding_type_name(c.position_embedding_type));
    EXPECT_EQ(read_checkpoint_state(dir.string()).model.normalization, kind.kind);
    fs::remove_all(dir);
  }
}

// --- MLP activations ------------------------------------------------------------------------------

using ActRef = std::function<double(const std::vector<double>& pre, int64_t row, int64_t j, int64_t f)>;

const std::map<std::string, ActRef>& activation_references() {
  static const std::map<std::string, ActRef> refs{
      {"GELU",
       [](const auto& pre, int64_t row, int64_t j, int64_t f) {
         const double x = pre[row * f + j];
         return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
       }},
      {"SwiGLU",
       [](const auto& pre, int64_t row, int64_t j, int64_t f) {
         const double g = pre[row * 2 * f + j], u = pre[row * 2 * f + f + j];
         return g / (1 + std::exp(-g)) * u;
       }},
  };
  return refs;
}

// Each activation: its ops against the float64 formula (forward; backward against central
// differences), its fc1 width and --ffn-hidden-size default in the model's parameters, and its
// factor in the FLOP count.
TEST(Variants, EveryMlpActivationBuildsItsMlp) {
  const int64_t rows = 3, f = 5;
  for (const MlpActivationKind& kind : mlp_activation_kinds()) {
    SCOPED_TRACE(kind.names.name);
    const auto ref_it = activation_references().find(kind.names.name);
    ASSERT_NE(ref_it, activation_references().end()) << "no float64 reference for this activation in variants_test.cpp";
    const ActRef& ref = ref_it->second;
    TransformerConfig c = tiny_config();
    c.hidden_size = 96;  // SwiGLU's default ffn is a multiple of 64: 256
    c.gated_linear_unit = kind.kind == MlpActivation::kSwiGLU;  // Megatron's flag for the one gated kind
    ASSERT_EQ(c.activation(), kind.kind) << "the configuration cannot select this activation";
    Stream st;
    const std::vector<float> prev = testing::randn(rows * kind.fc1_parts * f), dav = testing::randn(rows * f);
    OwnedTensor pre = testing::make_tensor(prev, DType::kF32, Device::cpu(), {rows, kind.fc1_parts * f}, st);
    OwnedTensor act(DType::kF32, Device::cpu(), {rows, f});
    OwnedTensor dact = testing::make_tensor(dav, DType::kF32, Device::cpu(), {rows, f}, st);
    OwnedTensor dpre(DType::kF32, Device::cpu(), {rows, kind.fc1_parts * f});
    testing::poison(act.t, st);
    testing::poison(dpre.t, st);
    kind.forward(act.t, pre.t, st);
    kind.backward(dpre.t, dact.t, pre.t, st);
    std::vector<double> p64 = to_f64(prev), ar(static_cast<size_t>(rows * f)), dpr(p64.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < f; ++j) ar[r * f + j] = ref(p64, r, j, f);
    EXPECT_LT(max_abs_diff(testing::to_host(act.t, st), ar), 1e-5);
    const auto objective = [&] {
      double l = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < f; ++j) l += ref(p64, r, j, f) * dav[r * f + j];
      return l;
    };
    for (size_t i = 0; i < p64.size(); ++i) dpr[i] = testing::finite_diff(objective, p64, i, 1e-6);
    EXPECT_LT(max_abs_diff(testing::to_host(dpre.t, st), dpr), 1e-4);
    // The model: fc1 [parts·f, h], f = the kind's default, every parameter counted.
    EXPECT_EQ(c.ffn(), kind.default_ffn(c.hidden_size));
    const std::vector<ParamSpec> specs = GPTModel::param_specs(c);
    for (const ParamSpec& s : specs)
      if (s.name == "decoder.layers.0.mlp.linear_fc1.weight")
        EXPECT_EQ(numel_of({s}), kind.fc1_parts * c.ffn() * c.hidden_size) << s.name;
    EXPECT_EQ(numel_of(specs), c.num_parameters());
    EXPECT_TRUE(std::isfinite(tiny_loss(c)));
    // FLOPs: the MLP term is 12·B·s·L·h·f·factor (flops_per_iteration without the MLP is the
    // same config with f -> 0 in the formula).
    const double B = 4, s = static_cast<double>(c.seq_length), L = static_cast<double>(c.num_layers);
    const double h = static_cast<double>(c.hidden_size), F = static_cast<double>(c.ffn());
    const double n = static_cast<double>(c.num_attention_heads), V = static_cast<double>(c.padded_vocab_size());
    const double expect =
        12 * B * s * L * h * h * ((1 + n / n + s / (2 * h)) + F * kind.flops_factor / h + V / (2 * L * h));
    EXPECT_NEAR(c.flops_per_iteration(4) / expect, 1.0, 1e-12);
  }
  EXPECT_EQ(mlp_activation_kind(MlpActivation::kGelu).flops_factor, 1.0);
  EXPECT_EQ(mlp_activation_kind(MlpActivation::kSwiGLU).flops_factor, 1.5);  // Megatron's gated_linear_multiplier
}

// --- position embeddings --------------------------------------------------------------------------

// Each position embedding builds: the learned table exactly when the kind has one (and counted),
// RoPE changes the loss of the same weights (it is applied), none does not rotate.
TEST(Variants, EveryPositionEmbeddingBuilds) {
  std::map<std::string, double> losses;
  for (const PositionEmbeddingKind& kind : position_embedding_kinds()) {
    SCOPED_TRACE(kind.names.name);
    TransformerConfig c = tiny_config();
    c.position_embedding_type = kind.kind;
    const std::vector<ParamSpec> specs = GPTModel::param_specs(c);
    EXPECT_EQ(has_param(specs, "embedding.position_embeddings.weight"), kind.learned_table);
    EXPECT_EQ(numel_of(specs), c.num_parameters());
    losses[kind.names.name] = tiny_loss(c);
    EXPECT_TRUE(std::isfinite(losses[kind.names.name]));
  }
  // rope and none have the same parameters and weights: only the rotation differs.
  ASSERT_TRUE(position_embedding_kind(PositionEmbeddingType::kRope).rotary);
  ASSERT_FALSE(position_embedding_kind(PositionEmbeddingType::kNone).rotary);
  EXPECT_NE(losses.at("rope"), losses.at("none"));
}

// --- attention backends ---------------------------------------------------------------------------

TEST(Variants, AttentionBackendResolution) {
  using A = AttentionBackend;
  struct Case {
    A requested;
    int64_t head_dim;
    AttentionPlatform p;
    A expect;
  };
  const AttentionPlatform cpu{}, gpu_bf16{true, DType::kBF16, true}, gpu_f16_no_cudnn{true, DType::kF16, false},
      gpu_f32{true, DType::kF32, true}, hopper_bf16{true, DType::kBF16, true, true},
      hopper_no_cudnn{true, DType::kBF16, false, true};
  const std::vector<Case> cases{
      {A::kAuto, 64, cpu, A::kLocal},           {A::kFlash, 64, cpu, A::kFlash},
      {A::kFused, 64, cpu, A::kFlash},          {A::kLocal, 64, cpu, A::kLocal},
      {A::kAuto, 64, gpu_bf16, A::kFused},      {A::kAuto, 128, gpu_bf16, A::kFused},
      {A::kAuto, 96, gpu_bf16, A::kLocal},      {A::kFused, 96, gpu_bf16, A::kFused},
      {A::kFlash, 64, gpu_bf16, A::kFlash},     {A::kLocal, 64, gpu_bf16, A::kLocal},
      {A::kAuto, 64, gpu_f16_no_cudnn, A::kFlash}, {A::kFused, 64, gpu_f16_no_cudnn, A::kFlash},
      {A::kAuto, 64, gpu_f32, A::kLocal},       {A::kFused, 64, gpu_f32, A::kFlash},
      // Hopper: cuDNN takes head dims up to 256 (multiples of 8), MLA's 192 among them
      {A::kAuto, 192, hopper_bf16, A::kFused},  {A::kAuto, 96, hopper_bf16, A::kFused},
      {A::kAuto, 256, hopper_bf16, A::kFused},  {A::kAuto, 264, hopper_bf16, A::kLocal},
      {A::kAuto, 100, hopper_bf16, A::kLocal},  {A::kAuto, 192, gpu_bf16, A::kLocal},
      {A::kAuto, 192, hopper_no_cudnn, A::kLocal}, {A::kAuto, 64, hopper_no_cudnn, A::kFlash},
  };
  for (const Case& k : cases)
    EXPECT_EQ(resolve_attention_backend(k.requested, k.head_dim, k.p), k.expect)
        << attention_backend_name(k.requested) << " head dim " << k.head_dim << " cuda " << k.p.cuda << " "
        << dtype_name(k.p.dtype) << " cudnn " << k.p.cudnn << " hopper " << k.p.hopper;
  for (const AttentionBackendKind& kind : attention_backend_kinds())
    for (const AttentionPlatform& p : {cpu, gpu_bf16, gpu_f16_no_cudnn, gpu_f32, hopper_bf16})
      EXPECT_NE(resolve_attention_backend(kind.kind, 64, p), A::kAuto);
  const std::string err = error_of([] { get_gpt_layer_local_spec(tiny_config(), A::kAuto); });
  EXPECT_NE(err.find("must be resolved first"), std::string::npos) << err;
}

// Each backend builds its core attention (auto none: it resolves first), and a model of each
// backend runs on the CPU under the name resolve_attention_backend gives it there, with the loss of
// the local (unfused) attention within fp32 rounding; the two flash backends give the same loss
// bitwise on the CPU (cuDNN is CUDA-only); auto and unfused are local there.
TEST(Variants, EveryAttentionBackendBuildsItsCoreAttention) {
  const TransformerConfig c = tiny_config();
  const TensorParallelRegion tp = TensorParallelRegion::layout_only(1, 0);
  auto loss_of = [&](AttentionBackend a, std::string* name) {
    TransformerConfig cb = c;
    cb.attention_backend = a;
    return tiny_loss(cb, name);
  };
  const double local = loss_of(AttentionBackend::kLocal, nullptr);
  std::map<AttentionBackend, double> losses;
  for (const AttentionBackendKind& kind : attention_backend_kinds()) {
    SCOPED_TRACE(kind.names.name);
    if (kind.kind == AttentionBackend::kAuto) {
      EXPECT_EQ(kind.make, nullptr);
    } else {
      ASSERT_NE(kind.make, nullptr);
      EXPECT_NE(kind.make(c, 0, tp), nullptr);
    }
    std::string name;
    losses[kind.kind] = loss_of(kind.kind, &name);
    EXPECT_EQ(name, attention_backend_name(resolve_attention_backend(kind.kind, c.head_dim(), AttentionPlatform{})));
    EXPECT_NEAR(losses[kind.kind], local, 1e-5 * std::abs(local));
  }
  EXPECT_TRUE(dynamic_cast<DotProductAttention*>(
                  attention_backend_kind(AttentionBackend::kLocal).make(c, 0, tp).get()) != nullptr);
  for (AttentionBackend a : {AttentionBackend::kFlash, AttentionBackend::kFused})
    EXPECT_TRUE(dynamic_cast<FlashAttention*>(attention_backend_kind(a).make(c, 0, tp).get()) != nullptr);
  EXPECT_EQ(losses.at(AttentionBackend::kFlash), losses.at(AttentionBackend::kFused));
  EXPECT_EQ(losses.at(AttentionBackend::kAuto), local);
  EXPECT_EQ(loss_of(parse_attention_backend("unfused"), nullptr), local);
}

}  // namespace
}  // namespace mt
