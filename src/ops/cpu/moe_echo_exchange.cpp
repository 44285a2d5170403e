// CPU reference of ops/moe_echo_exchange.h: the block maps written as their definitions (with the
// placement checked), the gathers as block memcpys, and the accumulation as a loop over the blocks
// in ascending order (the order the CUDA kernel keeps per element).
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "ops/moe_echo_exchange.h"

namespace mt::cpu {

void moe_echo_exchange_index(const Tensor& w_send, const Tensor& w_recv, const Tensor& g_send, const Tensor& g_acc,
                             const Tensor& clone_expert, int64_t ep_rank, int64_t num_local, int64_t num_echo,
                             const Stream&) {
  const char* fn = "moe_echo_exchange_index";
  const int64_t NS = clone_expert.numel(), S = num_echo, L = num_local, P = NS / S, me = ep_rank;
  const int32_t* ce = clone_expert.data_as<int32_t>();
  for (int64_t s = 0; s < NS; ++s) {  // the whole placement, identical on every rank
    const int64_t e = ce[s];
    if (e < 0) continue;
    MT_CHECK(e < P * L, "{}: slot {} holds expert {}, but there are {} experts ({} ranks of {})", fn, s, e, P * L, P,
             L);
    MT_CHECK(e / L != s / S, "{}: slot {} (rank {}) holds expert {} whose home is that rank", fn, s, s / S, e);
  }
  int32_t* ws = w_send.data_as<int32_t>();
  int32_t* wr = w_recv.data_as<int32_t>();
  int32_t* gs = g_send.data_as<int32_t>();
  int32_t* ga = g_acc.data_as<int32_t>();
  for (int64_t s = 0; s < NS; ++s) {  // send block p·S + j of the weights / receive block s of the gradients
    const int64_t e = ce[s];
    const int32_t local = e >= 0 && e / L == me ? static_cast<int32_t>(e - me * L) : -1;
    ws[s] = local;
    ga[s] = local;
    gs[s] = -1;
  }
  for (int64_t j = 0; j < S; ++j) {  // this rank's clones
    const int64_t e = ce[me * S + j];
    wr[j] = e >= 0 ? static_cast<int32_t>((e / L) * S + j) : -1;
    if (e >= 0) gs[(e / L) * S + j] = static_cast<int32_t>(j);
  }
}

namespace {

// out[m] = block(index[m]) for 0 <= index[m] < G, `bytes` per block.
template <typename BlockOf>
void gather(const Tensor& out, const Tensor& index, int64_t G, size_t bytes, BlockOf block_of) {
  const int32_t* idx = index.data_as<int32_t>();
  char* dst = static_cast<char*>(out.data());
  for (int64_t m = 0; m < index.numel(); ++m) {
    const int64_t g = idx[m];
    if (g < 0 || g >= G || bytes == 0) continue;
    std::memcpy(dst + static_cast<size_t>(m) * bytes, block_of(g), bytes);
  }
}

}  // namespace

void moe_echo_gather_experts(const Tensor& out, const GroupedWeights& experts, const Tensor& index, const Stream&) {
  const size_t bytes = experts[0].nbytes();
  gather(out, index, experts.groups(), bytes, [&](int64_t g) { return experts[g].data(); });
}

void moe_echo_gather_blocks(const Tensor& out, const Tensor& src, const Tensor& index, const Stream&) {
  const size_t bytes = static_cast<size_t>(src.size(1) * src.size(2)) * dtype_size(src.dtype());
  const char* base = static_cast<const char*>(src.data());
  gather(out, index, src.size(0), bytes, [&](int64_t g) { return base + static_cast<size_t>(g) * bytes; });
}

void moe_echo_accumulate_experts(const GroupedWeights& grads, const Tensor& src, const Tensor& index, const Stream&) {
  const int64_t M = index.numel(), G = grads.groups(), nk = grads.rows() * grads.cols();
  const int32_t* idx = index.data_as<int32_t>();
  const float* x = src.data_as<float>();
  for (int64_t m = 0; m < M; ++m) {  // ascending m: the documented summation order
    const int64_t g = idx[m];
    if (g < 0 || g >= G) continue;
    float* y = grads[g].data_as<float>();
    const float* xm = x + m * nk;
#pragma omp parallel for schedule(static) if (nk >= (1 << 16))
    for (int64_t i = 0; i < nk; ++i) y[i] += xm[i];
  }
}

}  // namespace mt::cpu
