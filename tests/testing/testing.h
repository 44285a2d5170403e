// Test helpers: owned tensors filled with fresh random data, host round trips in any dtype,
// relative errors, poisoning, central finite differences in float64, and running a shell command
// (the `megatron` binary) with its output captured.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/check.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "model/params.h"
#include "model/transformer_config.h"

namespace mt::testing {

/// A tensor that owns its memory.
struct OwnedTensor {
  Buffer buffer;
  Tensor t;
  OwnedTensor() = default;
  OwnedTensor(DType dtype, Device device, const std::vector<int64_t>& shape);
  operator const Tensor&() const { return t; }
  const Tensor* operator->() const { return &t; }
};

/// Seed for this test run: fresh each run (std::random_device), or MT_TEST_SEED if set.
/// Logged by the first call so that a failure can be reproduced.
uint64_t test_seed();
std::mt19937_64& test_rng();

std::vector<float> randn(int64_t n, float stddev = 1.f);
std::vector<float> randu(int64_t n, float lo, float hi);
std::vector<int32_t> randint(int64_t n, int32_t lo, int32_t hi);  ///< in [lo, hi)

/// Host floats -> new tensor of `dtype` on `device` (rounded through the dtype).
OwnedTensor make_tensor(const std::vector<float>& host, DType dtype, Device device, const std::vector<int64_t>& shape,
                        const Stream& stream);
OwnedTensor make_int_tensor(const std::vector<int32_t>& host, Device device, const std::vector<int64_t>& shape,
                            const Stream& stream);
/// Host doubles -> new fp64 tensor on `device` (exact); fp64 tensor -> host doubles (synchronizes).
OwnedTensor make_tensor_f64(const std::vector<double>& host, Device device, const std::vector<int64_t>& shape,
                            const Stream& stream);
std::vector<double> to_host_f64(const Tensor& t, const Stream& stream);
/// Tensor (any float dtype incl. fp64, any device) -> host floats; synchronizes the stream.
std::vector<float> to_host(const Tensor& t, const Stream& stream);
/// int32 tensor (any device) -> host ints; synchronizes the stream.
std::vector<int32_t> to_host_ints(const Tensor& t, const Stream& stream);
/// v with every element rounded through dtype t (the values a tensor of t holds).
std::vector<float> rounded(std::vector<float> v, DType t);
/// Process-wide streams for tests: one on the CPU, one on cuda:0 (created on first use).
const Stream& cpu_stream();
const Stream& cuda_stream();
/// Overwrites host data into an existing tensor (rounding to its dtype).
void upload(const Tensor& t, const std::vector<float>& host, const Stream& stream);
/// Fills a float tensor with NaN, any other with 0xFF bytes (outputs and workspaces are poisoned
/// before each call under test).
void poison(const Tensor& t, const Stream& stream);

/// Whether a and b have the same size and the same bits (memcmp: -0 != +0, NaN payloads count).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b);

/// The elements of a full (one-rank) tensor that the parameter shard `shard` holds, in the
/// shard's order (ParamInfo::box).
std::vector<float> shard_slice(const std::vector<float>& full, const ParamInfo& shard);

/// ||a - b|| / max(||b||, tiny), in double.
double rel_err(const std::vector<float>& a, const std::vector<float>& b);
double rel_err(const std::vector<float>& a, const std::vector<double>& b);
bool all_finite(const std::vector<float>& a);

/// Central finite difference of f with respect to x[i] (x modified and restored), float64.
double finite_diff(const std::function<double()>& f, std::vector<double>& x, size_t i, double eps = 1e-5);

/// What run_command returns: the command's exit status and everything it wrote.
struct RunResult {
  int rc;           ///< exit status (WEXITSTATUS of pclose; 128 + signal if the shell was killed), -1 if popen failed
  std::string out;  ///< stdout and stderr, interleaved as written
};

/// Runs `cmd` through /bin/sh (popen) with its stderr merged into its stdout (" 2>&1" is
/// appended, so in a pipeline it applies to the last command), waits for it to exit, and returns
/// its exit status (WEXITSTATUS, or 128 + the signal that killed the shell; -1 if popen itself failed) and the output.
RunResult run_command(const std::string& cmd);

/// run_command on the `megatron` binary: `$MT_MEGATRON_BIN args` (ctest sets MT_MEGATRON_BIN
/// to the built binary), or `megatron args` from the PATH when it is unset.
RunResult run_megatron(const std::string& args);

/// Whether process `pid` has ended: gone, or a zombie nobody has reaped yet (/proc/<pid>/stat).
bool process_ended(int pid);

/// Fails the test unless f() throws an mt::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected an mt::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

/// The small multi-latent attention of the GPU layout tests (parallel_layouts / moe_layouts
/// cuda_dist_test): query latent 24, key/value latent 16, d_n 24, d_r 8, d_v 16 (the value heads
/// padded to 32), YaRN x4 beyond 8 original positions (mscale_all_dim 0.7). Needs RoPE.
void use_small_mla(TransformerConfig& c);

/// Skips the current test unless a CUDA device is available.
#define MT_REQUIRE_CUDA()                                                \
  do {                                                                   \
    if (!::mt::cuda_available()) GTEST_SKIP() << "no CUDA device";       \
  } while (0)

}  // namespace mt::testing
