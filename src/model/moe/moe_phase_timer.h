// Per-phase timing of the MoE layers (docs/moe.md "Per-phase timing"). With the environment
// variable MT_MOE_PHASE_TIMING=1, every MoE layer (MoELayer, moe_layer.cpp) records an event (CUDA:
// a cudaEvent on the layer's stream; CPU: the host's steady clock, the CPU stream running inline)
// at the start and end of its forward and backward and around each phase of them:
//   router          the TopKRouter's forward (logits, top-k, probs, aux-loss values) / backward
//   permute         the dispatcher's preprocess(): the routing metadata and, alltoall, permutation 1
//                   (backward: preprocess_backward, permutation 1 undone)
//   dispatch        dispatch(): the host read of the counts where there is one, the token exchange
//                   (all-gather / all-to-all) and the rows put in local-expert order (backward:
//                   dispatch_backward)
//   experts         the local experts' fc1 -> activation -> fc2: the grouped GEMM
//                   (--moe-grouped-gemm) or the per-expert cuBLASLt loop (backward: dgrad, wgrad)
//   combine         the prob-weighted unpermute and the reverse exchange (backward: its gradients)
//   shared experts  the shared experts' MLP; with --moe-shared-expert-overlap the part not hidden:
//                   the wait for the side stream and the add
//   pipelined       --overlap-moe-expert-parallel-comm: the chunked dispatch, experts and combine,
//                   which overlap one another, as one phase
// At the end of the process (the timer is a process-wide static: `megatron pretrain` runs one
// rank per process; rank 0 logs) it prints one table: each phase's forward and backward ms per
// iteration summed over the MoE layers, averaged over the measured iterations, and the layers'
// own time, of which "between phases" (launch gaps, host work) is the part outside every phase.
// Measured: the training passes (recomputed forwards count as forwards) of the iterations after the
// first MT_MOE_PHASE_TIMING_WARMUP (default 1) the process runs, on the thread that ran the first
// one (CPU thread ranks in tests: that rank only). Not measured: evaluation, passes under CUDA-graph
// capture or replay (per-layer graphs, the full-iteration graph). The events of an iteration are
// read back (one host synchronisation) at the first MoE pass of the next one and at the report.
// Off (the default): no timer exists and each phase costs a null-pointer test.
#pragma once
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/logging.h"
#include "core/stream.h"
#include "model/module.h"

