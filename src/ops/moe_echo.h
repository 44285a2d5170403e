// ECHO, elastic cloning for hot experts (issue 16 item 5; docs/echo.md): an offloading planner
// that moves the tokens an overloaded EP rank's experts receive beyond the global average to
// clones of those experts ("echo experts") in spare expert slots of under-loaded EP ranks, and
// the rerouting of each rank's routing selection to the clones. The algorithm is Megatron-LM's
// ECHO offloading planner (gen_offloading_plan: gen_intermediate, one_shot_greedy_assignment,
// the breadth-first / depth-first split over source ranks) in integer arithmetic with fixed
// tie-breaking, so that every EP rank, given the same all-gathered counts, computes the same plan
// without agreeing on anything, and the CPU and CUDA backends give identical integers.
//
// Notation: ep EP ranks, E experts (E % ep == 0, L = E / ep local experts; expert e's home EP
// rank is e / L), S = num_echo spare expert slots per EP rank, NS = ep · S spare slots in all;
// spare slot s lives on EP rank s / S and, when used, holds a clone of one home expert whose
// expert id in a rerouted selection is E + s.
//
// The plan, from counts[r, e] = tokens (routed slots) that source rank r sends to expert e. The R
// source ranks are the EP ranks (R = ep), or with expert tensor parallelism G > 1 every rank of
// the G × ep grid (R = G·ep, row i·ep + j = ETP rank i of EP rank j: they hold different tokens,
// and each ETP rank of an EP rank computes on the rows of all of them):
//  1. tok_e = Σ_r counts[r, e]; load_p = Σ over p's experts of tok_e; avg = (Σ_p load_p) / ep
//     (floor division); spare_p = max(0, avg − load_p).
//  2. Spillover of expert e with home rank p (gen_intermediate): p's experts sorted by tok
//     ascending (ties: lower expert index first), c_e = the inclusive cumulative sum of tok in that
//     order; spill_e = max(0, c_e − avg) − max(0, c_e − tok_e − avg). Σ over p's experts of spill
//     = max(0, load_p − avg): the light experts keep their tokens, the heavy ones spill.
//  3. Assignment (one_shot_greedy_assignment): the experts sorted by spill descending (ties: lower
//     expert index first) lay their spills end to end as intervals ("chunks"); the ranks sorted by
//     spare descending (ties: lower rank first) lay their spare capacities end to end ("buckets");
//     A[e, p] = |chunk e ∩ bucket p|. A[e, home(e)] = 0 (a spilling rank has no spare capacity).
//  4. Clones: spare slot s = p·S + j holds the home expert with the j-th largest A[e, p] > 0 in
//     column p (ties: lower expert index first), with quota A[e, p]; columns with fewer than S
//     positive entries leave slots unused (expert −1, quota 0), and the assignments beyond the S
//     largest of a column are dropped (those tokens stay with their home expert).
//  5. Source split of each clone s of expert e with quota q_s (breadth-first, then depth-first):
//     f[r, s] = floor(counts[r, e] · q_s / tok_e); then, per expert e over its clones in slot
//     order, the remainders need_s = q_s − Σ_r f[r, s] are filled from the sources' leftovers
//     left_r = counts[r, e] − Σ_{clones s' of e} f[r, s'] by interval overlap, sources in row
//     order and clones in slot order (one_shot_greedy_assignment(left, need)):
//     quota[r, s] = f[r, s] + overlap. Hence Σ_r quota[r, s] = q_s exactly and
//     Σ_{clones s of e} quota[r, s] ≤ counts[r, e].
// Each rank's load after rerouting is ≤ max(avg, its load before); receivers end ≤ avg.
#pragma once
#include <cstdint>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// The ECHO offloading plan (see the file comment for the algorithm and its tie-breaking) from the
/// global token counts. counts: int32 [R, E], counts[r, e] ≥ 0 = slots source rank r routes to
/// expert e (the all-gathered per-expert counts of every source, identical on all ranks), R = G·ep
/// sources (G = 1: the EP ranks; G = expert TP size: the ETP × EP grid, row i·ep + j for ETP rank i
/// of EP rank j); ep = the EP ranks holding the experts, E % ep == 0; num_echo = S ≥ 1. Outputs,
/// int32 on counts' device, overwritten: clone_expert [ep·S] (home expert of spare slot s, −1 =
/// unused), clone_quota [ep·S] (tokens the clone takes, 0 when unused), quota [R, ep·S]
/// (quota[r, s] = how many of source r's slots of expert clone_expert[s] go to clone s; 0 in unused
/// columns). clone_expert and clone_quota depend on the counts summed over each EP rank's G sources
/// only. Fixed shapes, no host synchronisation and no allocation: capturable in a CUDA graph. The
/// CUDA backend is one block (limits: E ≤ 4096, ep·S ≤ 4096; the shared memory is 24·(E + ep) +
/// 12·ep·S bytes, whatever R). Errors: mt::Error on dtypes/shapes/devices, ep < 1, E % ep != 0,
/// R % ep != 0, num_echo < 1, the CUDA limits; on the CPU also on negative counts (the CUDA backend
/// does not read counts on the host: negative counts give an unspecified plan there).
/// Source: Megatron-LM's ECHO planner (gen_offloading_plan; issue 16 item 5).
void moe_echo_plan(const Tensor& clone_expert, const Tensor& clone_quota, const Tensor& quota, const Tensor& counts,
                   int64_t ep, int64_t num_echo, const Stream& stream);

