// ECHO weight dispatch and gradient return with fixed-size collectives (docs/echo.md,
// "Integration", steps 4 and 6; docs/architecture.md principle 8, capturable by construction): the
// device-side index computation, gathers and the ordered accumulation that let the clones' weights
// travel from their home EP ranks and their gradients travel back through one equal-split
// all_to_all over the EP group each, instead of the host-synchronised point-to-point exchange of
// model/moe/echo.h (echo_placement_sync, echo_dispatch_weights,
// echo_return_gradients). Nothing is read on the host and nothing is allocated, so the whole
// exchange can be captured in a CUDA graph and replayed with the next plan's clone_expert.
//
// Notation (ops/moe_echo.h): an EP group of P ranks, this rank `me` (ep_rank), L = num_local home
// experts per rank (E = P·L; expert e lives on rank e / L as its local expert e − (e / L)·L),
// S = num_echo spare (clone) slots per rank; spare slot s ∈ [0, P·S) lives on rank s / S as that
// rank's clone j = s mod S; clone_expert int32 [P·S] = moe_echo_plan's home expert of each slot,
// or < 0 (unused). A slot is never on its expert's home rank.
//
// An equal-split all_to_all of P·S blocks sends block p·S + j of rank r to rank p, where it is
// received as block r·S + j. Hence the scheme (the layer composes it from these ops and one
// all_to_all per direction; every block is one expert's tensor, e.g. this ETP rank's linear_fc1):
//  * Weights: w_send, w_recv = moe_echo_exchange_index(...).
//      send [P·S, n, k] ← moe_echo_gather_experts(send, local experts, w_send)
//        (block p·S + j = the local expert that rank p's clone j copies; other blocks untouched)
//      recv = all_to_all(send)   (recv block h·S + j came from rank h, for this rank's clone j)
//      clones [S, n, k] ← moe_echo_gather_blocks(clones, recv, w_recv)
//  * Gradients: g_send, g_acc from the same call.
//      send [P·S, n, k] ← moe_echo_gather_blocks(send, clone grads [S, n, k], g_send)
//        (block h·S + j = clone j's gradient when clone j's home rank is h)
//      recv = all_to_all(send)   (recv block s = c·S + j is slot s's gradient, from rank c)
//      moe_echo_accumulate_experts(main grads, recv, g_acc)
//        (main_grad[e − me·L] += block s, for the slots s of this rank's experts in ascending order)
// Blocks that no index names are sent but never read: they may hold anything (no memset needed).
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"
#include "ops/grouped_matmul.h"

