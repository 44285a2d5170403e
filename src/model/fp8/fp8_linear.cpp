#include "model/fp8/fp8_linear.h"

#include <algorithm>
#include <cstdint>

#include <fmt/ranges.h>

#include "model/fp8/fp8_model.h"
#include "ops/context_attention.h"  // transpose_blocks
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_epilogue.h"
#include "ops/gelu.h"

namespace mt {

namespace {

constexpr int64_t kAlign = 16;  // cuBLASLt's FP8 rule: m, n, k multiples of 16
int64_t pad16(int64_t m) { return (m + kAlign - 1) / kAlign * kAlign; }
int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

/// A contiguous view of `shape` and `dtype` at the start of a planned buffer (scratch planned for
/// the largest row count, used for fewer rows).
Tensor view_as(const Tensor& buf, DType dtype, const std::vector<int64_t>& shape) {
  if (buf.empty()) return Tensor();
  MT_CHECK(static_cast<size_t>(numel_of(shape)) * dtype_size(dtype) <= buf.nbytes(),
           "fp8: a [{}] {} view exceeds its planned buffer {}", fmt::join(shape, ", "), dtype_name(dtype), buf.str());
  return Tensor(buf.data(), dtype, buf.device(), shape);
}

/// The scale tensor of an operand [rows, cols] under a block scaling, or an empty tensor.
Tensor scale_view(const Tensor& buf, Fp8Scaling s, int64_t rows, int64_t cols) {
  if (s == Fp8Scaling::kTensor) return Tensor();
  return view_as(buf, DType::kF32, fp8_scale_shape(s, rows, cols));
}

/// Bytes of a scale tensor of an operand [rows, cols] under a block scaling (0 for tensorwise).
int64_t scale_numel(Fp8Scaling s, int64_t rows, int64_t cols) {
  return s == Fp8Scaling::kTensor ? 0 : numel_of(fp8_scale_shape(s, rows, cols));
}

/// x [m, cols] itself when m is a multiple of 16, else its copy into pad [mp, cols] with zero rows
/// after it (they change no amax, block scale or product).
Tensor padded_rows(const Tensor& x, const Tensor& pad, int64_t m, int64_t mp, const Stream& stream) {
  if (m == mp) return x;
  copy(pad.slice0(0, m), x, stream);
  memset_tensor(pad.slice0(m, mp), 0, stream);
  return pad;
}

void reduce_max(Communicator* group, const Tensor& t, const Stream& stream) {
  if (group != nullptr && group->size() > 1) group->all_reduce(t, ReduceOp::kMax, stream);
}

}  // namespace

Fp8Linear::Fp8Linear(const Fp8Model& model, std::string name, const ParamRef* weight, int64_t out, int64_t in,
                     Fp8Groups groups, bool in_params)
    : model_(model), name_(std::move(name)), weight_(weight), out_(out), in_(in), groups_(groups),
      in_params_(in_params) {
  MT_REQUIRE(out % kAlign == 0 && in % kAlign == 0,
             "{}: FP8 GEMMs need this rank's weight shard [{}, {}] to have both sizes multiples of 16 (cuBLASLt's FP8 "
             "rule): choose hidden / ffn sizes (divided by the tensor-parallel size) that are",
             name_, out, in);
}

Fp8Scaling Fp8Linear::act_scaling() const {
  return model_.settings().blockwise() ? Fp8Scaling::kBlock1x128 : Fp8Scaling::kTensor;
}

Fp8Scaling Fp8Linear::weight_scaling() const {
  return model_.settings().blockwise() ? Fp8Scaling::kBlock128x128 : Fp8Scaling::kTensor;
}

void Fp8Linear::plan(BufferPlanner& p, int64_t max_rows, bool save_input, bool variable_rows, int64_t row_blocks,
                     bool gathered_input) {
  MT_CHECK(!(save_input && variable_rows), "{}: save_input needs a fixed row count", name_);
  MT_CHECK(row_blocks >= 1 && max_rows % row_blocks == 0 && (row_blocks == 1 || !variable_rows),
           "{}: {} rows in {} blocks", name_, max_rows, row_blocks);
  MT_REQUIRE(variable_rows || max_rows % kAlign == 0,
             "{}: FP8 GEMMs need the rows of a micro-batch (sequence length / context-parallel size x micro-batch "
             "size = {}) to be a multiple of 16 (cuBLASLt's FP8 rule)",
             name_, max_rows);
  MT_REQUIRE(variable_rows || (max_rows / row_blocks) % kAlign == 0,
             "{}: FP8 GEMMs under sequence parallelism run per tensor-parallel block of rows (sequence length / "
             "context-parallel size / tensor-parallel size x micro-batch size = {} / {} = {}), which must be a "
             "multiple of 16 (cuBLASLt's FP8 rule)",
             name_, max_rows, row_blocks, max_rows / row_blocks);
  save_input_ = save_input;
  variable_rows_ = variable_rows;
  gathered_input_ = gathered_input;
  max_rows_ = max_rows;
  row_blocks_ = row_blocks;
  const size_t a = static_cast<size_t>(p.area());
  if (saved_.size() <= a) saved_.resize(a + 1);
  Saved& sv = saved_[a];
  const Fp8Scaling s = act_scaling();
  const DType f = model_.settings().forward_dtype(), g = model_.settings().grad_dtype();
  if (model_.settings().recipe == Fp8Recipe::kTensorwise) sv.x_scale = p.saved(DType::kF32, {2}, "fp8 x scale_inv and scale");
  if (save_input) {
    sv.x_t = p.saved(f, {in_, max_rows}, "fp8 transposed input");
    if (s != Fp8Scaling::kTensor) sv.x_t_s = p.saved(DType::kF32, fp8_scale_shape(s, in_, max_rows), "fp8 input scales");
  }
  const int64_t m = pad16(max_rows);
  // the shared experts' linears under --moe-shared-expert-overlap run on a side stream beside the
  // routed experts' FP8 GEMMs: scratch of their own (Fp8Model::scratch_prefix)
  const std::string prefix = model_.scratch_prefix(name_);
  auto bytes = [&](const char* key, DType t, int64_t n) { return n > 0 ? p.scratch(prefix + key, t, {n}) : Tensor(); };
  Scratch& sc = scratch_;
  sc.xq = bytes("xq", f, m * in_);
  sc.xq_s = bytes("xq_s", DType::kF32, scale_numel(s, m, in_));
  if (!save_input) {
    sc.x_t = bytes("x_t", f, in_ * m);
    sc.x_t_s = bytes("x_t_s", DType::kF32, scale_numel(s, in_, m));
  }
  sc.dyq = bytes("dyq", g, m * out_);
  sc.dyq_s = bytes("dyq_s", DType::kF32, scale_numel(s, m, out_));
  sc.dyq_t = bytes("dyq_t", g, out_ * m);
  sc.dyq_t_s = bytes("dyq_t_s", DType::kF32, scale_numel(s, out_, m));
  if (row_blocks > 1 && gathers_fp8()) sc.xq_local = bytes("xq_local", f, max_rows / row_blocks * in_);
  if (variable_rows) {
    const DType t = p.act_dtype();
    sc.pad_x = bytes("pad_x", t, m * in_);
    sc.pad_y = bytes("pad_y", t, m * out_);
    sc.pad_dy = bytes("pad_dy", t, m * out_);
    sc.pad_dx = bytes("pad_dx", t, m * in_);
  }
}

void Fp8Linear::plan_weights(BufferPlanner& p) {
  const DType f = model_.settings().forward_dtype();
  if (!in_params_) {
    wq_ = p.persistent(f, {out_, in_}, "fp8 weight");
    wq_t_ = p.persistent(f, {in_, out_}, "fp8 transposed weight");
  } else if (weight_ != nullptr && weight_->bound()) {  // unbound: a measuring pass (memory_plan)
    const Tensor w = weight_->value();
    MT_REQUIRE(w.dtype() == DType::kBF16 && w.numel() == out_ * in_,
               "{}: FP8 weight copies in the parameter storage need a bf16 [{}, {}] weight (2 bytes an element for "
               "wq and wq_t), got {}",
               name_, out_, in_, w.str());
    char* bytes = static_cast<char*>(w.data());  // 128-byte aligned (ParamStore::kAlign); out·in a multiple of 256
    wq_ = Tensor(bytes, f, w.device(), {out_, in_});
    wq_t_ = Tensor(bytes + out_ * in_, f, w.device(), {in_, out_});
  }
  const Fp8Scaling s = weight_scaling();
  if (s != Fp8Scaling::kTensor) {
    wq_s_ = p.persistent(DType::kF32, fp8_scale_shape(s, out_, in_), "fp8 weight scales");
    wq_t_s_ = p.persistent(DType::kF32, fp8_scale_shape(s, in_, out_), "fp8 transposed weight scales");
  }
}

void Fp8Linear::bind_state(const Fp8TensorState& x, const Fp8TensorState& w, const Fp8TensorState& dy) {
  x_ = x;
  w_ = w;
  dy_ = dy;
}

Fp8Linear::Scratch Fp8Linear::views(int64_t m) const {
  const Scratch& b = scratch_;
  const Fp8Scaling s = act_scaling();
  const DType f = model_.settings().forward_dtype(), g = model_.settings().grad_dtype();
  Scratch v;
  v.xq = view_as(b.xq, f, {m, in_});
  v.xq_s = scale_view(b.xq_s, s, m, in_);
  v.x_t = view_as(b.x_t, f, {in_, m});
  v.x_t_s = scale_view(b.x_t_s, s, in_, m);
  v.dyq = view_as(b.dyq, g, {m, out_});
  v.dyq_s = scale_view(b.dyq_s, s, m, out_);
  v.dyq_t = view_as(b.dyq_t, g, {out_, m});
  v.dyq_t_s = scale_view(b.dyq_t_s, s, out_, m);
  if (variable_rows_) {
    const DType t = b.pad_x.dtype();
    v.pad_x = view_as(b.pad_x, t, {m, in_});
    v.pad_y = view_as(b.pad_y, t, {m, out_});
    v.pad_dy = view_as(b.pad_dy, t, {m, out_});
    v.pad_dx = view_as(b.pad_dx, t, {m, in_});
  }
  return v;
}

namespace {
// The residual can be cuBLASLt's C of the fprop GEMM (fp8_matmul's addend): shaped, typed and laid
// out like the output, 16-byte aligned; otherwise forward_add adds it in a separate pass.
bool residual_as_c(const Tensor& out, const Tensor& residual) {
  return out.shape() == residual.shape() && residual.dtype() == out.dtype() && residual.is_contiguous() &&
         reinterpret_cast<uintptr_t>(residual.data()) % 16 == 0;
}
}  // namespace

bool Fp8Linear::main_whole() const {
  MT_CHECK(weight_ != nullptr && weight_->bound(), "{}: the FP8 weight's parameter is not bound", name_);
  return weight_->store->has_main_flat();
}

void Fp8Linear::quantize_weight(bool record, const Stream& st) {
  MT_CHECK(weight_ != nullptr && weight_->bound(), "{}: the FP8 weight is quantised before its parameter is bound",
           name_);
  Tensor w = weight_->value();
  // in_params: the storage is about to receive the FP8 bytes. The fp32 main parameters, rounded to
  // bf16 as the optimizer rounds them into the storage, in the quantiser's pass (rounded); staged:
  // blockwise (no such quantiser), and the storage itself when the main parameters are sharded (the
  // bf16 weight initialisation or a checkpoint load wrote it)
  bool rounded = false;
  if (in_params_) {
    const bool main = main_whole();
    if (main) w = weight_->store->main(weight_->index).view({out_, in_});
    rounded = main && !model_.settings().blockwise();
    if (!rounded) w = model_.stage_weight(w, st).view({out_, in_});
  }
  const auto quantize = [&](const Tensor& amax) {
    if (rounded) fp8_quantize_bf16_rounded(wq_, wq_t_, w, w_.scale, amax, st);
    else fp8_quantize(wq_, wq_t_, w, w_.scale, amax, st);
  };
  const DType f = model_.settings().forward_dtype();
  switch (model_.settings().recipe) {
    case Fp8Recipe::kTensorwise:
      fp8_amax(w_.amax, w, st);
      reduce_max(groups_.w, w_.amax, st);
      if (rounded) model_.round_to_bf16(w_.amax, st);  // the rounded values' amax (rounding is monotonic)
      fp8_scale_from_amax(w_.scale, w_.scale_inv, w_.amax, f, /*pow2=*/false, 0.f, st);
      quantize(Tensor());
      break;
    case Fp8Recipe::kDelayed:
      quantize(record ? w_.record : Tensor());
      break;
    case Fp8Recipe::kBlockwise:
      fp8_quantize_blockwise(wq_, wq_s_, wq_t_, wq_t_s_, w, Fp8Scaling::kBlock128x128, /*pow2=*/true, st);
      break;
  }
}

size_t Fp8Linear::weight_index() const {
  MT_CHECK(weight_ != nullptr && weight_->bound(), "{}: the FP8 weight's parameter is not bound", name_);
  return weight_->index;
}

Tensor Fp8Linear::weight_piece(const Tensor& main, int64_t begin, int64_t n) const {
  MT_CHECK(begin >= 0 && n > 0 && begin + n <= out_ * in_, "{}: weight piece [{}, {}) outside its {} elements", name_,
           begin, begin + n, out_ * in_);
  if (!in_params_) return weight_->value().flat_range(begin, n).view({1, n});
  MT_CHECK(main.dtype() == DType::kF32 && main.numel() == n, "{}: the main parameters of a weight piece of {} must be "
           "fp32 [{}], got {}", name_, n, n, main.str());
  return main.view({1, n});
}

void Fp8Linear::weight_piece_amax(const Tensor& amax, const Tensor& piece, const Stream& st) const {
  fp8_amax(amax, piece, st);
}

void Fp8Linear::set_weight_scale(const Tensor& amax, const Stream& st) {
  MT_CHECK(!model_.settings().blockwise(), "{}: --fp8-param-gather with blockwise scaling", name_);
  if (model_.settings().recipe != Fp8Recipe::kTensorwise) return;
  copy(w_.amax, amax, st);
  if (in_params_) model_.round_to_bf16(w_.amax, st);  // the fp32 values' amax: the rounded values' is its rounding
  fp8_scale_from_amax(w_.scale, w_.scale_inv, w_.amax, model_.settings().forward_dtype(), /*pow2=*/false, 0.f, st);
}

void Fp8Linear::quantize_weight_piece(const Tensor& q, const Tensor& piece, const Stream& st) {
  MT_CHECK(!model_.settings().blockwise(), "{}: --fp8-param-gather with blockwise scaling", name_);
  const int64_t n = piece.numel();
  MT_CHECK(q.numel() == n && q.dtype() == model_.settings().forward_dtype(), "{}: FP8 piece {} must be {} [{}]",
           name_, q.str(), dtype_name(model_.settings().forward_dtype()), n);
  const Tensor record = model_.settings().delayed() ? w_.record : Tensor();
  // Elementwise (one scale): as [n / kWidth, kWidth] and the rest as one row, which fills the
  // quantiser's 128 x 128 tiles ([1, n] would leave 127 of their 128 rows empty). in_params: the fp32
  // main parameters rounded to bf16 (the optimizer's rounding) in the quantiser's pass.
  constexpr int64_t kWidth = 1024;
  const Tensor qf = q.view({n}), pf = piece.view({n});
  const auto part = [&](int64_t at, int64_t len, int64_t cols) {
    if (len == 0) return;
    const Tensor qp = qf.flat_range(at, len).view({len / cols, cols}), xp = pf.flat_range(at, len).view(qp.shape());
    if (in_params_) fp8_quantize_bf16_rounded(qp, Tensor(), xp, w_.scale, record, st);
    else fp8_quantize(qp, Tensor(), xp, w_.scale, record, st);
  };
  const int64_t body = n / kWidth * kWidth;
  part(0, body, kWidth);
  part(body, n - body, n - body);
}

void Fp8Linear::finish_weight_gather(const Stream& st) { transpose_blocks(wq_t_, wq_, out_, in_, st); }

Fp8Operand Fp8Linear::weight_operand(bool transposed) const {
  const Fp8Scaling s = weight_scaling();
  if (s == Fp8Scaling::kTensor) return {transposed ? wq_t_ : wq_, w_.scale_inv, s};
  return {transposed ? wq_t_ : wq_, transposed ? wq_t_s_ : wq_s_, s};
}

void Fp8Linear::quantize_act(const Tensor& q, const Tensor& q_s, const Tensor& q_t, const Tensor& q_t_s,
                             const Tensor& x, const Tensor& scale, const Tensor& record, const Stream& st) const {
  if (model_.settings().blockwise()) {
    fp8_quantize_blockwise(q, q_s, q_t, q_t_s, x, Fp8Scaling::kBlock1x128, /*pow2=*/true, st);
  } else {
    fp8_quantize(q, q_t, x, scale, model_.settings().delayed() ? record : Tensor(), st);
  }
}

void Fp8Linear::quantize_x(const Tensor& xq, const Tensor& xq_s, const Tensor& x_t, const Tensor& x_t_s,
                           const Tensor& x, const Saved& sv, bool record, const Stream& st) {
  // tensorwise: the scale begin_forward computed, kept per activation slot; delayed: the step's
  const bool tensorwise = model_.settings().recipe == Fp8Recipe::kTensorwise;
  quantize_act(xq, xq_s, x_t, x_t_s, x, tensorwise ? sv.x_scale.flat_range(1, 1) : x_.scale,
               record ? x_.record : Tensor(), st);
}

Fp8Operand Fp8Linear::x_t_operand(const Saved& sv, const Tensor& x_t, const Tensor& x_t_s) const {
  switch (model_.settings().recipe) {
    case Fp8Recipe::kTensorwise: return {x_t, sv.x_scale.flat_range(0, 1), Fp8Scaling::kTensor};
    case Fp8Recipe::kDelayed: return {x_t, x_.scale_inv, Fp8Scaling::kTensor};
    case Fp8Recipe::kBlockwise: break;
  }
  return {x_t, x_t_s, Fp8Scaling::kBlock1x128};
}

void Fp8Linear::quantize_dy(const Tensor& dyq, const Tensor& dyq_s, const Tensor& dyq_t, const Tensor& dyq_t_s,
                            const Tensor& dy, bool record, const Stream& st) {
  quantize_act(dyq, dyq_s, dyq_t, dyq_t_s, dy, dy_.scale, record ? dy_.record : Tensor(), st);
}

Fp8Linear::Block Fp8Linear::block(int64_t rows, int64_t first, int64_t m, bool grad) const {
  MT_CHECK(first >= 0 && rows > 0 && first + rows <= m && first % kAlign == 0 && rows % kAlign == 0,
           "{}: FP8 row block [{}, {}) of {} rows: blocks must lie inside and start and end at multiples of 16", name_,
           first, first + rows, m);
  const Scratch v = views(m);
  const Fp8Scaling s = act_scaling();
  const int64_t cols = grad ? out_ : in_;
  const Tensor q = grad ? v.dyq : v.xq, q_s = grad ? v.dyq_s : v.xq_s;
  Block b;
  b.q = q.slice0(first, first + rows);
  // the block's own 1x128 scales [ceil(cols/128), rows] (rows % 4 == 0: blocks tile the buffer)
  if (s != Fp8Scaling::kTensor) {
    const int64_t kb = (cols + fp8_math::kBlock - 1) / fp8_math::kBlock;
    b.q_s = q_s.flat_range(first * kb, kb * rows).view(fp8_scale_shape(s, rows, cols));
  }
  b.whole = rows == m;
  if (b.whole) {
    b.q_s = q_s;
    b.q_t = grad ? v.dyq_t : Tensor();
    b.q_t_s = grad ? v.dyq_t_s : Tensor();
  }
  return b;
}

void Fp8Linear::begin_forward(const Tensor& x, bool shard, int slot, const Stream& st) {
  MT_CHECK(x.ndim() == 2 && x.size(1) == in_, "{}: FP8 forward of x {}: expected [m, {}]", name_, x.str(), in_);
  MT_CHECK(!shard || !variable_rows_, "{}: a sequence-parallel shard needs the fixed row count", name_);
  fwd_rows_ = shard ? max_rows_ : x.size(0);
  MT_CHECK(fwd_rows_ <= pad16(max_rows_) && (variable_rows_ || fwd_rows_ == max_rows_) && fwd_rows_ % kAlign == 0,
           "{}: {} rows, planned for {}{}", name_, fwd_rows_, max_rows_, variable_rows_ ? " at most" : "");
  x_t_ready_ = false;
  if (model_.settings().recipe != Fp8Recipe::kTensorwise) return;
  // this micro-batch's amax over x's shards (the sequence-parallel shards too); the backward
  // reuses the scale
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  fp8_amax(x_.amax, x, st);
  reduce_max(shard ? groups_.x_shard : groups_.x, x_.amax, st);
  fp8_scale_from_amax(sv.x_scale.flat_range(1, 1), sv.x_scale.flat_range(0, 1), x_.amax,
                      model_.settings().forward_dtype(), /*pow2=*/false, 0.f, st);
}

void Fp8Linear::forward_rows(const Tensor& y, const Tensor& x, int64_t first, const Tensor& bias,
                             const Tensor& pre_gelu, int slot, const Stream& st) {
  forward_rows_into(y, x, first, bias, pre_gelu, slot, st, Tensor());
}

void Fp8Linear::forward_rows_into(const Tensor& y, const Tensor& x, int64_t first, const Tensor& bias,
                                  const Tensor& pre_gelu, int slot, const Stream& st, const Tensor& residual) {
  const int64_t rows = x.size(0);
  MT_CHECK(x.ndim() == 2 && x.size(1) == in_ && y.ndim() == 2 && y.size(0) == rows && y.size(1) == out_ &&
               (pre_gelu.empty() || pre_gelu.shape() == y.shape()),
           "{}: FP8 forward of x {} into y {} (pre_gelu {}): expected [m, {}] and [m, {}]", name_, x.str(), y.str(),
           pre_gelu.str(), in_, out_);
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  Block b = block(rows, first, fwd_rows_, /*grad=*/false);
  const bool fuse_t = b.whole && save_input_;  // x_t in the same pass when this block is all of x
  quantize_x(b.q, b.q_s, fuse_t ? sv.x_t : Tensor(), fuse_t ? sv.x_t_s : Tensor(), x, sv, model_.training(), st);
  x_t_ready_ = x_t_ready_ || fuse_t;
  const Fp8Operand a = model_.settings().blockwise() ? Fp8Operand{b.q, b.q_s, Fp8Scaling::kBlock1x128}
                                                     : x_t_operand(sv, b.q, Tensor());
  fprop(y, a, bias, pre_gelu, st, residual);
}

void Fp8Linear::fprop(const Tensor& y, const Fp8Operand& a, const Tensor& bias, const Tensor& pre_gelu,
                      const Stream& st, const Tensor& residual) {
  const Tensor out = pre_gelu.empty() ? y : pre_gelu;  // the GEMM's product (+ the bias)
  const bool block = model_.settings().blockwise();
  MT_CHECK(residual.empty() || (pre_gelu.empty() && (bias.empty() || !block)),
           "{}: a residual GEMM has no GELU, and a bias only under per-tensor scaling", name_);
  // TE's fprop uses fast accumulation for the per-tensor recipes (no promotion of partial sums);
  // their bias rides in the GEMM's epilogue (blockwise: a pass of its own, fp8_bias_gelu)
  fp8_matmul(out, a, weight_operand(false), /*accumulate=*/!residual.empty(), /*fast_accum=*/!block, st, residual,
             block ? Tensor() : bias);
  const Tensor rest = block ? bias : Tensor();
  if (!rest.empty() || !pre_gelu.empty()) fp8_bias_gelu(out, rest, pre_gelu.empty() ? Tensor() : y, st);
}

bool Fp8Linear::gathers_fp8() const { return save_input_ && gathered_input_ && !model_.settings().blockwise(); }

std::pair<Tensor, Tensor> Fp8Linear::quantize_shard(const Tensor& x_local, int slot, const Stream& st) {
  MT_CHECK(gathers_fp8() && row_blocks_ > 1 && !scratch_.xq_local.empty(),
           "{}: the FP8 all-gather needs per-tensor scaling, the saved input and sequence-parallel blocks", name_);
  const int64_t rl = max_rows_ / row_blocks_;
  MT_CHECK(x_local.ndim() == 2 && x_local.size(0) == rl && x_local.size(1) == in_ && fwd_rows_ == max_rows_,
           "{}: the sequence-parallel shard x {} must be [{}, {}] after begin_forward of a shard", name_, x_local.str(),
           rl, in_);
  const Tensor local = view_as(scratch_.xq_local, model_.settings().forward_dtype(), {rl, in_});
  quantize_x(local, Tensor(), Tensor(), Tensor(), x_local, saved_.at(static_cast<size_t>(slot)), model_.training(),
             st);
  return {views(fwd_rows_).xq, local};
}

void Fp8Linear::forward_fp8_rows(const Tensor& y, const Tensor& q, int64_t first, const Tensor& bias,
                                 const Tensor& pre_gelu, int slot, const Stream& st) {
  const int64_t rows = q.size(0);
  MT_CHECK(q.ndim() == 2 && q.size(1) == in_ && q.dtype() == model_.settings().forward_dtype() && y.ndim() == 2 &&
               y.size(0) == rows && y.size(1) == out_ && first >= 0 && first + rows <= fwd_rows_,
           "{}: FP8 forward of the gathered rows [{}, {}) q {} into y {}: expected [m, {}] and [m, {}] within {} rows",
           name_, first, first + rows, q.str(), y.str(), in_, out_, fwd_rows_);
  fprop(y, x_t_operand(saved_.at(static_cast<size_t>(slot)), q, Tensor()), bias, pre_gelu, st);
}

void Fp8Linear::end_forward_fp8(int slot, const Stream& st) {
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  transpose_blocks(sv.x_t, views(fwd_rows_).xq, fwd_rows_, in_, st);
  x_t_ready_ = true;
}

const Fp8Settings& Fp8Linear::settings() const { return model_.settings(); }

Fp8Linear::FusedInput Fp8Linear::fused_input(int64_t m, int slot, bool transposed) {
  MT_CHECK(takes_fused_input(m),
           "{}: a fused FP8 producer needs delayed scaling, one row block and a multiple of 16 rows within the "
           "planned {}; got {} rows ({} row blocks, recipe {})",
           name_, max_rows_, m, row_blocks_, fp8_recipe_name(model_.settings().recipe));
  fwd_rows_ = m;
  const bool with_t = transposed && save_input_;  // the producer writes the saved x_t too
  x_t_ready_ = with_t;
  ++fused_inputs_;
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  return {views(m).xq, with_t ? view_as(sv.x_t, model_.settings().forward_dtype(), {in_, m}) : Tensor(), x_.scale,
          model_.training() ? x_.record : Tensor()};
}

bool Fp8Linear::takes_fused_input(int64_t m) const {
  return model_.settings().recipe == Fp8Recipe::kDelayed && row_blocks_ == 1 && m % kAlign == 0 && m > 0 &&
         (variable_rows_ ? m <= pad16(max_rows_) : m == max_rows_);
}

Fp8Linear::FusedGrad Fp8Linear::fused_grad(int64_t m) {
  MT_CHECK(takes_fused_grad(m),
           "{}: a fused FP8 producer of dy needs delayed scaling and the planned {} rows (a multiple of 16); got {} "
           "rows (recipe {}{})",
           name_, max_rows_, m, fp8_recipe_name(model_.settings().recipe), variable_rows_ ? ", variable rows" : "");
  bwd_rows_ = m;
  dy_t_ready_ = dy_recorded_ = dy_fused_ = true;
  ++fused_grads_;
  const Scratch v = views(m);
  return {v.dyq, v.dyq_t, dy_.scale, dy_.record};
}

bool Fp8Linear::takes_fused_grad(int64_t m) const {
  return model_.settings().recipe == Fp8Recipe::kDelayed && !variable_rows_ && m == max_rows_ && m % kAlign == 0 &&
         m > 0;
}

void Fp8Linear::forward_fused(const Tensor& y, const Tensor& bias, const Tensor& pre_gelu, int slot,
                              const Stream& st) {
  forward_fp8_rows(y, views(fwd_rows_).xq, 0, bias, pre_gelu, slot, st);
  if (save_input_ && !x_t_ready_) end_forward_fp8(slot, st);
}

void Fp8Linear::forward_fused_add(const Tensor& out, const Tensor& bias, const Tensor& residual, int slot,
                                  const Stream& st) {
  if (residual_as_c(out, residual)) {  // forward_add's GEMM with C and the bias (delayed: per-tensor)
    const Tensor xq = views(fwd_rows_).xq;
    MT_CHECK(out.ndim() == 2 && out.size(0) == fwd_rows_ && out.size(1) == out_, "{}: out {} must be [{}, {}]", name_,
             out.str(), fwd_rows_, out_);
    fprop(out, x_t_operand(saved_.at(static_cast<size_t>(slot)), xq, Tensor()), bias, Tensor(), st, residual);
    if (save_input_ && !x_t_ready_) end_forward_fp8(slot, st);
    return;
  }
  forward_fused(out, Tensor(), Tensor(), slot, st);
  bias_dropout_add_forward(out, out, bias, residual, 0.f, DropoutKey{}, 0, st);  // p = 0: residual + (y + bias)
}

void Fp8Linear::end_forward(const Tensor& x, int slot, const Stream& st) {
  if (!save_input_ || x_t_ready_) return;
  MT_CHECK(x.ndim() == 2 && x.size(0) == fwd_rows_ && x.size(1) == in_, "{}: x {} must be [{}, {}]", name_, x.str(),
           fwd_rows_, in_);
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  quantize_x(Tensor(), Tensor(), sv.x_t, sv.x_t_s, x, sv, /*record=*/false, st);  // recorded by the blocks
  x_t_ready_ = true;
}

void Fp8Linear::forward(const Tensor& y, const Tensor& x, const Tensor& bias, const Tensor& pre_gelu, int slot,
                        const Stream& st) {
  const int64_t m = x.size(0);
  MT_CHECK(x.ndim() == 2 && y.ndim() == 2 && y.size(0) == m && y.size(1) == out_,
           "{}: FP8 forward of x {} into y {}: expected [m, {}] and [m, {}]", name_, x.str(), y.str(), in_, out_);
  const int64_t mp = pad16(m);
  const Scratch v = views(mp);
  const Tensor xin = padded_rows(x, v.pad_x, m, mp, st);
  begin_forward(xin, /*shard=*/false, slot, st);
  if (mp == m) {
    forward_rows(y, xin, 0, bias, pre_gelu, slot, st);
  } else {  // the GEMM and its bias (fprop's) into the padded scratch, its first m rows copied out, the GELU after
    forward_rows(v.pad_y, xin, 0, bias, Tensor(), slot, st);
    const Tensor out = pre_gelu.empty() ? y : pre_gelu;
    copy(out, v.pad_y.slice0(0, m), st);
    if (!pre_gelu.empty()) fp8_bias_gelu(out, Tensor(), y, st);
  }
}

void Fp8Linear::forward_add(const Tensor& out, const Tensor& x, const Tensor& bias, const Tensor& residual, int slot,
                            const Stream& st) {
  const int64_t m = x.size(0);
  if (m % kAlign == 0 && !model_.settings().blockwise() && residual_as_c(out, residual)) {
    // the residual as the GEMM's C (beta = 1, C ≠ D) and the bias in its epilogue: out = (residual +
    // x · wᵀ) + bias in one rounding, no copy or add pass over out (per-tensor recipes; with padding
    // or blocks the add stays separate)
    begin_forward(x, /*shard=*/false, slot, st);
    forward_rows_into(out, x, 0, bias, Tensor(), slot, st, residual);
    return;
  }
  forward(out, x, Tensor(), Tensor(), slot, st);
  bias_dropout_add_forward(out, out, bias, residual, 0.f, DropoutKey{}, 0, st);  // p = 0: residual + (y + bias)
}

void Fp8Linear::begin_backward(const Tensor& dy, bool shard, const Stream& st) {
  MT_CHECK(dy.ndim() == 2 && dy.size(1) == out_, "{}: FP8 backward of dy {}: expected [m, {}]", name_, dy.str(), out_);
  MT_CHECK(!shard || !variable_rows_, "{}: a sequence-parallel shard needs the fixed row count", name_);
  bwd_rows_ = shard ? max_rows_ : dy.size(0);
  MT_CHECK(bwd_rows_ <= pad16(max_rows_) && (variable_rows_ || bwd_rows_ == max_rows_) && bwd_rows_ % kAlign == 0,
           "{}: {} rows, planned for {}", name_, bwd_rows_, max_rows_);
  dy_t_ready_ = dy_recorded_ = dy_fused_ = false;
  if (model_.settings().blockwise()) return;
  if (model_.settings().recipe == Fp8Recipe::kTensorwise) {
    fp8_amax(dy_.amax, dy, st);
    reduce_max(shard ? groups_.dy_shard : groups_.dy, dy_.amax, st);
    fp8_scale_from_amax(dy_.scale, dy_.scale_inv, dy_.amax, model_.settings().grad_dtype(), /*pow2=*/false, 0.f, st);
  }
}

void Fp8Linear::dgrad_rows(const Tensor& dx, const Tensor& dy, int64_t first, const Tensor& gelu_pre,
                           const Stream& st) {
  const int64_t rows = dy.size(0);
  MT_CHECK(dy.ndim() == 2 && dy.size(1) == out_ && dx.ndim() == 2 && dx.size(0) == rows && dx.size(1) == in_ &&
               (gelu_pre.empty() || gelu_pre.shape() == dx.shape()),
           "{}: FP8 dgrad of dy {} into dx {} (gelu_pre {}): expected [m, {}] and [m, {}]", name_, dy.str(), dx.str(),
           gelu_pre.str(), out_, in_);
  const Block b = block(rows, first, bwd_rows_, /*grad=*/true);
  if (!dy_fused_) quantize_dy(b.q, b.q_s, b.q_t, b.q_t_s, dy, /*record=*/true, st);
  dy_t_ready_ = dy_t_ready_ || b.whole;
  dy_recorded_ = true;  // the caller's blocks cover every row
  const bool block_scaled = model_.settings().blockwise();
  const Fp8Operand a = block_scaled ? Fp8Operand{b.q, b.q_s, Fp8Scaling::kBlock1x128}
                                    : Fp8Operand{b.q, dy_.scale_inv, Fp8Scaling::kTensor};
  fp8_matmul(dx, a, weight_operand(true), false, false, st);
  if (!gelu_pre.empty()) gelu_backward(dx, dx, gelu_pre, st);  // dL/dpre = gelu'(pre) * dL/dx
}

void Fp8Linear::wgrad(const Tensor& dw, GradWrite dw_write, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                      int slot, const Stream& st) {
  const int64_t m = bwd_rows_;
  MT_CHECK(dy.ndim() == 2 && dy.size(0) == m && dy.size(1) == out_, "{}: dy {} must be [{}, {}]", name_, dy.str(), m,
           out_);
  MT_CHECK(!dy_fused_ || dbias.empty(), "{}: a bias gradient needs the high-precision dy (not fused_grad's)", name_);
  dy_fused_ = false;  // the backward's last phase
  const Saved& sv = saved_.at(static_cast<size_t>(slot));
  const Scratch v = views(m);
  if (!dw.empty()) {
    if (!dy_t_ready_) quantize_dy(Tensor(), Tensor(), v.dyq_t, v.dyq_t_s, dy, /*record=*/!dy_recorded_, st);
    Tensor x_t = sv.x_t, x_t_s = sv.x_t_s;
    if (!save_input_) {  // the forward kept the bf16 input: x_t again, with the forward's scale
      MT_CHECK(x.ndim() == 2 && x.size(0) == m && x.size(1) == in_, "{}: x {} must be [{}, {}]", name_, x.str(), m,
               in_);
      x_t = v.x_t;
      x_t_s = v.x_t_s;
      quantize_x(Tensor(), Tensor(), x_t, x_t_s, x, sv, /*record=*/false, st);
    }
    const Fp8Operand dy_cols = model_.settings().blockwise()
                                   ? Fp8Operand{v.dyq_t, v.dyq_t_s, Fp8Scaling::kBlock1x128}
                                   : Fp8Operand{v.dyq_t, dy_.scale_inv, Fp8Scaling::kTensor};
    fp8_matmul(dw, dy_cols, x_t_operand(sv, x_t, x_t_s), dw_write == GradWrite::kAccumulate, false, st);
  }
  if (!dbias.empty()) bias_dropout_add_backward(Tensor(), dbias, dy, 0.f, DropoutKey{}, 0, st);
}

void Fp8Linear::backward(const Grads& g, const Tensor& dy, const Tensor& x, int slot, const Stream& st) {
  const int64_t m = dy.size(0);
  const int64_t mp = pad16(m);
  const bool padded = mp != m;
  const Scratch v = views(mp);
  const Tensor dyin = padded_rows(dy, v.pad_dy, m, mp, st);
  MT_CHECK(!dy_fused_ || g.dbias.empty(), "{}: a bias gradient needs the high-precision dy (not fused_grad's)", name_);
  if (!dy_fused_) begin_backward(dyin, /*shard=*/false, st);  // else fused_grad began it
  if (!g.dx.empty()) {
    MT_CHECK(g.dx.ndim() == 2 && g.dx.size(0) == m && g.dx.size(1) == in_, "{}: dx {} must be [{}, {}]", name_,
             g.dx.str(), m, in_);
    if (padded) {
      dgrad_rows(v.pad_dx, dyin, 0, Tensor(), st);
      copy(g.dx, v.pad_dx.slice0(0, m), st);
      if (!g.gelu_pre.empty()) gelu_backward(g.dx, g.dx, g.gelu_pre, st);
    } else {
      dgrad_rows(g.dx, dyin, 0, g.gelu_pre, st);
    }
    // the producer's bias gradient: Σ_m dL/dpre
    if (!g.gelu_pre.empty() && !g.gelu_dbias.empty())
      bias_dropout_add_backward(Tensor(), g.gelu_dbias, g.dx, 0.f, DropoutKey{}, 0, st);
  }
  const Tensor xin = g.dw.empty() || save_input_ ? x : padded_rows(x, v.pad_x, m, mp, st);
  wgrad(g.dw, g.dw_write, Tensor(), dyin, xin, slot, st);
  if (!g.dbias.empty()) bias_dropout_add_backward(Tensor(), g.dbias, dy, 0.f, DropoutKey{}, 0, st);
}

}  // namespace mt
