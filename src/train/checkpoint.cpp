#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>
#include <unordered_map>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "comm/launcher.h"
#include "core/crc32c.h"
#include "core/logging.h"

namespace mt {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string iter_dir_name(int64_t it) { return fmt::format("iter_{:07d}", it); }
const char* kTracker = "latest_checkpointed_iteration.txt";

json moe_config_to_json(const TransformerConfig& c) {
  std::vector<std::string> lb_types;
  for (MoeLoadBalancing t : c.moe_router_load_balancing_type) lb_types.push_back(moe_load_balancing_name(t));
  std::vector<int> pattern;
  for (int64_t l = 0; l < c.num_layers; ++l) pattern.push_back(c.is_moe_layer(l) ? 1 : 0);
  return json{{"num_experts", c.num_moe_experts},
              {"moe_layer_pattern", pattern},
              {"moe_ffn_hidden_size", c.moe_ffn()},
              {"moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size},
              {"moe_shared_expert_gate", c.moe_shared_expert_gate},
              {"moe_router_topk", c.moe_router_topk},
              {"moe_router_score_function", moe_score_function_name(c.moe_router_score_function)},
              {"moe_router_pre_softmax", c.moe_router_pre_softmax},
              {"moe_router_topk_scaling_factor", c.moe_router_topk_scaling_factor},
              {"moe_router_num_groups", c.moe_router_num_groups},
              {"moe_router_group_topk", c.moe_router_group_topk},
              {"moe_router_dtype", std::string(dtype_name(c.moe_router_dtype))},
              {"moe_router_load_balancing_type", lb_types},
              {"moe_aux_loss_coeff", c.moe_aux_loss_coeff},
              {"moe_z_loss_coeff", c.moe_z_loss_coeff},
              // the routing reads the expert bias (state/...expert_bias): inference must know it
              {"moe_router_enable_expert_bias", c.moe_router_enable_expert_bias},
              {"moe_router_bias_update_rate", c.moe_router_bias_update_rate}};
}

void moe_config_from_json(const json& j, TransformerConfig& c) {
  c.num_moe_experts = j.at("num_experts").get<int64_t>();
  c.moe_layer_pattern.clear();
  for (int v : j.at("moe_layer_pattern").get<std::vector<int>>()) c.moe_layer_pattern.push_back(v ? 1 : 0);
  c.moe_ffn_hidden_size = j.at("moe_ffn_hidden_size").get<int64_t>();
  c.moe_shared_expert_intermediate_size = j.value("moe_shared_expert_intermediate_size", int64_t{0});
  c.moe_shared_expert_gate = j.value("moe_shared_expert_gate", false);
  c.moe_router_topk = j.at("moe_router_topk").get<int64_t>();
  c.moe_router_score_function = parse_moe_score_function(j.value("moe_router_score_function", std::string("softmax")));
  c.moe_router_pre_softmax = j.value("moe_router_pre_softmax", false);
  c.moe_router_topk_scaling_factor = j.value("moe_router_topk_scaling_factor", 1.f);
  c.moe_router_num_groups = j.value("moe_router_num_groups", int64_t{0});
  c.moe_router_group_topk = j.value("moe_router_group_topk", int64_t{0});
  c.moe_router_dtype = parse_dtype(j.value("moe_router_dtype", std::string("fp32")));
  // one type and coefficient (older checkpoints: a string and a number) or lists of them
  const json types = j.value("moe_router_load_balancing_type", json("aux_loss"));
  const json coeffs = j.value("moe_aux_loss_coeff", json(0.f));
  c.moe_router_load_balancing_type.clear();
  for (const json& t : types.is_array() ? types : json::array({types}))
    c.moe_router_load_balancing_type.push_back(parse_moe_load_balancing(t.get<std::string>()));
  c.moe_aux_loss_coeff.clear();
  for (const json& v : coeffs.is_array() ? coeffs : json::array({coeffs})) c.moe_aux_loss_coeff.push_back(v.get<float>());
  c.moe_z_loss_coeff = j.value("moe_z_loss_coeff", 0.f);
  c.moe_router_enable_expert_bias = j.value("moe_router_enable_expert_bias", false);
  c.moe_router_bias_update_rate = j.value("moe_router_bias_update_rate", 1e-3f);
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
              {"layernorm_zero_centered_gamma", c.layernorm_zero_centered_gamma},
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
  if (c.multi_latent_attention)  // docs/mla.md; kv_channels above is the core attention's padded head dim
    j["mla"] = json{{"q_lora_rank", c.q_lora_rank},
                    {"kv_lora_rank", c.kv_lora_rank},
                    {"qk_head_dim", c.qk_head_dim},
                    {"qk_pos_emb_head_dim", c.qk_pos_emb_head_dim},
                    {"v_head_dim", c.v_head_dim},
                    {"rope_type", rope_type_name(c.rope_type)},
                    {"rotary_scaling_factor", c.rotary_scaling_factor},
                    {"mscale", c.mscale},
                    {"mscale_all_dim", c.mscale_all_dim},
                    {"original_max_position_embeddings", c.original_max_position_embeddings},
                    {"beta_fast", c.beta_fast},
                    {"beta_slow", c.beta_slow}};
  if (c.mtp_num_layers > 0) {
    j["mtp_num_layers"] = c.mtp_num_layers;
    j["mtp_loss_scaling_factor"] = c.mtp_loss_scaling_factor;
  }
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
  c.layernorm_zero_centered_gamma = j.value("layernorm_zero_centered_gamma", false);
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
  if (j.contains("mla")) {
    const json& m = j.at("mla");
    c.multi_latent_attention = true;
    c.kv_channels = 0;  // derived from the MLA head dims
    c.num_query_groups = 0;
    c.q_lora_rank = m.at("q_lora_rank").get<int64_t>();
    c.kv_lora_rank = m.at("kv_lora_rank").get<int64_t>();
    c.qk_head_dim = m.at("qk_head_dim").get<int64_t>();
    c.qk_pos_emb_head_dim = m.at("qk_pos_emb_head_dim").get<int64_t>();
    c.v_head_dim = m.at("v_head_dim").get<int64_t>();
    c.rope_type = parse_rope_type(m.at("rope_type").get<std::string>());
    c.rotary_scaling_factor = m.at("rotary_scaling_factor").get<float>();
    c.mscale = m.at("mscale").get<float>();
    c.mscale_all_dim = m.at("mscale_all_dim").get<float>();
    c.original_max_position_embeddings = m.at("original_max_position_embeddings").get<int64_t>();
    c.beta_fast = m.at("beta_fast").get<float>();
    c.beta_slow = m.at("beta_slow").get<float>();
  }
  c.mtp_num_layers = j.value("mtp_num_layers", int64_t{0});
  c.mtp_loss_scaling_factor = j.value("mtp_loss_scaling_factor", 0.1f);
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

struct TensorRef {
  std::string name;
  Tensor t;  // fp32, on device
  std::vector<int64_t> global_shape;
  ShardBox box;  // where t sits in the global tensor
  int64_t vocab_rows = 0;  // ParamSpec::vocab_rows: rows >= it are padding (not stored)
  bool expert = false;     // ParamSpec::expert: written by expert-data-parallel rank 0
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

// A full-length fp32 temporary in `buf`, which is reused when it already has that size on that
// device (the --async-save snapshot keeps its temporaries from one save to the next: freeing device
// memory would wait for the copies in flight).
Tensor temp_full(Buffer& buf, const ParamStore& params) {
  const size_t bytes = static_cast<size_t>(params.total_elements()) * 4;
  if (buf.bytes() != bytes || buf.device() != params.device()) buf = Buffer(params.device(), bytes);
  return buf.as(DType::kF32, {params.total_elements()});
}

// Views of the live buffers, or zeroed temporaries where the state is sharded (f's buffers reused).
FullState& full_state(FullState& f, const ParamStore& params, const AdamWOptimizer* opt, const Stream& stream) {
  f.main = f.m = f.v = Tensor();
  if (!params.has_main_flat()) {  // sharded, or int16 remainders (--use-precision-aware-optimizer)
    f.main = temp_full(f.main_buf, params);
    memset_tensor(f.main, 0, stream);
  } else {
    f.main = params.main_flat();
  }
  if (!opt) return f;
  if (opt->moments_flat()) {  // one owned range [0, total): state index == flat index (AdamW)
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
    out.push_back({"model/" + info.name, view(st.main, info), info.global_shape, info.box, info.vocab_rows, info.expert});
  }
  if (with_optimizer) {
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& info = params.info(i);
      if (writing && info.shared_embedding_copy) continue;
      out.push_back({"optim/exp_avg/" + info.name, view(st.m, info), info.global_shape, info.box, info.vocab_rows,
                     info.expert});
      out.push_back({"optim/exp_avg_sq/" + info.name, view(st.v, info), info.global_shape, info.box, info.vocab_rows,
                     info.expert});
    }
  }
  return out;
}

// The extra state (CheckpointExtra) as checkpoint tensors "state/<name>": whole, unsharded
// views of the caller's tensors (so a snapshot or a load reads / writes them in place).
std::vector<TensorRef> extra_tensors(const CheckpointExtra& extra, const char* fn) {
  std::vector<TensorRef> out;
  for (const auto& [name, t] : extra) {
    MT_REQUIRE(t.dtype() == DType::kF32 && t.is_contiguous(),
               "{}: extra state '{}' must be a contiguous fp32 tensor, got {} {}{}", fn, name, dtype_name(t.dtype()),
               t.shape_str(), t.is_contiguous() ? "" : " (not contiguous)");
    const std::vector<int64_t> shape = t.shape();
    out.push_back({"state/" + name, t, shape, ShardBox::whole(shape)});
  }
  return out;
}

}  // namespace

namespace {
std::string rank_file(int world_rank) { return fmt::format("rank_{:05d}.bin", world_rank); }

// What this rank writes, in file order: the non-expert tensors when it is data-parallel rank 0,
// the expert tensors when it is expert-data-parallel rank 0, and the extra state when it is
// data-parallel and tensor-parallel rank 0: one writer per pipeline stage (CheckpointWriter).
std::vector<TensorRef> file_tensors(const ParamStore& params, const FullState& st, bool with_optimizer,
                                    const CheckpointWriter& w, const CheckpointExtra& extra) {
  std::vector<TensorRef> out;
  for (auto& ref : checkpoint_tensors(params, st, with_optimizer, /*writing=*/true))
    if (ref.expert ? w.edp_rank == 0 : w.dp_rank == 0) out.push_back(std::move(ref));
  std::vector<TensorRef> state = extra_tensors(extra, "save_checkpoint");  // checked on every rank
  if (w.dp_rank == 0 && w.tp_rank == 0)
    for (auto& ref : state) out.push_back(std::move(ref));
  return out;
}

// The shard entries of this rank's file (its report to rank 0 for metadata.json), with byte offsets.
json shard_entries(const std::vector<TensorRef>& refs) {
  json out = json::array();
  uint64_t off = 0;
  for (const auto& ref : refs) {
    const StoredBox b = stored_box(ref.global_shape, ref.box, ref.vocab_rows);
    if (b.numel == 0) continue;  // a shard made only of vocabulary padding
    out.push_back({{"name", ref.name}, {"global_shape", b.global_shape}, {"shape", b.shape},
                   {"global_offset", b.offset}, {"offset_bytes", off}});
    off += static_cast<uint64_t>(b.numel) * 4;
  }
  return out;
}
}  // namespace

namespace {

// A file written with POSIX calls so that every failure (ENOSPC, EFBIG, EIO) is reported with
// the path and the system's reason, and the data can be fsync'ed before the rename that
// publishes it. The CRC-32C and size of everything written are kept for the metadata.
class OutFile {
 public:
  explicit OutFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MT_REQUIRE(fd_ >= 0, "cannot create checkpoint file '{}': {}", path.string(), std::strerror(errno));
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  void write(const void* data, size_t n) {
    crc_ = crc32c_extend(crc_, data, n);
    bytes_ += n;
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      MT_REQUIRE(w > 0, "error writing checkpoint file '{}' after {} bytes: {}", path_.string(), bytes_ - n,
                 w < 0 ? std::strerror(errno) : "no progress");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  /// fsync, then close; errors name the file.
  void close_synced() {
    MT_REQUIRE(::fsync(fd_) == 0, "error writing checkpoint file '{}' (fsync): {}", path_.string(),
               std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    MT_REQUIRE(::close(fd) == 0, "error writing checkpoint file '{}' (close): {}", path_.string(),
               std::strerror(errno));
  }
  uint32_t crc() const { return crc_; }
  uint64_t bytes() const { return bytes_; }

 private:
  fs::path path_;
  int fd_ = -1;
  uint32_t crc_ = 0;
  uint64_t bytes_ = 0;
};

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some file systems do not allow it
  ::fsync(fd);
  ::close(fd);
}

// Writes `text` to `path` through a temporary file, fsync and a rename.
void write_file_durable(const fs::path& path, const std::string& text) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    OutFile f(tmp);
    f.write(text.data(), text.size());
    f.close_synced();
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  MT_REQUIRE(!ec, "cannot rename '{}' to '{}': {}", tmp.string(), path.string(), ec.message());
}

std::string crc_hex(uint32_t c) { return fmt::format("{:08x}", c); }

// Bytes of one shard entry of metadata.json (fp32: 4 per element of its shape).
uint64_t shard_bytes(const json& shard) {
  uint64_t n = 4;
  for (const json& d : shard.at("shape")) n *= d.get<uint64_t>();
  return n;
}

// Format version 3: the CRC-32C of metadata.json's own content, stored in it under this key:
// the checksum of the compact JSON text (keys sorted, as nlohmann::json orders them) of the
// object without this key.
const char* kMetadataCrcKey = "metadata_crc32c";
std::string metadata_checksum(json meta) {
  meta.erase(kMetadataCrcKey);
  const std::string text = meta.dump();
  return crc_hex(crc32c(text.data(), text.size()));
}

// "<file>.done": what one rank reports to the finalizing rank 0 once its file is complete (or
// that it failed, with the reason), written atomically into the temporary directory.
fs::path marker_path(const fs::path& tmp_dir, const std::string& file) { return tmp_dir / (file + ".done"); }
void write_marker(const fs::path& tmp_dir, const std::string& file, const json& j) {
  write_file_durable(marker_path(tmp_dir, file), j.dump());
}

}  // namespace

/// Everything a save needs after the snapshot: paths, this rank's file, and (rank 0) the
/// metadata without the file checksums, which arrive in the markers.
struct CheckpointSaveJob {
  fs::path dir, tmp_dir, final_dir;
  int64_t iteration = 0;
  bool rank0 = false, writes_file = false;
  int world_rank = 0;
  std::string file;                // this rank's rank_XXXXX.bin (writes_file)
  json entries;                    // its shards (shard_entries), reported to rank 0 in the marker
  json meta;                       // rank 0: metadata.json without "tensors" and "files"
  std::vector<std::string> files;  // rank 0: every writing rank's file, in world-rank order
  double timeout_s = 600;
  // Async: this rank's shard bytes (the saver's snapshot buffer); null for a synchronous save.
  const char* snapshot = nullptr;
  size_t snapshot_bytes = 0;
  // Async on a GPU: completes when the snapshot's device-to-host copies have run (the writer
  // waits for it before reading `snapshot`); null when the bytes were copied synchronously.
  const Event* snapshot_copied = nullptr;
  const Event* snapshot_ordered = nullptr;  // recorded on the training stream just before the copies
  Device device;  // of snapshot_copied
};

/// The --async-save snapshot's memory and synchronisation, kept from one save to the next so that
/// a save allocates nothing once the first has run: the pinned host copy of this rank's shards,
/// the device temporaries of gathered (sharded) state, and on a GPU a copy stream with its events.
struct AsyncSnapshot {
  Buffer host;     // this rank's shard bytes in file order (pinned for a GPU)
  FullState full;  // whole fp32 state: views of the live buffers, or gathered temporaries
  std::optional<Stream> copy_stream;  // CUDA: the device-to-host copies run here
  std::unique_ptr<Event> ready;       // recorded on the training stream: the state is final
  std::unique_ptr<Event> copied;      // recorded on copy_stream after the copies
};

namespace {

// Rank 0: the "tensors" of metadata.json from the writing ranks' reports (in world-rank order):
// every tensor once with its global shape and the shards that hold it. A box stored by several
// ranks (a tensor replicated over TP, e.g. a norm weight or the router) is listed once, from the
// first rank that reports it.
json merge_tensor_reports(const std::vector<std::pair<std::string, json>>& reports) {
  json tensors = json::array();
  std::unordered_map<std::string, size_t> index;
  for (const auto& [file, report] : reports) {
    const int rank = report.at("rank").get<int>();
    for (const json& e : report.at("tensors")) {
      const std::string name = e.at("name").get<std::string>();
      auto [it, fresh] = index.try_emplace(name, tensors.size());
      if (fresh)
        tensors.push_back({{"name", name}, {"dtype", "fp32"}, {"global_shape", e.at("global_shape")},
                           {"shards", json::array()}});
      json& t = tensors[it->second];
      MT_REQUIRE(t.at("global_shape") == e.at("global_shape"),
                 "checkpoint save: ranks disagree on the global shape of '{}' ({} in {}, {} before)", name,
                 e.at("global_shape").dump(), file, t.at("global_shape").dump());
      bool stored = false;
      for (const json& sh : t.at("shards"))
        stored |= sh.at("global_offset") == e.at("global_offset") && sh.at("shape") == e.at("shape");
      if (stored) continue;
      t["shards"].push_back({{"rank", rank},
                             {"file", file},
                             {"offset_bytes", e.at("offset_bytes")},
                             {"shape", e.at("shape")},
                             {"global_offset", e.at("global_offset")},
                             {"crc32c", e.at("crc32c")}});
    }
  }
  return tensors;
}

// Rank 0: waits for every rank's marker, writes metadata.json with the tensors they report and
// the file sizes and checksums, publishes the directory (rename) and then the tracker. On any
// failure the temporary directory is removed and the error rethrown.
void finalize_save(CheckpointSaveJob& job) {
  json files = json::object();
  std::vector<std::pair<std::string, json>> reports;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(job.timeout_s);
  for (const auto& f : job.files) {
    const fs::path m = marker_path(job.tmp_dir, f);
    while (!fs::exists(m)) {
      MT_REQUIRE(std::chrono::steady_clock::now() < deadline,
                 "checkpoint save at iteration {}: no rank reported '{}' complete within {} s "
                 "(--distributed-timeout-minutes)", job.iteration, (job.tmp_dir / f).string(), job.timeout_s);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::ifstream in(m);
    json j;
    try {
      j = json::parse(in);
    } catch (const std::exception& e) {
      MT_FAIL("checkpoint save: marker '{}' is unreadable: {}", m.string(), e.what());
    }
    MT_REQUIRE(j.value("ok", false), "checkpoint save at iteration {} failed on another rank: {}", job.iteration,
               j.value("error", std::string("unknown error")));
    files[f] = {{"bytes", j.at("bytes")}, {"crc32c", j.at("crc32c")}};
    reports.emplace_back(f, std::move(j));
  }
  for (const auto& f : job.files) fs::remove(marker_path(job.tmp_dir, f));
  job.meta["tensors"] = merge_tensor_reports(reports);
  job.meta["files"] = files;
  job.meta[kMetadataCrcKey] = metadata_checksum(job.meta);
  write_file_durable(job.tmp_dir / "metadata.json", job.meta.dump(1));
  fsync_dir(job.tmp_dir);
  if (const char* ms = std::getenv("MT_TEST_CHECKPOINT_PUBLISH_DELAY_MS")) {  // tests: a kill lands here
    log_warn("test hook: publication of the checkpoint of iteration {} delayed by {} ms", job.iteration, ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atol(ms)));
  }
  // Nothing is published once the launcher is gone: the ranks are being stopped, and a job
  // started in its place may already be reading this directory (comm/launcher.h).
  const auto require_launcher = [&] {
    MT_REQUIRE(launcher_alive(),
               "checkpoint of iteration {} not published: the launcher that started this rank (parent process {}) "
               "has died",
               job.iteration, guarded_parent_pid());
  };
  require_launcher();
  std::error_code ec;
  // Replace any previous checkpoint of the same iteration only after the new one is complete.
  if (fs::exists(job.final_dir)) {
    const fs::path old = job.dir / (job.final_dir.filename().string() + ".old");
    fs::remove_all(old, ec);
    fs::rename(job.final_dir, old);
    fs::rename(job.tmp_dir, job.final_dir);
    fs::remove_all(old, ec);
  } else {
    fs::rename(job.tmp_dir, job.final_dir);
  }
  fsync_dir(job.dir);
  require_launcher();
  write_file_durable(job.dir / kTracker, std::to_string(job.iteration) + "\n");
  fsync_dir(job.dir);
}

// This rank's part of a save: write its file (from the snapshot, or streamed by `stream_fn`),
// its marker, and on rank 0 finalize. Never throws on a non-zero rank without first writing a
// failure marker, so that rank 0 stops waiting; rank 0 removes the temporary directory on failure.
void run_save_job(CheckpointSaveJob& job, const std::function<void(OutFile&)>& stream_fn) {
  try {
    if (job.writes_file) {
      try {
        OutFile f(job.tmp_dir / job.file);
        if (stream_fn) {
          stream_fn(f);  // also records each shard's checksum in job.entries
        } else {
          f.write(job.snapshot, job.snapshot_bytes);
          for (json& e : job.entries) {
            const uint64_t off = e.at("offset_bytes").get<uint64_t>();
            e["crc32c"] = crc_hex(crc32c(job.snapshot + off, shard_bytes(e)));
          }
        }
        f.close_synced();
        write_marker(job.tmp_dir, job.file,
                     {{"ok", true}, {"bytes", f.bytes()}, {"crc32c", crc_hex(f.crc())}, {"rank", job.world_rank},
                      {"tensors", job.entries}});
      } catch (const std::exception& e) {
        if (!job.rank0) write_marker(job.tmp_dir, job.file, {{"ok", false}, {"error", e.what()}});
        throw;
      }
    }
    if (job.rank0) finalize_save(job);
  } catch (...) {
    if (job.rank0) {
      std::error_code ec;
      fs::remove_all(job.tmp_dir, ec);  // a failed save leaves nothing behind
    }
    throw;
  }
}

// Starts a save (collective over the world): rank 0 prepares the temporary directory and learns
// which ranks write a file, every rank gathers the whole fp32 state (collective over DP / EDP when
// sharded) and returns the job plus, in *refs, the tensors of its file (empty when it writes none).
CheckpointSaveJob prepare_save(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                               const AdamWOptimizer* optimizer, const CheckpointWriter& w, const Stream& stream,
                               const CheckpointExtra& extra, FullState& full, std::vector<TensorRef>* refs) {
  CheckpointSaveJob job;
  job.world_rank = w.world->rank();
  job.rank0 = job.world_rank == 0;
  job.dir = dir;
  job.iteration = state.iteration;
  job.final_dir = job.dir / iter_dir_name(state.iteration);
  job.tmp_dir = job.dir / (iter_dir_name(state.iteration) + ".tmp");
  job.timeout_s = w.timeout_s;
  job.file = rank_file(job.world_rank);
  int32_t ok = 1;
  std::string why;
  if (job.rank0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec || !fs::is_directory(dir)) {
      ok = 0;
      why = fmt::format("--save directory '{}' cannot be created: {}", dir, ec.message());
    } else {
      fs::remove_all(job.tmp_dir, ec);
      fs::create_directories(job.tmp_dir, ec);
      if (ec) {
        ok = 0;
        why = fmt::format("cannot create checkpoint directory '{}': {}", job.tmp_dir.string(), ec.message());
      }
    }
  }
  const bool with_optim = optimizer != nullptr && w.save_optim;
  // Whole fp32 main parameters and moments (views, or temporaries filled below when sharded).
  if (optimizer) {
    optimizer->grad_sync().finish_param_sync(stream);
    optimizer->grad_sync().sync_model_params(stream);  // --fp8-param-gather: whole model parameters
  }
  full_state(full, params, with_optim ? optimizer : nullptr, stream);
  *refs = file_tensors(params, full, with_optim, w, extra);
  job.entries = shard_entries(*refs);
  job.writes_file = !job.entries.empty();
  // Every rank learns whether rank 0 could prepare the directory (no rank is left waiting), and
  // rank 0 which ranks write a file.
  const int32_t mine[2] = {ok, job.writes_file ? 1 : 0};
  const std::vector<char> all = all_gather_host(*w.world, mine, sizeof(mine), stream);
  int32_t flags[2] = {0, 0};
  std::memcpy(flags, all.data(), sizeof(flags));
  MT_REQUIRE(flags[0] == 1, "{}", job.rank0 ? why : std::string("checkpoint save failed on rank 0 (see its error)"));
  // Sharded state is all-gathered (every DP / EDP rank takes part); remainders are merged.
  if (!params.has_main_flat()) {
    MT_REQUIRE(optimizer != nullptr,
               "save_checkpoint: the main parameters are sharded or stored as remainders, the optimizer is needed");
    optimizer->gather_main(full.main, stream);
  }
  if (with_optim && !optimizer->moments_flat()) optimizer->gather_moments(full.m, full.v, stream);
  if (job.rank0) {
    for (int r = 0; r < w.world->size(); ++r) {
      std::memcpy(flags, all.data() + r * sizeof(mine), sizeof(flags));
      if (flags[1] == 1) job.files.push_back(rank_file(r));
    }
    job.meta = json{{"format", "megatron.cpp-checkpoint"},
                    {"version", 3},
                    {"iteration", state.iteration},
                    {"consumed_train_samples", state.consumed_train_samples},
                    {"seed", state.seed},
                    {"tensor_model_parallel_size", w.tp},
                    {"pipeline_model_parallel_size", w.pp},
                    {"data_parallel_size", w.dp},
                    {"expert_model_parallel_size", w.ep},
                    {"expert_tensor_parallel_size", w.etp},
                    {"model", config_to_json(state.model)},
                    {"scalars", scalars_to_json(state.scalars)},
                    {"has_optimizer", with_optim}};
    // The optimizer whose state exp_avg / exp_avg_sq hold (Muon: exp_avg is the momentum of its
    // matrices and their exp_avg_sq is zero; docs/optimizer.md).
    if (with_optim) job.meta["optimizer"] = optimizer->config().optimizer;
  }
  return job;
}

// Calls fn(host bytes, n) for the shards of `refs` in file order (rows of vocabulary padding left out).
void for_each_shard_bytes(const std::vector<TensorRef>& refs, const Stream& stream,
                          const std::function<void(const char*, size_t)>& fn) {
  std::vector<char> host;
  for (const auto& ref : refs) {
    host.resize(static_cast<size_t>(stored_box(ref.global_shape, ref.box, ref.vocab_rows).numel) * 4);
    if (host.empty()) continue;
    copy_bytes(host.data(), Device::cpu(), ref.t.data(), ref.t.device(), host.size(), stream);
    stream.synchronize();
    fn(host.data(), host.size());
  }
}

// After every rank ran its job: all ranks learn whether the save succeeded everywhere.
void agree_on_save(const CheckpointWriter& w, bool ok, const std::string& why, int64_t iteration,
                   const Stream& stream) {
  const int mine = ok ? 1 : 0;
  const std::vector<char> all = all_gather_host(*w.world, &mine, sizeof(mine), stream);
  if (!ok) MT_FAIL("{}", why);
  for (int r = 0; r < w.world->size(); ++r) {
    int v = 0;
    std::memcpy(&v, all.data() + r * sizeof(int), sizeof(int));
    MT_REQUIRE(v == 1, "checkpoint save at iteration {} failed on rank {} (see its error)", iteration, r);
  }
}

}  // namespace

void save_checkpoint(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                     const AdamWOptimizer* optimizer, const CheckpointWriter& w, const Stream& stream,
                     const CheckpointExtra& extra) {
  FullState full;
  std::vector<TensorRef> refs;
  CheckpointSaveJob job = prepare_save(dir, state, params, optimizer, w, stream, extra, full, &refs);
  bool ok = true;
  std::string why;
  try {
    run_save_job(job, [&](OutFile& f) {
      size_t k = 0;  // the shards come in the order of job.entries
      for_each_shard_bytes(refs, stream, [&](const char* p, size_t n) {
        f.write(p, n);
        job.entries.at(k++)["crc32c"] = crc_hex(crc32c(p, n));
      });
    });
  } catch (const std::exception& e) {
    ok = false;
    why = e.what();
  }
  agree_on_save(w, ok, why, state.iteration, stream);
}

AsyncCheckpointSaver::AsyncCheckpointSaver() : snap_(std::make_unique<AsyncSnapshot>()) {}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      log_warn("asynchronous checkpoint save failed: {}", e.what());
    }
  }
}

