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
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/stream.h"
#include "model/module.h"

namespace mt {

enum class MoePhase : uint8_t { kRouter, kPermute, kDispatch, kExperts, kCombine, kSharedExperts, kPipelined };
inline constexpr int kMoePhases = 7;

/// The phase's name in the table ("router", "permute", ...).
const char* moe_phase_name(MoePhase p);

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
  static std::unique_ptr<MoePhaseTimer> from_environment();

  /// The timer the MoE layers of this thread record into: a ScopedForTesting one, else the
  /// process's (from_environment(), read once; its destructor prints the table at the end of the
  /// process); nullptr when timing is off.
  static MoePhaseTimer* current();
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

  /// Errors: mt::Error when `warmup_iterations` < 0.
  explicit MoePhaseTimer(int64_t warmup_iterations);
  /// Prints report() (log_info) when anything was measured; never throws.
  ~MoePhaseTimer();
  MoePhaseTimer(const MoePhaseTimer&) = delete;
  MoePhaseTimer& operator=(const MoePhaseTimer&) = delete;

  /// The times so far, per measured iteration (reads the recorded events back: synchronises).
  MoePhaseTimes times();

  /// The table: a header line, then "phase forward backward total % of layer" (ms per iteration)
  /// for each phase that ran, "between phases" and "MoE layers (total)". Empty when nothing was
  /// measured.
  std::string report();

 private:
  friend class MoePhasePass;
  struct Record {
    uint32_t begin, end;  // indices into events_
    int8_t phase;         // -1: the layer's whole pass
    bool backward;
  };
  // The most events one pass records: its start and end, and a start and end per phase scope.
  static constexpr size_t kMaxEventsPerPass = 2 + 2 * (kMoePhases + 2);

  static MoePhaseTimer*& thread_override();  // this thread's ScopedForTesting timer, or nullptr
  static bool capturing(const Stream& s);    // whether `s` is under CUDA-graph capture

  // Whether a pass with this context is measured; reads the previous iteration's events back at
  // the first pass of a new one (no pass is open then: the MoE layers of a rank run one at a time).
  bool begin_pass(const StepContext& ctx, int64_t layer);
  // Records an event on `stream`; returns its index into events_.
  uint32_t record(const Stream& stream);
  // Records the end of a pass (phase -1) or phase that began at event `begin`, unless an exception
  // is unwinding the pass.
  void end_scope(uint32_t begin, const Stream& stream, int8_t phase, bool backward);
  // Reads the pending events back into sums_ and frees the pool.
  void resolve();

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
    if (timer_ != nullptr) begin(ctx, layer);
  }
  ~MoePhasePass() {
    if (timer_ != nullptr) timer_->end_scope(begin_, *stream_, -1, backward_);
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
      if (pass_ != nullptr)
        pass_->timer_->end_scope(begin_, *pass_->stream_, static_cast<int8_t>(phase_), pass_->backward_);
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
  // The active start: whether timer_ measures this pass (else timer_ = nullptr), its first event.
  void begin(const StepContext& ctx, int64_t layer);

  MoePhaseTimer* timer_;  // nullptr: inactive
  const Stream* stream_;
  bool backward_;
  uint32_t begin_ = 0;
};

}  // namespace mt
