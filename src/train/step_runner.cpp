#include "train/step_runner.h"

#include <chrono>

#include <fmt/ranges.h>

#include "core/logging.h"
#include "model/moe/token_dispatcher.h"
#include "ops/elementwise.h"

namespace mt {

StepRunner::StepRunner(ModelSetup& setup, const CudaGraphOptions& graphs, uint64_t seed, Timers* timers,
                       const Stream& stream)
    : setup_(setup),
      graphs_(graphs),
      seed_(seed),
      timers_(graphs.enabled() ? nullptr : timers),
      stream_(stream),
      step_values_(setup.options().device),
      eval_values_(setup.options().device),
      layer_graphs_(graphs.captures("attn"), graphs.captures("mlp"), graphs.captures("moe"),
                    graphs.captures("moe_router"), graphs.captures("moe_preprocess")),
      step_loss_(setup.options().device, 4) {
  if (graphs_.per_layer()) {
    setup_.model().set_layer_graphs(&layer_graphs_);
    setup_.executor().use_slot_keys();
  }
}

// The scopes of the per-layer graphs and what a moe_preprocess graph holds (the summary line).
std::string StepRunner::per_layer_scopes() const {
  const TransformerConfig& cfg = setup_.options().model;
  std::string out = graphs_.scope.empty() ? std::string("attn mlp moe") : fmt::format("{}", fmt::join(graphs_.scope, " "));
  if (cfg.num_moe_experts > 0 && !graphs_.scope.empty() && graphs_.captures("moe_preprocess"))
    out += fmt::format(" (moe_preprocess: {})",
                       moe_preprocess_region(cfg.moe_token_dispatcher_type,
                                             {.num_echo = cfg.moe_enable_echo ? cfg.moe_num_echo_experts : 0,
                                              .received_capacity = cfg.moe_received_token_capacity}));
  return out;
}

void StepRunner::step(int64_t iteration, float lr, const std::vector<MicroBatch>& micro_batches,
                      const Tensor& loss_slot, const Event* snapshot_pending, float decoupled_lr) {
  const auto host_t0 = std::chrono::steady_clock::now();  // the host's time to issue the step
  step_values_.write(iteration, lr, stream_, decoupled_lr);
  const ProcessGroups& g = setup_.groups();
  StepOptions so{seed_, iteration, lr, g.dp->rank(), g.dp->size(), timers_, &step_values_};
  so.decoupled_lr = decoupled_lr;
  if (graphs_.full_iteration()) {
    step_full_iteration(micro_batches, so, loss_slot, snapshot_pending);
  } else {
    // An --async-save snapshot still being copied: the step's update waits for it on the device.
    so.wait_before_update = snapshot_pending;
    step_eager(micro_batches, so, loss_slot);
  }
  host_issue_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_t0).count();
  ++steps_run_;
}

// Eager, or per layer: after the warm-up the layers capture their regions on first use.
void StepRunner::step_eager(const std::vector<MicroBatch>& micro_batches, const StepOptions& so,
                            const Tensor& loss_slot) {
  const Device device = setup_.options().device;
  if (graphs_.per_layer() && steps_run_ >= graphs_.warmup_steps) layer_graphs_.set_capturing(true);
  const size_t before = graphs_.per_layer() ? device_memory_in_use(device) : 0;
  const PipelinePlan& plan = setup_.train_plan(static_cast<int64_t>(micro_batches.size()));  // ramp-up: per count
  train_step(setup_.model(), setup_.executor(), plan, setup_.optimizer(), micro_batches, so, loss_slot,
             stream_);
  if (layer_graphs_.graphs() <= layer_graphs_logged_) return;
  // a step captured new per-layer graphs
  log_info("> CUDA graph (per layer, scopes {}): {} graphs ({} nodes) over {} activation slots (the static "
           "buffer sets; the pipeline schedule's in-flight bound); graph memory {:.1f} MiB (device memory "
           "in use before and after the capturing step)",
           per_layer_scopes(), layer_graphs_.graphs(), layer_graphs_.nodes(), plan.activation_slots,
           (static_cast<double>(device_memory_in_use(device)) - static_cast<double>(before)) / 1048576.0);
  layer_graphs_logged_ = layer_graphs_.graphs();
}

