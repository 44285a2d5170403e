#include "testing/testing.h"

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "ops/elementwise.h"

namespace mt::testing {

OwnedTensor::OwnedTensor(DType dtype, Device device, const std::vector<int64_t>& shape) {
  Tensor probe(nullptr, dtype, device, shape);
  buffer = Buffer(device, std::max<size_t>(probe.nbytes(), 4));
  t = Tensor(buffer.data(), dtype, device, shape);
}

uint64_t test_seed() {
  static uint64_t seed = [] {
    uint64_t s;
    if (const char* e = std::getenv("MT_TEST_SEED")) {
      s = std::strtoull(e, nullptr, 10);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    std::fprintf(stderr, "[mt::testing] MT_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

std::mt19937_64& test_rng() {
  static std::mt19937_64 rng(test_seed());
  return rng;
}

std::vector<float> randn(int64_t n, float stddev) {
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(test_rng());
  return v;
}

std::vector<float> randu(int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(test_rng());
  return v;
}

std::vector<int32_t> randint(int64_t n, int32_t lo, int32_t hi) {
  std::uniform_int_distribution<int32_t> d(lo, hi - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(test_rng());
  return v;
}

namespace {
std::vector<uint8_t> encode(const std::vector<float>& host, DType dtype) {
  std::vector<uint8_t> bytes(host.size() * dtype_size(dtype));
  for (size_t i = 0; i < host.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &host[i], 4);
    } else if (dtype == DType::kBF16) {
      uint16_t b = f32_to_bf16_bits(host[i]);
      std::memcpy(&bytes[i * 2], &b, 2);
    } else if (dtype == DType::kF16) {
      uint16_t b = f32_to_f16_bits(host[i]);
      std::memcpy(&bytes[i * 2], &b, 2);
    } else if (dtype == DType::kF64) {
      const double d = host[i];
      std::memcpy(&bytes[i * 8], &d, 8);
    } else {
      MT_FAIL("encode: unsupported dtype {}", dtype_name(dtype));
    }
  }
  return bytes;
}
}  // namespace

void upload(const Tensor& t, const std::vector<float>& host, const Stream& stream) {
  MT_CHECK(static_cast<int64_t>(host.size()) == t.numel(), "upload size {} vs {}", host.size(), t.str());
  auto bytes = encode(host, t.dtype());
  copy_bytes(t.data(), t.device(), bytes.data(), Device::cpu(), bytes.size(), stream);
  stream.synchronize();
}

OwnedTensor make_tensor(const std::vector<float>& host, DType dtype, Device device, const std::vector<int64_t>& shape,
                        const Stream& stream) {
  OwnedTensor o(dtype, device, shape);
  upload(o.t, host, stream);
  return o;
}

OwnedTensor make_int_tensor(const std::vector<int32_t>& host, Device device, const std::vector<int64_t>& shape,
                            const Stream& stream) {
  OwnedTensor o(DType::kI32, device, shape);
  MT_CHECK(static_cast<int64_t>(host.size()) == o.t.numel(), "int tensor size mismatch");
  copy_bytes(o.t.data(), device, host.data(), Device::cpu(), host.size() * 4, stream);
  stream.synchronize();
  return o;
}

std::vector<float> rounded(std::vector<float> v, DType t) {
  for (auto& x : v) x = round_through(t, x);
  return v;
}

const Stream& cpu_stream() {
  static Stream s(Device::cpu());
  return s;
}

const Stream& cuda_stream() {
  static Stream s(Device::cuda(0));
  return s;
}

OwnedTensor make_tensor_f64(const std::vector<double>& host, Device device, const std::vector<int64_t>& shape,
                            const Stream& stream) {
  OwnedTensor o(DType::kF64, device, shape);
  MT_CHECK(static_cast<int64_t>(host.size()) == o.t.numel(), "fp64 tensor size {} vs {}", host.size(), o.t.str());
  copy_bytes(o.t.data(), device, host.data(), Device::cpu(), host.size() * sizeof(double), stream);
  stream.synchronize();
  return o;
}

std::vector<double> to_host_f64(const Tensor& t, const Stream& stream) {
  MT_CHECK(t.dtype() == DType::kF64, "to_host_f64: {} is not fp64", t.str());
  std::vector<double> out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), Device::cpu(), t.data(), t.device(), out.size() * sizeof(double), stream);
  stream.synchronize();
  return out;
}

std::vector<int32_t> to_host_ints(const Tensor& t, const Stream& stream) {
  MT_CHECK(t.dtype() == DType::kI32, "to_host_ints: {} is not int32", t.str());
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  copy_bytes(out.data(), Device::cpu(), t.data(), t.device(), out.size() * sizeof(int32_t), stream);
  stream.synchronize();
  return out;
}

std::vector<float> to_host(const Tensor& t, const Stream& stream) {
  std::vector<uint8_t> bytes(t.nbytes());
  copy_bytes(bytes.data(), Device::cpu(), t.data(), t.device(), bytes.size(), stream);
  stream.synchronize();
  std::vector<float> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32: std::memcpy(&out[i], &bytes[i * 4], 4); break;
      case DType::kBF16: {
        uint16_t b;
        std::memcpy(&b, &bytes[i * 2], 2);
        out[i] = bf16_bits_to_f32(b);
        break;
      }
      case DType::kF16: {
        uint16_t b;
        std::memcpy(&b, &bytes[i * 2], 2);
        out[i] = f16_bits_to_f32(b);
        break;
      }
      case DType::kI32: {
        int32_t v;
        std::memcpy(&v, &bytes[i * 4], 4);
        out[i] = static_cast<float>(v);
        break;
      }
      case DType::kF64: {
        double v;
        std::memcpy(&v, &bytes[i * 8], 8);
        out[i] = static_cast<float>(v);
        break;
      }
      default: MT_FAIL("to_host: unsupported dtype {}", dtype_name(t.dtype()));
    }
  }
  return out;
}

