// Fp8Linear (model/fp8/fp8_linear.h) on the CPU against a float64 reference written here: for each
// recipe the forward (with bias and the GELU epilogue), dgrad, wgrad (written and accumulated) and
// bias gradient equal the products of the operands quantised as docs/fp8.md says — e4m3 / e5m2
// with round-to-nearest-even and saturation (core/dtype.h), scales fp8_max / amax of the whole
// tensor (tensorwise), of the stored scale (delayed; the amaxes recorded into the history's row 0
// and turned into the next scale by Fp8Model::finish_step), or of each 1x128 tile / 128x128 block
// rounded down to a power of two (blockwise) — within fp32 accumulation error. Row counts that are
// not multiples of 16 (MoE experts) give the same results through the padded path, and the
// saved transposed input gives the same weight gradient as quantising the bf16 input again.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "comm/communicator.h"
#include "model/fp8/fp8_model.h"
#include "model/layers/parallel_params.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_fused.h"
#include "ops/swiglu.h"
#include "ops/gelu_math.h"
#include "testing/testing.h"

namespace mt {
namespace {

using testing::to_host;

/// A matrix [rows, cols] of doubles, row-major.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double at(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
};

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = x[static_cast<size_t>(r * cols + c)];
  return t;
}

float pow2_floor(float s) {  // keeps sign and exponent
  uint32_t b;
  std::memcpy(&b, &s, 4);
  b &= 0xff800000u;
  std::memcpy(&s, &b, 4);
  return s;
}

/// x [rows, cols] quantised along its rows and dequantised: q = fp8(x * s), value = q * (1 / s), with
/// s = `scale` (tensorwise: > 0), or per block of `block_rows` x 128 (block_rows 1 or 128) from the
/// block's amax as a power of two (1 for an all-zero block).
Mat quantized(const std::vector<float>& x, int64_t rows, int64_t cols, DType t, float scale, int64_t block_rows = 0) {
  Mat m{rows, cols, std::vector<double>(x.size())};
  auto put = [&](int64_t r, int64_t c, float s) {
    const float q = fp8_bits_to_f32(t, f32_to_fp8_bits(t, x[static_cast<size_t>(r * cols + c)] * s));
    m.v[static_cast<size_t>(r * cols + c)] = static_cast<double>(q) * static_cast<double>(1.f / s);
  };
  if (block_rows == 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) put(r, c, scale);
    return m;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows)
    for (int64_t c0 = 0; c0 < cols; c0 += 128) {
      float amax = 0;
      const int64_t r1 = std::min(rows, r0 + block_rows), c1 = std::min(cols, c0 + 128);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      const float s = amax == 0 ? 1.f : pow2_floor(fp8_max(t) / amax);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) put(r, c, s);
    }
  return m;
}

float amax_of(const std::vector<float>& x) {
  float a = 0;
  for (float v : x) a = std::max(a, std::fabs(v));
  return a;
}

/// Expects got[i, j] = Σ_k a[i, k] b[j, k] (+ base) within fp32 accumulation error of the products.
void expect_product(const std::vector<float>& got, const Mat& a, const Mat& b, const char* what,
                    const std::vector<float>& base = {}) {
  ASSERT_EQ(static_cast<int64_t>(got.size()), a.rows * b.rows) << what;
  int bad = 0;
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      double s = 0, mag = 0;
      for (int64_t k = 0; k < a.cols; ++k) {
        s += a.at(i, k) * b.at(j, k);
        mag += std::fabs(a.at(i, k) * b.at(j, k));
      }
      const size_t e = static_cast<size_t>(i * b.rows + j);
      if (!base.empty()) {
        s += base[e];
        mag += std::fabs(base[e]);
      }
      if (!(std::fabs(got[e] - s) <= 1e-5 * mag + 1e-30) && ++bad <= 5)
        ADD_FAILURE() << what << "[" << i << ", " << j << "] = " << got[e] << ", expected " << s << " (sum |products| "
                      << mag << ")";
    }
}

/// One FP8 linear [out, in] on the CPU with its model, weight and buffers.
struct Harness {
  Harness(Fp8Recipe recipe, Fp8Format format, int64_t out_, int64_t in_, int64_t rows_, bool save_input,
           bool variable_rows, int64_t row_blocks = 1)
      : out(out_), in(in_), rows(rows_) {
    cfg.num_layers = 1;
    cfg.fp8 = format;
    cfg.fp8_recipe = recipe;
    cfg.fp8_amax_history_len = 2;
    model = std::make_unique<Fp8Model>(cfg, ProcessGroups::single());
    store = std::make_unique<ParamStore>(
        std::vector<ParamSpec>{column_parallel_weight("decoder.layers.0.test.weight", out, in, 0.02f, 1, 0)},
        DType::kF32, Device::cpu());
    weight = ParamRef{0, store.get()};
    lin = model->make_linear(0, model->reserve(0, 1), "decoder.layers.0.test", &weight, out, in, Fp8Groups{});
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      lin->plan(planner, rows, save_input, variable_rows, row_blocks);
      planner.close_area();
      model->plan(planner);
      if (pass == 0) planner.materialize();
    }
    model->initialize(Device::cpu());
  }
  TransformerConfig cfg;
  std::unique_ptr<Fp8Model> model;
  std::unique_ptr<ParamStore> store;
  ParamRef weight;
  std::unique_ptr<Fp8Linear> lin;
  BufferPlanner planner{Device::cpu(), DType::kF32};
  int64_t out, in, rows;
};

struct Outputs {
  std::vector<float> y, pre, dx, dw, dw2, db;
};

/// Every output of two runs bitwise equal.
void expect_same_outputs(const Outputs& a, const Outputs& b) {
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.pre, b.pre);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dw, b.dw);
  EXPECT_EQ(a.dw2, b.dw2);
  EXPECT_EQ(a.db, b.db);
}

