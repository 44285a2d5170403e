#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <memory>
#include <optional>

#include "comm/bootstrap.h"
#include "core/logging.h"
#include "parallel/process_groups.h"
#include "data/gpt2_tokenizer.h"
#include "data/gpt_window_dataset.h"
#include "data/indexed_dataset.h"
#include "model/gpt.h"
#include "ops/elementwise.h"
#include "train/checkpoint.h"
#include "train/train_step.h"

namespace mt {

Device resolve_device(const std::string& flag) {
  if (flag == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();
  Device d = parse_device(flag);
  MT_REQUIRE(d.is_cpu() || cuda_available(), "--device {} requested but no CUDA device is available{}", flag,
#ifdef MT_WITH_CUDA
             ""
#else
             " (this binary was built without CUDA)"
#endif
  );
  return d;
}

namespace {

std::string timestamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

// Host-side staging of one iteration's batch: tokens and labels of every micro-batch in the
// model's [s, b] layout, copied to the device once per iteration from pinned memory. Two host
// buffers alternate, so filling the next batch only waits for the copy issued two iterations
// earlier (long done); the device buffer is reused in stream order.
class BatchStager {
 public:
  BatchStager(int64_t num_micro, int64_t micro, int64_t seq, Device device)
      : M_(num_micro), b_(micro), s_(seq), device_(device), dev_(device, bytes()),
        samples_(static_cast<size_t>(num_micro * micro * (seq + 1))) {
    for (int i = 0; i < 2; ++i) {
      host_[i] = Buffer(Device::cpu(), bytes(), HostMemory::kPinned);
      copied_[i] = std::make_unique<Event>(device);
    }
  }

  // Loads samples [consumed, consumed + M·b) of the sampler and starts the host-to-device copy.
  void stage(data::GptSampler& sampler, int64_t consumed, const Stream& stream) {
    const int k = next_;
    next_ ^= 1;
    if (used_[k]) copied_[k]->synchronize();  // the copy that last read this host buffer is done
    sampler.get_batch(consumed, M_ * b_, samples_.data());
    int32_t* h = static_cast<int32_t*>(host_[k].data());
    for (int64_t m = 0; m < M_; ++m) {
      int32_t* tok = h + (m * 2) * s_ * b_;
      int32_t* lab = tok + s_ * b_;
      for (int64_t ib = 0; ib < b_; ++ib) {
        const int32_t* smp = samples_.data() + (m * b_ + ib) * (s_ + 1);
        for (int64_t is = 0; is < s_; ++is) {
          tok[is * b_ + ib] = smp[is];
          lab[is * b_ + ib] = smp[is + 1];
        }
      }
    }
    copy_bytes(dev_.data(), device_, host_[k].data(), Device::cpu(), bytes(), stream);
    copied_[k]->record(stream);
    used_[k] = true;
  }

  MicroBatch micro_batch(int64_t m) const {
    int32_t* d = static_cast<int32_t*>(dev_.data()) + (m * 2) * s_ * b_;
    return {Tensor(d, DType::kI32, device_, {s_, b_}), Tensor(d + s_ * b_, DType::kI32, device_, {s_, b_}), Tensor()};
  }

 private:
  size_t bytes() const { return static_cast<size_t>(M_ * 2 * s_ * b_) * 4; }
  int64_t M_, b_, s_;
  Device device_;
  Buffer host_[2];
  Buffer dev_;
  std::vector<int32_t> samples_;
  std::unique_ptr<Event> copied_[2];
  bool used_[2] = {false, false};
  int next_ = 0;
};

struct Datasets {
  std::shared_ptr<const data::IndexedDataset> indexed;
  std::unique_ptr<data::GptWindowDataset> train, valid;
};

Datasets build_datasets(const PretrainArgs& args) {
  Datasets d;
  d.indexed = std::make_shared<data::IndexedDataset>(args.data_path);
  const auto ranges = data::split_document_ranges(data::parse_split(args.split), d.indexed->num_documents());
  const int64_t seq = args.model.seq_length;
  d.train = std::make_unique<data::GptWindowDataset>(d.indexed, ranges[0].first, ranges[0].second, seq, "train");
  d.train->check_token_range(args.model.vocab_size);
  if (ranges[1].second > ranges[1].first && args.eval_iters > 0) {
    try {
      d.valid = std::make_unique<data::GptWindowDataset>(d.indexed, ranges[1].first, ranges[1].second, seq, "valid");
      d.valid->check_token_range(args.model.vocab_size);
    } catch (const Error& e) {
      log_warn("no validation set: {}", e.what());
      d.valid.reset();
    }
  }
  log_info("> datasets: {} documents; train docs [{}, {}) = {} samples; valid docs [{}, {}) = {} samples",
           d.indexed->num_documents(), ranges[0].first, ranges[0].second, d.train->num_samples(), ranges[1].first,
           ranges[1].second, d.valid ? d.valid->num_samples() : 0);
  return d;
}

void check_resume_config(const GptConfig& ck, const GptConfig& m) {
  auto same = [](const char* flag, int64_t a, int64_t b) {
    MT_REQUIRE(a == b, "checkpoint has {} {} but the command line asks for {}", flag, a, b);
  };
  same("--num-layers", ck.num_layers, m.num_layers);
  same("--hidden-size", ck.hidden_size, m.hidden_size);
  same("--num-attention-heads", ck.num_attention_heads, m.num_attention_heads);
  same("--ffn-hidden-size", ck.ffn(), m.ffn());
  same("--max-position-embeddings", ck.max_positions(), m.max_positions());
  same("padded vocabulary size", ck.padded_vocab_size(), m.padded_vocab_size());
}

class ProgressLine {
 public:
  explicit ProgressLine(bool enabled) : enabled_(enabled && isatty(STDERR_FILENO)) {}
  void update(int64_t it, int64_t total) {
    if (!enabled_) return;
    const int width = 30;
    int done = static_cast<int>(width * it / std::max<int64_t>(total, 1));
    std::fprintf(stderr, "\r[%.*s%*s] %lld/%lld", done, "##############################", width - done, "",
                 static_cast<long long>(it), static_cast<long long>(total));
    std::fflush(stderr);
    dirty_ = true;
  }
  void clear() {
    if (enabled_ && dirty_) std::fprintf(stderr, "\r%*s\r", 60, "");
    dirty_ = false;
  }

 private:
  bool enabled_;
  bool dirty_ = false;
};

}  // namespace

int run_pretrain(PretrainArgs args) {
  const LaunchEnv env = read_launch_env();
  Device device = resolve_device(args.device);
  if (device.is_cuda() && env.world_size > 1) device = local_device(DeviceType::kCUDA, env);  // GPU = LOCAL_RANK
  set_current_device(device);
  const std::shared_ptr<Communicator> world = init_world(device, env, args.distributed_timeout_minutes);
  if (world->rank() != 0) set_log_level(LogLevel::kWarn);  // rank 0 logs
  ParallelConfig pc;
  pc.tp = args.tensor_model_parallel_size;
  validate_and_derive(pc, world->size());
  args.data_parallel_size = pc.dp;
  MT_REQUIRE(device.is_cuda() || args.dtype() == DType::kF32,
             "--{} needs a CUDA device; the CPU backend trains in fp32", args.bf16 ? "bf16" : "fp16");

  data::Gpt2Tokenizer tokenizer = data::Gpt2Tokenizer::from_files(args.vocab_file, args.merge_file);
  args.model.vocab_size = tokenizer.vocab_size();

  std::optional<CheckpointState> resume;
  if (!args.load.empty()) {
    const bool autoresume = args.load == args.save;
    if (autoresume && !latest_checkpoint_iteration(args.load).has_value()) {
      log_info("> no checkpoint in {} yet (--load == --save): starting from scratch", args.load);
    } else {
      resume = read_checkpoint_state(args.load);
    }
  }
  validate_pretrain_args(args);
  if (resume) check_resume_config(resume->model, args.model);
  if (!args.save.empty() && world->rank() == 0) {  // fail early on an unwritable --save
    std::error_code ec;
    std::filesystem::create_directories(args.save, ec);
    const auto probe = std::filesystem::path(args.save) / ".write_test";
    std::FILE* f = ec ? nullptr : std::fopen(probe.c_str(), "w");
    MT_REQUIRE(f != nullptr, "--save directory '{}' is not writable{}", args.save,
               ec ? ": " + ec.message() : std::string());
    std::fclose(f);
    std::filesystem::remove(probe, ec);
  }

  Datasets data = build_datasets(args);
  Stream stream(device);
  const ProcessGroups groups = build_process_groups(world, pc);
  if (world->size() > 1) log_info("{}", layout_table(pc));
  const int dp_rank = groups.dp->rank();
  GptModel model(args.model, args.micro_batch_size, args.dtype(), device, groups, args.sequence_parallel, pc.dp);
  const auto& cfg = model.config();
  log_info("> model: GPT {} layers, hidden {}, heads {}, ffn {}, seq {}, vocab {} (padded {}), {:.2f}M parameters, "
           "{} on {}; activations {:.1f} MiB",
           cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn(), cfg.seq_length, cfg.vocab_size,
           model.padded_vocab(), model.params().num_parameters() / 1e6, dtype_name(args.dtype()), device.str(),
           model.activation_bytes() / 1048576.0);
  AdamWOptimizer optimizer(model.params(), args.optim, stream, {groups.dp, groups.mp, groups.tp->rank()});

  int64_t iteration = 0, consumed = 0;
  if (resume) {
    CheckpointState st = load_checkpoint(args.load, model.params(), &optimizer, stream);
    iteration = st.iteration;
    consumed = st.consumed_train_samples;
    MT_REQUIRE(st.seed == args.seed, "checkpoint was trained with --seed {} but --seed {} was given", st.seed,
               args.seed);
    log_info("> loaded checkpoint from {} at iteration {} ({} samples consumed)", args.load, iteration, consumed);
  } else {
    model.params().initialize(args.seed, stream);
  }

  const int64_t M = args.num_microbatches();
  const int64_t tokens_per_micro = cfg.seq_length * args.micro_batch_size;
  // Each rank's share of the global mean loss: summed over DP it is the mean over all tokens.
  const float loss_weight = 1.0f / static_cast<float>(tokens_per_micro * M * pc.dp);
  const int64_t dp_sample_offset = dp_rank * M * args.micro_batch_size;  // this rank's slice of a batch
  const LrScheduleConfig sched = args.lr_schedule();

  // Per-iteration losses of the current log interval live on the device; read at log time.
  Buffer losses_dev(device, static_cast<size_t>(args.log_interval) * 4);
  Tensor losses = losses_dev.as(DType::kF32, {args.log_interval});
  fill(losses, 0.f, stream);
  Buffer eval_loss_dev(device, 4);
  Tensor eval_loss = eval_loss_dev.as(DType::kF32, {1});
  BatchStager stager(M, args.micro_batch_size, cfg.seq_length, device);
  data::GptSampler train_sampler(*data.train, args.seed, /*shuffle=*/true);
  std::unique_ptr<data::GptSampler> valid_sampler;
  if (data.valid) valid_sampler = std::make_unique<data::GptSampler>(*data.valid, args.seed, /*shuffle=*/false);

  auto save = [&](int64_t it) {
    CheckpointState st{it, consumed, args.seed, cfg, optimizer.read_scalars_sync(stream)};
    CheckpointWriter writer{world, pc.tp, groups.tp->rank(), dp_rank,
                            [&](int r) { return GptModel::param_specs(cfg, pc.tp, r); }};
    save_checkpoint(args.save, st, model.params(), &optimizer, writer, stream);
    log_info("  successfully saved checkpoint at iteration {:7d} to {}", it, args.save);
  };

  auto evaluate = [&](int64_t it) -> std::optional<EvalResult> {
    if (!data.valid) return std::nullopt;
    fill(eval_loss, 0.f, stream);
    for (int64_t e = 0; e < args.eval_iters; ++e) {
      stager.stage(*valid_sampler, e * args.global_batch_size + dp_sample_offset, stream);
      for (int64_t m = 0; m < M; ++m) {
        DropoutContext dc{args.seed, static_cast<uint64_t>(it), static_cast<uint32_t>(m), false};
        model.forward(stager.micro_batch(m), dc, eval_loss, loss_weight / static_cast<float>(args.eval_iters),
                      stream);
      }
    }
    groups.dp->all_reduce(eval_loss, ReduceOp::kSum, stream);
    float host = 0;
    copy_bytes(&host, Device::cpu(), eval_loss.data(), device, 4, stream);
    stream.synchronize();
    EvalResult r{host, std::exp(std::min<double>(host, 20.0))};
    std::string line = fmt::format(" validation loss at iteration {} | lm loss value: {:.6E} | lm loss PPL: {:.6E} | ",
                                   it, r.loss, r.ppl);
    std::string bar(line.size(), '-');
    log_info("{}\n{}\n{}", bar, line, bar);
    return r;
  };

  log_info("> training {} iterations from iteration {}: global batch {} = {} micro-batches of {}, seq {}", 
           args.train_iters, iteration, args.global_batch_size, M, args.micro_batch_size, cfg.seq_length);
  ProgressLine progress(args.progress);
  OptimizerScalars last = optimizer.read_scalars_sync(stream);
  int64_t last_skipped = last.skipped_iters;
  auto t_last = std::chrono::steady_clock::now();
  int64_t iters_since_log = 0;
  const double flops_iter = cfg.flops_per_iteration(args.global_batch_size);

  // Validation before the first iteration of a fresh run gives the starting point of the curve.
  if (!resume && data.valid) evaluate(0);
  t_last = std::chrono::steady_clock::now();
  while (iteration < args.train_iters) {
    const float lr = static_cast<float>(learning_rate(sched, iteration));
    stager.stage(train_sampler, consumed + dp_sample_offset, stream);
    std::vector<MicroBatch> mbs;
    for (int64_t m = 0; m < M; ++m) mbs.push_back(stager.micro_batch(m));
    train_step(model, optimizer, mbs,
               {args.seed, iteration, lr, loss_weight, static_cast<uint32_t>(dp_rank * M)},
               losses.flat_range(iters_since_log, 1), stream);
    ++iteration;
    ++iters_since_log;
    consumed += args.global_batch_size;
    progress.update(iteration, args.train_iters);

    if (iteration % args.log_interval == 0 || iteration == args.train_iters) {
      std::vector<float> host(static_cast<size_t>(iters_since_log));
      groups.dp->all_reduce(losses, ReduceOp::kSum, stream);
      copy_bytes(host.data(), Device::cpu(), losses.data(), device, host.size() * 4, stream);
      const OptimizerScalars sc = optimizer.read_scalars_sync(stream);  // synchronizes
      const auto now = std::chrono::steady_clock::now();
      const double ms = std::chrono::duration<double, std::milli>(now - t_last).count() / iters_since_log;
      double loss_sum = 0;
      int64_t n_ok = 0, n_nan = 0;
      for (float l : host) {
        if (std::isfinite(l)) {
          loss_sum += l;
          ++n_ok;
        } else {
          ++n_nan;
        }
      }
      const double tokens_per_s = args.global_batch_size * cfg.seq_length / (ms / 1e3);
      const double tflops = flops_iter / (ms / 1e3) / 1e12 / world->size();  // per GPU
      progress.clear();
      std::string line = fmt::format(
          " [{}] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} | "
          "throughput per GPU (TFLOP/s/GPU): {:.1f} | tokens per second: {:.0f} | learning rate: {:.6E} | "
          "global batch size: {:5d} | lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} | "
          "number of skipped iterations: {:3d} | number of nan iterations: {:3d} |",
          timestamp(), iteration, args.train_iters, consumed, ms, tflops, tokens_per_s, lr, args.global_batch_size,
          n_ok ? loss_sum / n_ok : NAN, sc.loss_scale, sc.grad_norm, sc.skipped_iters - last_skipped, n_nan);
      log_info("{}", line);
      last_skipped = sc.skipped_iters;
      iters_since_log = 0;
      fill(losses, 0.f, stream);
      t_last = std::chrono::steady_clock::now();
    }
    bool timing_reset = false;
    if (iteration % args.eval_interval == 0 || iteration == args.train_iters) {
      progress.clear();
      evaluate(iteration);
      timing_reset = true;
    }
    const bool exiting = args.exit_interval > 0 && iteration % args.exit_interval == 0;
    if (!args.save.empty() && ((args.save_interval > 0 && iteration % args.save_interval == 0) ||
                               iteration == args.train_iters || exiting)) {
      progress.clear();
      save(iteration);
      timing_reset = true;
    }
    if (timing_reset) t_last = std::chrono::steady_clock::now();
    if (exiting && iteration < args.train_iters) {
      log_info("exiting program at iteration {} (--exit-interval {})", iteration, args.exit_interval);
      break;
    }
  }
  progress.clear();
  stream.synchronize();
  if (device.is_cuda()) {
    log_info("> device memory: {:.1f} MiB in megatron.cpp buffers (static: allocated once, so also the peak), "
             "{:.1f} MiB in use on {} (cudaMemGetInfo, includes the CUDA context and cuBLAS)",
             device_bytes_allocated(device) / 1048576.0, device_memory_in_use(device) / 1048576.0, device.str());
  }
  return 0;
}

}  // namespace mt