namespace mt {

enum class MoePhase : uint8_t { kRouter, kPermute, kDispatch, kExperts, kCombine, kSharedExperts, kPipelined };
inline constexpr int kMoePhases = 7;

/// The phase's name in the table ("router", "permute", ...).
inline const char* moe_phase_name(MoePhase p) {
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

/// What the table shows: ms per measured iteration, summed over the MoE layers.
struct MoePhaseTimes {
  std::array<double, kMoePhases> forward_ms{}, backward_ms{};
  double layer_forward_ms = 0, layer_backward_ms = 0;  ///< the layers' whole passes
  int64_t iterations = 0;                              ///< measured iterations
  int64_t layers = 0;                                  ///< distinct MoE layers measured
  int64_t forward_passes = 0, backward_passes = 0;     ///< measured layer passes (totals, not per iteration)
};

class MoePhaseTimer {
 public:
  /// The most events recorded between two read-backs (a read-back also happens at every new iteration).
  static constexpr size_t kEventPoolSize = 8192;

  /// From the environment: nullptr when MT_MOE_PHASE_TIMING is unset, empty or "0"; a timer when it
  /// is "1", leaving out the first MT_MOE_PHASE_TIMING_WARMUP (a non-negative integer, default 1)
  /// iterations it sees. Errors: mt::Error naming the variable and its value otherwise.
  static std::unique_ptr<MoePhaseTimer> from_environment() {
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

  /// The timer the MoE layers of this thread record into: a ScopedForTesting one, else the
  /// process's (from_environment(), read once; its destructor prints the table at the end of the
  /// process); nullptr when timing is off.
  static MoePhaseTimer* current() {
    if (MoePhaseTimer* t = thread_override()) return t;
    static const std::unique_ptr<MoePhaseTimer> timer = from_environment();
    return timer.get();
  }
  /// Tests: the MoE layers of this thread record into `timer` while this object lives.
  class ScopedForTesting {
   public:
    explicit ScopedForTesting(MoePhaseTimer* timer) : saved_(thread_override()) { thread_override() = timer; }
    ~ScopedForTesting() { thread_override() = saved_; }
    ScopedForTesting(const ScopedForTesting&) = delete;
    ScopedForTesting& operator=(const ScopedForTesting&) = delete;

   private:
    MoePhaseTimer* saved_;
  };

  explicit MoePhaseTimer(int64_t warmup_iterations) : warmup_(warmup_iterations) {
    MT_REQUIRE(warmup_iterations >= 0, "MoE phase timing: warm-up iterations {} < 0", warmup_iterations);
  }
  /// Prints report() (log_info) when anything was measured; never throws.
  ~MoePhaseTimer() {
    try {
      const std::string r = report();
      if (!r.empty()) log_info("{}", r);
    } catch (const std::exception& e) {  // e.g. a device already failed: say so, never throw here
      std::fprintf(stderr, "MoE phase timing: no report (%s)\n", e.what());
    }
  }
  MoePhaseTimer(const MoePhaseTimer&) = delete;
  MoePhaseTimer& operator=(const MoePhaseTimer&) = delete;

  /// The times so far, per measured iteration (reads the recorded events back: synchronises).
  MoePhaseTimes times() {
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

  /// The table: a header line, then "phase forward backward total % of layer" (ms per iteration)
  /// for each phase that ran, "between phases" and "MoE layers (total)". Empty when nothing was
  /// measured.
  std::string report() {
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

 private:
  friend class MoePhasePass;
  struct Record {
    uint32_t begin, end;  // indices into events_
    int8_t phase;         // -1: the layer's whole pass
    bool backward;
  };
  // The most events one pass records: its start and end, and a start and end per phase scope.
  static constexpr size_t kMaxEventsPerPass = 2 + 2 * (kMoePhases + 2);

  static MoePhaseTimer*& thread_override() {
    thread_local MoePhaseTimer* t = nullptr;
    return t;
  }
  static bool capturing(const Stream& s) {
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

  // Whether a pass with this context is measured; reads the previous iteration's events back at
  // the first pass of a new one (no pass is open then: the MoE layers of a rank run one at a time).
  bool begin_pass(const StepContext& ctx, int64_t layer) {
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
  uint32_t record(const Stream& stream) {
    MT_CHECK(used_ < kEventPoolSize, "MoE phase timing: event pool exhausted ({} events)", used_);
    if (used_ == events_.size()) {
      events_.push_back(std::make_unique<Event>(stream.device()));
      clock_ = stream.is_cpu() ? "the host's steady clock" : "CUDA events";
    }
    events_[used_]->record(stream);
    return static_cast<uint32_t>(used_++);
  }
  void resolve() {
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

  int64_t warmup_;
  bool have_first_ = false;
  uint64_t first_iteration_ = 0;
  std::thread::id thread_;
  std::set<uint64_t> iterations_;
  std::set<int64_t> layers_;
  std::string clock_ = "events";  // where the times come from (CUDA events, the host's clock)
  std::vector<std::unique_ptr<Event>> events_;
  size_t used_ = 0;
  std::vector<Record> pending_;
  MoePhaseTimes sums_;  // ms summed over every measured iteration
};

/// One pass (forward or backward) of one MoE layer (RAII): records the layer's start at
/// construction and its end at destruction; phase() times a phase of it. Inactive (records
/// nothing) when `timer` is null or does not measure this pass.
class MoePhasePass {
 public:
  MoePhasePass(MoePhaseTimer* timer, const StepContext& ctx, bool backward, int64_t layer)
      : timer_(timer), stream_(&ctx.stream), backward_(backward) {
    if (timer_ == nullptr) return;
    if (!timer_->begin_pass(ctx, layer)) {
      timer_ = nullptr;
      return;
    }
    ++(backward ? timer_->sums_.backward_passes : timer_->sums_.forward_passes);
    begin_ = timer_->record(*stream_);
  }
  ~MoePhasePass() {
    if (timer_ != nullptr && std::uncaught_exceptions() == 0)
      timer_->pending_.push_back({begin_, timer_->record(*stream_), -1, backward_});
  }
  MoePhasePass(const MoePhasePass&) = delete;
  MoePhasePass& operator=(const MoePhasePass&) = delete;

  /// Times a phase of the pass from construction to destruction.
  class Phase {
   public:
    Phase(MoePhasePass* pass, MoePhase p) : pass_(pass), phase_(p) {
      if (pass_ != nullptr) begin_ = pass_->timer_->record(*pass_->stream_);
    }
    ~Phase() {
      if (pass_ != nullptr && std::uncaught_exceptions() == 0)
        pass_->timer_->pending_.push_back(
            {begin_, pass_->timer_->record(*pass_->stream_), static_cast<int8_t>(phase_), pass_->backward_});
    }
    Phase(const Phase&) = delete;
    Phase& operator=(const Phase&) = delete;

   private:
    MoePhasePass* pass_;  // nullptr: inactive
    MoePhase phase_;
    uint32_t begin_ = 0;
  };
  Phase phase(MoePhase p) { return Phase(timer_ != nullptr ? this : nullptr, p); }

 private:
  MoePhaseTimer* timer_;  // nullptr: inactive
  const Stream* stream_;
  bool backward_;
  uint32_t begin_ = 0;
};

}  // namespace mt
