// CPU reference of ops/moe_block.h: the send and receive index maps of the static-buffer MoE
// dispatch written as walks over the destinations' runs and the received blocks, in int64. The
// CUDA backend (ops/cuda/moe_block.cu) computes the same integers with one thread per row.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "ops/moe_block.h"

namespace mt::cpu {

void moe_block_send_layout(const Tensor& send_index, const Tensor& slot_send, const Tensor& sent,
                           const Tensor& overflow, const Tensor& counts, const Tensor& row_index, int64_t num_dest,
                           int64_t block, const Stream&) {
  const char* fn = "moe_block_send_layout";
  const int64_t Ev = counts.numel(), D = num_dest, B = block, Lv = Ev / D, n = row_index.numel();
  const int32_t* cnt = counts.data_as<int32_t>();
  const int32_t* ri = row_index.data_as<int32_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < Ev; ++e) {
    MT_CHECK(cnt[e] >= 0, "{}: counts[{}] = {} is negative", fn, e, cnt[e]);
    total += cnt[e];
  }
  MT_CHECK(total <= n, "{}: the counts add up to {} slots, more than row_index's {}", fn, total, n);
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int64_t p = 0; p < total; ++p) {
    const int32_t i = ri[p];
    MT_CHECK(i >= 0 && i < n && !seen[static_cast<size_t>(i)],
             "{}: row_index[{}] = {} is not a fresh slot in [0, {}) (the first {} positions must hold distinct slots)",
             fn, p, i, n, total);
    seen[static_cast<size_t>(i)] = true;
  }

  int32_t* si = send_index.data_as<int32_t>();
  int32_t* ss = slot_send.data_as<int32_t>();
  int32_t* st = sent.data_as<int32_t>();
  std::fill(si, si + D * B, -1);
  std::fill(ss, ss + n, -1);
  int64_t start = 0, kept = 0;  // start of destination m's run in row_index
  for (int64_t m = 0; m < D; ++m) {
    int64_t run = 0;  // slots of m's experts so far: the destination's experts in order
    for (int64_t e = m * Lv; e < (m + 1) * Lv; ++e) {
      const int64_t s = std::max<int64_t>(0, std::min<int64_t>(cnt[e], B - run));
      st[e] = static_cast<int32_t>(s);
      kept += s;
      run += cnt[e];
    }
    for (int64_t o = 0; o < std::min(run, B); ++o) {
      const int32_t i = ri[start + o];
      si[m * B + o] = i;
      ss[i] = static_cast<int32_t>(m * B + o);
    }
    start += run;
  }
  if (!overflow.empty()) overflow.data_as<float>()[0] += static_cast<float>(total - kept);
}

void moe_block_receive_layout(const Tensor& gather_index, const Tensor& scatter_index, const Tensor& local_counts,
                              const Tensor& sent_all, int64_t first, int64_t num_local, int64_t block,
                              const Stream&) {
  const char* fn = "moe_block_receive_layout";
  const int64_t C = sent_all.size(0), Ev = sent_all.size(1), L = num_local, B = block;
  const int32_t* sa = sent_all.data_as<int32_t>();
  const auto s_of = [&](int64_t c, int64_t i) -> int64_t { return sa[c * Ev + first + i]; };
  // pb[c·(L+1) + i]: the first row of local expert i within block c; pb[c·(L+1) + L] = n_c.
  std::vector<int64_t> pb(static_cast<size_t>(C * (L + 1)), 0);
  for (int64_t c = 0; c < C; ++c) {
    int64_t run = 0;
    for (int64_t i = 0; i < L; ++i) {
      MT_CHECK(s_of(c, i) >= 0, "{}: sent_all[{}, {}] = {} is negative", fn, c, first + i, s_of(c, i));
      run += s_of(c, i);
      pb[static_cast<size_t>(c * (L + 1) + i + 1)] = run;
    }
    MT_CHECK(run <= B, "{}: source {} sends {} rows for experts [{}, {}), more than the block of {}", fn, c, run,
             first, first + L, B);
  }
  int32_t* g = gather_index.data_as<int32_t>();
  int32_t* sc = scatter_index.data_as<int32_t>();
  int32_t* lc = local_counts.data_as<int32_t>();
  std::fill(g, g + C * B, -1);
  std::fill(sc, sc + C * B, -1);
  int64_t q = 0;  // the expert-ordered row: local expert, then source, then the order in the block
  for (int64_t i = 0; i < L; ++i) {
    int64_t rows = 0;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t r0 = c * B + pb[static_cast<size_t>(c * (L + 1) + i)];
      for (int64_t o = 0; o < s_of(c, i); ++o, ++q) {
        g[q] = static_cast<int32_t>(r0 + o);
        sc[r0 + o] = static_cast<int32_t>(q);
      }
      rows += s_of(c, i);
    }
    lc[i] = static_cast<int32_t>(rows);
  }
}

}  // namespace mt::cpu