/// The weight w uploaded and quantised, the inputs x [m, in], bias, dy [m, out] on the CPU, the
/// outputs poisoned (db zeroed).
struct Io {
  Io(Harness& h, int64_t m, const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& bias,
     const std::vector<float>& dy)
      : xt(make(x, {m, h.in})), bt(make(bias, {h.out})), dyt(make(dy, {m, h.out})),
        y(DType::kF32, Device::cpu(), {m, h.out}), pre(DType::kF32, Device::cpu(), {m, h.out}),
        dx(DType::kF32, Device::cpu(), {m, h.in}), db(DType::kF32, Device::cpu(), {h.out}) {
    testing::upload(h.weight.value(), w, st);
    h.model->quantize_weights(0, /*force=*/true, st);
    for (const Tensor& t : {y.t, pre.t, dx.t, h.weight.grad()}) testing::poison(t, st);
    fill(db, 0.f, st);
  }
  static testing::OwnedTensor make(const std::vector<float>& v, std::vector<int64_t> shape) {
    return testing::make_tensor(v, DType::kF32, Device::cpu(), shape, testing::cpu_stream());
  }
  const Stream& st = testing::cpu_stream();
  testing::OwnedTensor xt, bt, dyt, y, pre, dx, db;
};

/// forward (bias + GELU epilogue: pre = x wᵀ + b, y = gelu(pre)), backward (dx, dw written, db), then
/// backward again accumulating into dw (dw2).
Outputs run(Harness& h, int64_t m, const std::vector<float>& x, const std::vector<float>& w,
            const std::vector<float>& bias, const std::vector<float>& dy) {
  Io io(h, m, x, w, bias, dy);
  const Stream& st = io.st;
  const auto &xt = io.xt, &bt = io.bt, &dyt = io.dyt, &y = io.y, &pre = io.pre, &dx = io.dx, &db = io.db;
  h.lin->forward(y, xt, bt, pre, 0, st);
  h.lin->backward({dx, h.weight.grad(), GradWrite::kOverwrite, db, Tensor(), Tensor()}, dyt, xt, 0, st);
  Outputs o{to_host(y, st), to_host(pre, st), to_host(dx, st), to_host(h.weight.grad(), st), {}, to_host(db, st)};
  h.lin->backward({Tensor(), h.weight.grad(), GradWrite::kAccumulate, Tensor(), Tensor(), Tensor()}, dyt, xt, 0, st);
  o.dw2 = to_host(h.weight.grad(), st);
  return o;
}

/// The reference of run() for tensorwise scales sx, sw, sdy (blockwise: block scales from the data).
void expect_reference(const Outputs& o, bool blockwise, DType gt, int64_t m, int64_t out, int64_t in,
                      const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& bias,
                      const std::vector<float>& dy, float sx, float sw, float sdy) {
  const DType f = DType::kF8E4M3;
  const int64_t act = blockwise ? 1 : 0, wb = blockwise ? 128 : 0;
  // fprop: x rows, w rows; dgrad: dy rows, wᵀ rows (the same blocks transposed); wgrad: dyᵀ, xᵀ rows
  const Mat xq = quantized(x, m, in, f, sx, act), wq = quantized(w, out, in, f, sw, wb);
  const Mat dyq = quantized(dy, m, out, gt, sdy, act);
  const Mat wtq = quantized(transpose(w, out, in), in, out, f, sw, wb);
  const Mat dytq = quantized(transpose(dy, m, out), out, m, gt, sdy, act);
  const Mat xtq = quantized(transpose(x, m, in), in, m, f, sx, act);
  std::vector<float> pre_minus_bias(o.pre.size());
  for (size_t i = 0; i < o.pre.size(); ++i) pre_minus_bias[i] = o.pre[i] - bias[i % static_cast<size_t>(out)];
  expect_product(pre_minus_bias, xq, wq, "fprop");
  for (size_t i = 0; i < o.y.size(); ++i) EXPECT_FLOAT_EQ(o.y[i], gelu_math::gelu(o.pre[i])) << "gelu " << i;
  expect_product(o.dx, dyq, wtq, "dgrad");
  expect_product(o.dw, dytq, xtq, "wgrad");
  expect_product(o.dw2, dytq, xtq, "wgrad accumulated", o.dw);
  for (int64_t j = 0; j < out; ++j) {
    double s = 0;
    for (int64_t i = 0; i < m; ++i) s += dy[static_cast<size_t>(i * out + j)];
    EXPECT_NEAR(o.db[static_cast<size_t>(j)], s, 1e-5 * (std::fabs(s) + 1)) << "bias grad " << j;
  }
}

struct Case {
  Fp8Recipe recipe;
  Fp8Format format;
  int64_t rows;
  bool save_input, variable_rows;
};

class Fp8LinearCpu : public ::testing::TestWithParam<Case> {};

TEST_P(Fp8LinearCpu, MatchesQuantizedReference) {
  const Case c = GetParam();
  const int64_t out = 48, in = 144, m = c.rows;  // in: a full and a ragged 128-block
  Harness h(c.recipe, c.format, out, in, c.variable_rows ? 40 : m, c.save_input, c.variable_rows);
  const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                           bias = testing::randn(out, 0.1f), dy = testing::randn(m * out, 1e-3f);
  const DType gt = c.format == Fp8Format::kHybrid ? DType::kF8E5M2 : DType::kF8E4M3;
  const bool block = c.recipe == Fp8Recipe::kBlockwise;
  const Outputs o = run(h, m, x, w, bias, dy);
  if (c.recipe == Fp8Recipe::kDelayed) {  // the first step's scale is 1
    expect_reference(o, false, gt, m, out, in, x, w, bias, dy, 1.f, 1.f, 1.f);
    // the amaxes were recorded into the history's row 0 (fwd: x, w; bwd: dy)
    const auto [fwd, bwd] = h.model->layer_state(0, testing::cpu_stream());
    const std::vector<float> f = to_host(fwd, testing::cpu_stream()), b = to_host(bwd, testing::cpu_stream());
    EXPECT_EQ(f[0], amax_of(x));
    EXPECT_EQ(f[1], amax_of(w));
    EXPECT_EQ(b[0], amax_of(dy));
    // the update: scale = fp8_max / amax (most_recent, margin 0), used by the next step
    h.model->finish_step(testing::cpu_stream());
    const Outputs o2 = run(h, m, x, w, bias, dy);
    expect_reference(o2, false, gt, m, out, in, x, w, bias, dy, 448.f / amax_of(x), 448.f / amax_of(w),
                     fp8_max(gt) / amax_of(dy));
    return;
  }
  expect_reference(o, block, gt, m, out, in, x, w, bias, dy, 448.f / amax_of(x), 448.f / amax_of(w),
                   fp8_max(gt) / amax_of(dy));
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, Fp8LinearCpu,
    ::testing::Values(Case{Fp8Recipe::kTensorwise, Fp8Format::kE4M3, 32, true, false},
                      Case{Fp8Recipe::kTensorwise, Fp8Format::kHybrid, 32, false, false},
                      Case{Fp8Recipe::kTensorwise, Fp8Format::kE4M3, 13, false, true},
                      Case{Fp8Recipe::kDelayed, Fp8Format::kHybrid, 32, true, false},
                      Case{Fp8Recipe::kDelayed, Fp8Format::kE4M3, 21, false, true},
                      Case{Fp8Recipe::kBlockwise, Fp8Format::kE4M3, 32, true, false},
                      Case{Fp8Recipe::kBlockwise, Fp8Format::kHybrid, 29, false, true}),
    [](const ::testing::TestParamInfo<Case>& i) {
      const Case& c = i.param;
      return std::string(fp8_recipe_name(c.recipe)) + "_" + fp8_format_name(c.format) + "_m" +
             std::to_string(c.rows) + (c.save_input ? "_saved" : "") + (c.variable_rows ? "_padded" : "");
    });