void poison(const Tensor& t, const Stream& stream) {
  if (t.empty()) return;
  const DType dt = t.dtype();
  if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16 && dt != DType::kF64) {
    // byte buffers (workspaces), integers, FP8: every byte 0xFF (NaN in E4M3 and E5M2)
    std::vector<uint8_t> ff(static_cast<size_t>(t.numel()) * dtype_size(t.dtype()), 0xFF);
    copy_bytes(t.data(), t.device(), ff.data(), Device::cpu(), ff.size(), stream);
    stream.synchronize();
    return;
  }
  std::vector<float> nan(t.numel(), std::nanf(""));
  upload(t, nan, stream);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> shard_slice(const std::vector<float>& full, const ParamInfo& shard) {
  std::vector<float> out(static_cast<size_t>(shard.numel));
  for (int64_t e = 0; e < shard.numel; ++e) out[static_cast<size_t>(e)] = full[static_cast<size_t>(shard.box.global_index(e))];
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  MT_CHECK(a.size() == b.size(), "rel_err size {} vs {}", a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  MT_CHECK(a.size() == b.size(), "rel_err size {} vs {}", a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

bool all_finite(const std::vector<float>& a) {
  for (float x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

double finite_diff(const std::function<double()>& f, std::vector<double>& x, size_t i, double eps) {
  double orig = x[i];
  x[i] = orig + eps;
  double fp = f();
  x[i] = orig - eps;
  double fm = f();
  x[i] = orig;
  return (fp - fm) / (2 * eps);
}

RunResult run_command(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, ""};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  // a shell killed by a signal reads as 128 + the signal, as shells report it (never as success)
  return {WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status), out};
}

bool process_ended(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return true;
  const size_t close = stat.rfind(')');  // "<pid> (<comm>) <state> ..."
  return close == std::string::npos || stat.substr(close + 2, 1) == "Z";
}

RunResult run_megatron(const std::string& args) {
  const char* bin = std::getenv("MT_MEGATRON_BIN");
  return run_command(std::string(bin ? bin : "megatron") + " " + args);
}

void use_small_mla(TransformerConfig& c) {
  c.num_query_groups = 0;
  c.multi_latent_attention = true;
  c.q_lora_rank = 24;
  c.kv_lora_rank = 16;
  c.qk_head_dim = 24;
  c.qk_pos_emb_head_dim = 8;
  c.v_head_dim = 16;
  c.rotary_scaling_factor = 4.f;
  c.original_max_position_embeddings = 8;
  c.mscale_all_dim = 0.7f;
}

}  // namespace mt::testing
