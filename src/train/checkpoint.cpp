#include "train/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

namespace mt {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string iter_dir_name(int64_t it) { return fmt::format("iter_{:07d}", it); }
const char* kTracker = "latest_checkpointed_iteration.txt";
const char* kRankFile = "rank_00000.bin";

json config_to_json(const GptConfig& c) {
  return json{{"num_layers", c.num_layers},
              {"hidden_size", c.hidden_size},
              {"num_attention_heads", c.num_attention_heads},
              {"ffn_hidden_size", c.ffn()},
              {"seq_length", c.seq_length},
              {"max_position_embeddings", c.max_positions()},
              {"vocab_size", c.vocab_size},
              {"make_vocab_size_divisible_by", c.make_vocab_size_divisible_by},
              {"padded_vocab_size", c.padded_vocab_size()},
              {"init_method_std", c.init_method_std},
              {"layernorm_epsilon", c.layernorm_epsilon},
              {"hidden_dropout", c.hidden_dropout},
              {"attention_dropout", c.attention_dropout}};
}

GptConfig config_from_json(const json& j) {
  GptConfig c;
  c.num_layers = j.at("num_layers").get<int64_t>();
  c.hidden_size = j.at("hidden_size").get<int64_t>();
  c.num_attention_heads = j.at("num_attention_heads").get<int64_t>();
  c.ffn_hidden_size = j.at("ffn_hidden_size").get<int64_t>();
  c.seq_length = j.at("seq_length").get<int64_t>();
  c.max_position_embeddings = j.at("max_position_embeddings").get<int64_t>();
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.make_vocab_size_divisible_by = j.at("make_vocab_size_divisible_by").get<int64_t>();
  c.init_method_std = j.at("init_method_std").get<float>();
  c.layernorm_epsilon = j.at("layernorm_epsilon").get<float>();
  c.hidden_dropout = j.at("hidden_dropout").get<float>();
  c.attention_dropout = j.at("attention_dropout").get<float>();
  return c;
}

json scalars_to_json(const OptimizerScalars& s) {
  return json{{"loss_scale", s.loss_scale},         {"step", s.step},
              {"growth_tracker", s.growth_tracker}, {"hysteresis_tracker", s.hysteresis_tracker},
              {"skipped_iters", s.skipped_iters},   {"grad_norm", s.grad_norm}};
}

OptimizerScalars scalars_from_json(const json& j) {
  OptimizerScalars s;
  s.loss_scale = j.at("loss_scale").get<float>();
  s.step = j.at("step").get<int32_t>();
  s.growth_tracker = j.at("growth_tracker").get<int32_t>();
  s.hysteresis_tracker = j.at("hysteresis_tracker").get<int32_t>();
  s.skipped_iters = j.at("skipped_iters").get<int32_t>();
  s.grad_norm = j.at("grad_norm").get<float>();
  s.grad_sumsq = 0.f;
  s.clip_coeff = 1.f;
  s.found_inf = 0;
  return s;
}

// Writes `text` to `path` through a temporary file and a rename.
void write_file_atomic(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    MT_REQUIRE(f.good(), "cannot write checkpoint file '{}'", tmp.string());
    f << text;
    f.flush();
    MT_REQUIRE(f.good(), "error writing checkpoint file '{}'", tmp.string());
  }
  fs::rename(tmp, path);
}

struct TensorRef {
  std::string name;
  Tensor t;  // fp32, on device
  std::vector<int64_t> global_shape;
};

std::vector<TensorRef> checkpoint_tensors(const ParamStore& params, const AdamWOptimizer* opt) {
  std::vector<TensorRef> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& info = params.info(i);
    out.push_back({"model/" + info.name, params.main(i), info.global_shape});
  }
  if (opt) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& info = params.info(i);
      out.push_back({"optim/exp_avg/" + info.name, opt->exp_avg().flat_range(info.offset, info.numel).view(info.shape),
                     info.global_shape});
      out.push_back({"optim/exp_avg_sq/" + info.name,
                     opt->exp_avg_sq().flat_range(info.offset, info.numel).view(info.shape), info.global_shape});
    }
  }
  return out;
}

}  // namespace

