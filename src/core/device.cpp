#include "core/device.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

#include "core/check.h"
#ifdef MT_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace mt {

std::string Device::str() const { return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index); }

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t pos = 0;
      int i = std::stoi(s.substr(5), &pos);
      if (pos == s.size() - 5 && i >= 0) return Device::cuda(i);
    } catch (const std::exception&) {
    }
  }
  MT_FAIL("unknown device '{}', expected cpu, cuda or cuda:N", s);
}

bool cuda_available() {
#ifdef MT_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

int compute_capability(Device d) {
  if (d.is_cpu()) return 0;
#ifdef MT_WITH_CUDA
  static std::mutex mu;
  static std::map<int, int> known;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(d.index); it != known.end()) return it->second;
  int major = 0, minor = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d.index));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d.index));
  return known.emplace(d.index, major * 10 + minor).first->second;
#else
  MT_FAIL("device {} requested but this binary was built without CUDA", d.str());
#endif
}

void set_current_device(Device d) {
  if (d.is_cpu()) return;
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaSetDevice(d.index));
#else
  MT_FAIL("device {} requested but this binary was built without CUDA", d.str());
#endif
}

}  // namespace mt
