// How much host memory a new allocation may take, for validating sizes before allocating.
#pragma once
#include <cstdint>

namespace mt {

/// Bytes of host memory available to new allocations: MemAvailable of /proc/meminfo (Linux),
/// else physical pages × page size (sysconf). 0 when neither is known (callers then skip checks).
uint64_t available_host_memory_bytes();

}  // namespace mt