namespace {

// Bytes of this rank's file (the shards of `refs` without vocabulary padding rows).
size_t file_bytes(const std::vector<TensorRef>& refs) {
  size_t total = 0;
  for (const auto& ref : refs) total += static_cast<size_t>(stored_box(ref.global_shape, ref.box, ref.vocab_rows).numel) * 4;
  return total;
}

// The snapshot's host buffer of at least `bytes` (pinned for a GPU), and on a GPU its copy stream
// and events; what exists is kept.
void ensure_snapshot_memory(AsyncSnapshot& sn, size_t bytes, Device device) {
  if (sn.host.bytes() < bytes)
    sn.host = Buffer(Device::cpu(), bytes, device.is_cuda() ? HostMemory::kPinned : HostMemory::kPageable);
  if (device.is_cuda() && !sn.copy_stream) {
    sn.copy_stream.emplace(device);
    sn.ready = std::make_unique<Event>(device);
    sn.copied = std::make_unique<Event>(device);
  }
}

}  // namespace

void AsyncCheckpointSaver::allocate(const ParamStore& params, const AdamWOptimizer* optimizer,
                                    const CheckpointWriter& writer, const Stream& stream,
                                    const CheckpointExtra& extra) {
  wait();
  AsyncSnapshot& sn = *snap_;
  const bool with_optim = optimizer != nullptr && writer.save_optim;
  full_state(sn.full, params, with_optim ? optimizer : nullptr, stream);  // the device temporaries, if any
  const size_t bytes = file_bytes(file_tensors(params, sn.full, with_optim, writer, extra));
  if (bytes > 0) ensure_snapshot_memory(sn, bytes, params.device());
}

