#include "model/hf/hf_mapping.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace mt::hf::detail {

nlohmann::json decimal(float v) { return std::stod(fmt::format("{}", v)); }

std::vector<float> read(const SafetensorsCheckpoint& ck, const std::string& name, const std::vector<int64_t>& shape) {
  MT_REQUIRE(ck.has(name), "Hugging Face checkpoint '{}' has no tensor '{}'", ck.dir(), name);
  const SafetensorsTensorInfo info = ck.info(name);
  MT_REQUIRE(info.shape == shape, "tensor '{}' in '{}' has shape [{}] but config.json implies [{}]", name, ck.dir(),
             fmt::join(info.shape, ", "), fmt::join(shape, ", "));
  return ck.read_f32(name);
}

std::vector<float> pad_rows(std::vector<float> a, int64_t padded, int64_t h) {
  a.resize(static_cast<size_t>(padded * h), 0.f);
  return a;
}

std::string layer(int64_t l) { return fmt::format("decoder.layers.{}.", l); }

void swiglu_to_megatron(const SafetensorsCheckpoint& ck, const std::string& hf, const std::string& mt, int64_t f,
                        int64_t h, GlobalTensors& t, const SwigluNames& n) {
  std::vector<float> fc1 = read(ck, hf + n.gate + ".weight", {f, h});
  const std::vector<float> up = read(ck, hf + n.up + ".weight", {f, h});
  fc1.insert(fc1.end(), up.begin(), up.end());  // [gate; up] = [2, f, h]
  t[mt + "linear_fc1.weight"] = std::move(fc1);
  t[mt + "linear_fc2.weight"] = read(ck, hf + n.down + ".weight", {h, f});
}

void swiglu_to_hf(const GetTensor& get, const PutTensor& put, const std::string& mt, const std::string& hf, int64_t f,
                  int64_t h, const SwigluNames& n) {
  const auto& fc1 = get(mt + "linear_fc1.weight");
  put(hf + n.gate + ".weight", {f, h}, std::vector<float>(fc1.begin(), fc1.begin() + f * h));
  put(hf + n.up + ".weight", {f, h}, std::vector<float>(fc1.begin() + f * h, fc1.end()));
  put(hf + n.down + ".weight", {h, f}, get(mt + "linear_fc2.weight"));
}

void routed_experts_to_megatron(const SafetensorsCheckpoint& ck, const std::string& hub, const std::string& fused,
                                const std::string& mt, int64_t E, int64_t f, int64_t h, GlobalTensors& t,
                                const SwigluNames& n) {
  auto expert = [&](int64_t e) { return fmt::format("{}experts.local_experts.{}.", mt, e); };
  if (ck.has(fused + "experts.gate_up_proj")) {
    t[mt + "router.weight"] = read(ck, fused + "gate.weight", {E, h});
    const std::vector<float> gu = read(ck, fused + "experts.gate_up_proj", {E, 2 * f, h});
    const std::vector<float> dn = read(ck, fused + "experts.down_proj", {E, h, f});
    for (int64_t e = 0; e < E; ++e) {
      t[expert(e) + "linear_fc1.weight"].assign(gu.begin() + e * 2 * f * h, gu.begin() + (e + 1) * 2 * f * h);
      t[expert(e) + "linear_fc2.weight"].assign(dn.begin() + e * h * f, dn.begin() + (e + 1) * h * f);
    }
    return;
  }
  t[mt + "router.weight"] = read(ck, hub + "gate.weight", {E, h});
  for (int64_t e = 0; e < E; ++e) swiglu_to_megatron(ck, fmt::format("{}experts.{}.", hub, e), expert(e), f, h, t, n);
}

void routed_experts_to_hf(const GetTensor& get, const PutTensor& put, const std::string& mt, const std::string& hub,
                          int64_t E, int64_t f, int64_t h, const SwigluNames& n) {
  put(hub + "gate.weight", {E, h}, get(mt + "router.weight"));
  for (int64_t e = 0; e < E; ++e)
    swiglu_to_hf(get, put, fmt::format("{}experts.local_experts.{}.", mt, e), fmt::format("{}experts.{}.", hub, e), f,
                 h, n);
}

}  // namespace mt::hf::detail
