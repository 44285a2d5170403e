#include "train/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

namespace mt {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string iter_dir_name(int64_t it) { return fmt::format("iter_{:07d}", it); }
const char* kTracker = "latest_checkpointed_iteration.txt";

json moe_config_to_json(const TransformerConfig& c) {
  std::vector<int> pattern;
  for (int64_t l = 0; l < c.num_layers; ++l) pattern.push_back(c.is_moe_layer(l) ? 1 : 0);
  return json{{"num_experts", c.num_moe_experts},
              {"moe_layer_pattern", pattern},
              {"moe_ffn_hidden_size", c.moe_ffn()},
              {"moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size},
              {"moe_router_topk", c.moe_router_topk},
              {"moe_router_score_function",
               c.moe_router_score_function == MoeScoreFunction::kSigmoid ? "sigmoid" : "softmax"},
              {"moe_router_pre_softmax", c.moe_router_pre_softmax},
              {"moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor},
              {"moe_router_num_groups", c.moe_router_num_groups},
              {"moe_router_group_topk", c.moe_router_group_topk},
              {"moe_router_load_balancing_type",
               c.moe_router_load_balancing_type == MoeLoadBalancing::kAuxLoss ? "aux_loss" : "none"},
              {"moe_aux_loss_coeff", c.moe_aux_loss_coeff},
              {"moe_z_loss_coeff", c.moe_z_loss_coeff}};
}

void moe_config_from_json(const json& j, TransformerConfig& c) {
  c.num_moe_experts = j.at("num_experts").get<int64_t>();
  c.moe_layer_pattern.clear();
  for (int v : j.at("moe_layer_pattern").get<std::vector<int>>()) c.moe_layer_pattern.push_back(v ? 1 : 0);
  c.moe_ffn_hidden_size = j.at("moe_ffn_hidden_size").get<int64_t>();
  c.moe_shared_expert_intermediate_size = j.value("moe_shared_expert_intermediate_size", int64_t{0});
  c.moe_router_topk = j.at("moe_router_topk").get<int64_t>();
  c.moe_router_score_function = parse_moe_score_function(j.value("moe_router_score_function", std::string("softmax")));
  c.moe_router_pre_softmax = j.value("moe_router_pre_softmax", false);
  c.moe_router_topk_scaling_factor = j.value("moe_router_topk_scaling_factor", 1.f);
  c.moe_router_num_groups = j.value("moe_router_num_groups", int64_t{0});
  c.moe_router_group_topk = j.value("moe_router_group_topk", int64_t{0});
  c.moe_router_load_balancing_type =
      parse_moe_load_balancing(j.value("moe_router_load_balancing_type", std::string("aux_loss")));
  c.moe_aux_loss_coeff = j.value("moe_aux_loss_coeff", 0.f);
  c.moe_z_loss_coeff = j.value("moe_z_loss_coeff", 0.f);
}

json config_to_json(const TransformerConfig& c) {
  json j = json{{"num_layers", c.num_layers},
              {"hidden_size", c.hidden_size},
              {"num_attention_heads", c.num_attention_heads},
              {"num_query_groups", c.query_groups()},
              {"kv_channels", c.head_dim()},
              {"ffn_hidden_size", c.ffn()},
              {"seq_length", c.seq_length},
              {"max_position_embeddings", c.max_positions()},
              {"vocab_size", c.vocab_size},
              {"make_vocab_size_divisible_by", c.make_vocab_size_divisible_by},
              {"padded_vocab_size", c.padded_vocab_size()},
              {"normalization", normalization_name(c.normalization)},
              {"norm_epsilon", c.norm_epsilon},
              {"swiglu", c.gated_linear_unit},
              {"position_embedding_type", position_embedding_type_name(c.position_embedding_type)},
              {"rotary_base", c.rotary_base},
              {"rotary_percent", c.rotary_percent},
              {"rotary_interleaved", c.rotary_interleaved},
              {"add_bias_linear", c.add_bias_linear},
              {"add_qkv_bias", c.add_qkv_bias},
              {"qk_layernorm", c.qk_layernorm},
              {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights},
              {"init_method_std", c.init_method_std},
              {"hidden_dropout", c.hidden_dropout},
              {"attention_dropout", c.attention_dropout}};
  if (c.num_moe_experts > 0) j["moe"] = moe_config_to_json(c);
  return j;
}

// Fields added after the first checkpoint version default to the GPT-2 architecture.
TransformerConfig config_from_json(const json& j) {
  TransformerConfig c;
  c.num_layers = j.at("num_layers").get<int64_t>();
  c.hidden_size = j.at("hidden_size").get<int64_t>();
  c.num_attention_heads = j.at("num_attention_heads").get<int64_t>();
  c.num_query_groups = j.value("num_query_groups", int64_t{0});
  c.kv_channels = j.value("kv_channels", int64_t{0});
  c.ffn_hidden_size = j.at("ffn_hidden_size").get<int64_t>();
  c.seq_length = j.at("seq_length").get<int64_t>();
  c.max_position_embeddings = j.at("max_position_embeddings").get<int64_t>();
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.make_vocab_size_divisible_by = j.at("make_vocab_size_divisible_by").get<int64_t>();
  c.normalization = parse_normalization(j.value("normalization", std::string("LayerNorm")));
  c.norm_epsilon = j.contains("norm_epsilon") ? j.at("norm_epsilon").get<float>() : j.at("layernorm_epsilon").get<float>();
  c.gated_linear_unit = j.value("swiglu", false);
  c.position_embedding_type =
      parse_position_embedding_type(j.value("position_embedding_type", std::string("learned_absolute")));
  c.rotary_base = j.value("rotary_base", 10000.f);
  c.rotary_percent = j.value("rotary_percent", 1.f);
  c.rotary_interleaved = j.value("rotary_interleaved", false);
  c.add_bias_linear = j.value("add_bias_linear", true);
  c.add_qkv_bias = j.value("add_qkv_bias", false);
  c.qk_layernorm = j.value("qk_layernorm", false);
  c.untie_embeddings_and_output_weights = j.value("untie_embeddings_and_output_weights", false);
  c.init_method_std = j.at("init_method_std").get<float>();
  c.hidden_dropout = j.at("hidden_dropout").get<float>();
  c.attention_dropout = j.at("attention_dropout").get<float>();
  if (j.contains("moe")) moe_config_from_json(j.at("moe"), c);
  return c;
}

json scalars_to_json(const OptimizerScalars& s) {
  return json{{"loss_scale", s.loss_scale},         {"step", s.step},
              {"growth_tracker", s.growth_tracker}, {"hysteresis_tracker", s.hysteresis_tracker},
              {"skipped_iters", s.skipped_iters},   {"grad_norm", std::isfinite(s.grad_norm) ? s.grad_norm : -1.f}};
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
  ShardBox box;  // where t sits in the global tensor
  int64_t vocab_rows = 0;  // ParamSpec::vocab_rows: rows >= it are padding (not stored)
};

/// What a checkpoint stores of a parameter: its global shape and this shard's box without the
/// vocabulary padding (ParamSpec::vocab_rows), and the number of leading local elements that
/// box covers (its rows are a prefix of the shard's rows).
struct StoredBox {
  std::vector<int64_t> global_shape, offset, shape;
  int64_t numel = 0;
};
StoredBox stored_box(const std::vector<int64_t>& global_shape, const ShardBox& box, int64_t vocab_rows) {
  StoredBox s;
  s.global_shape = global_shape;
  for (int d = 0; d < box.ndim; ++d) {
    s.offset.push_back(box.offset[d]);
    s.shape.push_back(box.shape[d]);
  }
  if (vocab_rows > 0 && !s.shape.empty()) {
    s.global_shape[0] = vocab_rows;
    s.shape[0] = std::clamp<int64_t>(vocab_rows - s.offset[0], 0, s.shape[0]);
  }
  s.numel = 1;
  for (int64_t d : s.shape) s.numel *= d;
  return s;
}

// Full-length fp32 state for a checkpoint: main parameters and AdamW moments, as views of the
// live buffers where they are whole, or as temporary device buffers holding the gathered shards
// (distributed optimizer) at save time / the values to scatter at load time.
struct FullState {
  Buffer main_buf, m_buf, v_buf;
  Tensor main, m, v;  // fp32 [total]; m, v empty without an optimizer
};

Tensor temp_full(Buffer& buf, const ParamStore& params) {
  buf = Buffer(params.device(), static_cast<size_t>(params.total_elements()) * 4);
  return buf.as(DType::kF32, {params.total_elements()});
}

// Views of the live buffers, or zeroed temporaries where the state is sharded.
FullState full_state(const ParamStore& params, const AdamWOptimizer* opt, const Stream& stream) {
  FullState f;
  if (params.main_sharded()) {
    f.main = temp_full(f.main_buf, params);
    memset_tensor(f.main, 0, stream);
  } else {
    f.main = params.main_flat();
  }
  if (!opt) return f;
  if (!opt->distributed()) {  // one owned range [0, total): state index == flat index
    f.m = opt->exp_avg();
    f.v = opt->exp_avg_sq();
    return f;
  }
  f.m = temp_full(f.m_buf, params);
  f.v = temp_full(f.v_buf, params);
  memset_tensor(f.m, 0, stream);
  memset_tensor(f.v, 0, stream);
  return f;
}

// Checkpoint tensors in file order. writing: parameters flagged shared_embedding_copy are left
// out (the original on another pipeline stage is saved under the same name); when loading they
// are filled from that tensor.
std::vector<TensorRef> checkpoint_tensors(const ParamStore& params, const FullState& st, bool with_optimizer,
                                          bool writing) {
  std::vector<TensorRef> out;
  auto view = [&](const Tensor& full, const ParamInfo& info) {
    return full.flat_range(info.offset, info.numel).view(info.shape);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& info = params.info(i);
    if (writing && info.shared_embedding_copy) continue;
    out.push_back({"model/" + info.name, view(st.main, info), info.global_shape, info.box, info.vocab_rows});
  }
  if (with_optimizer) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& info = params.info(i);
      if (writing && info.shared_embedding_copy) continue;
      out.push_back({"optim/exp_avg/" + info.name, view(st.m, info), info.global_shape, info.box, info.vocab_rows});
      out.push_back({"optim/exp_avg_sq/" + info.name, view(st.v, info), info.global_shape, info.box, info.vocab_rows});
    }
  }
  return out;
}

}  // namespace