void AsyncCheckpointSaver::save(const std::string& dir, const CheckpointState& state, const ParamStore& params,
                                const AdamWOptimizer* optimizer, const CheckpointWriter& writer,
                                const Stream& stream, const CheckpointExtra& extra) {
  wait();  // one save in flight at a time (and its error surfaces here); its copies have run
  last_copy_ = nullptr;
  last_copy_ms_ = -1;
  AsyncSnapshot& sn = *snap_;
  std::vector<TensorRef> refs;
  auto job = std::make_shared<CheckpointSaveJob>(
      prepare_save(dir, state, params, optimizer, writer, stream, extra, sn.full, &refs));
  if (job->writes_file) {
    const Device device = params.device();
    const size_t total = file_bytes(refs);
    // Pinned host memory when the state is on a GPU (a fast, asynchronous device-to-host copy),
    // allocated by allocate() or the first save and kept for the next.
    ensure_snapshot_memory(sn, total, device);
    char* dst = static_cast<char*>(sn.host.data());
    // GPU: the copies run on the snapshot's own stream once the work queued so far on `stream`
    // (the optimizer step, the gathers above) is done; nothing here waits for them. CPU: `stream`
    // runs the copies inline.
    const Stream* copy_stream = &stream;
    if (device.is_cuda()) {
      sn.ready->record(stream);
      sn.ready->wait(*sn.copy_stream);
      copy_stream = &*sn.copy_stream;
    }
    size_t off = 0;
    for (const auto& ref : refs) {  // the same bytes in the same order as for_each_shard_bytes
      const size_t n = static_cast<size_t>(stored_box(ref.global_shape, ref.box, ref.vocab_rows).numel) * 4;
      if (n == 0) continue;
      copy_bytes(dst + off, Device::cpu(), ref.t.data(), ref.t.device(), n, *copy_stream);
      off += n;
    }
    if (device.is_cuda()) {
      sn.copied->record(*copy_stream);
      job->snapshot_copied = sn.copied.get();
      job->snapshot_ordered = sn.ready.get();
      job->device = device;
      last_copy_ = sn.copied.get();
    }
    job->snapshot = dst;
    job->snapshot_bytes = total;
  }
  thread_ = std::thread([this, job] {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      if (job->snapshot_copied) {
        set_current_device(job->device);  // this thread's CUDA calls go to the state's device
        job->snapshot_copied->synchronize();  // the host bytes are complete
        // From the end of the work the copies waited for to the end of the copies.
        last_copy_ms_ = job->snapshot_copied->elapsed_ms_since(*job->snapshot_ordered);
      }
      run_save_job(*job, nullptr);
      last_write_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

void AsyncCheckpointSaver::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

namespace {
const char* kLockFile = ".megatron.lock";

std::string lock_holder(int fd) {
  char buf[256] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s.empty() ? "another process (it has not recorded itself yet)" : s;
}
}  // namespace

SaveDirectoryLock& SaveDirectoryLock::operator=(SaveDirectoryLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

SaveDirectoryLock::~SaveDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

SaveDirectoryLock SaveDirectoryLock::acquire(const std::string& dir, double wait_s) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MT_REQUIRE(!ec && fs::is_directory(dir), "--save directory '{}' cannot be created: {}", dir,
             ec ? ec.message() : "it is not a directory");
  const fs::path path = fs::path(dir) / kLockFile;
  SaveDirectoryLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MT_REQUIRE(lock.fd_ >= 0, "--save directory '{}' is not writable: cannot create its lock file '{}': {}", dir,
             path.string(), std::strerror(errno));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno == ENOLCK || errno == EOPNOTSUPP || errno == ENOSYS) {
      log_warn("the file system of --save '{}' does not support locks ({}): a second job writing into it would not be "
               "detected",
               dir, std::strerror(errno));
      return {};
    }
    MT_REQUIRE(errno == EWOULDBLOCK, "cannot lock '{}': {}", path.string(), std::strerror(errno));
    MT_REQUIRE(std::chrono::steady_clock::now() < deadline,
               "--save directory '{}' is in use by another job: {} holds its lock '{}' (two jobs saving into one "
               "directory would overwrite each other's checkpoints); wait for that job to end, or give another --save",
               dir, lock_holder(lock.fd_), path.string());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  char host[256] = "unknown";
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char when[64] = "";
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string who = fmt::format("pid {} on host {} since {}\n", ::getpid(), host, when);
  if (::ftruncate(lock.fd_, 0) != 0 || ::pwrite(lock.fd_, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    log_warn("cannot record the holder in '{}': {}", path.string(), std::strerror(errno));
  return lock;
}

SaveDirectoryLock lock_save_directory(const std::string& save, Communicator& world, Device device) {
  if (save.empty()) return {};
  SaveDirectoryLock lock;
  std::exception_ptr failed;
  if (world.rank() == 0) {
    try {
      lock = SaveDirectoryLock::acquire(save);
    } catch (const Error&) {
      failed = std::current_exception();
    }
  }
  const int32_t ok = failed ? 0 : 1;
  const Stream stream(device);
  const std::vector<char> all = all_gather_host(world, &ok, sizeof(ok), stream);
  if (failed) std::rethrow_exception(failed);
  int32_t rank0 = 0;
  std::memcpy(&rank0, all.data(), sizeof(rank0));
  MT_REQUIRE(rank0 == 1, "the --save directory '{}' could not be locked (see rank 0's error)", save);
  return lock;
}

uint64_t checkpoint_bytes(const std::string& dir, int64_t iteration) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(dir) / iter_dir_name(iteration), ec))
    if (e.is_regular_file(ec)) total += e.file_size(ec);
  return total;
}

std::vector<std::string> clean_interrupted_saves(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  static const std::regex kLeftover(R"(iter_\d{7,}\.(tmp|old))");
  std::vector<fs::path> found;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.is_directory() && std::regex_match(entry.path().filename().string(), kLeftover))
      found.push_back(entry.path());
  for (const auto& p : found) {
    const std::string name = p.filename().string();
    const fs::path complete = p.parent_path() / name.substr(0, name.size() - 4);
    if (name.ends_with(".old") && !fs::exists(complete)) {
      fs::rename(p, complete, ec);
      out.push_back(name + " (renamed back to " + complete.filename().string() + ")");
      continue;
    }
    fs::remove_all(p, ec);
    out.push_back(name);
  }
  return out;
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

const char* kFallbackHint = " (--fallback-to-previous-checkpoint loads the newest earlier checkpoint that verifies)";

// The directory of iteration `it`: iter_XXXXXXX, or the iter_XXXXXXX.old that a replacement of
// the same iteration interrupted between its two renames left behind.
fs::path iteration_path(const std::string& dir, int64_t it) {
  const fs::path p = fs::path(dir) / iter_dir_name(it);
  const fs::path old = fs::path(dir) / (iter_dir_name(it) + ".old");
  return !fs::exists(p) && fs::is_directory(old) ? old : p;
}

json read_metadata_at(const fs::path& iter_path) {
  const fs::path meta_path = iter_path / "metadata.json";
  MT_REQUIRE(fs::is_directory(iter_path), "checkpoint directory '{}' is missing", iter_path.string());
  std::ifstream f(meta_path);
  MT_REQUIRE(f.good(), "checkpoint metadata '{}' is missing", meta_path.string());
  json meta;
  try {
    meta = json::parse(f);
  } catch (const std::exception& e) {
    MT_FAIL("checkpoint metadata '{}' is not valid JSON: {}", meta_path.string(), e.what());
  }
  MT_REQUIRE(meta.is_object() && meta.value("format", "") == "megatron.cpp-checkpoint",
             "'{}' is not a megatron.cpp checkpoint", meta_path.string());
  return meta;
}

// The shards metadata.json places in `file` that carry a checksum (format version 3), by offset.
struct ShardCheck {
  std::string tensor;
  uint64_t begin = 0, end = 0;  // byte range in the file
  std::string want;             // recorded CRC-32C
  uint32_t crc = 0;             // of the bytes read so far
};
std::vector<ShardCheck> shard_checks(const json& meta, const std::string& file) {
  std::vector<ShardCheck> out;
  for (const json& t : meta.at("tensors"))
    for (const json& sh : t.at("shards"))
      if (sh.at("file").get<std::string>() == file && sh.contains("crc32c")) {
        const uint64_t off = sh.at("offset_bytes").get<uint64_t>();
        out.push_back({t.at("name").get<std::string>(), off, off + shard_bytes(sh), sh.at("crc32c").get<std::string>()});
      }
  std::sort(out.begin(), out.end(), [](const ShardCheck& a, const ShardCheck& b) { return a.begin < b.begin; });
  return out;
}

// The shards whose bytes do not match their recorded checksum or lie beyond the file's end, as
// "'<tensor>' (bytes [a, b): CRC-32C x, metadata.json records y)", at most 4 named.
std::string bad_shards(const std::vector<ShardCheck>& shards, uint64_t file_bytes) {
  std::vector<std::string> bad;
  size_t n = 0;
  for (const ShardCheck& c : shards) {
    const bool beyond = c.end > file_bytes;
    if (!beyond && crc_hex(c.crc) == c.want) continue;
    if (++n > 4) continue;
    bad.push_back(beyond ? fmt::format("'{}' (bytes [{}, {}) lie beyond the file's {} bytes)", c.tensor, c.begin, c.end,
                                       file_bytes)
                         : fmt::format("'{}' (bytes [{}, {}): CRC-32C {}, metadata.json records {})", c.tensor, c.begin,
                                       c.end, crc_hex(c.crc), c.want));
  }
  if (n > 4) bad.push_back(fmt::format("and {} more", n - 4));
  return fmt::format("{}", fmt::join(bad, ", "));
}

// Size check (cheap) of one data file against metadata "files"; with `crc` also its CRC-32C and
// the CRC-32C of every shard metadata.json places in it (one read of the whole file). A shard whose
// bytes do not match names its tensor: with the file's checksum intact the index was edited (e.g.
// two tensors' offsets swapped), else the file is damaged there. Checkpoints of format version 1
// carry no checksums, version 2 none per shard: nothing more to check.
void verify_file(const fs::path& iter_path, const json& meta, const std::string& file, bool crc) {
  const fs::path path = iter_path / file;
  MT_REQUIRE(fs::exists(path), "checkpoint data file '{}' is missing", path.string());
  if (!meta.contains("files")) return;
  const json& files = meta.at("files");
  MT_REQUIRE(files.contains(file), "checkpoint data file '{}' is not listed in {}", path.string(),
             (iter_path / "metadata.json").string());
  const uint64_t want = files.at(file).at("bytes").get<uint64_t>();
  std::error_code ec;
  const uint64_t have = fs::file_size(path, ec);
  MT_REQUIRE(!ec, "cannot read checkpoint data file '{}': {}", path.string(), ec.message());
  MT_REQUIRE(have == want, "checkpoint data file '{}' is {}: {} bytes, metadata.json records {}", path.string(),
             have < want ? "truncated" : "too long", have, want);
  if (!crc) return;
  std::vector<ShardCheck> shards = shard_checks(meta, file);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_REQUIRE(fd >= 0, "cannot read checkpoint data file '{}': {}", path.string(), std::strerror(errno));
  std::vector<char> buf(size_t{16} << 20);
  uint32_t c = 0;
  uint64_t total = 0;
  size_t first = 0;  // shards before it are complete
  while (true) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      MT_REQUIRE(n == 0, "error reading checkpoint data file '{}': {}", path.string(), std::strerror(err));
      break;
    }
    c = crc32c_extend(c, buf.data(), static_cast<size_t>(n));
    const uint64_t lo = total, hi = total + static_cast<uint64_t>(n);
    while (first < shards.size() && shards[first].end <= lo) ++first;
    for (size_t i = first; i < shards.size() && shards[i].begin < hi; ++i) {  // shards overlapping [lo, hi)
      ShardCheck& sh = shards[i];
      const uint64_t b = std::max(sh.begin, lo), e = std::min(sh.end, hi);
      if (b < e) sh.crc = crc32c_extend(sh.crc, buf.data() + (b - lo), e - b);
    }
    total = hi;
  }
  const std::string want_crc = files.at(file).at("crc32c").get<std::string>();
  const bool file_ok = total == want && crc_hex(c) == want_crc;
  const std::string bad = bad_shards(shards, total);
  MT_REQUIRE(file_ok || bad.empty(),
             "checkpoint data file '{}' is corrupt: its CRC-32C is {} but metadata.json records {}; damaged tensors: {}",
             path.string(), crc_hex(c), want_crc, bad);
  MT_REQUIRE(file_ok, "checkpoint data file '{}' is corrupt: its CRC-32C is {} but metadata.json records {}",
             path.string(), crc_hex(c), want_crc);
  MT_REQUIRE(bad.empty(),
             "checkpoint '{}': metadata.json does not match the data of {}: tensors {} (the file's own checksum "
             "matches, so the index was edited or damaged)",
             iter_path.string(), file, bad);
}