/// The backward half of run_blocks / run_fp8_gather: dgrad per block of rows in the reverse rotated
/// order, then the wgrad (overwrite, then accumulate) from the whole tensors.
Outputs backward_blocks(Harness& h, const Io& io, int64_t m, int64_t block, int start) {
  const Stream& st = io.st;
  const auto &xt = io.xt, &dyt = io.dyt, &y = io.y, &pre = io.pre, &dx = io.dx, &db = io.db;
  const int n = static_cast<int>(m / block);
  auto rows = [&](const Tensor& t, int i) { return t.slice0(i * block, (i + 1) * block); };
  h.lin->begin_backward(dyt, /*shard=*/false, st);
  for (int k = 0; k < n; ++k) {
    const int i = (start + n - k) % n;
    h.lin->dgrad_rows(rows(dx, i), rows(dyt, i), i * block, Tensor(), st);
  }
  h.lin->wgrad(h.weight.grad(), GradWrite::kOverwrite, db, dyt, xt, 0, st);
  Outputs o{to_host(y, st), to_host(pre, st), to_host(dx, st), to_host(h.weight.grad(), st), {}, to_host(db, st)};
  h.lin->begin_backward(dyt, /*shard=*/false, st);
  h.lin->wgrad(h.weight.grad(), GradWrite::kAccumulate, Tensor(), dyt, xt, 0, st);
  o.dw2 = to_host(h.weight.grad(), st);
  return o;
}

/// run() through the phases a tensor-parallel region drives under sequence parallelism: the forward
/// and the dgrad block by block of `block` rows, in the rotated orders all_gather_gemm /
/// gemm_reduce_scatter use (from block `start` on), the saved x_t and the wgrad from the whole
/// tensors after them; the accumulating backward runs the wgrad alone.
Outputs run_blocks(Harness& h, int64_t m, int64_t block, int start, const std::vector<float>& x,
                   const std::vector<float>& w, const std::vector<float>& bias, const std::vector<float>& dy) {
  Io io(h, m, x, w, bias, dy);
  const Stream& st = io.st;
  const auto &xt = io.xt, &bt = io.bt, &dyt = io.dyt, &y = io.y, &pre = io.pre, &dx = io.dx, &db = io.db;
  const int n = static_cast<int>(m / block);
  auto rows = [&](const Tensor& t, int i) { return t.slice0(i * block, (i + 1) * block); };
  h.lin->begin_forward(xt, /*shard=*/false, 0, st);
  for (int k = 0; k < n; ++k) {
    const int i = (start + k) % n;
    h.lin->forward_rows(rows(y, i), rows(xt, i), i * block, bt, rows(pre, i), 0, st);
  }
  h.lin->end_forward(xt, 0, st);
  return backward_blocks(h, io, m, block, start);
}

// ColumnParallelLinear / RowParallelLinear under sequence parallelism (with or without
// --tp-comm-overlap) run the FP8 GEMMs once per TP block of rows, in a rotated order. Each block's
// rows are quantised with the whole tensor's scale (blockwise: into the block's own packed 1x128
// scales), so forward and dgrad match the reference of the whole tensor's quantised operands; the
// wgrad (from the whole tensors: x_t saved after the blocks or quantised again), the bias gradient
// and the recorded delayed-scaling amaxes are bitwise those of one block. (The block GEMMs' own
// rounding depends on the row count on the CPU, so y and dx are compared with the reference.)
TEST(Fp8Linear, RowBlocksMatchWholeRows) {
  for (Fp8Recipe r : {Fp8Recipe::kTensorwise, Fp8Recipe::kDelayed, Fp8Recipe::kBlockwise})
    for (bool save_input : {true, false}) {
      SCOPED_TRACE(std::string(fp8_recipe_name(r)) + (save_input ? " saved" : ""));
      const int64_t out = 48, in = 144, m = 64, block = 16;
      Harness whole(r, Fp8Format::kHybrid, out, in, m, save_input, false),
          split(r, Fp8Format::kHybrid, out, in, m, save_input, false, m / block);
      const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                               bias = testing::randn(out, 0.1f), dy = testing::randn(m * out, 1e-3f);
      const Outputs a = run(whole, m, x, w, bias, dy), b = run_blocks(split, m, block, 1, x, w, bias, dy);
      const bool delayed = r == Fp8Recipe::kDelayed;  // the first step's scales are 1
      const DType gt = DType::kF8E5M2;
      expect_reference(b, r == Fp8Recipe::kBlockwise, gt, m, out, in, x, w, bias, dy, delayed ? 1.f : 448.f / amax_of(x),
                       delayed ? 1.f : 448.f / amax_of(w), delayed ? 1.f : fp8_max(gt) / amax_of(dy));
      EXPECT_EQ(a.dw, b.dw);
      EXPECT_EQ(a.dw2, b.dw2);
      EXPECT_EQ(a.db, b.db);
      const auto [fa, ba] = whole.model->layer_state(0, testing::cpu_stream());
      const auto [fb, bb] = split.model->layer_state(0, testing::cpu_stream());
      EXPECT_EQ(to_host(fa, testing::cpu_stream()), to_host(fb, testing::cpu_stream()));
      EXPECT_EQ(to_host(ba, testing::cpu_stream()), to_host(bb, testing::cpu_stream()));
    }
}

