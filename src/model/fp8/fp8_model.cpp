#include "model/fp8/fp8_model.h"

#include <algorithm>
#include <cctype>

#include "ops/elementwise.h"
#include "ops/fp8.h"

namespace mt {

Fp8Model::Fp8Model(const TransformerConfig& config, const ProcessGroups& groups)
    : config_(config),
      settings_(config.fp8_settings()),
      tp_(groups.tp),
      cp_(groups.cp),
      tp_cp_(groups.tp_cp),
      dp_cp_(groups.dp_cp) {
  MT_REQUIRE(settings_.on(), "Fp8Model without --fp8-format");
  MT_REQUIRE(!config.fp8_param || !settings_.blockwise(),
             "--fp8-param-gather needs a per-tensor recipe (--fp8-recipe tensorwise or delayed), got blockwise: its "
             "128x128 weight blocks span the distributed optimizer's flat slices, so no rank can quantise its slice "
             "alone");
}

std::string Fp8Model::scratch_prefix(const std::string& name) const {
  const bool side = config_.moe_shared_expert_overlap && name.find(".shared_experts.") != std::string::npos;
  return side ? "fp8.shared_experts." : "fp8.";
}

int64_t Fp8Model::decoder_layer(const std::string& prefix) {
  static const std::string kHead = "decoder.layers.";
  if (prefix.compare(0, kHead.size(), kHead) != 0) return -1;
  size_t i = kHead.size();
  int64_t layer = 0;
  bool digits = false;
  for (; i < prefix.size() && std::isdigit(static_cast<unsigned char>(prefix[i])); ++i, digits = true)
    layer = layer * 10 + (prefix[i] - '0');
  return digits && (i == prefix.size() || prefix[i] == '.') ? layer : -1;
}

Fp8Model::LayerEntry& Fp8Model::entry(int64_t layer) {
  for (LayerEntry& e : layers_)
    if (e.layer == layer) return e;
  MT_CHECK(layers_.empty() || layers_.back().layer < layer,
           "fp8: layer {} registered after layer {} (layers are built in increasing order)", layer,
           layers_.back().layer);
  layers_.push_back(LayerEntry{});
  layers_.back().layer = layer;
  return layers_.back();
}

const Fp8Model::LayerEntry* Fp8Model::find(int64_t layer) const {
  for (const LayerEntry& e : layers_)
    if (e.layer == layer) return &e;
  return nullptr;
}

int64_t Fp8Model::reserve(int64_t layer, int64_t count) {
  MT_CHECK(layer_on(layer) && count >= 1, "fp8: reserve({}, {}) for a layer without FP8", layer, count);
  LayerEntry& e = entry(layer);
  const int64_t first = e.columns;
  e.columns += count;
  return first;
}

std::unique_ptr<Fp8Linear> Fp8Model::make_linear(int64_t layer, int64_t column, std::string name,
                                                 const ParamRef* weight, int64_t out, int64_t in, Fp8Groups groups,
                                                 bool dense) {
  LayerEntry& e = entry(layer);
  MT_CHECK(column >= 0 && column < e.columns, "fp8: column {} of layer {} not reserved ({} columns)", column, layer,
           e.columns);
  auto linear = std::make_unique<Fp8Linear>(*this, std::move(name), weight, out, in, groups, linear_in_params(dense));
  e.linears.push_back(linear.get());
  e.linear_column.push_back(column);
  e.gathered.push_back(0);
  return linear;
}

std::unique_ptr<Fp8Linear> Fp8Model::tp_linear(const std::string& prefix, bool row, const ParamRef* weight,
                                               int64_t out, int64_t in) {
  const int64_t layer = decoder_layer(prefix);
  if (!layer_on(layer)) return nullptr;
  return make_linear(layer, reserve(layer, 1), prefix, weight, out, in, row ? row_groups() : column_groups(),
                     /*dense=*/true);
}

Fp8Groups Fp8Model::column_groups() const {
  return Fp8Groups{cp_.get(), tp_.get(), tp_cp_.get(), /*x_shard=*/tp_cp_.get(), nullptr};
}
Fp8Groups Fp8Model::row_groups() const {
  return Fp8Groups{tp_cp_.get(), tp_.get(), cp_.get(), nullptr, /*dy_shard=*/tp_cp_.get()};
}

Fp8TensorState Fp8Model::tensor_state(const Tensor& block, int64_t column) const {
  const int64_t h = history_rows(), n = block.size(1);
  auto at = [&](int64_t row) { return block.flat_range(row * n + kStateStride * column, 1); };
  return Fp8TensorState{at(h), at(h + 1), at(h + 2), h > 0 ? at(0) : Tensor()};
}

void Fp8Model::plan(BufferPlanner& p) {
  const size_t before = p.persistent_bytes();
  const int64_t rows = state_rows();
  int64_t total = 0;
  for (const LayerEntry& e : layers_) total += rows * 3 * e.columns;
  state_ = p.persistent(DType::kF32, {std::max<int64_t>(kStateStride * total, 1)}, "fp8 scaling state");
  packed_ = p.persistent(DType::kF32, {std::max<int64_t>(total, 1)}, "fp8 scaling state (packed: checkpoints)");
  // The weights kept in their parameter storage: the amax rounding's two bytes persistent; staged
  // (stage_weight) in the linears' dyq_t scratch: blockwise, and the sharded main parameters of
  // --fp8-param-gather (the others quantise their fp32 main parameters: fp8_quantize_bf16_rounded)
  bool in_params = false;
  int64_t stage = 0;
  for (const LayerEntry& e : layers_)
    for (const Fp8Linear* l : e.linears) {
      in_params = in_params || l->in_params();
      if (l->in_params() && (settings_.blockwise() || config_.fp8_param)) stage = std::max(stage, l->out() * l->in());
    }
  weight_stage_ = bf16_temp_ = Tensor();
  act_dtype_ = p.act_dtype();
  if (stage > 0) weight_stage_ = p.scratch("fp8.dyq_t", DType::kU8, {static_cast<int64_t>(stage_bytes(stage))});
  if (in_params) bf16_temp_ = p.persistent(DType::kBF16, {8}, "fp8 amax bf16 rounding");
  int64_t off = 0;
  for (LayerEntry& e : layers_) {
    const int64_t n = e.columns, s = kStateStride;
    e.fwd = state_.flat_range(s * off, rows * s * 2 * n).view({rows, s * 2 * n});
    e.bwd = state_.flat_range(s * (off + rows * 2 * n), rows * s * n).view({rows, s * n});
    e.fwd_packed = packed_.flat_range(off, rows * 2 * n).view({rows, 2 * n});
    e.bwd_packed = packed_.flat_range(off + rows * 2 * n, rows * n).view({rows, n});
    off += rows * 3 * n;
    for (size_t j = 0; j < e.linears.size(); ++j) {
      const int64_t c = e.linear_column[j];
      e.linears[j]->bind_state(tensor_state(e.fwd, 2 * c), tensor_state(e.fwd, 2 * c + 1), tensor_state(e.bwd, c));
      e.linears[j]->plan_weights(p);
    }
  }
  if (!p.placing()) planned_bytes_ = p.persistent_bytes() - before;
}

size_t Fp8Model::stage_bytes(int64_t n) const {
  return static_cast<size_t>(n) * (act_dtype_ == DType::kBF16 ? 2 : 6);  // CPU: the bf16 values, then widened
}

Tensor Fp8Model::stage_weight(const Tensor& src, const Stream& stream) const {
  const int64_t n = src.numel();
  MT_CHECK(n >= 1 && !weight_stage_.empty() && stage_bytes(n) <= weight_stage_.nbytes(),
           "fp8: staging a weight of {} elements needs {} bytes, {} planned (staged: blockwise scaling, or sharded "
           "main parameters under --fp8-param-gather)",
           n, stage_bytes(n), weight_stage_.empty() ? 0 : weight_stage_.nbytes());
  char* base = static_cast<char*>(weight_stage_.data());
  const Device dev = weight_stage_.device();
  const Tensor x = src.view({n});
  if (act_dtype_ == DType::kBF16) {
    const Tensor stage(base, DType::kBF16, dev, {n});
    if (x.dtype() == DType::kBF16) copy(stage, x, stream);
    else cast(stage, x, stream);  // round to nearest even: the optimizer's rounding
    return stage;
  }
  const Tensor stage(base, DType::kF32, dev, {n});
  Tensor b = x;
  if (x.dtype() != DType::kBF16) {
    b = Tensor(base + 4 * n, DType::kBF16, dev, {n});
    cast(b, x, stream);
  }
  cast(stage, b, stream);  // widened: exact
  return stage;
}

void Fp8Model::round_to_bf16(const Tensor& x, const Stream& stream) const {
  MT_CHECK(x.numel() == 1 && !bf16_temp_.empty(), "fp8: round_to_bf16 of {} (planned: {})", x.str(), bf16_temp_.str());
  const Tensor b = bf16_temp_.flat_range(0, 1);
  cast(b, x.view({1}), stream);
  cast(x.view({1}), b, stream);
}

void Fp8Model::initialize(Device device) {
  stepped_ = false;
  for (LayerEntry& e : layers_) e.storage_fresh = true;
  // scale and scale_inv 1 (padding columns too: never read), amaxes and histories 0
  std::vector<float> host(static_cast<size_t>(state_.numel()), 0.f);
  const int64_t h = history_rows();
  for (const LayerEntry& e : layers_) {
    for (const Tensor& block : {e.fwd, e.bwd}) {
      const int64_t n = block.size(1);
      float* b = host.data() + (block.data_as<float>() - state_.data_as<float>());
      std::fill(b + (h + 1) * n, b + (h + 3) * n, 1.f);
    }
  }
  Stream stream(device);
  copy_bytes(state_.data(), device, host.data(), Device::cpu(), host.size() * sizeof(float), stream);
  stream.synchronize();
}

void Fp8Model::repack(bool pack, const Stream& stream) const {
  if (layers_.empty()) return;
  std::vector<float> live(static_cast<size_t>(state_.numel())), packed(static_cast<size_t>(packed_.numel()));
  const Device dev = state_.device(), host = Device::cpu();
  copy_bytes(live.data(), host, state_.data(), dev, state_.nbytes(), stream);
  copy_bytes(packed.data(), host, packed_.data(), dev, packed_.nbytes(), stream);
  stream.synchronize();
  // element i of the packed array is element kStateStride·i of the live one (blocks and rows alike)
  for (size_t i = 0; i < packed.size(); ++i) {
    float& l = live[static_cast<size_t>(kStateStride) * i];
    if (pack) packed[i] = l; else l = packed[i];
  }
  if (pack) copy_bytes(packed_.data(), dev, packed.data(), host, packed_.nbytes(), stream);
  else copy_bytes(state_.data(), dev, live.data(), host, state_.nbytes(), stream);
  stream.synchronize();  // the host vectors go out of scope
}

void Fp8Model::quantize_weights(int64_t layer, bool force, const Stream& stream) {
  for (LayerEntry& e : layers_) {
    if (e.layer != layer) continue;
    bool consumed = false;
    for (size_t j = 0; j < e.linears.size(); ++j) {
      Fp8Linear& l = *e.linears[j];
      if (weights_gathered_ && e.gathered[j]) continue;  // the FP8 all-gather filled wq and wq_t
      if (l.in_params() && !l.main_whole()) {
        // The storage is the only whole copy of the weight: bf16 until its first quantisation, which
        // every later forward (another micro-batch, an evaluation) reuses; its amax is recorded
        // whatever the forward, since the training forward after an evaluation skips it.
        if (!e.storage_fresh) {
          MT_CHECK(!stepped_,
                   "fp8: {}'s weight changed in an optimizer step, but its FP8 copy, kept in its parameter storage, "
                   "was not refilled by the FP8 parameter all-gather (--fp8-param-gather): its main parameters are "
                   "sharded, so nothing else can quantise it",
                   l.name());
          continue;
        }
        l.quantize_weight(/*record=*/true, stream);
        consumed = true;
      } else if (force || !e.weights_ready) {
        l.quantize_weight(training_, stream);
      }
    }
    if (consumed) e.storage_fresh = false;
    e.weights_ready = true;
  }
}

std::vector<Fp8Linear*> Fp8Model::linears() const {
  std::vector<Fp8Linear*> out;
  for (const LayerEntry& e : layers_) out.insert(out.end(), e.linears.begin(), e.linears.end());
  return out;
}

std::vector<std::string> Fp8Model::weight_names() const {
  std::vector<std::string> out;
  for (const Fp8Linear* l : linears()) out.push_back(l->name() + ".weight");
  return out;
}

void Fp8Model::reduce_weight_amaxes(const Tensor& amaxes, const Stream& stream) {
  for (const std::shared_ptr<Communicator>& g : {tp_, dp_cp_})
    if (g && g->size() > 1) g->all_reduce(amaxes, ReduceOp::kMax, stream);
}

void Fp8Model::set_param_gather(const std::vector<Fp8Linear*>& linears) {
  MT_CHECK(!settings_.blockwise(), "fp8: --fp8-param-gather with blockwise scaling");
  for (LayerEntry& e : layers_)
    for (size_t j = 0; j < e.linears.size(); ++j)
      e.gathered[j] = std::find(linears.begin(), linears.end(), e.linears[j]) != linears.end();
}

void Fp8Model::invalidate_weights() {
  for (LayerEntry& e : layers_) e.weights_ready = false;
}

void Fp8Model::finish_step(const Stream& stream) {
  stepped_ = true;  // the optimizer step follows
  if (!settings_.delayed() || layers_.empty()) return;
  // The records (history row 0) of every tensor: MAX over the stage's ranks. The other rows are
  // the same on every rank of the stage already, so the whole buffer is reduced in one call each.
  for (const std::shared_ptr<Communicator>& g : {tp_, dp_cp_})
    if (g && g->size() > 1) g->all_reduce(state_, ReduceOp::kMax, stream);
  const int64_t h = history_rows();
  for (const LayerEntry& e : layers_) {
    for (const auto& [block, dtype] : {std::pair{e.fwd, settings_.forward_dtype()}, {e.bwd, settings_.grad_dtype()}}) {
      const int64_t n = block.size(1);
      fp8_delayed_scale_update(block.slice0(0, h), block.slice0(h + 1, h + 2).view({n}),
                               block.slice0(h + 2, h + 3).view({n}), dtype, settings_.margin,
                               settings_.amax_compute_algo, stream);
    }
  }
}

std::vector<std::pair<std::string, Tensor>> Fp8Model::persistent_state(const Stream& stream) const {
  std::vector<std::pair<std::string, Tensor>> out;
  if (!settings_.delayed()) return out;
  repack(/*pack=*/true, stream);
  for (const LayerEntry& e : layers_) {
    out.emplace_back(fmt::format("decoder.layers.{}.fp8_meta.scaling_fwd", e.layer), e.fwd_packed);
    out.emplace_back(fmt::format("decoder.layers.{}.fp8_meta.scaling_bwd", e.layer), e.bwd_packed);
  }
  return out;
}

void Fp8Model::load_state(const Stream& stream) {
  weights_gathered_ = false;  // the loaded parameters: quantised by their next forward
  stepped_ = false;
  for (LayerEntry& e : layers_) e.storage_fresh = true;  // set_main_from_full wrote every bf16 weight
  if (settings_.delayed()) repack(/*pack=*/false, stream);
}

std::pair<Tensor, Tensor> Fp8Model::layer_state(int64_t layer, const Stream& stream) const {
  const LayerEntry* e = find(layer);
  if (!e) return {Tensor(), Tensor()};
  repack(/*pack=*/true, stream);
  return {e->fwd_packed, e->bwd_packed};
}

}  // namespace mt