// Every data file the metadata names (in "files", or in the tensors' shards for version 1).
std::vector<std::string> data_files(const json& meta) {
  std::vector<std::string> out;
  if (meta.contains("files")) {
    for (const auto& [name, _] : meta.at("files").items()) out.push_back(name);
    return out;
  }
  std::set<std::string> seen;
  for (const auto& t : meta.at("tensors"))
    for (const auto& sh : t.at("shards")) seen.insert(sh.at("file").get<std::string>());
  return {seen.begin(), seen.end()};
}

// Format version 3: metadata.json's checksum of itself (kMetadataCrcKey). On a mismatch every
// data file is verified with its shards, so that the error names the tensors whose recorded
// place or checksum no longer fits their bytes; when they all fit, the edit is elsewhere (the
// model configuration, the iteration, the scalars). Older checkpoints have no such field.
void verify_metadata_checksum(const fs::path& iter_path, const json& meta) {
  if (!meta.contains(kMetadataCrcKey)) return;
  const std::string want = meta.at(kMetadataCrcKey).get<std::string>(), have = metadata_checksum(meta);
  if (have == want) return;
  for (const auto& f : data_files(meta)) verify_file(iter_path, meta, f, /*crc=*/true);  // names the tensors
  MT_FAIL("checkpoint metadata '{}' was edited or damaged: its checksum is {} but it records {} (the tensors' data "
          "all match their checksums: a field outside them, e.g. the model configuration or the iteration, changed)",
          (iter_path / "metadata.json").string(), have, want);
}

