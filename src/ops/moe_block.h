// Index maps of the static-buffer MoE all-to-all token dispatch (docs/cuda_graphs.md, capturable
// MoE: "token dispatch into static receive buffers sized by --moe-received-token-capacity, with
// an overflow that is counted, never silent"). Each source EP rank sends every one of the D
// destination EP ranks a fixed block of B rows with an equal-split all_to_all, so that no split
// size is read on the host; the rows routed to a destination beyond B are dropped and counted.
//
// Notation: N tokens, top-k, n = N·k flat slots i = t·k + j; Ev experts over D destinations
// (Ev % D == 0, Lv = Ev / D experts per destination; expert e lives on destination e / Lv); B rows
// per block. C source ranks send to this rank (C = D in an EP group); this rank's local experts are
// the global ids [first, first + num_local).
//
// Layouts, with Megatron-Core's names (moe_utils.py permute / sort_chunks_by_idxs, the
// all-to-all dispatcher's "permutation 1" and "permutation 2"):
//   send buffer [D·B, h]: block m (rows m·B .. m·B + B - 1) goes to destination m; its rows are the
//     first B slots of m's run in the expert-sorted order (experts m·Lv .. (m+1)·Lv - 1, each in
//     flat slot order), then padding.
//   received buffer [C·B, h]: block c came from source c; its first n_c rows are the source's
//     slots for this rank's experts sorted by expert, the rest padding.
//   expert-ordered rows [C·B, h]: the R = Σ local_counts received rows ordered by local expert,
//     then source, then the row order within the source's block (the grouped GEMM's input), then
//     C·B - R unused rows.
//
// The dispatcher's use (model/moe/alltoall_dispatcher.cpp, MoEStaticAlltoAllTokenDispatcher):
//   moe_routing_map_device(row_index, slot_row, counts, top, 0, Ev)   // over all experts
//   moe_block_send_layout(send_index, slot_send, sent, overflow, counts, row_index, D, B)
//   moe_permute(send, x, send_index, k); all_to_all(send -> recv); all_gather(sent -> sent_all)
//   moe_block_receive_layout(gather_index, scatter_index, local_counts, sent_all, first, Lv, B)
//   moe_permute(xp, recv, gather_index, 1)          // expert inputs, by local expert
//   ... experts (local_counts on the device) ...
//   moe_permute(blocks, out, scatter_index, 1)      // expert outputs back in block layout
//   all_to_all(blocks -> back); moe_unpermute(y, back, probs, slot_send)
// and the backward with the same maps (moe_unpermute_backward with row_index = send_index writes
// zeros to the padding rows). Every map is int32, fixed in shape, written on the device without
// host synchronisation or allocation: capturable in a CUDA graph. The CUDA kernels give the CPU
// reference's integers bitwise.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"
#include "ops/dispatch.h"

