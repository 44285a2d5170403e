// Megatron's get_ltor_masks_and_position_ids (megatron/core/datasets/gpt_dataset.py
// _get_ltor_masks_and_position_ids, and GPTDataset.__getitem__'s pad handling) on the host, in a
// compact form for an attention kernel.
//
// Documents inside a sample are delimited by EOD tokens; the EOD belongs to the document it ends
// (Megatron zeroes attention_mask[i+1:, :i+1] for an EOD at i). For query position q let
// doc_start[q] = 1 + (position of the last EOD before q), or 0 when there is none.
//   --reset-attention-mask: q attends to keys k with doc_start[q] <= k <= q (block-diagonal causal);
//                           otherwise to all k <= q (doc_start is then all zeros).
//   --reset-position-ids:   position_ids[q] = q - doc_start'[q] (doc_start' computed as above,
//                           independent of reset-attention-mask); otherwise q.
//   --eod-mask-loss:        loss_mask[q] = 0 where tokens[q] == EOD; otherwise 1.
// Example (doc_start with the reset): tokens A B C EOD D E F EOD G H -> doc_start 0 0 0 0 4 4 4 4 8 8,
// position ids 0 1 2 3 0 1 2 3 0 1: D sees only itself, E sees D and E.
#pragma once
#include <cstdint>
#include <vector>

namespace mt::data {

struct LtorOptions {
  int32_t eod = -1;                   ///< EOD token id (tokenizer.eod)
  bool reset_position_ids = false;    ///< --reset-position-ids
  bool reset_attention_mask = false;  ///< --reset-attention-mask
  bool eod_mask_loss = false;         ///< --eod-mask-loss
  int32_t pad = -1;                   ///< pad id of partial samples (Megatron's _PAD_TOKEN_ID)
};

/// Masks for a batch of input tokens. tokens: [batch, seq] int32 row-major. Outputs (any may be
/// nullptr), all [batch, seq]: loss_mask (float 0/1), position_ids (int32), doc_start (int32: first
/// key index each query may attend to; 0 everywhere without reset_attention_mask). Error: batch or
/// seq < 0.
void get_ltor_masks_and_position_ids(const int32_t* tokens, int64_t batch, int64_t seq, const LtorOptions& opt,
                                     float* loss_mask, int32_t* position_ids, int32_t* doc_start);

/// The whole of GPTDataset.__getitem__ after fetching the text, for a batch of samples
/// [batch, seq + 1] (as SampleSource::get writes them): tokens = text[:-1], labels = text[1:], masks as
/// above, then loss_mask = 0 where labels == pad, and pad tokens/labels replaced by 0.
/// Outputs [batch, seq]; loss_mask/position_ids/doc_start may be nullptr.
void prepare_ltor_batch(const int32_t* samples, int64_t batch, int64_t seq, const LtorOptions& opt, int32_t* tokens,
                        int32_t* labels, float* loss_mask, int32_t* position_ids, int32_t* doc_start);

/// Dense boolean attention mask of one sample from doc_start ([seq] -> [seq, seq] row-major,
/// 1 = may attend), for tests and reference implementations. Note Megatron's own tensor has the
/// opposite convention (True = masked out).
std::vector<uint8_t> dense_attention_mask(const int32_t* doc_start, int64_t seq);

}  // namespace mt::data