/// run_blocks with the input gathered in FP8 (Fp8Linear::quantize_shard, forward_fp8_rows,
/// end_forward_fp8): each "rank" quantises its shard with the whole tensor's scale, the all-gather
/// copies the bytes into its block, the GEMMs run per block in the same order.
Outputs run_fp8_gather(Harness& h, int64_t m, int64_t block, int start, const std::vector<float>& x,
                       const std::vector<float>& w, const std::vector<float>& bias, const std::vector<float>& dy) {
  Io io(h, m, x, w, bias, dy);
  const Stream& st = io.st;
  const auto &xt = io.xt, &bt = io.bt, &dyt = io.dyt, &y = io.y, &pre = io.pre, &dx = io.dx, &db = io.db;
  const int n = static_cast<int>(m / block);
  auto rows = [&](const Tensor& t, int i) { return t.slice0(i * block, (i + 1) * block); };
  h.lin->begin_forward(xt, /*shard=*/false, 0, st);  // the scale of the whole x (the shards' amaxes reduced)
  Tensor full;
  for (int i = 0; i < n; ++i) {
    const auto [f, local] = h.lin->quantize_shard(rows(xt, i), 0, st);
    if (i == 0) memset_tensor(f, 0x7f, st);  // poisoned: every block is written by the "gather"
    copy(rows(f, i), local, st);
    full = f;
  }
  for (int k = 0; k < n; ++k) {
    const int i = (start + k) % n;
    h.lin->forward_fp8_rows(rows(y, i), rows(full, i), i * block, bt, rows(pre, i), 0, st);
  }
  h.lin->end_forward_fp8(0, st);
  return backward_blocks(h, io, m, block, start);
}

// The FP8 all-gather of a sequence-parallel input (per-tensor scaling) is bitwise the bf16 gather
// quantised block by block: every output, the saved x_t (through dw) and the recorded state.
// Delayed scaling records each shard's amax (max-accumulated: the whole tensor's). Blockwise keeps
// the bf16 gather.
TEST(Fp8Linear, Fp8GatherEqualsBlockQuantisation) {
  for (Fp8Recipe r : {Fp8Recipe::kTensorwise, Fp8Recipe::kDelayed}) {
    SCOPED_TRACE(fp8_recipe_name(r));
    const int64_t out = 48, in = 144, m = 64, block = 16;
    Harness a(r, Fp8Format::kHybrid, out, in, m, true, false, m / block),
        b(r, Fp8Format::kHybrid, out, in, m, true, false, m / block);
    ASSERT_TRUE(b.lin->gathers_fp8());
    const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                             bias = testing::randn(out, 0.1f), dy = testing::randn(m * out, 1e-3f);
    const Outputs bf = run_blocks(a, m, block, 1, x, w, bias, dy), f8 = run_fp8_gather(b, m, block, 1, x, w, bias, dy);
    expect_same_outputs(bf, f8);
    const auto [fa, ba] = a.model->layer_state(0, testing::cpu_stream());
    const std::vector<float> sa = to_host(fa, testing::cpu_stream()), da = to_host(ba, testing::cpu_stream());
    const auto [fb, bb] = b.model->layer_state(0, testing::cpu_stream());
    EXPECT_EQ(sa, to_host(fb, testing::cpu_stream()));
    EXPECT_EQ(da, to_host(bb, testing::cpu_stream()));
    if (r == Fp8Recipe::kDelayed) EXPECT_EQ(sa[0], amax_of(x)) << "x's record: the max of the shards' amaxes";
  }
  Harness blockwise(Fp8Recipe::kBlockwise, Fp8Format::kE4M3, 48, 144, 64, true, false, 4);
  EXPECT_FALSE(blockwise.lin->gathers_fp8());
  const testing::OwnedTensor x16(DType::kF32, Device::cpu(), {16, 144});
  testing::expect_error([&] { blockwise.lin->quantize_shard(x16, 0, testing::cpu_stream()); },
                        "decoder.layers.0.test: the FP8 all-gather needs per-tensor scaling");
}

/// One FP8 linear over a weight [out, in] on the CPU: a bf16 weight with its copies wq / wq_t in the
/// weight's own storage (in_params), or the reference: an fp32 weight holding the bf16 values, with
/// separate copies — quantising a bf16 weight is quantising its (exact) fp32 values, which is how the
/// separate copies of a bf16 run are made (the CPU's ops are fp32).
struct WeightCopies {
  WeightCopies(Fp8Recipe recipe, bool in_params, int64_t out_, int64_t in_) : out(out_), in(in_) {
    cfg.num_layers = 1;
    cfg.fp8 = Fp8Format::kHybrid;
    cfg.fp8_recipe = recipe;
    cfg.fp8_amax_history_len = 2;
    cfg.fp8_weights_in_params = in_params;
    // --fp8-param-gather: its sharded main parameters, the storage staged (per-tensor recipes only)
    cfg.fp8_param = in_params && recipe != Fp8Recipe::kBlockwise;
    model = std::make_unique<Fp8Model>(cfg, ProcessGroups::single());
    store = std::make_unique<ParamStore>(
        std::vector<ParamSpec>{column_parallel_weight("decoder.layers.0.test.weight", out, in, 0.02f, 1, 0)},
        in_params ? DType::kBF16 : DType::kF32, Device::cpu());
    weight = ParamRef{0, store.get()};
    lin = model->tp_linear("decoder.layers.0.test", /*row=*/false, &weight, out, in);
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      model->plan(planner);
      if (pass == 0) planner.materialize();
    }
    model->initialize(Device::cpu());
  }
  /// New main parameters (fp32 [out·in]): the bf16 weight's are `full` (its storage then holds their
  /// bf16 rounding, as after an optimizer step), the reference's their bf16 rounding.
  void set_main(std::vector<float> full) {
    if (!in_params()) for (float& v : full) v = bf16_bits_to_f32(f32_to_bf16_bits(v));
    const testing::OwnedTensor t = testing::make_tensor(full, DType::kF32, Device::cpu(), {out * in}, st);
    store->set_main_from_full(t.t, st);
  }
  bool in_params() const { return cfg.fp8_weights_in_params; }
  /// The bytes [begin, begin + n) of a tensor on the CPU.
  static std::vector<uint8_t> bytes(const Tensor& t, size_t begin, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(t.data()) + begin;
    return std::vector<uint8_t>(p, p + n);
  }
  std::vector<uint8_t> wq() const { return bytes(lin->fp8_weight(), 0, static_cast<size_t>(out * in)); }
  std::vector<float> state() const {
    const auto [f, b] = model->layer_state(0, st);
    std::vector<float> v = to_host(f, st), w = to_host(b, st);
    v.insert(v.end(), w.begin(), w.end());
    return v;
  }
  const Stream& st = testing::cpu_stream();
  TransformerConfig cfg;
  std::unique_ptr<Fp8Model> model;
  std::unique_ptr<ParamStore> store;
  ParamRef weight;
  std::unique_ptr<Fp8Linear> lin;
  BufferPlanner planner{Device::cpu(), DType::kF32};
  int64_t out, in;
};

