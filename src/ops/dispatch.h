// Backend dispatch (docs/architecture.md, "Ops"). An op is declared once, in its public header
// ops/<op>.h, with its documentation; MT_OP_BACKENDS(fn) then declares the CPU and CUDA entry
// points mt::cpu::fn and mt::cuda::fn with exactly the same type (defined in ops/cpu/<op>.cpp and
// ops/cuda/<op>.cu). ops/<op>.cpp validates the arguments once (ops/op_checks.h) and calls
// MT_DISPATCH(device, fn, args...), which picks the backend from the tensors' device.
#pragma once
#include <string_view>

#include "core/check.h"
#include "core/device.h"

namespace mt {
[[noreturn]] inline void no_cuda_backend(std::string_view fn) {
  MT_FAIL("{} called on a CUDA tensor but this binary was built without CUDA", fn);
}
}  // namespace mt

/// Inside namespace mt, after the declaration of op `fn` (not overloaded): declares
/// mt::cpu::fn and mt::cuda::fn with the type of mt::fn.
#define MT_OP_BACKENDS(fn)     \
  namespace cpu {              \
  decltype(::mt::fn) fn;       \
  }                            \
  namespace cuda {             \
  decltype(::mt::fn) fn;       \
  }

#ifdef MT_WITH_CUDA
#define MT_DISPATCH(dev, fn, ...) ((dev).is_cpu() ? ::mt::cpu::fn(__VA_ARGS__) : ::mt::cuda::fn(__VA_ARGS__))
#else
#define MT_DISPATCH(dev, fn, ...) ((dev).is_cpu() ? ::mt::cpu::fn(__VA_ARGS__) : ::mt::no_cuda_backend(#fn))
#endif
