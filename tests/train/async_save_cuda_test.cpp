// --async-save on a GPU (train/checkpoint.h, AsyncCheckpointSaver): the snapshot's device-to-host
// copies run on the saver's own stream and save() returns without waiting for them; training
// continues at once, its optimizer steps waiting for AsyncCheckpointSaver::snapshot_copied() on the
// device (as the trainer's StepOptions::wait_before_update does). The checkpoint written in the
// background must be byte for byte the synchronous checkpoint of the same state, although the
// parameters and moments it was copied from change right after save() returns. The state is
// large (about 0.8 GB with the moments), so that the copy is still running when the next
// optimizer steps are issued: an update that did not wait for it would change the saved bytes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "comm/communicator.h"
#include "model/params.h"
#include "optim/optimizer.h"
#include "testing/testing.h"
#include "train/checkpoint.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A GPT-like list of large matrices (4 layers of [4096, 4096]) and a small bias.
std::vector<ParamSpec> specs() {
  std::vector<ParamSpec> out;
  for (int l = 0; l < 4; ++l) {
    ParamSpec p;
    p.name = "decoder.layers." + std::to_string(l) + ".mlp.linear_fc1.weight";
    p.shape = p.global_shape = {4096, 4096};
    out.push_back(p);
  }
  ParamSpec b;
  b.name = "decoder.final_layernorm.bias";
  b.shape = b.global_shape = {4096};
  b.weight_decay = false;
  b.init = InitKind::kZeros;
  out.push_back(b);
  return out;
}

class AsyncSaveCuda : public ::testing::TestWithParam<DType> {};

TEST_P(AsyncSaveCuda, WritesTheSynchronousBytesWhileTrainingContinues) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  const Stream& st = testing::cuda_stream();
  const fs::path dir = fs::temp_directory_path() / ("mt_async_save_cuda_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParamStore P(specs(), GetParam(), dev);
  P.initialize(11, st);
  OptimizerConfig oc;
  oc.weight_decay = 0.1f;
  AdamWOptimizer opt(P, oc, st);
  // Fixed random gradients: every step changes the parameters and both moments.
  const int64_t total = P.total_elements();
  testing::OwnedTensor g = testing::make_tensor(testing::randn(total, 0.01f), DType::kF32, dev, {total}, st);
  auto step = [&](const Event* wait_for) {
    opt.grad_sync().zero_grad_buffer(st);
    copy(P.grads_flat(), g, st);
    if (wait_for) wait_for->wait(st);  // the trainer's StepOptions::wait_before_update
    opt.step(1e-3f, st);
  };
  for (int i = 0; i < 3; ++i) step(nullptr);

  const CheckpointWriter writer{.world = std::make_shared<SingleRankCommunicator>()};
  CheckpointState cs{true, 3, 12, 5, TransformerConfig{}, opt.read_scalars_sync(st)};
  save_checkpoint((dir / "sync").string(), cs, P, &opt, writer, st);

  AsyncCheckpointSaver saver;
  saver.allocate(P, &opt, writer, st);  // as the trainer does before its loop
  for (int round = 0; round < 2; ++round) {  // the second save reuses the snapshot's buffers
    const auto t0 = std::chrono::steady_clock::now();
    saver.save((dir / ("async" + std::to_string(round))).string(), cs, P, &opt, writer, st);
    const double save_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const Event* copied = saver.snapshot_copied();
    ASSERT_NE(copied, nullptr) << "a GPU snapshot must be copied asynchronously";
    // Training continues at once: three steps issued while the copy may still run.
    for (int i = 0; i < 3; ++i) step(i == 0 ? copied : nullptr);
    const bool copy_running = !copied->query();
    std::printf("round %d: save() returned in %.1f ms; copy %s when the next steps had been issued\n", round, save_ms,
                copy_running ? "still running" : "already complete");
    saver.wait();
    st.synchronize();
    std::printf("round %d: the snapshot's device-to-host copy took %.1f ms\n", round, saver.last_copy_ms());
    EXPECT_GT(saver.last_copy_ms(), 0.0);
    for (const char* f : {"metadata.json", "rank_00000.bin"}) {
      const std::string want = read_bytes(dir / "sync" / "iter_0000003" / f);
      ASSERT_FALSE(want.empty()) << f;
      EXPECT_TRUE(read_bytes(dir / ("async" + std::to_string(round)) / "iter_0000003" / f) == want)
          << f << " of the asynchronous save (round " << round << ") differs from the synchronous one";
    }
    // The steps after it did change the state (the comparison above is not vacuous); the next
    // round saves the state as it now is, against a fresh synchronous save.
    cs.scalars = opt.read_scalars_sync(st);
    fs::remove_all(dir / "sync");
    save_checkpoint((dir / "sync").string(), cs, P, &opt, writer, st);
    EXPECT_FALSE(read_bytes(dir / "sync" / "iter_0000003" / "rank_00000.bin") ==
                 read_bytes(dir / ("async" + std::to_string(round)) / "iter_0000003" / "rank_00000.bin"))
        << "training did not change the state after the save";
  }
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AsyncSaveCuda, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace mt
