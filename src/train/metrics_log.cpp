#include "train/metrics_log.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace mt {

namespace {
double unix_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}
nlohmann::json num(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }
}  // namespace

MetricsLog::MetricsLog(const MetricsLogOptions& opt) : opt_(opt) {
  if (!opt_.tensorboard_dir.empty()) tb_ = std::make_unique<TensorBoardWriter>(opt_.tensorboard_dir);
  if (!opt_.metrics_file.empty()) {
    const auto parent = std::filesystem::path(opt_.metrics_file).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    metrics_.open(opt_.metrics_file, std::ios::app);
    MT_REQUIRE(metrics_.good(), "--metrics-file '{}' cannot be opened for writing", opt_.metrics_file);
  }
}

void MetricsLog::line(const std::string& text) {
  if (!metrics_.is_open()) return;
  metrics_ << text << '\n';
  metrics_.flush();
  MT_REQUIRE(metrics_.good(), "error writing --metrics-file '{}'", opt_.metrics_file);
}

void MetricsLog::iteration_loss(int64_t it, int64_t samples, double loss, double lr, int64_t batch_size) {
  if (!tb_ || it % opt_.tensorboard_log_interval != 0) return;
  tb_->add_scalar("learning-rate", lr, it);
  tb_->add_scalar("learning-rate vs samples", lr, samples);
  tb_->add_scalar("batch-size", static_cast<double>(batch_size), it);
  tb_->add_scalar("batch-size vs samples", static_cast<double>(batch_size), samples);
  tb_->add_scalar("lm loss", loss, it);
  tb_->add_scalar("lm loss vs samples", loss, samples);
}

void MetricsLog::train_point(const TrainLogPoint& p) {
  if (tb_ && p.iteration % opt_.tensorboard_log_interval == 0) {
    const int64_t it = p.iteration, s = p.consumed_samples;
    if (opt_.log_loss_scale) {
      tb_->add_scalar("loss-scale", p.loss_scale, it);
      tb_->add_scalar("loss-scale vs samples", p.loss_scale, s);
    }
    tb_->add_scalar("world-size", p.world_size, it);
    tb_->add_scalar("world-size vs samples", p.world_size, s);
    tb_->add_scalar("grad-norm", p.grad_norm, it);
    tb_->add_scalar("grad-norm vs samples", p.grad_norm, s);
    if (opt_.log_timers) {
      tb_->add_scalar("iteration-time", p.iteration_time_s, it);
      tb_->add_scalar("throughput", p.tflops_per_gpu, it);
      for (const auto& [name, ms] : p.timers_max_ms) tb_->add_scalar(name + "-time", ms / 1e3, it);
    }
    if (opt_.log_memory) {
      if (p.mem_reserved_bytes) tb_->add_scalar("mem-reserved-bytes", *p.mem_reserved_bytes, it);
      if (p.mem_allocated_bytes) tb_->add_scalar("mem-allocated-bytes", *p.mem_allocated_bytes, it);
    }
    tb_->flush();
  }
  nlohmann::json j{{"type", "train"},
                   {"iteration", p.iteration},
                   {"consumed_samples", p.consumed_samples},
                   {"lm_loss", num(p.lm_loss)},
                   {"learning_rate", num(p.learning_rate)},
                   {"global_batch_size", p.batch_size},
                   {"grad_norm", num(p.grad_norm)},
                   {"loss_scale", num(p.loss_scale)},
                   {"elapsed_time_per_iteration_s", num(p.iteration_time_s)},
                   {"throughput_tflops_per_gpu", num(p.tflops_per_gpu)},
                   {"tokens_per_second", num(p.tokens_per_s)},
                   {"skipped_iterations", p.skipped_iterations},
                   {"nan_iterations", p.nan_iterations},
                   {"world_size", p.world_size},
                   {"time", unix_seconds()}};
  if (p.mem_allocated_bytes) j["mem_allocated_bytes"] = *p.mem_allocated_bytes;
  if (p.mem_reserved_bytes) j["mem_reserved_bytes"] = *p.mem_reserved_bytes;
  for (const auto& [name, ms] : p.timers_max_ms) j["timers_max_ms"][name] = ms;
  line(j.dump());
}

void MetricsLog::validation(int64_t it, int64_t samples, double loss, double ppl) {
  if (tb_) {
    tb_->add_scalar("lm loss validation", loss, it);
    tb_->add_scalar("lm loss validation vs samples", loss, samples);
    if (opt_.log_validation_ppl) {
      tb_->add_scalar("lm loss validation ppl", ppl, it);
      tb_->add_scalar("lm loss validation ppl vs samples", ppl, samples);
    }
    tb_->flush();
  }
  line(nlohmann::json{{"type", "validation"},
                      {"iteration", it},
                      {"consumed_samples", samples},
                      {"lm_loss", num(loss)},
                      {"ppl", num(ppl)},
                      {"time", unix_seconds()}}
           .dump());
}

void MetricsLog::flush() {
  if (tb_) tb_->flush();
}

}  // namespace mt