// The FP8 weight copies kept in the bytes of the bf16 weight (Fp8Linear::in_params, docs/fp8.md
// "Memory"): quantised from the fp32 main parameters rounded to bf16, they are bitwise the copies
// quantised from the bf16 weight — wq, wq_t (the transposed bytes) and the scaling state — for
// every recipe, initially and after new main parameters overwrote the storage with their bf16
// rounding (as the optimizer step does); --fp8-param-gather's owned pieces quantised from fp32 main
// slices (their amaxes rounded to bf16) give the same bytes and scale; with sharded main parameters
// the freshly loaded bf16 storage is quantised once (an evaluation forward first changes nothing)
// and an optimizer step that no FP8 gather followed is an error. Negative control: quantising the
// fp32 values without the bf16 rounding gives other bytes, which the comparison would catch.
// When the FP8 copies may live in the bf16 weights' storage (Fp8Model::weights_in_params): only where
// every rank can requantise each dense weight after the step — whole fp32 main parameters, or the
// FP8 all-gather of --fp8-param-gather over a DP x CP group of more than one rank. With DP x CP = 1 but
// an expert-data-parallel group > 1 the distributed optimizer shards the main parameters while no FP8
// gather refills the dense weights (a review found the run refused at its second iteration).
TEST(Fp8Linear, WeightsInParamsOnlyWhereTheyCanBeRefilled) {
  const DType bf = DType::kBF16;
  EXPECT_TRUE(Fp8Model::weights_in_params(bf, false, false, false, 1, 1));   // no distributed optimizer
  EXPECT_TRUE(Fp8Model::weights_in_params(bf, false, false, false, 4, 8));
  EXPECT_FALSE(Fp8Model::weights_in_params(bf, false, true, false, 4, 4));   // distopt without the FP8 gather
  EXPECT_TRUE(Fp8Model::weights_in_params(bf, false, true, true, 2, 2));     // --fp8-param-gather over DP 2
  EXPECT_TRUE(Fp8Model::weights_in_params(bf, false, true, true, 1, 1));     // distopt on one rank: not sharded
  EXPECT_FALSE(Fp8Model::weights_in_params(bf, false, true, true, 1, 2));    // TP 2, ETP 1: EDP 2, DP 1
  EXPECT_FALSE(Fp8Model::weights_in_params(bf, true, false, false, 1, 1));   // int16 remainders
  EXPECT_FALSE(Fp8Model::weights_in_params(DType::kF32, false, false, false, 1, 1));
}

TEST(Fp8Linear, WeightCopiesInParamsEqualSeparateCopies) {
  const int64_t out = 96, in = 160, n = out * in;
  for (const Fp8Recipe r : {Fp8Recipe::kTensorwise, Fp8Recipe::kDelayed, Fp8Recipe::kBlockwise}) {
    SCOPED_TRACE(fp8_recipe_name(r));
    WeightCopies a(r, true, out, in), b(r, false, out, in);
    const Stream& st = a.st;
    ASSERT_TRUE(a.lin->in_params());
    ASSERT_FALSE(b.lin->in_params());
    ASSERT_EQ(a.lin->fp8_weight().data(), a.store->param(0).data()) << "wq is the weight's storage";
    ASSERT_NE(b.lin->fp8_weight().data(), b.store->param(0).data());
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(round);
      const std::vector<float> full = testing::randn(n, 0.02f * (round + 1));
      a.set_main(full);
      b.set_main(full);
      a.model->quantize_weights(0, /*force=*/true, st);
      b.model->quantize_weights(0, /*force=*/true, st);
      const std::vector<uint8_t> wq = a.wq();
      EXPECT_EQ(wq, b.wq()) << "wq";
      const std::vector<uint8_t> wq_t = WeightCopies::bytes(a.store->param(0), static_cast<size_t>(n),
                                                             static_cast<size_t>(n));
      int bad = 0;
      for (int64_t i = 0; i < out; ++i)
        for (int64_t k = 0; k < in; ++k)
          bad += wq_t[static_cast<size_t>(k * out + i)] != wq[static_cast<size_t>(i * in + k)];
      EXPECT_EQ(bad, 0) << "wq_t, the rest of the storage, is wq transposed";
      EXPECT_EQ(a.state(), b.state()) << "scaling state";
      if (r == Fp8Recipe::kTensorwise) {  // negative control: no bf16 rounding
        const Tensor main = a.store->main(0);
        testing::OwnedTensor amax(DType::kF32, Device::cpu(), {1}), s(DType::kF32, Device::cpu(), {1}),
            si(DType::kF32, Device::cpu(), {1}), q(DType::kF8E4M3, Device::cpu(), {out, in});
        fp8_amax(amax.t, main, st);
        fp8_scale_from_amax(s.t, si.t, amax.t, DType::kF8E4M3, false, 0.f, st);
        fp8_quantize(q.t, Tensor(), main, s.t, Tensor(), st);
        EXPECT_NE(WeightCopies::bytes(q.t, 0, static_cast<size_t>(n)), wq);
      }
    }
    if (r == Fp8Recipe::kBlockwise) continue;  // --fp8-param-gather refuses it
    // --fp8-param-gather's pieces from fp32 main slices (two ranks' slices of this weight)
    const int64_t k = 5000;
    testing::OwnedTensor amax(DType::kF32, Device::cpu(), {2}), q(DType::kF8E4M3, Device::cpu(), {n});
    const Tensor main = a.store->main(0).view({n});
    const Tensor p0 = a.lin->weight_piece(main.flat_range(0, k), 0, k),
                 p1 = a.lin->weight_piece(main.flat_range(k, n - k), k, n - k);
    a.lin->weight_piece_amax(amax.t.flat_range(0, 1), p0, st);
    a.lin->weight_piece_amax(amax.t.flat_range(1, 1), p1, st);
    const std::vector<float> am = to_host(amax.t, st);
    const testing::OwnedTensor whole =
        testing::make_tensor({std::max(am[0], am[1])}, DType::kF32, Device::cpu(), {1}, st);
    a.lin->set_weight_scale(whole.t, st);
    a.lin->quantize_weight_piece(q.t.flat_range(0, k), p0, st);
    a.lin->quantize_weight_piece(q.t.flat_range(k, n - k), p1, st);
    EXPECT_EQ(WeightCopies::bytes(q.t, 0, static_cast<size_t>(n)), b.wq()) << "pieces";
    if (r == Fp8Recipe::kTensorwise) EXPECT_EQ(a.state(), b.state()) << "the pieces' scale";
    // sharded main parameters: the loaded bf16 storage is the source, once
    a.store->shard_main({{0, k}}, st);
    ASSERT_FALSE(a.lin->main_whole());
    const std::vector<float> full = testing::randn(n, 0.02f);
    a.set_main(full);
    b.set_main(full);
    a.model->load_state(st);
    a.model->set_training(false);  // an evaluation forward, then the training forward: quantised once
    a.model->quantize_weights(0, true, st);
    a.model->set_training(true);
    a.model->quantize_weights(0, true, st);
    b.model->quantize_weights(0, true, st);
    EXPECT_EQ(a.wq(), b.wq()) << "from the loaded storage";
    if (r == Fp8Recipe::kDelayed) EXPECT_EQ(a.state(), b.state()) << "the weight's amax recorded once, in the evaluation";
    a.model->finish_step(st);
    testing::expect_error([&] { a.model->quantize_weights(0, true, st); },
                          "was not refilled by the FP8 parameter all-gather");
  }
}

