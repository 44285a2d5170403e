#include "comm/comm_util.h"

#include <algorithm>
#include <cstdint>

namespace mt::comm_detail {

std::string describe(const Communicator& c) {
  return fmt::format("group '{}' (rank {} of {})", c.name(), c.rank(), c.size());
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data()), b0 = reinterpret_cast<uintptr_t>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

namespace {

bool reducible(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kI32 || t == DType::kI64;
}

void check_contiguous(const Communicator& c, const Tensor& t, const char* op, const char* what) {
  MT_REQUIRE(t.is_contiguous(), "{} on {}: {} {} is not contiguous", op, describe(c), what, t.str());
  MT_REQUIRE(t.numel() == 0 || !t.empty(), "{} on {}: {} {} has no data", op, describe(c), what, t.str());
}

}  // namespace

void check_all_reduce(const Communicator& c, const Tensor& t) {
  check_contiguous(c, t, "all_reduce", "tensor");
  MT_REQUIRE(reducible(t.dtype()), "all_reduce on {}: dtype {} of {} cannot be reduced (fp32/bf16/fp16/int32/int64)",
             describe(c), dtype_name(t.dtype()), t.str());
}

bool check_all_gather(const Communicator& c, const Tensor& out, const Tensor& in) {
  check_contiguous(c, out, "all_gather", "out");
  check_contiguous(c, in, "all_gather", "in");
  MT_REQUIRE(out.dtype() == in.dtype(), "all_gather on {}: dtype of out {} != in {}", describe(c), out.str(), in.str());
  MT_REQUIRE(out.numel() == c.size() * in.numel(), "all_gather on {}: out {} must have size ({}) x in.numel() ({}) elements",
             describe(c), out.str(), c.size(), in.numel());
  const bool in_place =
      in.numel() > 0 && static_cast<const char*>(in.data()) ==
                            static_cast<const char*>(out.data()) + static_cast<size_t>(c.rank()) * in.nbytes();
  MT_REQUIRE(in_place || !overlaps(out, in),
             "all_gather on {}: in {} overlaps out {} but is not this rank's slice of it", describe(c), in.str(),
             out.str());
  return in_place;
}

bool check_reduce_scatter(const Communicator& c, const Tensor& out, const Tensor& in) {
  check_contiguous(c, out, "reduce_scatter", "out");
  check_contiguous(c, in, "reduce_scatter", "in");
  MT_REQUIRE(out.dtype() == in.dtype(), "reduce_scatter on {}: dtype of out {} != in {}", describe(c), out.str(),
             in.str());
  MT_REQUIRE(reducible(in.dtype()), "reduce_scatter on {}: dtype {} cannot be reduced (fp32/bf16/fp16/int32/int64)",
             describe(c), dtype_name(in.dtype()));
  MT_REQUIRE(in.numel() == c.size() * out.numel(),
             "reduce_scatter on {}: in {} must have size ({}) x out.numel() ({}) elements", describe(c), in.str(),
             c.size(), out.numel());
  const bool in_place =
      out.numel() > 0 && static_cast<const char*>(out.data()) ==
                             static_cast<const char*>(in.data()) + static_cast<size_t>(c.rank()) * out.nbytes();
  MT_REQUIRE(in_place || !overlaps(out, in),
             "reduce_scatter on {}: out {} overlaps in {} but is not this rank's chunk of it", describe(c), out.str(),
             in.str());
  return in_place;
}

void check_broadcast(const Communicator& c, const Tensor& t, int root) {
  check_contiguous(c, t, "broadcast", "tensor");
  MT_REQUIRE(root >= 0 && root < c.size(), "broadcast on {}: root {} out of range [0, {})", describe(c), root,
             c.size());
}

void check_all_to_all(const Communicator& c, const Tensor& out, const Tensor& in) {
  check_contiguous(c, out, "all_to_all", "out");
  check_contiguous(c, in, "all_to_all", "in");
  MT_REQUIRE(out.dtype() == in.dtype() && out.numel() == in.numel(),
             "all_to_all on {}: out {} and in {} must have the same dtype and numel", describe(c), out.str(),
             in.str());
  MT_REQUIRE(in.numel() % c.size() == 0, "all_to_all on {}: numel {} of {} not divisible by the group size {}",
             describe(c), in.numel(), in.str(), c.size());
  MT_REQUIRE(!overlaps(out, in), "all_to_all on {}: out {} overlaps in {} (in-place all_to_all is not supported)",
             describe(c), out.str(), in.str());
}

namespace {

// One side of all_to_allv: lengths, signs, ranges; returns the resolved offsets.
std::vector<int64_t> check_splits(const Communicator& c, const AllToAllvSplits& sp, const Tensor& t,
                                  const char* side) {
  const size_t P = static_cast<size_t>(c.size());
  MT_REQUIRE(sp.counts.size() == P, "all_to_allv on {}: {} counts has {} entries, expected one per rank ({})",
             describe(c), side, sp.counts.size(), P);
  MT_REQUIRE(sp.offsets.empty() || sp.offsets.size() == P,
             "all_to_allv on {}: {} offsets has {} entries, expected none (packed) or one per rank ({})", describe(c),
             side, sp.offsets.size(), P);
  std::vector<int64_t> off = sp.resolved_offsets();
  for (size_t r = 0; r < P; ++r) {
    MT_REQUIRE(sp.counts[r] >= 0 && off[r] >= 0,
               "all_to_allv on {}: {} piece of rank {} has count {} at offset {} (must be >= 0)", describe(c), side, r,
               sp.counts[r], off[r]);
    MT_REQUIRE(sp.counts[r] == 0 || off[r] + sp.counts[r] <= t.numel(),
               "all_to_allv on {}: {} piece of rank {} [{}, +{}) exceeds the {} elements of {}", describe(c), side, r,
               off[r], sp.counts[r], t.numel(), t.str());
  }
  return off;
}

}  // namespace

std::pair<std::vector<int64_t>, std::vector<int64_t>> check_all_to_allv(const Communicator& c, const Tensor& out,
                                                                        const AllToAllvSplits& recv, const Tensor& in,
                                                                        const AllToAllvSplits& send) {
  check_contiguous(c, out, "all_to_allv", "out");
  check_contiguous(c, in, "all_to_allv", "in");
  MT_REQUIRE(out.dtype() == in.dtype(), "all_to_allv on {}: dtype of out {} != in {}", describe(c), out.str(),
             in.str());
  std::vector<int64_t> roff = check_splits(c, recv, out, "receive");
  std::vector<int64_t> soff = check_splits(c, send, in, "send");
  // Receive pieces pairwise disjoint: sort the non-empty ones by offset.
  std::vector<std::pair<int64_t, size_t>> pieces;
  for (size_t r = 0; r < roff.size(); ++r)
    if (recv.counts[r] > 0) pieces.push_back({roff[r], r});
  std::sort(pieces.begin(), pieces.end());
  for (size_t i = 1; i < pieces.size(); ++i) {
    const size_t a = pieces[i - 1].second, b = pieces[i].second;
    MT_REQUIRE(roff[a] + recv.counts[a] <= roff[b],
               "all_to_allv on {}: the receive pieces of ranks {} [{}, +{}) and {} [{}, +{}) overlap", describe(c), a,
               roff[a], recv.counts[a], b, roff[b], recv.counts[b]);
  }
  MT_REQUIRE(!overlaps(out, in), "all_to_allv on {}: out {} overlaps in {} (in-place all_to_allv is not supported)",
             describe(c), out.str(), in.str());
  return {std::move(roff), std::move(soff)};
}

void check_p2p(const Communicator& c, const Tensor& t, int peer, const char* op) {
  check_contiguous(c, t, op, "tensor");
  MT_REQUIRE(peer >= 0 && peer < c.size() && peer != c.rank(), "{} on {}: peer {} invalid (range [0, {}), not self)",
             op, describe(c), peer, c.size());
}

}  // namespace mt::comm_detail
