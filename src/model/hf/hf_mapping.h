// Helpers shared by the Hugging Face mappings (hf_convert.cpp, hf_deepseek.cpp): reading
// config.json fields, reading a tensor with its shape checked, and the SwiGLU MLP / routed-expert
// layouts every supported family stores the same way (facts from transformers' modeling files).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "model/hf/hf_convert.h"
#include "model/hf/safetensors.h"

namespace mt::hf::detail {

/// The fields of one config.json, read with their errors naming the file and the field.
struct Fields {
  const nlohmann::json& j;
  std::string file;
  /// The key is present and not null.
  bool has(const char* k) const { return j.contains(k) && !j.at(k).is_null(); }
  template <typename T>
  T get(const char* k) const {
    MT_REQUIRE(has(k), "{}: field '{}' is missing", file, k);
    try {
      return j.at(k).get<T>();
    } catch (const nlohmann::json::exception&) {
      MT_FAIL("{}: field '{}' has the wrong type ({})", file, k, j.at(k).dump());
    }
  }
  template <typename T>
  T get_or(const char* k, T dflt) const {
    return has(k) ? get<T>(k) : dflt;
  }
};

/// A float field of config.json as the shortest decimal that reads back as the same float (1e-06,
/// not 9.999999974752427e-07): a float read at import is written back as it was.
nlohmann::json decimal(float v);

/// Reads an HF tensor as fp32, checking its shape against what config.json implies. Errors: the
/// tensor is missing (naming it and the directory) or has another shape (naming both).
std::vector<float> read(const SafetensorsCheckpoint& ck, const std::string& name, const std::vector<int64_t>& shape);

/// Vocabulary rows padded with zeros to `padded` rows (rows of width h).
std::vector<float> pad_rows(std::vector<float> a, int64_t padded, int64_t h);

/// "decoder.layers.<l>."
std::string layer(int64_t l);

/// A Megatron tensor by name (errors name the missing tensor), and a writer of one HF tensor.
using GetTensor = std::function<const std::vector<float>&(const std::string&)>;
using PutTensor = std::function<void(std::string, std::vector<int64_t>, std::vector<float>)>;

/// A SwiGLU MLP without biases: <hf>{gate}.weight and <hf>{up}.weight [f, h] stack into
/// <mt>linear_fc1.weight [2, f, h] (gate rows first), <hf>{down}.weight [h, f] is
/// <mt>linear_fc2.weight. `hf` and `mt` end with '.'.
struct SwigluNames {
  std::string gate = "gate_proj", up = "up_proj", down = "down_proj";
};
void swiglu_to_megatron(const SafetensorsCheckpoint& ck, const std::string& hf, const std::string& mt, int64_t f,
                        int64_t h, GlobalTensors& t, const SwigluNames& n = {});
void swiglu_to_hf(const GetTensor& get, const PutTensor& put, const std::string& mt, const std::string& hf, int64_t f,
                  int64_t h, const SwigluNames& n = {});

/// A MoE layer's router and routed experts (Mixtral, Qwen MoE, DeepSeek-V3):
///   <hub>gate.weight [E, h]                       -> <mt>router.weight
///   <hub>experts.e.{gate,up}.weight [f, h]        -> <mt>experts.local_experts.e.linear_fc1.weight [2, f, h]
///   <hub>experts.e.{down}.weight [h, f]           -> <mt>experts.local_experts.e.linear_fc2.weight
/// or transformers 5's in-memory layout under `fused` (gate.weight, experts.gate_up_proj [E, 2f, h]
/// with the gate rows first, experts.down_proj [E, h, f]), read when present. Export writes the
/// per-expert Hub names, which every transformers version loads.
void routed_experts_to_megatron(const SafetensorsCheckpoint& ck, const std::string& hub, const std::string& fused,
                                const std::string& mt, int64_t E, int64_t f, int64_t h, GlobalTensors& t,
                                const SwigluNames& n = {});
void routed_experts_to_hf(const GetTensor& get, const PutTensor& put, const std::string& mt, const std::string& hub,
                          int64_t E, int64_t f, int64_t h, const SwigluNames& n = {});

}  // namespace mt::hf::detail
