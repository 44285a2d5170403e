// In-process communicator: N ranks as N threads sharing one address space (CPU tensors only).
// For tests of every parallel layout without processes or MPI (docs/architecture.md: "ranks tested as
// several processes or threads"). Reductions sum in rank order, so results are deterministic.
#pragma once
#include <functional>
#include <memory>

#include "comm/communicator.h"

namespace mt {

/// Runs fn(rank, world) on n threads, each with its own communicator of one shared group;
/// waits for all and rethrows the first exception (after all threads ended). If a rank throws,
/// the others' pending collectives fail instead of waiting forever.
void run_thread_ranks(int n, const std::function<void(int rank, std::shared_ptr<Communicator> world)>& fn);

}  // namespace mt
