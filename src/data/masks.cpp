#include "data/masks.h"

#include "core/check.h"

namespace mt::data {

void get_ltor_masks_and_position_ids(const int32_t* tokens, int64_t batch, int64_t seq, const LtorOptions& opt,
                                     float* loss_mask, int32_t* position_ids, int32_t* doc_start) {
  MT_REQUIRE(batch >= 0 && seq >= 0, "get_ltor_masks_and_position_ids: bad shape [{}, {}]", batch, seq);
  MT_REQUIRE(seq <= INT32_MAX, "get_ltor_masks_and_position_ids: seq {} too long", seq);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* t = tokens + b * seq;
    int32_t start = 0;  // 1 + position of the last EOD before the current position
    for (int64_t q = 0; q < seq; ++q) {
      const int64_t o = b * seq + q;
      if (loss_mask) loss_mask[o] = (opt.eod_mask_loss && t[q] == opt.eod) ? 0.0f : 1.0f;
      if (position_ids) position_ids[o] = static_cast<int32_t>(opt.reset_position_ids ? q - start : q);
      if (doc_start) doc_start[o] = opt.reset_attention_mask ? start : 0;
      if (t[q] == opt.eod) start = static_cast<int32_t>(q + 1);
    }
  }
}

void prepare_ltor_batch(const int32_t* samples, int64_t batch, int64_t seq, const LtorOptions& opt, int32_t* tokens,
                        int32_t* labels, float* loss_mask, int32_t* position_ids, int32_t* doc_start) {
  MT_REQUIRE(batch >= 0 && seq >= 1, "prepare_ltor_batch: bad shape [{}, {}]", batch, seq);
  MT_REQUIRE(tokens != nullptr && labels != nullptr, "prepare_ltor_batch: tokens and labels are required");
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* s = samples + b * (seq + 1);
    for (int64_t q = 0; q < seq; ++q) {
      tokens[b * seq + q] = s[q];
      labels[b * seq + q] = s[q + 1];
    }
  }
  get_ltor_masks_and_position_ids(tokens, batch, seq, opt, loss_mask, position_ids, doc_start);
  for (int64_t o = 0; o < batch * seq; ++o) {
    if (labels[o] == opt.pad) {
      if (loss_mask) loss_mask[o] = 0.0f;
      labels[o] = 0;
    }
    if (tokens[o] == opt.pad) tokens[o] = 0;
  }
}

std::vector<uint8_t> dense_attention_mask(const int32_t* doc_start, int64_t seq) {
  std::vector<uint8_t> m(static_cast<size_t>(seq * seq), 0);
  for (int64_t q = 0; q < seq; ++q) {
    for (int64_t k = doc_start[q]; k <= q; ++k) m[q * seq + k] = 1;
  }
  return m;
}

}  // namespace mt::data
