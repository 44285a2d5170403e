#include "comm/rank_order_sum.h"

#include <array>

#include "core/check.h"
#include "core/dtype.h"

#ifdef MT_WITH_NCCL
#include "comm/nccl/peer_copy.h"
#endif

namespace mt {

namespace {

float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

void store(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

}  // namespace

void rank_order_sum(const Tensor& out, const Tensor* pieces, int n, const Stream& stream) {
  MT_REQUIRE(n >= 1 && n <= kRankOrderSumMaxPieces, "rank_order_sum: {} pieces, expected 1 to {}", n,
             kRankOrderSumMaxPieces);
  const DType t = out.dtype();
  MT_CHECK(t == DType::kF32 || t == DType::kBF16 || t == DType::kF16, "rank_order_sum: out {} needs fp32, bf16 or fp16",
           out.str());
  MT_CHECK(out.is_contiguous(), "rank_order_sum: out {} must be contiguous", out.str());
  for (int r = 0; r < n; ++r) {
    const Tensor& p = pieces[r];
    MT_CHECK(p.numel() == out.numel() && p.dtype() == t && p.device() == out.device() && p.is_contiguous(),
             "rank_order_sum: piece {} {} does not match out {} (contiguous, same numel, dtype and device)", r, p.str(),
             out.str());
  }
  const int64_t count = out.numel();
  if (out.device().is_cpu()) {
    std::array<const void*, kRankOrderSumMaxPieces> src{};
    for (int r = 0; r < n; ++r) src[static_cast<size_t>(r)] = pieces[r].data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      float acc = load(src[0], t, i);
      for (int r = 1; r < n; ++r) acc += load(src[static_cast<size_t>(r)], t, i);
      store(out.data(), t, i, acc);
    }
    return;
  }
#ifdef MT_WITH_NCCL
  std::array<const void*, PeerCopyGroup::kMaxRanks> src{};
  for (int r = 0; r < n; ++r) src[static_cast<size_t>(r)] = pieces[r].data();
  launch_sum_ranks(out.data(), src, n, static_cast<size_t>(count), t, static_cast<cudaStream_t>(stream.cuda_stream()));
#else
  (void)stream;
  MT_FAIL("rank_order_sum: {} tensors need a build with NCCL", out.device().str());
#endif
}

}  // namespace mt
