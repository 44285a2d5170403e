#include "train/hf_commands.h"

#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>

#include "comm/communicator.h"
#include "core/cli_validators.h"
#include "core/logging.h"
#include "model/gpt_model.h"
#include "model/hf/hf_convert.h"
#include "optim/optimizer.h"
#include "train/checkpoint.h"
#include "train/memory_estimate.h"

namespace mt {

namespace fs = std::filesystem;

std::string hf_assets_dir(const std::string& checkpoint_dir) { return (fs::path(checkpoint_dir) / "hf").string(); }

void add_import_hf_options(CLI::App& app, ImportHfArgs& a) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--hf-dir", a.hf_dir, "Hugging Face model directory (config.json, *.safetensors)")->required();
  app.add_option("--save", a.save, "Checkpoint directory to write")->required();
  app.add_option("--seq-length", a.seq_length,
                 "Sequence length of the checkpoint's model (default min(max_position_embeddings, 4096))")
      ->check(positive_integer());
  app.add_option("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by,
                 "Pad the vocabulary to a multiple of this (times TP)")
      ->check(positive_integer())
      ->capture_default_str();
  app.add_flag("--apply-layernorm-1p", a.apply_layernorm_1p,
               "Store the norm weights zero-centred (weight - 1) for training with --apply-layernorm-1p");
}

void add_export_hf_options(CLI::App& app, ExportHfArgs& a) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--load", a.load, "Checkpoint directory (the latest iteration is exported)")->required();
  app.add_option("--hf-dir", a.hf_dir, "Output directory")->required();
  app.add_option("--hf-architecture", a.architecture,
                 "GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
                 "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, DeepseekV3ForCausalLM or DeepseekV2ForCausalLM (default: the "
                 "imported one, else "
                 "inferred from the model)");
  app.add_option("--hf-dtype", a.dtype, "fp32, bf16 or fp16")->capture_default_str();
  app.add_option("--max-shard-size", a.max_shard_bytes, "Bytes per safetensors file (0 = one file)")
      ->check(integer_range(0));
}

namespace {

// Tokenizer and generation files carried through import and export (config.json is rewritten).
const char* const kAssetFiles[] = {"tokenizer.json",   "tokenizer_config.json", "special_tokens_map.json",
                                   "vocab.json",       "merges.txt",            "tokenizer.model",
                                   "generation_config.json", "added_tokens.json"};

void copy_assets(const fs::path& from, const fs::path& to) {
  for (const char* f : kAssetFiles) {
    if (!fs::is_regular_file(from / f)) continue;
    std::error_code ec;
    fs::copy_file(from / f, to / f, fs::copy_options::overwrite_existing, ec);
    MT_REQUIRE(!ec, "cannot copy '{}' to '{}': {}", (from / f).string(), (to / f).string(), ec.message());
  }
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  MT_REQUIRE(f.good(), "cannot write '{}'", path.string());
  f << text;
  f.flush();
  MT_REQUIRE(f.good(), "error writing '{}' (disk full?)", path.string());
}

DType parse_hf_dtype(const std::string& s) {
  if (s == "fp32") return DType::kF32;
  if (s == "bf16") return DType::kBF16;
  if (s == "fp16") return DType::kF16;
  MT_FAIL("--hf-dtype '{}' is not supported: expected fp32, bf16 or fp16", s);
}

// import-hf / export-hf hold the whole model on the host in fp32 at least twice (the converted
// tensors and the ParamStore's parameters): refused from the configuration before either exists.
void check_host_model(const TransformerConfig& config, const std::string& command) {
  ConfigMemoryOptions o;
  o.training = false;
  o.extra_fp32_copies = 1;
  o.what = command;
  pipeline::PipelineLayout layout;
  layout.num_layers = config.num_layers;
  check_config_memory(config, 1, 1, layout, o, Device::cpu());
}

// The model state beside the parameters (hf::expert_bias_state_names) as views of t's vectors:
// what save_checkpoint writes and load_checkpoint fills in place.
CheckpointExtra state_tensors(const TransformerConfig& config, hf::GlobalTensors& t) {
  CheckpointExtra extra;
  for (const std::string& name : hf::expert_bias_state_names(config)) {
    auto it = t.find(name);
    MT_CHECK(it != t.end() && static_cast<int64_t>(it->second.size()) == config.num_moe_experts,
             "model state '{}' was not mapped with {} values", name, config.num_moe_experts);
    extra.emplace_back(name, Tensor(it->second.data(), DType::kF32, Device::cpu(), {config.num_moe_experts}));
  }
  return extra;
}

CheckpointWriter single_rank_writer() {
  CheckpointWriter w;
  w.world = std::make_shared<SingleRankCommunicator>("world");
  return w;
}

}  // namespace