// The saved transposed input (ColumnParallelLinear) and the input quantised again in the backward
// (RowParallelLinear, experts) give the same bytes, hence the same weight gradient, bit for bit.
TEST(Fp8Linear, SavedInputEqualsRequantizedInput) {
  for (Fp8Recipe r : {Fp8Recipe::kTensorwise, Fp8Recipe::kDelayed, Fp8Recipe::kBlockwise}) {
    const int64_t out = 32, in = 160, m = 48;
    Harness saved(r, Fp8Format::kE4M3, out, in, m, true, false), again(r, Fp8Format::kE4M3, out, in, m, false, false);
    const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                             bias = testing::randn(out, 0.1f), dy = testing::randn(m * out, 1e-3f);
    const Outputs a = run(saved, m, x, w, bias, dy), b = run(again, m, x, w, bias, dy);
    EXPECT_EQ(a.dw, b.dw) << fp8_recipe_name(r);
    EXPECT_EQ(a.y, b.y) << fp8_recipe_name(r);
  }
}

// A fused producer (SwiGLU -> FP8, delayed scaling) writing the linear's xq — with the saved input
// also its transpose x_t, with or without its bf16 output — then forward_fused: every output, the
// saved x_t (through dw) and the recorded state bitwise the unfused forward of the producer's
// stored output.
TEST(Fp8Linear, FusedProducerEqualsUnfused) {
  for (bool save_input : {true, false})
    for (bool transposed : {false, true}) {
      if (transposed && !save_input) continue;
      SCOPED_TRACE(save_input ? (transposed ? "saved, written by the producer" : "saved") : "requantised");
      const int64_t out = 32, in = 160, m = 48;
      const Stream& st = testing::cpu_stream();
      Harness a(Fp8Recipe::kDelayed, Fp8Format::kHybrid, out, in, m, save_input, false),
          b(Fp8Recipe::kDelayed, Fp8Format::kHybrid, out, in, m, save_input, false);
      a.model->set_training(true);
      b.model->set_training(true);
      const std::vector<float> x2 = testing::randn(m * 2 * in, 3.f), w = testing::randn(out * in, 0.05f),
                               bias = testing::randn(out, 0.1f), dy = testing::randn(m * out, 1e-3f);
      const testing::OwnedTensor x2t = Io::make(x2, {m, 2 * in}), act(DType::kF32, Device::cpu(), {m, in});
      swiglu_forward(act, x2t, st);
      const std::vector<float> x = to_host(act, st);
      const Outputs ref = run(a, m, x, w, bias, dy);
      Io io(b, m, x, w, bias, dy);
      const testing::OwnedTensor act2(DType::kF32, Device::cpu(), {m, in});
      const Fp8Linear::FusedInput fi = b.lin->fused_input(m, 0, transposed);
      ASSERT_FALSE(fi.record.empty());
      ASSERT_EQ(fi.x_t.empty(), !transposed);
      // with x_t written by the producer nothing reads the bf16 input: the producer skips it
      fp8_swiglu_forward(transposed ? Tensor() : Tensor(act2), fi.xq, fi.x_t, x2t, fi.scale, fi.record, st);
      b.lin->forward_fused(io.y, io.bt, io.pre, 0, st);
      const Tensor xin = transposed ? Tensor(act) : Tensor(act2);  // read by the backward only when not saved
      b.lin->backward({io.dx, b.weight.grad(), GradWrite::kOverwrite, io.db, Tensor(), Tensor()}, io.dyt, xin, 0, st);
      Outputs o{to_host(io.y, st), to_host(io.pre, st), to_host(io.dx, st), to_host(b.weight.grad(), st), {},
                to_host(io.db, st)};
      b.lin->backward({Tensor(), b.weight.grad(), GradWrite::kAccumulate, Tensor(), Tensor(), Tensor()}, io.dyt, xin,
                      0, st);
      o.dw2 = to_host(b.weight.grad(), st);
      if (!transposed) EXPECT_EQ(to_host(act2, st), x);
      expect_same_outputs(ref, o);
      const auto [fa, ba] = a.model->layer_state(0, st);
      const auto [fb, bb] = b.model->layer_state(0, st);
      const std::vector<float> sa = to_host(fa, st);
      EXPECT_EQ(sa, to_host(fb, st));
      EXPECT_EQ(to_host(ba, st), to_host(bb, st));
      EXPECT_EQ(sa[0], amax_of(x)) << "x's record";
    }
  Harness tw(Fp8Recipe::kTensorwise, Fp8Format::kE4M3, 32, 160, 48, true, false);
  testing::expect_error([&] { tw.lin->fused_input(48, 0); },
                        "decoder.layers.0.test: a fused FP8 producer needs delayed scaling");
}