namespace mt {

/// The four block maps of ECHO's fixed-size weight dispatch and gradient return (see the file
/// comment) for EP rank ep_rank, from the plan's clone_expert int32 [P·S] (P = clone_expert.numel()
/// / num_echo). Outputs, int32, contiguous 1-D, on clone_expert's device, overwritten:
///  * w_send [P·S]: w_send[p·S + j] = e − ep_rank·L when e = clone_expert[p·S + j] ≥ 0 and
///    e / L == ep_rank (the local expert to put in send block p·S + j), else −1.
///  * w_recv [S]: w_recv[j] = (e / L)·S + j for this rank's clone j (e = clone_expert[ep_rank·S + j]
///    ≥ 0: the receive block holding its weights), −1 when the slot is unused.
///  * g_send [P·S]: g_send[h·S + j] = j when this rank's clone j has an expert e ≥ 0 with
///    e / L == h (clone j's gradient goes into send block h·S + j), else −1.
///  * g_acc [P·S]: g_acc[s] = e − ep_rank·L when e = clone_expert[s] ≥ 0 and e / L == ep_rank (the
///    local main gradient that receive block s is added to), else −1. (Element for element equal to
///    w_send, because the all_to_all maps block p·S + j of rank r to block r·S + j of rank p; both
///    are returned so that each direction reads its own map.)
/// Negative clone_expert entries are unused slots. One small kernel on CUDA: no host
/// synchronisation, no allocation, capturable.
/// Errors (mt::Error): dtypes, shapes, devices or the stream; num_local < 1, num_echo < 1,
/// clone_expert empty or its size not a multiple of num_echo, ep_rank outside [0, P), P·L beyond
/// int32. The CPU also checks every slot (all ranks'): an expert id ≥ P·L, or a slot on its
/// expert's home rank (s / S == e / L), raises. The CUDA backend reads nothing on the host: ids
/// ≥ P·L are treated as unused (−1 in every map), and a slot on its home rank gets the maps the
/// formulas give (a block the rank sends to itself, which the all_to_all delivers correctly).
/// Source: ECHO (docs/echo.md), weight dispatch and gradient return as fixed-size all_to_alls.
void moe_echo_exchange_index(const Tensor& w_send, const Tensor& w_recv, const Tensor& g_send, const Tensor& g_acc,
                             const Tensor& clone_expert, int64_t ep_rank, int64_t num_local, int64_t num_echo,
                             const Stream& stream);

/// Gathers whole experts into blocks (the weight dispatch's send buffer): out[m] = experts[index[m]]
/// for every m with 0 ≤ index[m] < G; rows m whose index is outside [0, G) (e.g. −1) are left
/// untouched. experts: G tensors [n, k] of one float dtype (GroupedWeights: the rank's local
/// experts, or any G same-shape tensors; its device address table is what CUDA reads); index int32
/// [M] on their device; out: contiguous [M, n, k] of experts' dtype and device, disjoint from every
/// expert. Bitwise copies (any dtype). Several m may name one expert. CUDA: one grid-stride kernel
/// (16-byte vectors when the block size and every address allow, else narrower units); no host
/// synchronisation, capturable. Errors (mt::Error): shapes, dtypes, devices, the stream, out
/// overlapping an expert, M beyond int32.
/// Source: ECHO (docs/echo.md), weight dispatch as a fixed-size all_to_all.
void moe_echo_gather_experts(const Tensor& out, const GroupedWeights& experts, const Tensor& index,
                             const Stream& stream);

/// moe_echo_gather_experts with the G source blocks in one contiguous tensor (the receive buffer of
/// the weight dispatch, or a rank's clone gradient buffer for the gradient return): out[m] =
/// src[index[m]] for 0 ≤ index[m] < G, other rows untouched. out [M, n, k], src [G, n, k]: contiguous,
/// same dtype (any) and device, disjoint; index int32 [M] on their device. Bitwise; CUDA as
/// moe_echo_gather_experts. Errors (mt::Error): shapes, dtypes, devices, the stream, overlap, M or G
/// beyond int32.
void moe_echo_gather_blocks(const Tensor& out, const Tensor& src, const Tensor& index, const Stream& stream);

/// The gradient return's ordered accumulation into the home experts' fp32 main gradients:
/// for m = 0, 1, ..., M − 1 in this order, if 0 ≤ index[m] < G: grads[index[m]] += src[m]
/// (accumulate, +=; entries outside [0, G), e.g. −1, are skipped). Every element's sum runs over
/// ascending m, so several m naming one expert give a deterministic result, and the CPU and CUDA
/// results are bitwise equal (the same fp32 additions in the same order). grads: G fp32 tensors
/// [n, k] (GroupedWeights over the main gradients); src: contiguous fp32 [M, n, k] on their device,
/// disjoint from every gradient; index int32 [M]. CUDA: one thread per element (or per 4 elements
/// when every address is 16-byte aligned and n·k % 4 == 0) looping over m; no atomics, no host
/// synchronisation, capturable. Errors (mt::Error): shapes, dtypes (fp32 only), devices, the
/// stream, overlap, M beyond int32.
/// Source: ECHO (docs/echo.md), gradient return in slot order ("Integration", step 6).
void moe_echo_accumulate_experts(const GroupedWeights& grads, const Tensor& src, const Tensor& index,
                                 const Stream& stream);

MT_OP_BACKENDS(moe_echo_exchange_index)
MT_OP_BACKENDS(moe_echo_gather_experts)
MT_OP_BACKENDS(moe_echo_gather_blocks)
MT_OP_BACKENDS(moe_echo_accumulate_experts)

}  // namespace mt