int run_import_hf(const ImportHfArgs& a) {
  const SaveDirectoryLock save_lock = SaveDirectoryLock::acquire(a.save);  // one writer per --save
  hf::HfModel m = hf::read_hf_config(a.hf_dir, a.seq_length, a.make_vocab_size_divisible_by);
  m.config.layernorm_zero_centered_gamma = a.apply_layernorm_1p;
  const hf::SafetensorsCheckpoint ck = hf::SafetensorsCheckpoint::open(a.hf_dir);
  hf::drop_absent_mtp_layers(m, ck);
  log_info("> importing {} from {}: {}, vocab {} (padded {})", hf::architecture_name(m.arch), a.hf_dir,
           m.config.summary(), m.config.vocab_size, m.config.padded_vocab_size());
  check_host_model(m.config, "import-hf");  // before any tensor is read
  hf::GlobalTensors t = hf::hf_to_megatron(m, ck);
  Stream stream(Device::cpu());
  ParamStore params(GPTModel::param_specs(m.config), DType::kF32, Device::cpu());
  memset_tensor(params.main_flat(), 0, stream);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamInfo& p = params.info(i);
    auto it = t.find(p.name);
    MT_CHECK(it != t.end(), "the {} mapping produced no tensor for parameter {}", hf::architecture_name(m.arch),
             p.name);
    MT_CHECK(static_cast<int64_t>(it->second.size()) == p.numel, "parameter {}: {} values mapped, {} expected",
             p.name, it->second.size(), p.numel);
    copy_bytes(params.main(i).data(), Device::cpu(), it->second.data(), Device::cpu(), it->second.size() * 4, stream);
  }
  CheckpointState st{false, 0, 0, 0, m.config, initial_optimizer_scalars(LossScalerConfig{})};
  save_checkpoint(a.save, st, params, nullptr, single_rank_writer(), stream, state_tensors(m.config, t));
  const fs::path assets = hf_assets_dir(a.save);
  fs::create_directories(assets);
  write_text(assets / "config.json", m.config_json.dump(2) + "\n");
  copy_assets(a.hf_dir, assets);
  log_info("> wrote {} ({:.2f}M parameters; tokenizer files in {})", a.save, params.num_parameters() / 1e6,
           assets.string());
  return 0;
}

int run_export_hf(const ExportHfArgs& a) {
  const DType dtype = parse_hf_dtype(a.dtype);
  const CheckpointState st = read_checkpoint_state(a.load);
  hf::HfModel m;
  m.config = st.model;
  const fs::path assets = hf_assets_dir(a.load);
  if (fs::is_regular_file(assets / "config.json")) {
    std::ifstream f(assets / "config.json");
    m.config_json = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  }
  if (!a.architecture.empty()) {
    m.arch = hf::parse_architecture(a.architecture);
  } else if (m.config_json.is_object() && m.config_json.contains("architectures") &&
             m.config_json["architectures"].is_array() && !m.config_json["architectures"].empty()) {
    m.arch = hf::parse_architecture(m.config_json["architectures"][0].get<std::string>());
  } else {
    m.arch = hf::infer_architecture(m.config);
  }
  hf::check_representable(m.arch, m.config);
  check_host_model(m.config, "export-hf");
  // The whole model on one CPU rank, whatever layout wrote the checkpoint.
  Stream stream(Device::cpu());
  ParamStore params(GPTModel::param_specs(m.config), DType::kF32, Device::cpu());
  hf::GlobalTensors t;
  for (const std::string& name : hf::expert_bias_state_names(m.config))  // read in place by load_checkpoint
    t[name].assign(static_cast<size_t>(m.config.num_moe_experts), 0.f);
  load_checkpoint(a.load, params, nullptr, stream, {}, state_tensors(m.config, t));
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor v = params.main(i);
    const float* p = v.data_as<float>();
    t[params.info(i).name].assign(p, p + v.numel());
  }
  const std::vector<hf::TensorToWrite> out = hf::megatron_to_hf(m, t, dtype);
  fs::create_directories(a.hf_dir);
  hf::write_safetensors_checkpoint(a.hf_dir, out, static_cast<uint64_t>(a.max_shard_bytes));
  write_text(fs::path(a.hf_dir) / "config.json",
             hf::make_hf_config(m.arch, m.config, m.config_json, dtype).dump(2) + "\n");
  copy_assets(assets, a.hf_dir);
  log_info("> exported {} (iteration {}) as {} to {}", a.load, st.iteration, hf::architecture_name(m.arch), a.hf_dir);
  return 0;
}

}  // namespace mt