namespace {
std::string rank_file(int tp_rank) { return fmt::format("rank_{:05d}.bin", tp_rank); }

// Shard entries of one TP rank's file, in write order, with byte offsets.
struct ShardEntry {
  std::string name;
  std::vector<int64_t> global_shape, shape, global_offset;
  uint64_t offset_bytes;
};
std::vector<ShardEntry> shard_entries(const std::vector<ParamSpec>& specs, bool with_optimizer) {
  // Same order as checkpoint_tensors(writing): every model tensor, then per parameter its two
  // moments, shared_embedding_copy parameters left out.
  std::vector<ShardEntry> out;
  uint64_t off = 0;
  auto add = [&](const std::string& prefix, const ParamSpec& sp) {
    const std::vector<int64_t> gshape = sp.global_shape.empty() ? sp.shape : sp.global_shape;
    const StoredBox b = stored_box(
        gshape, ShardBox::make(gshape, sp.shard_offset, sp.shard_shape.empty() ? sp.shape : sp.shard_shape),
        sp.vocab_rows);
    if (b.numel == 0) return;  // a shard made only of vocabulary padding
    out.push_back({prefix + sp.name, b.global_shape, b.shape, b.offset, off});
    off += static_cast<uint64_t>(b.numel) * 4;
  };
  for (const auto& sp : specs)
    if (!sp.shared_embedding_copy) add("model/", sp);
  if (with_optimizer) {
    for (const auto& sp : specs) {
      if (sp.shared_embedding_copy) continue;
      add("optim/exp_avg/", sp);
      add("optim/exp_avg_sq/", sp);
    }
  }
  return out;
}
}  // namespace