// A fused producer of dy (SwiGLU's backward -> FP8, delayed scaling: linear_fc1's output gradient)
// writing the linear's dyq and dyq_t, then backward: dx, dw and the recorded dy amax bitwise the
// unfused backward of the producer's stored gradient; the next (unfused) backward is unaffected; a
// bias gradient, another recipe or row count are refused.
TEST(Fp8Linear, FusedGradEqualsUnfused) {
  const int64_t out = 160, in = 32, m = 48;  // out = 2f: the SwiGLU's input width
  const Stream& st = testing::cpu_stream();
  Harness a(Fp8Recipe::kDelayed, Fp8Format::kHybrid, out, in, m, true, false),
      b(Fp8Recipe::kDelayed, Fp8Format::kHybrid, out, in, m, true, false);
  a.model->set_training(true);
  b.model->set_training(true);
  const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                           pre = testing::randn(m * out, 3.f), dact = testing::randn(m * out / 2, 1e-3f);
  const testing::OwnedTensor pret = Io::make(pre, {m, out}), dactt = Io::make(dact, {m, out / 2});
  const testing::OwnedTensor dyt(DType::kF32, Device::cpu(), {m, out}), junk(DType::kF32, Device::cpu(), {m, out});
  swiglu_backward(dyt, dactt, pret, st);
  const std::vector<float> dy = to_host(dyt, st), zeros(out, 0.f);
  testing::poison(junk, st);  // the fused backward must not read its dy argument
  Io ia(a, m, x, w, zeros, dy), ib(b, m, x, w, zeros, dy);
  a.lin->forward(ia.y, ia.xt, Tensor(), Tensor(), 0, st);
  b.lin->forward(ib.y, ib.xt, Tensor(), Tensor(), 0, st);
  a.lin->backward({ia.dx, a.weight.grad(), GradWrite::kOverwrite, Tensor(), Tensor(), Tensor()}, dyt, ia.xt, 0, st);
  ASSERT_TRUE(b.lin->takes_fused_grad(m));
  const Fp8Linear::FusedGrad g = b.lin->fused_grad(m);
  ASSERT_FALSE(g.record.empty());
  fp8_swiglu_backward(g.dyq, g.dyq_t, dactt, pret, g.scale, g.record, st);
  b.lin->backward({ib.dx, b.weight.grad(), GradWrite::kOverwrite, Tensor(), Tensor(), Tensor()}, junk, ib.xt, 0, st);
  EXPECT_EQ(to_host(ia.dx, st), to_host(ib.dx, st));
  EXPECT_EQ(to_host(a.weight.grad(), st), to_host(b.weight.grad(), st));
  const auto [fa, ba] = a.model->layer_state(0, st);
  const auto [fb, bb] = b.model->layer_state(0, st);
  const std::vector<float> dba = to_host(ba, st);
  EXPECT_EQ(dba, to_host(bb, st));
  EXPECT_EQ(dba[0], amax_of(dy)) << "dy's record";
  // the next backward quantises its dy again
  a.lin->backward({Tensor(), a.weight.grad(), GradWrite::kAccumulate, Tensor(), Tensor(), Tensor()}, dyt, ia.xt, 0, st);
  b.lin->backward({Tensor(), b.weight.grad(), GradWrite::kAccumulate, Tensor(), Tensor(), Tensor()}, dyt, ib.xt, 0, st);
  EXPECT_EQ(to_host(a.weight.grad(), st), to_host(b.weight.grad(), st));
  // refused: a bias gradient from the FP8 dy, other recipes, other row counts
  b.lin->fused_grad(m);
  testing::expect_error(
      [&] { b.lin->backward({Tensor(), b.weight.grad(), GradWrite::kAccumulate, ib.db, Tensor(), Tensor()}, junk,
                            ib.xt, 0, st); },
      "decoder.layers.0.test: a bias gradient needs the high-precision dy");
  EXPECT_FALSE(b.lin->takes_fused_grad(32));
  testing::expect_error([&] { b.lin->fused_grad(32); }, "needs delayed scaling and the planned 48 rows");
  Harness tw(Fp8Recipe::kTensorwise, Fp8Format::kHybrid, out, in, m, true, false);
  EXPECT_FALSE(tw.lin->takes_fused_grad(m));
  testing::expect_error([&] { tw.lin->fused_grad(m); }, "got 48 rows (recipe tensorwise)");
}

// --moe-shared-expert-overlap runs the shared experts on a side stream beside the routed experts'
// FP8 GEMMs: their linears' FP8 scratch must be their own (otherwise every linear shares it).
TEST(Fp8Linear, SharedExpertsScratchOfTheirOwnUnderOverlap) {
  for (const bool overlap : {false, true}) {
    TransformerConfig cfg;
    cfg.num_layers = 1;
    cfg.fp8 = Fp8Format::kHybrid;
    cfg.fp8_recipe = Fp8Recipe::kDelayed;
    cfg.moe_shared_expert_overlap = overlap;
    Fp8Model model(cfg, ProcessGroups::single());
    const std::string shared = "decoder.layers.0.mlp.shared_experts.linear_fc1",
                      routed = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1";
    EXPECT_EQ(model.scratch_prefix(shared), overlap ? "fp8.shared_experts." : "fp8.");
    EXPECT_EQ(model.scratch_prefix(routed), "fp8.");
    ParamRef none;
    auto a = model.make_linear(0, model.reserve(0, 2), shared, &none, 32, 64, {});
    auto b = model.make_linear(0, model.reserve(0, 2), routed, &none, 32, 64, {});
    BufferPlanner planner(Device::cpu(), DType::kF32);
    for (int pass = 0; pass < 2; ++pass) {
      planner.begin_pass();
      planner.open_area(BufferPlanner::Family::kActivations, 0);
      a->plan(planner, 32, true);
      b->plan(planner, 32, true);
      planner.close_area();
      if (pass == 0) planner.materialize();
    }
    const void* xa = a->fused_input(32, 0).xq.data();
    const void* xb = b->fused_input(32, 0).xq.data();
    if (overlap) {
      EXPECT_NE(xa, xb) << "the shared experts' FP8 scratch is the routed experts'";
    } else {
      EXPECT_EQ(xa, xb) << "the linears' FP8 scratch is shared";
    }
  }
}

