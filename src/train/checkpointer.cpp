#include "train/checkpointer.h"

#include <chrono>

#include "core/logging.h"

namespace mt {

Checkpointer::Checkpointer(TrainingSetup& setup) : setup_(setup) {
  const PretrainArgs& args = setup.args();
  const ProcessGroups& g = setup.groups();
  const ParallelConfig& pc = setup.model_setup().parallel();
  writer_ = CheckpointWriter{.world = setup.world_ptr(),
                             .dp_rank = g.dp_cp->rank(),
                             .tp_rank = g.tp->rank(),
                             .edp_rank = g.edp->rank(),
                             .save_optim = !args.no_save_optim,
                             .timeout_s = args.distributed_timeout_minutes * 60,
                             .tp = pc.tp,
                             .pp = pc.pp,
                             .dp = pc.dp,
                             .ep = pc.ep,
                             .etp = pc.etp};
  if (args.async_save)
    async_saver_.allocate(setup.model().params(), &setup.optimizer(), writer_, setup.stream(),
                          setup.model().persistent_state(setup.stream()));
}

Checkpointer::~Checkpointer() = default;

bool Checkpointer::due(int64_t iteration, bool exiting) const {
  const PretrainArgs& args = setup_.args();
  return !args.save.empty() && ((args.save_interval > 0 && iteration % args.save_interval == 0) ||
                                iteration == args.train_iters || exiting);
}

void Checkpointer::save(int64_t iteration, int64_t consumed) {
  const PretrainArgs& args = setup_.args();
  const Stream& stream = setup_.stream();
  GPTModel& model = setup_.model();
  AdamWOptimizer& optimizer = setup_.optimizer();
  CheckpointState st{!args.no_save_optim, iteration, consumed, args.seed, model.config(),
                     optimizer.read_scalars_sync(stream)};
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (args.async_save) {
    const bool previous = async_saver_.in_flight();
    async_saver_.save(args.save, st, model.params(), &optimizer, writer_, stream, model.persistent_state(stream));
    snapshot_pending_ = async_saver_.snapshot_copied();
    log_info("  checkpoint at iteration {:7d}: snapshot taken in {:.2f} s{}, being written to {} (--async-save)",
             iteration, seconds(), previous ? " (incl. waiting for the previous save)" : "", args.save);
  } else {
    save_checkpoint(args.save, st, model.params(), &optimizer, writer_, stream, model.persistent_state(stream));
    const double s = seconds(), gb = static_cast<double>(checkpoint_bytes(args.save, iteration)) / 1e9;
    log_info("  successfully saved checkpoint at iteration {:7d} to {} ({:.3f} GB in {:.2f} s: {:.2f} GB/s)",
             iteration, args.save, gb, s, gb / std::max(s, 1e-9));
  }
}

const Event* Checkpointer::take_snapshot_pending() {
  const Event* e = snapshot_pending_;
  snapshot_pending_ = nullptr;
  return e;
}

void Checkpointer::finish(int64_t iteration) {
  if (!async_saver_.in_flight()) return;
  const std::string& dir = setup_.args().save;
  async_saver_.wait();  // the last checkpoint is complete (and published by rank 0) before exit
  const double gb = static_cast<double>(checkpoint_bytes(dir, iteration)) / 1e9;
  log_info("  successfully saved checkpoint at iteration {:7d} to {} (--async-save; {:.3f} GB written in the "
           "background in {:.2f} s: {:.2f} GB/s)", iteration, dir, gb, async_saver_.last_write_seconds(),
           gb / std::max(async_saver_.last_write_seconds(), 1e-9));
  if (async_saver_.last_copy_ms() >= 0)
    log_info("  its snapshot: device-to-host copy into pinned memory in {:.1f} ms on the GPU, beside the next "
             "step's forward and backward", async_saver_.last_copy_ms());
}

}  // namespace mt