// Metadata of the checkpoint to load and its directory. Without a fallback: the tracker's
// iteration, whose files must all be present with their recorded sizes (checksums are verified
// as the files are read). With `fallback`: the newest iteration directory, at most the tracker's,
// whose every file verifies completely (size and CRC-32C); skipped ones are named in warnings.
json resolve_checkpoint(const std::string& dir, const LoadOptions& opt, fs::path* iter_path) {
  MT_REQUIRE(fs::is_directory(dir), "--load directory '{}' does not exist", dir);
  std::optional<int64_t> tracked;
  std::string tracker_error;
  if (opt.iteration) {
    tracked = opt.iteration;
  } else {
    try {
      tracked = latest_checkpoint_iteration(dir);
    } catch (const Error& e) {
      if (!opt.fallback_to_previous) throw;
      tracker_error = e.what();
    }
  }
  auto check = [&](int64_t it, bool crc) {
    *iter_path = iteration_path(dir, it);
    json meta = read_metadata_at(*iter_path);
    try {
      verify_metadata_checksum(*iter_path, meta);
      MT_REQUIRE(meta.at("iteration").get<int64_t>() == it, "'{}' holds iteration {}",
                 (*iter_path / "metadata.json").string(), meta.at("iteration").get<int64_t>());
      for (const auto& f : data_files(meta)) verify_file(*iter_path, meta, f, crc);
    } catch (const json::exception& e) {
      MT_FAIL("checkpoint metadata '{}' is incomplete: {}", (*iter_path / "metadata.json").string(), e.what());
    }
    return meta;
  };
  if (!opt.fallback_to_previous) {
    MT_REQUIRE(tracked.has_value(), "--load directory '{}' holds no checkpoint ({} missing)", dir, kTracker);
    try {
      return check(*tracked, false);
    } catch (const Error& e) {
      MT_FAIL("{}{}", e.what(), kFallbackHint);
    }
  }
  std::vector<int64_t> candidates;
  static const std::regex kIterDir(R"(iter_(\d{7,})(\.old)?)");
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, kIterDir)) continue;
    const int64_t it = std::stoll(m[1].str());
    if (!tracked || it <= *tracked) candidates.push_back(it);
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  if (!tracker_error.empty()) log_warn("{}: trying the iteration directories in '{}'", tracker_error, dir);
  for (int64_t it : candidates) {
    try {
      json meta = check(it, true);
      if (tracked && it != *tracked) log_warn("> falling back to the checkpoint of iteration {} in {}", it, dir);
      return meta;
    } catch (const Error& e) {
      log_warn("checkpoint of iteration {} is unusable: {}", it, e.what());
    }
  }
  MT_FAIL("--load directory '{}' holds no complete checkpoint{}", dir,
          tracked ? fmt::format(" at or before iteration {}", *tracked) : std::string());
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