TEST(Fp8Linear, Errors) {
  TransformerConfig cfg;
  cfg.num_layers = 2;
  cfg.fp8 = Fp8Format::kE4M3;
  Fp8Model model(cfg, ProcessGroups::single());
  ParamRef none;
  testing::expect_error([&] { model.make_linear(0, model.reserve(0, 1), "decoder.layers.0.x", &none, 40, 64, {}); },
                        "decoder.layers.0.x: FP8 GEMMs need this rank's weight shard [40, 64] to have both sizes "
                        "multiples of 16");
  auto lin = model.make_linear(1, model.reserve(1, 1), "decoder.layers.1.x", &none, 32, 64, {});
  BufferPlanner p(Device::cpu(), DType::kF32);
  p.begin_pass();
  p.open_area(BufferPlanner::Family::kActivations, 0);
  testing::expect_error([&] { lin->plan(p, 24, true); }, "to be a multiple of 16");
  testing::expect_error([&] { lin->plan(p, 32, true, false, 4); },
                        "per tensor-parallel block of rows (sequence length / context-parallel size / tensor-parallel "
                        "size x micro-batch size = 32 / 4 = 8), which must be a multiple of 16");
  EXPECT_EQ(Fp8Model::decoder_layer("decoder.layers.12.mlp.linear_fc1"), 12);
  EXPECT_EQ(Fp8Model::decoder_layer("output_layer"), -1);
  EXPECT_EQ(Fp8Model::decoder_layer("decoder.layers.x"), -1);
  cfg.fp8_param = true;  // --fp8-param-gather: per-tensor recipes only
  { Fp8Model m(cfg, ProcessGroups::single()); }
  cfg.fp8_recipe = Fp8Recipe::kBlockwise;
  testing::expect_error([&] { Fp8Model m(cfg, ProcessGroups::single()); },
                        "--fp8-param-gather needs a per-tensor recipe (--fp8-recipe tensorwise or delayed), got blockwise");
}

// forward_add (a RowParallelLinear's residual add): for the per-tensor recipes the residual is the
// GEMM's C and the bias its epilogue, out = (residual + product) + bias (cuBLASLt's order; the CPU
// emulation adds in that order), for blockwise a separate add, out = residual + (product + bias) —
// each bitwise on the CPU against the forward's product without the bias (and forward's y = product
// + bias); the residual itself is left unchanged. Delayed scaling: forward_fused_add of the
// producer's FP8 bytes is the same.
TEST(Fp8Linear, ForwardAddEqualsForwardPlusResidual) {
  for (Fp8Recipe r : {Fp8Recipe::kTensorwise, Fp8Recipe::kDelayed, Fp8Recipe::kBlockwise}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(std::string(fp8_recipe_name(r)) + (with_bias ? " with bias" : ""));
      const int64_t out = 32, in = 160, m = 48;
      const Stream& st = testing::cpu_stream();
      Harness a(r, Fp8Format::kHybrid, out, in, m, false, false), b(r, Fp8Format::kHybrid, out, in, m, false, false);
      const std::vector<float> x = testing::randn(m * in), w = testing::randn(out * in, 0.05f),
                               bias = with_bias ? testing::randn(out, 0.1f) : std::vector<float>(out, 0.f),
                               res = testing::randn(m * out), dy = testing::randn(m * out, 1e-3f);
      Io ia(a, m, x, w, bias, dy), ib(b, m, x, w, bias, dy);
      a.lin->forward(ia.y, ia.xt, Tensor(), Tensor(), 0, st);  // the product alone
      const std::vector<float> p = to_host(ia.y, st);
      a.lin->forward(ia.y, ia.xt, with_bias ? Tensor(ia.bt) : Tensor(), Tensor(), 0, st);
      const std::vector<float> y = to_host(ia.y, st);
      const testing::OwnedTensor rt = Io::make(res, {m, out});
      b.lin->forward_add(ib.y, ib.xt, with_bias ? Tensor(ib.bt) : Tensor(), rt, 0, st);
      const std::vector<float> got = to_host(ib.y, st);
      std::vector<float> want(y.size());
      for (size_t i = 0; i < y.size(); ++i) {
        const float bi = bias[i % static_cast<size_t>(out)];
        ASSERT_EQ(y[i], p[i] + bi) << i;  // forward: product + bias, one addition
        want[i] = r == Fp8Recipe::kBlockwise ? res[i] + (p[i] + bi) : (res[i] + p[i]) + bi;
      }
      EXPECT_EQ(got, want);
      EXPECT_EQ(to_host(rt, st), res);
      if (r != Fp8Recipe::kDelayed) continue;
      // the producer's FP8 bytes (a fused producer writes exactly fp8_quantize's) into forward_fused_add
      Harness c(r, Fp8Format::kHybrid, out, in, m, false, false);
      Io ic(c, m, x, w, bias, dy);
      const Fp8Linear::FusedInput fi = c.lin->fused_input(m, 0);
      fp8_quantize(fi.xq, Tensor(), ic.xt, fi.scale, fi.record, st);
      c.lin->forward_fused_add(ic.y, with_bias ? Tensor(ic.bt) : Tensor(), rt, 0, st);
      EXPECT_EQ(to_host(ic.y, st), want) << "forward_fused_add";
    }
  }
}

}  // namespace
}  // namespace mt