void save_checkpoint(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                     const AdamWOptimizer* optimizer, const Stream& stream) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MT_REQUIRE(!ec && fs::is_directory(dir), "--save directory '{}' cannot be created: {}", dir, ec.message());
  const fs::path final_dir = fs::path(dir) / iter_dir_name(state.iteration);
  const fs::path tmp_dir = fs::path(dir) / (iter_dir_name(state.iteration) + ".tmp");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  MT_REQUIRE(!ec, "cannot create checkpoint directory '{}': {}", tmp_dir.string(), ec.message());

  json tensors = json::array();
  {
    const fs::path bin = tmp_dir / kRankFile;
    std::ofstream f(bin, std::ios::binary | std::ios::trunc);
    MT_REQUIRE(f.good(), "cannot write checkpoint file '{}'", bin.string());
    std::vector<char> host;
    uint64_t offset = 0;
    for (const auto& ref : checkpoint_tensors(params, optimizer)) {
      host.resize(ref.t.nbytes());
      copy_bytes(host.data(), Device::cpu(), ref.t.data(), ref.t.device(), host.size(), stream);
      stream.synchronize();
      f.write(host.data(), static_cast<std::streamsize>(host.size()));
      std::vector<int64_t> zeros(ref.global_shape.size(), 0);
      tensors.push_back({{"name", ref.name},
                         {"dtype", "fp32"},
                         {"global_shape", ref.global_shape},
                         {"shards", json::array({json{{"rank", 0},
                                                      {"file", kRankFile},
                                                      {"offset_bytes", offset},
                                                      {"shape", ref.t.shape()},
                                                      {"global_offset", zeros}}})}});
      offset += host.size();
    }
    f.flush();
    MT_REQUIRE(f.good(), "error writing checkpoint file '{}' (disk full?)", bin.string());
  }
  json meta{{"format", "megatron.cpp-checkpoint"},
            {"version", 1},
            {"iteration", state.iteration},
            {"consumed_train_samples", state.consumed_train_samples},
            {"seed", state.seed},
            {"world_size", 1},
            {"model", config_to_json(state.model)},
            {"scalars", scalars_to_json(state.scalars)},
            {"has_optimizer", optimizer != nullptr},
            {"tensors", tensors}};
  write_file_atomic(tmp_dir / "metadata.json", meta.dump(1));
  // Replace any previous checkpoint of the same iteration only after the new one is complete.
  if (fs::exists(final_dir)) {
    const fs::path old = fs::path(dir) / (iter_dir_name(state.iteration) + ".old");
    fs::remove_all(old, ec);
    fs::rename(final_dir, old);
    fs::rename(tmp_dir, final_dir);
    fs::remove_all(old, ec);
  } else {
    fs::rename(tmp_dir, final_dir);
  }
  write_file_atomic(fs::path(dir) / kTracker, std::to_string(state.iteration) + "\n");
}

std::optional<int64_t> latest_checkpoint_iteration(const std::string& dir) {
  const fs::path tracker = fs::path(dir) / kTracker;
  if (!fs::exists(tracker)) return std::nullopt;
  std::ifstream f(tracker);
  MT_REQUIRE(f.good(), "cannot read checkpoint tracker '{}'", tracker.string());
  std::string s;
  f >> s;
  try {
    size_t pos = 0;
    int64_t it = std::stoll(s, &pos);
    MT_REQUIRE(pos == s.size() && it >= 0, "bad iteration '{}'", s);
    return it;
  } catch (const std::exception&) {
    MT_FAIL("checkpoint tracker '{}' does not hold an iteration number (read '{}')", tracker.string(), s);
  }
}