void save_checkpoint(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                     const AdamWOptimizer* optimizer, const CheckpointWriter& w, const Stream& stream) {
  const bool rank0 = w.world->rank() == 0;
  const fs::path final_dir = fs::path(dir) / iter_dir_name(state.iteration);
  const fs::path tmp_dir = fs::path(dir) / (iter_dir_name(state.iteration) + ".tmp");
  std::error_code ec;
  if (rank0) {
    fs::create_directories(dir, ec);
    MT_REQUIRE(!ec && fs::is_directory(dir), "--save directory '{}' cannot be created: {}", dir, ec.message());
    fs::remove_all(tmp_dir, ec);
    fs::create_directories(tmp_dir, ec);
    MT_REQUIRE(!ec, "cannot create checkpoint directory '{}': {}", tmp_dir.string(), ec.message());
  }
  w.world->barrier();
  // Whole fp32 main parameters and moments; sharded ones are all-gathered (all DP ranks take part).
  if (optimizer) optimizer->grad_sync().finish_param_sync(stream);
  FullState full = full_state(params, optimizer, stream);
  if (params.main_sharded()) {
    MT_REQUIRE(optimizer != nullptr, "save_checkpoint: the main parameters are sharded, the optimizer is needed");
    optimizer->gather_main(full.main, stream);
  }
  if (optimizer && optimizer->distributed()) optimizer->gather_moments(full.m, full.v, stream);
  if (w.dp_rank == 0) {  // data-parallel replicas hold identical state; one of them writes
    const fs::path bin = tmp_dir / rank_file(w.pp_rank * w.tp + w.tp_rank);
    std::ofstream f(bin, std::ios::binary | std::ios::trunc);
    MT_REQUIRE(f.good(), "cannot write checkpoint file '{}'", bin.string());
    std::vector<char> host;
    for (const auto& ref : checkpoint_tensors(params, full, optimizer != nullptr, /*writing=*/true)) {
      // Only the rows that are not vocabulary padding (a prefix of the shard).
      host.resize(static_cast<size_t>(stored_box(ref.global_shape, ref.box, ref.vocab_rows).numel) * 4);
      copy_bytes(host.data(), Device::cpu(), ref.t.data(), ref.t.device(), host.size(), stream);
      stream.synchronize();
      f.write(host.data(), static_cast<std::streamsize>(host.size()));
    }
    f.flush();
    MT_REQUIRE(f.good(), "error writing checkpoint file '{}' (disk full?)", bin.string());
  }
  w.world->barrier();
  if (rank0) {
    std::map<std::string, json> by_name;
    std::vector<std::string> order;
    for (int r = 0; r < w.tp * w.pp; ++r) {
      for (const auto& e : shard_entries(w.specs_of(r % w.tp, r / w.tp), optimizer != nullptr)) {
        auto [it, fresh] = by_name.try_emplace(e.name);
        if (fresh) {
          order.push_back(e.name);
          it->second = {{"name", e.name}, {"dtype", "fp32"}, {"global_shape", e.global_shape}, {"shards", json::array()}};
        }
        // A replicated tensor is stored by every TP rank; keep the copy of TP rank 0.
        if (!fresh && e.shape == e.global_shape) continue;
        it->second["shards"].push_back({{"rank", r},
                                        {"file", rank_file(r)},
                                        {"offset_bytes", e.offset_bytes},
                                        {"shape", e.shape},
                                        {"global_offset", e.global_offset}});
      }
    }
    json tensors = json::array();
    for (const auto& n : order) tensors.push_back(by_name[n]);
    json meta{{"format", "megatron.cpp-checkpoint"},
              {"version", 1},
              {"iteration", state.iteration},
              {"consumed_train_samples", state.consumed_train_samples},
              {"seed", state.seed},
              {"tensor_model_parallel_size", w.tp},
              {"pipeline_model_parallel_size", w.pp},
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
  w.world->barrier();
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
  s.has_optimizer = meta.value("has_optimizer", true);
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
  FullState full;
  json meta = read_metadata(dir, &iter_path);
  CheckpointState state;
  try {
    state = state_from_meta(meta);
    MT_REQUIRE(!optimizer || meta.at("has_optimizer").get<bool>(),
               "checkpoint '{}' has no optimizer state (e.g. written by import-hf): load its weights with --finetune "
               "or --no-load-optim",
               iter_path.string());
    std::unordered_map<std::string, const json*> by_name;
    for (const auto& t : meta.at("tensors")) by_name[t.at("name").get<std::string>()] = &t;
    std::map<std::string, std::ifstream> files;
    std::vector<float> host;
    if (optimizer) optimizer->grad_sync().finish_param_sync(stream);  // nothing may still write the parameters
    full = full_state(params, optimizer, stream);
    if (!params.main_sharded()) memset_tensor(full.main, 0, stream);  // padding (the loop fills the rest)
    if (optimizer && !optimizer->distributed()) {
      memset_tensor(full.m, 0, stream);
      memset_tensor(full.v, 0, stream);
    }
    for (const auto& ref : checkpoint_tensors(params, full, optimizer != nullptr, /*writing=*/false)) {
      auto it = by_name.find(ref.name);
      MT_REQUIRE(it != by_name.end(), "checkpoint '{}' has no tensor '{}'", iter_path.string(), ref.name);
      const json& t = *it->second;
      auto gshape = t.at("global_shape").get<std::vector<int64_t>>();
      const StoredBox want = stored_box(ref.global_shape, ref.box, ref.vocab_rows);
      // A vocabulary tensor may have been stored with more rows (older checkpoints stored the
      // padding): its first vocab_rows rows are the real ones.
      const bool same = gshape == want.global_shape ||
                        (ref.vocab_rows > 0 && gshape.size() == want.global_shape.size() &&
                         gshape[0] >= want.global_shape[0] &&
                         std::equal(gshape.begin() + 1, gshape.end(), want.global_shape.begin() + 1));
      MT_REQUIRE(same, "tensor '{}' has shape [{}] in the checkpoint but [{}] in the model", ref.name,
                 fmt::join(gshape, ", "), fmt::join(want.global_shape, ", "));
      // This rank's box and each saved shard's box in global coordinates; their intersection is
      // copied run by run along the last dimension.
      const ShardBox& mine = ref.box;
      const int nd = mine.ndim;
      host.assign(static_cast<size_t>(ref.t.numel()), 0.f);
      int64_t filled = 0;
      for (const auto& shard : t.at("shards")) {
        const auto sshape = shard.at("shape").get<std::vector<int64_t>>();
        const auto soff = shard.at("global_offset").get<std::vector<int64_t>>();
        MT_REQUIRE(static_cast<int>(sshape.size()) == nd && static_cast<int>(soff.size()) == nd,
                   "checkpoint '{}': a shard of tensor '{}' has rank {} (offset rank {}) but the tensor has rank {}",
                   iter_path.string(), ref.name, sshape.size(), soff.size(), nd);
        std::vector<int64_t> lo(nd), hi(nd);
        bool empty = nd == 0;
        for (int d = 0; d < nd; ++d) {
          lo[d] = std::max(mine.offset[d], soff[d]);
          hi[d] = std::min(mine.offset[d] + mine.shape[d], soff[d] + sshape[d]);
          if (d == 0 && ref.vocab_rows > 0) hi[d] = std::min(hi[d], ref.vocab_rows);  // padding stays 0
          empty |= lo[d] >= hi[d];
        }
        if (empty) continue;
        const std::string file = shard.at("file").get<std::string>();
        auto& f = files[file];
        if (!f.is_open()) {
          f.open(iter_path / file, std::ios::binary);
          MT_REQUIRE(f.good(), "checkpoint data file '{}' is missing", (iter_path / file).string());
        }
        const uint64_t base = shard.at("offset_bytes").get<uint64_t>();
        const int64_t run = hi[nd - 1] - lo[nd - 1];
        std::vector<int64_t> idx(lo);  // global index of the run's first element
        while (true) {
          int64_t src = 0, dst = 0;
          for (int d = 0; d < nd; ++d) {
            src = src * sshape[d] + (idx[d] - soff[d]);
            dst = dst * mine.shape[d] + (idx[d] - mine.offset[d]);
          }
          const uint64_t off = base + static_cast<uint64_t>(src) * 4;
          f.seekg(static_cast<std::streamoff>(off));
          f.read(reinterpret_cast<char*>(host.data() + dst), static_cast<std::streamsize>(run * 4));
          MT_REQUIRE(f.good(), "checkpoint file '{}' is truncated: tensor '{}' needs bytes at {}",
                     (iter_path / file).string(), ref.name, off);
          filled += run;
          int d = nd - 2;  // next run: odometer over the leading dimensions
          for (; d >= 0; --d) {
            if (++idx[d] < hi[d]) break;
            idx[d] = lo[d];
          }
          if (d < 0) break;
        }
      }
      MT_REQUIRE(filled == want.numel, "checkpoint '{}' does not cover tensor '{}' (got {} of {} elements)",
                 iter_path.string(), ref.name, filled, want.numel);
      copy_bytes(ref.t.data(), ref.t.device(), host.data(), Device::cpu(), host.size() * 4, stream);
      stream.synchronize();
    }
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("checkpoint metadata in '{}' is incomplete: {}", iter_path.string(), e.what());
  }
  if (params.main_sharded()) {
    params.set_main_from_full(full.main, stream);  // model parameters whole, main copy the owned elements
  } else {
    params.sync_model_from_main(stream);
  }
  if (optimizer && optimizer->distributed()) optimizer->scatter_moments(full.m, full.v, stream);
  if (optimizer) optimizer->write_scalars(state.scalars, stream);
  stream.synchronize();
  return state;
}

}  // namespace mt