CheckpointState read_checkpoint_state(const std::string& dir, const LoadOptions& opt) {
  fs::path iter_path;
  try {
    return state_from_meta(resolve_checkpoint(dir, opt, &iter_path));
  } catch (const json::exception& e) {
    MT_FAIL("checkpoint metadata in '{}' is incomplete: {}", iter_path.string(), e.what());
  }
}

CheckpointState load_checkpoint(const std::string& dir, ParamStore& params, AdamWOptimizer* optimizer,
                                const Stream& stream, const LoadOptions& opt, const CheckpointExtra& extra) {
  std::vector<TensorRef> state_refs = extra_tensors(extra, "load_checkpoint");
  fs::path iter_path;
  FullState full;
  json meta = resolve_checkpoint(dir, opt, &iter_path);
  if (meta.value("version", 1) < 3)
    log_warn("checkpoint '{}' (format version {}) was written without checksums of metadata.json and of each tensor: "
             "an edited or damaged index cannot be detected; loading it unverified (the next save records them)",
             iter_path.string(), meta.value("version", 1));
  else if (!meta.contains(kMetadataCrcKey))
    log_warn("checkpoint '{}' has no checksum of its metadata.json ('{}' removed): an edit outside the tensors' "
             "shards cannot be detected; loading it (each tensor's checksum is still verified)",
             iter_path.string(), kMetadataCrcKey);
  CheckpointState state;
  try {
    state = state_from_meta(meta);
    MT_REQUIRE(!optimizer || meta.at("has_optimizer").get<bool>(),
               "checkpoint '{}' has no optimizer state (e.g. written by import-hf): load its weights with --finetune "
               "or --no-load-optim",
               iter_path.string());
    // Optimizer state of another optimizer (AdamW moments vs Muon momentum): switching is for
    // --finetune (weights only) or --no-load-optim; checkpoints before the field are AdamW's.
    MT_REQUIRE(!optimizer || meta.value("optimizer", std::string("adam")) == optimizer->config().optimizer,
               "checkpoint '{}' holds the state of --optimizer {}, this run uses --optimizer {}: switch optimizers "
               "with --finetune or --no-load-optim",
               iter_path.string(), meta.value("optimizer", std::string("adam")), optimizer->config().optimizer);
    std::unordered_map<std::string, const json*> by_name;
    for (const auto& t : meta.at("tensors")) by_name[t.at("name").get<std::string>()] = &t;
    std::map<std::string, std::ifstream> files;
    std::vector<float> host;
    if (optimizer) optimizer->grad_sync().finish_param_sync(stream);  // nothing may still write the parameters
    full_state(full, params, optimizer, stream);
    if (params.has_main_flat()) memset_tensor(full.main, 0, stream);  // padding (the loop fills the rest)
    if (optimizer && optimizer->moments_flat()) {
      memset_tensor(full.m, 0, stream);
      memset_tensor(full.v, 0, stream);
    }
    // The parameters (and moments), then the extra state, read in place into the caller's tensors.
    std::vector<TensorRef> refs = checkpoint_tensors(params, full, optimizer != nullptr, /*writing=*/false);
    const size_t num_required = refs.size();
    for (auto& ref : state_refs) refs.push_back(std::move(ref));
    std::vector<std::string> missing_state;
    for (size_t i = 0; i < refs.size(); ++i) {
      const TensorRef& ref = refs[i];
      auto it = by_name.find(ref.name);
      if (it == by_name.end() && i >= num_required) {  // an older checkpoint: keep the current value
        missing_state.push_back(ref.name);
        continue;
      }
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
          try {
            verify_file(iter_path, meta, file, /*crc=*/true);  // size and CRC-32C before any byte is used
          } catch (const Error& e) {
            MT_FAIL("{}{}", e.what(), kFallbackHint);
          }
          f.open(iter_path / file, std::ios::binary);
          MT_REQUIRE(f.good(), "checkpoint data file '{}' is missing", (iter_path / file).string());
        }
        const uint64_t base = shard.at("offset_bytes").get<uint64_t>();
        // Trailing dimensions that both boxes span completely are contiguous in both: one read
        // covers them (a whole shard when the layouts match), instead of one per row.
        int k = nd - 1;
        int64_t inner = 1;
        auto full = [&](int d) {
          return lo[d] == soff[d] && lo[d] == mine.offset[d] && hi[d] - lo[d] == sshape[d] && sshape[d] == mine.shape[d];
        };
        while (k > 0 && full(k)) inner *= sshape[k--];
        const int64_t run = (hi[k] - lo[k]) * inner;
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
          int d = k - 1;  // next run: odometer over the leading dimensions
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
    if (!missing_state.empty())
      log_warn("checkpoint '{}' holds no {} (saved before this state was stored, or by a model without it): "
               "keeping the current values",
               iter_path.string(), fmt::join(missing_state, ", "));
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("checkpoint metadata in '{}' is incomplete: {}", iter_path.string(), e.what());
  }
  if (!params.has_main_flat()) {
    // model parameters whole, main copy (or remainders) the stored elements
    params.set_main_from_full(full.main, stream);
  } else {
    params.sync_model_from_main(stream);
  }
  if (optimizer && !optimizer->moments_flat()) optimizer->scatter_moments(full.m, full.v, stream);
  if (optimizer) optimizer->write_scalars(state.scalars, stream);
  stream.synchronize();
  return state;
}

}  // namespace mt
