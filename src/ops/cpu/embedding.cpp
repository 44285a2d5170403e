// CPU reference of ops/embedding.h (fp32).
#include <algorithm>

#include "ops/embedding.h"

namespace mt::cpu {
namespace {

/// Explicit positions must index the table: checked here (serially, before any parallel work).
void check_positions(const Tensor& positions, int64_t p_rows, const char* fn) {
  const int32_t* pos = positions.data_as<int32_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) {
    MT_CHECK(pos[t] >= 0 && pos[t] < p_rows, "{}: positions[{}]={} outside the position table [0, {})", fn, t,
             pos[t], p_rows);
  }
}

}  // namespace

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                       const Tensor& positions, int64_t vocab_start, const Stream& stream) {
  const int64_t b = ids.size(1), n = ids.numel(), h = out.size(2), v_local = wte.size(0);
  const bool has_wpe = !wpe.empty(), has_pos = !positions.empty();
  if (has_wpe && has_pos) check_positions(positions, wpe.size(0), "embedding_forward");
  const int32_t* pid = ids.data_as<int32_t>();
  const int32_t* ppos = has_pos ? positions.data_as<int32_t>() : nullptr;
  const float* pte = wte.data_as<float>();
  const float* ppe = has_wpe ? wpe.data_as<float>() : nullptr;
  float* po = out.data_as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t row = static_cast<int64_t>(pid[t]) - vocab_start;
    const float* te = (row >= 0 && row < v_local) ? pte + row * h : nullptr;
    const float* pe = has_wpe ? ppe + (has_pos ? ppos[t] : t / b) * h : nullptr;
    float* o = po + t * h;
    for (int64_t c = 0; c < h; ++c) o[c] = (te ? te[c] : 0.f) + (pe ? pe[c] : 0.f);
  }
}

void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& ids,
                        const Tensor& positions, int64_t vocab_start, bool /*deterministic: always*/,
                        const Stream& stream) {
  const int64_t b = ids.size(1), n = ids.numel(), h = dout.size(2), v_local = dwte.size(0);
  const bool has_wpe = !dwpe.empty(), has_pos = !positions.empty();
  if (has_wpe && has_pos) check_positions(positions, dwpe.size(0), "embedding_backward");
  const int32_t* pid = ids.data_as<int32_t>();
  const int32_t* ppos = has_pos ? positions.data_as<int32_t>() : nullptr;
  const float* pd = dout.data_as<float>();
  float* pte = dwte.data_as<float>();
  float* ppe = has_wpe ? dwpe.data_as<float>() : nullptr;
  // Threads split the columns; tokens are visited in order, so the result is deterministic.
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (h + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const int64_t c0 = cb * kBlock, c1 = std::min(h, c0 + kBlock);
    for (int64_t t = 0; t < n; ++t) {
      const float* d = pd + t * h;
      const int64_t row = static_cast<int64_t>(pid[t]) - vocab_start;
      if (row >= 0 && row < v_local) {
        float* g = pte + row * h;
        for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
      if (has_wpe) {
        float* g = ppe + (has_pos ? ppos[t] : t / b) * h;
        for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
    }
  }
}

}  // namespace mt::cpu