/// Reroutes one EP rank's selection to the clones of a plan (Megatron's reroute_tokens): of the
/// slots of top int32 [T, k] routed to home expert e, taken in flat slot order i = t·k + j, the
/// first quota_row[s1] go to clone s1 (expert id E + s1), the next quota_row[s2] to s2, ..., for
/// e's clones s1 < s2 < ... (clone_expert[s] == e); the others keep e. rerouted int32 [T, k]
/// (overwritten, must not alias top); entries of top outside [0, E) (−1: dropped) are copied
/// unchanged. clone_expert int32 [NS] and quota_row int32 [NS] (this rank's row quota[ep_rank] of
/// moe_echo_plan; a row of the [ep, NS] tensor is contiguous) on top's device. The probabilities
/// are unchanged (the clone computes the home expert's function). When the quotas of a rank exceed
/// its slots of an expert (not the case for a plan made from this selection's counts) the later
/// clones get fewer slots. Deterministic; CUDA: a stable counting pass over chunks of 4096 slots
/// (scratch: the stream's cuBLASLt workspace, about 4·E + 12·NS + 4·NS·chunks bytes; NS ≤ 4096),
/// no host synchronisation. Errors: mt::Error on dtypes/shapes/devices, aliasing, num_experts < 1.
void moe_echo_reroute(const Tensor& rerouted, const Tensor& top, const Tensor& clone_expert, const Tensor& quota_row,
                      int64_t num_experts, const Stream& stream);

/// The expert ids of a rerouted selection in the all-to-all dispatcher's rank-major virtual
/// layout of ep ranks with L + S experts each (L = E / ep home experts, then the rank's S spare
/// slots), so that every destination EP rank's slots are one contiguous run of expert ids:
/// x < E (home expert) → (x / L)·(L + S) + x mod L; E ≤ x < E + ep·S (spare slot s = x − E) →
/// (s / S)·(L + S) + L + s mod S; x < 0 (dropped) is copied. out and in int32, same numel, on one
/// device; out may alias in. Errors: mt::Error on dtypes/sizes/devices, E % ep != 0, num_echo < 1;
/// the CPU also on an id ≥ E + ep·S (CUDA maps such ids to −1).
void moe_echo_virtual_experts(const Tensor& out, const Tensor& in, int64_t num_experts, int64_t ep, int64_t num_echo,
                              const Stream& stream);

MT_OP_BACKENDS(moe_echo_plan)
MT_OP_BACKENDS(moe_echo_reroute)
MT_OP_BACKENDS(moe_echo_virtual_experts)

/// The planner's steps as pure host functions (int64 throughout), the CPU reference's building
/// blocks, exposed for tests and for host-side tools. Sizes are checked (mt::Error).
namespace echo {

/// Step 1–2 (gen_intermediate) from tokens per expert tok [E] over ep ranks.
struct Intermediate {
  int64_t avg = 0;             ///< floor(Σ tok / ep)
  std::vector<int64_t> load;   ///< [ep] tokens of each rank's experts
  std::vector<int64_t> spare;  ///< [ep] max(0, avg − load)
  std::vector<int64_t> spill;  ///< [E] spillover of each expert above its home rank's share of avg
};
Intermediate gen_intermediate(const std::vector<int64_t>& tokens_per_expert, int64_t ep);

/// Per-rank spillover of one rank's experts against avg: sort ascending (stable), cumulative sum,
/// minus avg, clamp ≥ 0, difference; returned in the experts' original order.
std::vector<int64_t> spillover(const std::vector<int64_t>& tokens, int64_t avg);

/// out[c, b] = |[C_c − chunks[c], C_c) ∩ [B_b − buckets[b], B_b)| with C, B the inclusive
/// cumulative sums: [chunks.size(), buckets.size()] row-major. Sizes must be ≥ 0.
std::vector<int64_t> one_shot_greedy_assignment(const std::vector<int64_t>& chunks,
                                                const std::vector<int64_t>& buckets);

/// Step 3: A [E, ep] row-major in the original expert and rank order (spills sorted descending,
/// spares sorted descending, both ties to the lower index, then one_shot_greedy_assignment).
std::vector<int64_t> assignment(const std::vector<int64_t>& spill, const std::vector<int64_t>& spare);

/// Step 5 for one home expert: src [R] = tokens of each source rank for it, quotas [n] = its
/// clones' quotas in slot order (Σ ≤ Σ src). Returns [R, n] row-major: proportional floors, then
/// the remainders by interval overlap (sources in rank order, clones in order).
std::vector<int64_t> split_quota(const std::vector<int64_t>& src, const std::vector<int64_t>& quotas);

/// The whole plan (moe_echo_plan's CPU reference) from counts [R, E] row-major, R = G·ep sources
/// (counts.size() a multiple of ep·E).
struct Plan {
  std::vector<int64_t> clone_expert;  ///< [ep·S], −1 = unused
  std::vector<int64_t> clone_quota;   ///< [ep·S]
  std::vector<int64_t> quota;         ///< [R, ep·S] row-major
};
Plan plan(const std::vector<int64_t>& counts, int64_t ep, int64_t num_experts, int64_t num_echo);

}  // namespace echo

}  // namespace mt
