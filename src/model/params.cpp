#include "model/params.h"

#include "core/rng.h"
#include "ops/elementwise.h"

namespace mt {

ParamStore::ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, int64_t pad_multiple)
    : model_dtype_(model_dtype), device_(device) {
  MT_CHECK(model_dtype == DType::kF32 || model_dtype == DType::kBF16 || model_dtype == DType::kF16,
           "parameter dtype must be fp32, bf16 or fp16, got {}", dtype_name(model_dtype));
  int64_t off = 0;
  for (auto& s : specs) {
    ParamInfo info;
    static_cast<ParamSpec&>(info) = std::move(s);
    if (info.global_shape.empty()) info.global_shape = info.shape;
    if (info.shard.global_cols == 0) {  // unsharded: columns of the global tensor as a 2-D matrix
      const int64_t rows = info.global_shape.size() >= 2 ? info.global_shape[0] : 1;
      int64_t gnumel = 1;
      for (auto d : info.global_shape) gnumel *= d;
      info.shard.global_cols = rows > 0 ? gnumel / rows : 0;
    }
    info.numel = 1;
    for (auto d : info.shape) info.numel *= d;
    info.offset = off;
    off += (info.numel + kAlign - 1) / kAlign * kAlign;
    MT_CHECK(by_name_.emplace(info.name, infos_.size()).second, "duplicate parameter name {}", info.name);
    infos_.push_back(std::move(info));
  }
  const int64_t q = kAlign * std::max<int64_t>(pad_multiple, 1);
  total_ = (off + q - 1) / q * q;
  main_ = Buffer(device, static_cast<size_t>(total_) * 4);
  if (model_dtype != DType::kF32) params_ = Buffer(device, static_cast<size_t>(total_) * dtype_size(model_dtype));
  grads_ = Buffer(device, static_cast<size_t>(total_) * 4);
}

size_t ParamStore::index(const std::string& name) const {
  auto it = by_name_.find(name);
  MT_REQUIRE(it != by_name_.end(), "no parameter named '{}'", name);
  return it->second;
}

Tensor ParamStore::param(size_t i) const {
  if (!has_separate_main()) return main(i);
  const auto& p = infos_.at(i);
  char* base = static_cast<char*>(params_.data()) + p.offset * static_cast<int64_t>(dtype_size(model_dtype_));
  return Tensor(base, model_dtype_, device_, p.shape);
}

Tensor ParamStore::main(size_t i) const {
  const auto& p = infos_.at(i);
  return Tensor(static_cast<float*>(main_.data()) + p.offset, DType::kF32, device_, p.shape);
}

Tensor ParamStore::grad(size_t i) const {
  const auto& p = infos_.at(i);
  return Tensor(static_cast<float*>(grads_.data()) + p.offset, DType::kF32, device_, p.shape);
}

Tensor ParamStore::params_flat() const {
  if (!has_separate_main()) return main_flat();
  return Tensor(params_.data(), model_dtype_, device_, {total_});
}
Tensor ParamStore::main_flat() const { return Tensor(main_.data(), DType::kF32, device_, {total_}); }
Tensor ParamStore::grads_flat() const { return Tensor(grads_.data(), DType::kF32, device_, {total_}); }

int64_t ParamStore::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : infos_) n += p.numel;
  return n;
}

void ParamStore::initialize(uint64_t seed, const Stream& stream) {
  fill(main_flat(), 0.f, stream);  // alignment padding stays zero
  for (size_t i = 0; i < infos_.size(); ++i) {
    const auto& p = infos_[i];
    Tensor m = main(i);
    switch (p.init) {
      case InitKind::kZeros: fill(m, 0.f, stream); break;
      case InitKind::kOnes: fill(m, 1.f, stream); break;
      case InitKind::kNormal: init_normal(m, p.init_std, seed, tensor_stream_id(p.name), p.shard, stream); break;
    }
  }
  sync_model_from_main(stream);
  zero_grads(stream);
}

void ParamStore::sync_model_from_main(const Stream& stream) {
  if (has_separate_main()) cast(params_flat(), main_flat(), stream);
}

void ParamStore::zero_grads(const Stream& stream) { memset_tensor(grads_flat(), 0, stream); }

}  // namespace mt
