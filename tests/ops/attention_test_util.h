// Helpers shared by the CPU and CUDA tests of ops/attention.h.
#pragma once
#include <vector>

#include "ops/attention.h"
#include "testing/testing.h"

namespace mt::testing {

/// s, b, n query heads, d, and g key/value heads (query groups; 0 = n, multi-head attention).
struct AttnDims {
  int64_t s, b, n, d;
  int64_t g = 0;
  int64_t groups() const { return g > 0 ? g : n; }
  /// The fused QKV shape [s, b, g, n/g + 2, d] and its element count.
  std::vector<int64_t> qkv_shape() const { return {s, b, groups(), n / groups() + 2, d}; }
  int64_t qkv_numel() const { return s * b * groups() * (n / groups() + 2) * d; }
};

/// The buffers of one attention call (ops/attention.h AttentionBuffers), owned.
struct AttnBufs {
  OwnedTensor q, k, v, probs, scratch, dq, dk, dv;
  AttnBufs(AttnDims z, DType t, Device dev) {
    const std::vector<int64_t> nd{z.b, z.n, z.s, z.d}, gd{z.b, z.groups(), z.s, z.d}, ns{z.b, z.n, z.s, z.s};
    q = OwnedTensor(t, dev, nd);
    k = OwnedTensor(t, dev, gd);
    v = OwnedTensor(t, dev, gd);
    dq = OwnedTensor(t, dev, nd);
    dk = OwnedTensor(t, dev, gd);
    dv = OwnedTensor(t, dev, gd);
    probs = OwnedTensor(t, dev, ns);
    scratch = OwnedTensor(t, dev, ns);
  }
  AttentionBuffers view() const { return {q.t, k.t, v.t, probs.t, scratch.t, dq.t, dk.t, dv.t}; }
  void poison_all(const Stream& st) const {
    for (const OwnedTensor* o : {&q, &k, &v, &probs, &scratch, &dq, &dk, &dv}) poison(*o, st);
  }
};

/// Random document starts doc_start [b, s] (ops/attention.h): in every sample but the last
/// (which, for b > 1, is one document) each position starts a document with probability
/// 1/one_in, plus a document of length 1 in the middle and one at the last position. s >= 4.
inline std::vector<int32_t> random_doc_start(int64_t s, int64_t b, uint64_t one_in) {
  std::vector<int32_t> ds(b * s, 0);
  auto& rng = test_rng();
  for (int64_t bi = 0; bi < b; ++bi) {
    if (b > 1 && bi == b - 1) continue;  // one document
    std::vector<bool> starts(s, false);
    starts[0] = true;
    for (int64_t j = 1; j < s; ++j) starts[j] = rng() % one_in == 0;
    const int64_t a = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(s - 3));  // in [1, s - 3]
    starts[a] = starts[a + 1] = true;  // document {a} of length 1
    starts[s - 1] = true;              // document {s - 1} of length 1
    int32_t cur = 0;
    for (int64_t j = 0; j < s; ++j) {
      if (starts[j]) cur = static_cast<int32_t>(j);
      ds[bi * s + j] = cur;
    }
  }
  return ds;
}

}  // namespace mt::testing
