// Deterministic column sums for the fp32 weight and bias gradients of the row-wise ops (LayerNorm
// dweight/dbias, RMSNorm dweight, bias-dropout-add dbias). A gradient kernel reduces its rows per
// block and writes one fp32 partial row per block (or per row group) into the stream's workspace,
// part [P, h]; add_column_partials then adds Σ_p part[p, c] to the main gradient in an order that
// depends only on (P, h). No float atomics: the gradients are bitwise the same on every run (and
// under CUDA-graph replay), for a fixed GPU model (P follows the SM count).
// Only included by .cu files.
#pragma once
#include <cstdint>

#include "core/stream.h"
#include "core/tensor.h"

namespace mt::cuda {

/// The largest number of partial rows P for `count` gradients of h columns that the stream's
/// workspace holds ([count][P][h] fp32 in CudaStreamResources::kWorkspaceBytes), capped at `want`
/// and at least 1. Errors: mt::Error naming `fn` when not even one row fits (count · h > 8 Mi).
int64_t column_partials_rows(int64_t want, int64_t h, int count, const char* fn);

/// The row groups (grid.y) of a column-partials kernel whose blocks cover `col_blocks` column
/// tiles (grid.x) and `rows_per_block` rows at a time: about 8 blocks per SM in all, no more
/// groups than row steps, at most 65535, and as many as the workspace holds
/// (column_partials_rows). Errors: as column_partials_rows.
int64_t column_partials_grid_rows(int64_t rows, int64_t rows_per_block, int64_t col_blocks, int64_t h, int count,
                                  const Stream& stream, const char* fn);

/// The scratch for [count][P][h] fp32 partials: the stream's workspace (shared with cuBLASLt and
/// the MoE ops, which use it in stream order only; nothing in it outlives the op that writes it).
/// Errors: mt::Error naming `fn` for a stream without CUDA resources.
float* column_partials_scratch(const Stream& stream, const char* fn);

/// dst0[c] += Σ_{p < P} part0[p·h + c] (and likewise dst1 / part1 when dst1 is not null) for
/// c < h. Fixed order: 64 lanes per column, lane i sums p = i, i + 64, ... in increasing order,
/// then the lanes are added in order. P >= 1.
void add_column_partials(float* dst0, const float* part0, float* dst1, const float* part1, int64_t P, int64_t h,
                         const Stream& stream);

/// out[n] += the column sums of x [m, n] (act dtype, row-major, contiguous), deterministic: one
/// partial row per row group (16-byte loads where n and x allow), then add_column_partials.
/// out: fp32 [n]. Errors: as column_partials_rows (naming `fn`), and a stream without CUDA
/// resources.
void column_sum_add(const Tensor& out, const void* x, DType act, int64_t m, int64_t n, const Stream& stream,
                    const char* fn);

}  // namespace mt::cuda