namespace mt {

/// The send side ("permutation 1" into D fixed blocks of B rows).
/// Inputs: counts int32 [Ev] (slots routed to each expert) and row_index int32 [n] (the flat
/// slots sorted by expert, -1 from position Σ counts on), as moe_routing_map_device(row_index,
/// slot_row, counts, top, 0, Ev) writes them over all Ev experts. Destination m's run is the
/// positions [start_m, start_m + run_m) of row_index, start_m = Σ_{e < m·Lv} counts[e],
/// run_m = Σ of its experts' counts.
/// Outputs (int32 on counts' device, overwritten):
///   send_index [D·B]: send_index[m·B + o] = row_index[start_m + o] (the flat slot that is row o
///     of m's block) for o < min(run_m, B), else -1 (padding; moe_permute leaves the row as is);
///   slot_send [n] (any shape with n elements): the send row m·B + o of each flat slot, -1 for a
///     slot that is not routed (dropped by the router) or overflowed (o >= B);
///   sent [Ev]: the kept slots of each expert, max(0, min(counts[e], B - Σ counts of e's
///     destination's experts below e)) (lower experts of a destination first);
///   overflow: fp32 [1] or an empty Tensor: when given, overflow[0] += Σ counts - Σ sent (the
///     dropped slots; accumulates, read on the host only at log intervals).
/// Errors (mt::Error): dtypes, shapes, devices or contiguity; num_dest < 1; Ev % num_dest != 0;
/// block < 0; D·B or n beyond int32; slot_send's numel != row_index's; an output overlapping an
/// input. The CPU also raises on negative counts, Σ counts > n, and a row_index entry below
/// Σ counts that is not a slot in [0, n). The CUDA backend reads nothing on the host and cannot
/// raise on values: negative counts count as 0, positions of row_index beyond n read as -1 and
/// entries outside [0, n) are sent as no slot — memory-safe, otherwise unspecified (inputs from
/// moe_routing_map_device never do this). CUDA scratch: 8·(Ev + 1) bytes of the stream's
/// workspace.
/// Source: Megatron-Core moe_utils.py permute (+ the drop-and-pad capacity path), with the
/// capacity applied per destination block instead of per expert.
void moe_block_send_layout(const Tensor& send_index, const Tensor& slot_send, const Tensor& sent,
                           const Tensor& overflow, const Tensor& counts, const Tensor& row_index, int64_t num_dest,
                           int64_t block, const Stream& stream);

/// The receive side ("permutation 2", Megatron's sort_chunks_by_idxs from [source][expert] to
/// [expert][source] order, as index maps).
/// Input: sent_all int32 [C, Ev]: the `sent` of moe_block_send_layout of each source rank
/// (all-gathered; row c = the source whose block arrives as received block c). Local expert i
/// (global id first + i, i < num_local) occupies the received rows
/// [c·B + Σ_{i' < i} sent_all[c, first + i'], + sent_all[c, first + i]) of block c, and block c
/// uses its first n_c = Σ_i sent_all[c, first + i] rows.
/// Outputs (int32 on sent_all's device, overwritten):
///   local_counts [num_local]: Σ_c sent_all[c, first + i] (the rows of each local expert);
///   gather_index [C·B]: row q < R = Σ local_counts of the expert-ordered layout (local expert,
///     then source c, then the row order within c's block) comes from received row
///     gather_index[q]; -1 for q >= R;
///   scatter_index [C·B]: its inverse: received row c·B + o (o < n_c) goes to row
///     scatter_index[c·B + o] of the expert-ordered layout; -1 for the padding rows o >= n_c.
/// Use: moe_permute(xp, recv, gather_index, 1) gathers the expert inputs (rows q >= R untouched);
/// moe_permute(blocks, out, scatter_index, 1) brings the expert outputs back into block layout
/// (padding rows untouched); the backward of each is the other one.
/// Errors (mt::Error): dtypes, shapes, devices or contiguity; first < 0, num_local < 1,
/// first + num_local > Ev; block < 0; C·B beyond int32; an output overlapping the input. The CPU
/// also raises on negative entries of sent_all and on n_c > B. The CUDA backend cannot raise on
/// values; it clips consistently instead: negative entries count as 0 and each block's rows stop
/// at B (expert i of block c gets the rows [min(B, p_i), min(B, p_i + s_i)) for the prefix p_i
/// and count s_i, so the later experts of an overfull block lose the rows beyond B), and
/// local_counts, gather_index and scatter_index all describe the clipped rows. CUDA scratch:
/// 4·C·(2·num_local + 1) bytes (+ alignment) of the stream's workspace (mt::Error beyond it).
/// Source: Megatron-Core moe_utils.py sort_chunks_by_idxs (token_dispatcher.py
/// MoEAlltoAllTokenDispatcher's sort_input_by_local_experts / restore_output_by_local_experts).
void moe_block_receive_layout(const Tensor& gather_index, const Tensor& scatter_index, const Tensor& local_counts,
                              const Tensor& sent_all, int64_t first, int64_t num_local, int64_t block,
                              const Stream& stream);

MT_OP_BACKENDS(moe_block_send_layout)
MT_OP_BACKENDS(moe_block_receive_layout)

}  // namespace mt
