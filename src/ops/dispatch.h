// Backend dispatch: ops/<op>.cpp validates arguments once, then calls cpu::<fn> or cuda::<fn>
// (declared in ops/<op>_impl.h, defined in ops/cpu/<op>.cpp and ops/cuda/<op>.cu).
#pragma once
#include <string_view>

#include "core/check.h"
#include "core/device.h"

namespace mt {
[[noreturn]] inline void no_cuda_backend(std::string_view fn) {
  MT_FAIL("{} called on a CUDA tensor but this binary was built without CUDA", fn);
}
}  // namespace mt

#ifdef MT_WITH_CUDA
#define MT_DISPATCH(dev, fn, ...) ((dev).is_cpu() ? ::mt::cpu::fn(__VA_ARGS__) : ::mt::cuda::fn(__VA_ARGS__))
#else
#define MT_DISPATCH(dev, fn, ...) ((dev).is_cpu() ? ::mt::cpu::fn(__VA_ARGS__) : ::mt::no_cuda_backend(#fn))
#endif