namespace {
json read_metadata(const std::string& dir, fs::path* iter_path) {
  MT_REQUIRE(fs::is_directory(dir), "--load directory '{}' does not exist", dir);
  auto it = latest_checkpoint_iteration(dir);
  MT_REQUIRE(it.has_value(), "--load directory '{}' holds no checkpoint ({} missing)", dir, kTracker);
  *iter_path = fs::path(dir) / iter_dir_name(*it);
  const fs::path meta_path = *iter_path / "metadata.json";
  std::ifstream f(meta_path);
  MT_REQUIRE(f.good(), "checkpoint metadata '{}' is missing", meta_path.string());
  json meta;
  try {
    meta = json::parse(f);
  } catch (const std::exception& e) {
    MT_FAIL("checkpoint metadata '{}' is not valid JSON: {}", meta_path.string(), e.what());
  }
  MT_REQUIRE(meta.value("format", "") == "megatron.cpp-checkpoint", "'{}' is not a megatron.cpp checkpoint",
             meta_path.string());
  return meta;
}

CheckpointState state_from_meta(const json& meta) {
  CheckpointState s;
  s.iteration = meta.at("iteration").get<int64_t>();
  s.consumed_train_samples = meta.at("consumed_train_samples").get<int64_t>();
  s.seed = meta.at("seed").get<uint64_t>();
  s.model = config_from_json(meta.at("model"));
  s.scalars = scalars_from_json(meta.at("scalars"));
  return s;
}
}  // namespace

CheckpointState read_checkpoint_state(const std::string& dir) {
  fs::path iter_path;
  try {
    return state_from_meta(read_metadata(dir, &iter_path));
  } catch (const json::exception& e) {
    MT_FAIL("checkpoint metadata in '{}' is incomplete: {}", iter_path.string(), e.what());
  }
}

CheckpointState load_checkpoint(const std::string& dir, ParamStore& params, AdamWOptimizer* optimizer,
                                const Stream& stream) {
  fs::path iter_path;
  json meta = read_metadata(dir, &iter_path);
  CheckpointState state;
  try {
    state = state_from_meta(meta);
    MT_REQUIRE(!optimizer || meta.at("has_optimizer").get<bool>(), "checkpoint '{}' has no optimizer state",
               iter_path.string());
    std::unordered_map<std::string, const json*> by_name;
    for (const auto& t : meta.at("tensors")) by_name[t.at("name").get<std::string>()] = &t;
    const fs::path bin = iter_path / kRankFile;
    std::ifstream f(bin, std::ios::binary);
    MT_REQUIRE(f.good(), "checkpoint data file '{}' is missing", bin.string());
    const uint64_t file_size = fs::file_size(bin);
    std::vector<char> host;
    for (const auto& ref : checkpoint_tensors(params, optimizer)) {
      auto it = by_name.find(ref.name);
      MT_REQUIRE(it != by_name.end(), "checkpoint '{}' has no tensor '{}'", iter_path.string(), ref.name);
      const json& t = *it->second;
      auto gshape = t.at("global_shape").get<std::vector<int64_t>>();
      MT_REQUIRE(gshape == ref.global_shape, "tensor '{}' has shape [{}] in the checkpoint but [{}] in the model",
                 ref.name, fmt::join(gshape, ", "), fmt::join(ref.global_shape, ", "));
      const json& shard = t.at("shards").at(0);
      const uint64_t off = shard.at("offset_bytes").get<uint64_t>();
      MT_REQUIRE(off + ref.t.nbytes() <= file_size, "checkpoint file '{}' is truncated ({} bytes, tensor '{}' needs "
                 "bytes [{}, {}))", bin.string(), file_size, ref.name, off, off + ref.t.nbytes());
      host.resize(ref.t.nbytes());
      f.seekg(static_cast<std::streamoff>(off));
      f.read(host.data(), static_cast<std::streamsize>(host.size()));
      MT_REQUIRE(f.good(), "error reading '{}' from '{}'", ref.name, bin.string());
      copy_bytes(ref.t.data(), ref.t.device(), host.data(), Device::cpu(), host.size(), stream);
      stream.synchronize();
    }
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("checkpoint metadata in '{}' is incomplete: {}", iter_path.string(), e.what());
  }
  params.sync_model_from_main(stream);
  if (optimizer) optimizer->write_scalars(state.scalars, stream);
  stream.synchronize();
  return state;
}

}  // namespace mt