// The forward and backward of all micro-batches (with --cuda-graph-include-optimizer the optimizer
// step too) as one graph, captured after the warm-up and replayed; the loss through step_loss_.
void StepRunner::step_full_iteration(const std::vector<MicroBatch>& micro_batches, const StepOptions& so,
                                     const Tensor& loss_slot, const Event* snapshot_pending) {
  // a captured step cannot wait for the event of a later save: the graph launch waits
  if (snapshot_pending) snapshot_pending->wait(stream_);
  const Tensor step_loss = step_loss_.as(DType::kF32, {1});
  fill(step_loss, 0.f, stream_);
  const PipelinePlan& plan = setup_.train_plan(static_cast<int64_t>(micro_batches.size()));
  auto body = [&] {
    if (graphs_.include_optimizer) {
      train_step(setup_.model(), setup_.executor(), plan, setup_.optimizer(), micro_batches, so,
                 step_loss, stream_);
    } else {
      forward_backward_step(setup_.model(), setup_.executor(), plan, setup_.optimizer(), micro_batches,
                            so, step_loss, stream_);
    }
  };
  GradSync& sync = setup_.grad_sync();
  if (steps_run_ >= graphs_.warmup_steps && !train_graph_.captured()) {
    // The captured step must start and end at a step boundary (GradSync::live_host_state: nothing
    // bound, gathered or in flight; docs/fsdp.md "CUDA graphs of the whole step"), so that every
    // replay takes the captured binding decisions and no event crosses the capture's edge.
    // Communication-stream work issued eagerly before (a validation forward's gathers) is joined
    // here, outside the capture, so that the replays are ordered after it.
    sync.finish_param_sync(stream_);
    check_step_boundary("before the captured training step");
    const uint64_t allocs = buffer_allocation_count(), syncs = host_sync_count();
    train_graph_.capture(stream_, body);
    MT_CHECK(buffer_allocation_count() == allocs && host_sync_count() == syncs,
             "the captured training step allocated ({}) or synchronised ({})", buffer_allocation_count() - allocs,
             host_sync_count() - syncs);
    check_step_boundary("after the captured training step");
    log_info("> CUDA graph: training step{} captured after {} warmup steps ({} nodes; no memory of its own: "
             "it replays on the model's static buffers)",
             graphs_.include_optimizer ? " with the optimizer" : "", steps_run_, train_graph_.num_nodes());
  }
  if (train_graph_.captured()) {
    train_graph_.launch(stream_);
    // The host state the replayed step leaves (a replay runs no host code): the gradients reduced,
    // so the optimizer step below must not reduce them again; with the optimizer in the graph, the
    // parameter phase's too. Right after the capture this is the state its host code left.
    sync.mark_replayed_grad_sync();
    if (graphs_.include_optimizer) sync.mark_replayed_param_sync();
  } else {
    body();
  }
  if (!graphs_.include_optimizer)
    setup_.optimizer().step(so.lr, stream_, nullptr, step_values_.lr(), so.decoupled_lr, step_values_.decoupled_lr());
  add(loss_slot, loss_slot, step_loss, stream_);
}

const uint64_t* StepRunner::begin_validation(int64_t iteration) {
  eval_values_.write(iteration, 0.f, stream_);  // e.g. --moe-router-force-load-balancing keys by it
  return eval_values_.iteration();
}

void StepRunner::validation_forward(const std::function<void()>& forward) {
  GradSync& sync = setup_.grad_sync();
  // Every validation forward ends at a step boundary (sharded parameters: the gathers joined, the
  // slots returned), eager or captured, so the next step or forward starts from the state the
  // graphs were captured in.
  const auto body = [&] {
    forward();
    sync.end_param_use(stream_);
  };
  if (!graphs_.full_iteration() || steps_run_ < graphs_.warmup_steps) {
    body();
    return;
  }
  if (!eval_graph_.captured()) {
    sync.finish_param_sync(stream_);  // eager work of ours on the communication stream: before the graph
    check_step_boundary("before the captured validation forward");
    eval_graph_.capture(stream_, body);
    check_step_boundary("after the captured validation forward");
    log_info("> CUDA graph: the validation forward captured ({} nodes)", eval_graph_.num_nodes());
  }
  eval_graph_.launch(stream_);
}

void StepRunner::check_step_boundary(const char* where) const {
  const std::string live = setup_.grad_sync().live_host_state();
  MT_CHECK(live.empty(),
           "CUDA graph: the data-parallel state {} is not a step boundary's ({}): a replay would not repeat the host "
           "bookkeeping that binds and releases it (docs/fsdp.md \"CUDA graphs of the whole step\")",
           where, live);
}

double StepRunner::take_host_issue_ms() {
  const double ms = host_issue_ms_;
  host_issue_ms_ = 0;
  return ms;
}

}  // namespace mt
