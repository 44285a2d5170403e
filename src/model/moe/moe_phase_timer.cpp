#include "model/moe/moe_phase_timer.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/logging.h"

namespace mt {

const char* moe_phase_name(MoePhase p) {
  switch (p) {
    case MoePhase::kRouter: return "router";
    case MoePhase::kPermute: return "permute";
    case MoePhase::kDispatch: return "dispatch";
    case MoePhase::kExperts: return "experts";
    case MoePhase::kCombine: return "combine";
    case MoePhase::kSharedExperts: return "shared experts";
    case MoePhase::kPipelined: return "pipelined dispatch+experts+combine";
  }
  return "?";
}

std::unique_ptr<MoePhaseTimer> MoePhaseTimer::from_environment() {
  const char* on = std::getenv("MT_MOE_PHASE_TIMING");
  if (on == nullptr || *on == '\0' || std::strcmp(on, "0") == 0) return nullptr;
  MT_REQUIRE(std::strcmp(on, "1") == 0, "MT_MOE_PHASE_TIMING={}: expected 0 or 1", on);
  int64_t warmup = 1;
  if (const char* w = std::getenv("MT_MOE_PHASE_TIMING_WARMUP"); w != nullptr && *w != '\0') {
    char* end = nullptr;
    const long long x = std::strtoll(w, &end, 10);
    MT_REQUIRE(end != w && *end == '\0' && x >= 0, "MT_MOE_PHASE_TIMING_WARMUP={}: expected a non-negative integer",
               w);
    warmup = x;
  }
  return std::make_unique<MoePhaseTimer>(warmup);
}

MoePhaseTimer* MoePhaseTimer::current() {
  if (MoePhaseTimer* t = thread_override()) return t;
  static const std::unique_ptr<MoePhaseTimer> timer = from_environment();
  return timer.get();
}

MoePhaseTimer::MoePhaseTimer(int64_t warmup_iterations) : warmup_(warmup_iterations) {
  MT_REQUIRE(warmup_iterations >= 0, "MoE phase timing: warm-up iterations {} < 0", warmup_iterations);
}

MoePhaseTimer::~MoePhaseTimer() {
  try {
    const std::string r = report();
    if (!r.empty()) log_info("{}", r);
  } catch (const std::exception& e) {  // e.g. a device already failed: say so, never throw here
    std::fprintf(stderr, "MoE phase timing: no report (%s)\n", e.what());
  }
}

MoePhaseTimes MoePhaseTimer::times() {
  resolve();
  MoePhaseTimes t = sums_;
  t.iterations = static_cast<int64_t>(iterations_.size());
  t.layers = static_cast<int64_t>(layers_.size());
  const double n = t.iterations > 0 ? static_cast<double>(t.iterations) : 1.0;
  for (double& v : t.forward_ms) v /= n;
  for (double& v : t.backward_ms) v /= n;
  t.layer_forward_ms /= n;
  t.layer_backward_ms /= n;
  return t;
}

std::string MoePhaseTimer::report() {
  const MoePhaseTimes t = times();
  if (t.forward_passes + t.backward_passes == 0) return "";
  const double layer = t.layer_forward_ms + t.layer_backward_ms;
  const auto line = [&](const char* name, double f, double b) {
    return fmt::format("  {:<36} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.1f}%\n", name, f, b, f + b,
                       layer > 0 ? 100.0 * (f + b) / layer : 0.0);
  };
  std::string s = fmt::format(
      "MoE phase timing (MT_MOE_PHASE_TIMING, {}): {} MoE layer(s), {} iteration(s) measured after {} warm-up, "
      "{} forward / {} backward layer passes; ms per iteration, summed over the layers\n",
      clock_, t.layers, t.iterations, warmup_, t.forward_passes, t.backward_passes);
  s += fmt::format("  {:<36} {:>10} {:>10} {:>10} {:>11}\n", "phase", "forward", "backward", "total", "% of layer");
  double fsum = 0, bsum = 0;
  for (int p = 0; p < kMoePhases; ++p) {
    const double f = t.forward_ms[static_cast<size_t>(p)], b = t.backward_ms[static_cast<size_t>(p)];
    fsum += f;
    bsum += b;
    if (f > 0 || b > 0) s += line(moe_phase_name(static_cast<MoePhase>(p)), f, b);  // the phases that ran
  }
  s += line("between phases", t.layer_forward_ms - fsum, t.layer_backward_ms - bsum);
  s += line("MoE layers (total)", t.layer_forward_ms, t.layer_backward_ms);
  s.pop_back();  // the last newline
  return s;
}

MoePhaseTimer*& MoePhaseTimer::thread_override() {
  thread_local MoePhaseTimer* t = nullptr;
  return t;
}

bool MoePhaseTimer::capturing(const Stream& s) {
#ifdef MT_WITH_CUDA
  if (!s.is_cpu()) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(s.cuda_stream()), &cs));
    return cs != cudaStreamCaptureStatusNone;
  }
#endif
  (void)s;
  return false;
}

bool MoePhaseTimer::begin_pass(const StepContext& ctx, int64_t layer) {
  if (!ctx.dropout.training || ctx.graphs != nullptr) return false;
  if (!have_first_) {
    have_first_ = true;
    first_iteration_ = ctx.dropout.iteration;
    thread_ = std::this_thread::get_id();
  }
  if (std::this_thread::get_id() != thread_ || capturing(ctx.stream)) return false;
  const uint64_t it = ctx.dropout.iteration;
  if (it < first_iteration_ + static_cast<uint64_t>(warmup_)) return false;
  if (iterations_.insert(it).second || used_ + kMaxEventsPerPass > kEventPoolSize) resolve();
  layers_.insert(layer);
  return true;
}

uint32_t MoePhaseTimer::record(const Stream& stream) {
  MT_CHECK(used_ < kEventPoolSize, "MoE phase timing: event pool exhausted ({} events)", used_);
  if (used_ == events_.size()) {
    events_.push_back(std::make_unique<Event>(stream.device()));
    clock_ = stream.is_cpu() ? "the host's steady clock" : "CUDA events";
  }
  events_[used_]->record(stream);
  return static_cast<uint32_t>(used_++);
}

void MoePhaseTimer::end_scope(uint32_t begin, const Stream& stream, int8_t phase, bool backward) {
  if (std::uncaught_exceptions() == 0) pending_.push_back({begin, record(stream), phase, backward});
}

void MoePhaseTimer::resolve() {
  for (const Record& r : pending_) {
    const Event& e = *events_[r.end];
    e.synchronize();
    const double ms = e.elapsed_ms_since(*events_[r.begin]);
    if (r.phase < 0)
      (r.backward ? sums_.layer_backward_ms : sums_.layer_forward_ms) += ms;
    else
      (r.backward ? sums_.backward_ms : sums_.forward_ms)[static_cast<size_t>(r.phase)] += ms;
  }
  pending_.clear();
  used_ = 0;
}

void MoePhasePass::begin(const StepContext& ctx, int64_t layer) {
  if (!timer_->begin_pass(ctx, layer)) {
    timer_ = nullptr;
    return;
  }
  ++(backward_ ? timer_->sums_.backward_passes : timer_->sums_.forward_passes);
  begin_ = timer_->record(*stream_);
}

}  // namespace mt
