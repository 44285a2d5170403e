// Devices: the host CPU and CUDA GPUs by ordinal.
#pragma once
#include <cstdint>
#include <string>

namespace mt {

enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::kCUDA, i}; }
  bool is_cpu() const { return type == DeviceType::kCPU; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

/// Parses "cpu", "cuda", "cuda:N". Throws mt::Error naming the value otherwise.
Device parse_device(const std::string& s);
/// True when this binary has the CUDA backend and at least one GPU is visible.
bool cuda_available();
/// Compute capability of a CUDA device as major * 10 + minor (90: Hopper), queried once per device
/// and cached (thread-safe); 0 for the CPU. Errors: mt::Error for a CUDA device in a binary
/// without CUDA, or from the CUDA runtime (no such device).
int compute_capability(Device d);
/// Makes `d` the current CUDA device of the calling thread (no-op for CPU).
void set_current_device(Device d);

}  // namespace mt
