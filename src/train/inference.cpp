#include "train/inference.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "train/generate.h"

namespace mt {

namespace {

std::vector<pipeline::LayerRange> single_chunk(const GPTModel& m) {
  MT_REQUIRE(m.num_chunks() == 1,
             "inference needs one model chunk per pipeline rank, this rank has {} (no virtual pipeline stages)",
             m.num_chunks());
  return {m.chunk(0).layers};
}

float to_float(const char* p, DType t) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return bf16_bits_to_f32(b);
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return f16_bits_to_f32(b);
    }
    default: MT_FAIL("logits of dtype {} cannot be read", dtype_name(t));
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

void pipeline_forward(GPTModel& m, const MicroBatch& mb, bool compute_loss, const Tensor& loss_accum,
                      const Stream& st) {
  const pipeline::LayerRange range = single_chunk(m)[0];
  Communicator& pp = *m.groups().pp;
  if (!range.has_embedding) pp.recv(m.chunk_input(0, 0), pp.rank() - 1, st);
  const Tensor out = m.forward_chunk(0, ChunkBuffers{}, mb, DropoutContext{0, 0, 0, false}, loss_accum,
                                     mb.loss_weight, st, /*first_forward=*/false, compute_loss);
  if (!range.has_loss) pp.send(out, pp.rank() + 1, st);
}

std::vector<float> gather_logit_rows(GPTModel& m, int64_t first, int64_t rows, Buffer& scratch, const Stream& st) {
  const Tensor logits = m.logits();
  if (logits.empty()) return {};
  Communicator& tp = *m.groups().tp;
  const int64_t T = logits.size(0), vl = logits.size(1), V = m.config().vocab_size, n = tp.size();
  MT_REQUIRE(first >= 0 && rows >= 1 && first + rows <= T, "logit rows [{}, {}) outside the {} rows", first,
             first + rows, T);
  const Tensor part = logits.slice0(first, first + rows);
  const DType dt = logits.dtype();
  const size_t es = dtype_size(dt), need = static_cast<size_t>(n * rows * vl) * es;
  if (scratch.bytes() < need) scratch = Buffer(logits.device(), need);
  const Tensor all(scratch.data(), dt, logits.device(), {n, rows, vl});
  if (n == 1) {
    copy(all.view({rows, vl}), part, st);
  } else {
    tp.all_gather(all, part, st);
  }
  std::vector<char> host(need);
  copy_bytes(host.data(), Device::cpu(), scratch.data(), logits.device(), need, st);
  st.synchronize();
  std::vector<float> out(static_cast<size_t>(rows * V));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < vl; ++c) {
        const int64_t col = r * vl + c;
        if (col >= V) break;
        out[static_cast<size_t>(i * V + col)] = to_float(host.data() + ((r * rows + i) * vl + c) * es, dt);
      }
  return out;
}

int32_t sample_next(const std::vector<float>& logits, const SamplingOptions& s, std::mt19937_64& rng) {
  return sample_token(logits, s.greedy, s.temperature, s.top_k, s.top_p, rng);
}

TextGenerator::TextGenerator(GPTModel& model, int64_t max_batch, int64_t max_sequence_length, const Stream& stream)
    : model_(model),
      stream_(stream),
      max_batch_(max_batch),
      max_seq_(max_sequence_length),
      cache_(model.config(), model.groups().tp->size(), single_chunk(model), max_batch, max_sequence_length,
             model.dtype(), model.device()) {
  const TransformerConfig& c = model.config();
  MT_REQUIRE(!position_embedding_kind(c.position_embedding_type).learned_table || max_seq_ <= c.max_positions(),
             "generation context of {} tokens exceeds the model's {} learned positions", max_seq_, c.max_positions());
  const Device dev = model.device();
  tokens_dev_ = Buffer(dev, static_cast<size_t>(max_seq_ * max_batch_) * 4);
  positions_dev_ = Buffer(dev, static_cast<size_t>(max_batch_) * 4);
  bcast_dev_ = Buffer(dev, static_cast<size_t>(max_batch_) * 4);
  decode_ = model.planned_for(1, max_batch_, stream_);
}

GPTModel& TextGenerator::planned(std::unique_ptr<GPTModel>& slot, int64_t seq) {
  if (!slot || slot->config().seq_length != seq) {
    slot.reset();  // free the previous plan first
    slot = model_.planned_for(seq, max_batch_, stream_);
  }
  return *slot;
}

std::vector<std::vector<float>> TextGenerator::logits_at(GPTModel& m, int64_t pos) {
  const std::vector<float> all = gather_logit_rows(m, pos * max_batch_, max_batch_, gather_, stream_);
  std::vector<std::vector<float>> rows;
  if (all.empty()) return rows;
  const size_t V = all.size() / static_cast<size_t>(max_batch_);
  for (int64_t b = 0; b < max_batch_; ++b)
    rows.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(b * V), all.begin() + static_cast<std::ptrdiff_t>((b + 1) * V));
  return rows;
}

void TextGenerator::broadcast_tokens(std::vector<int32_t>& tokens) {
  Communicator& pp = *model_.groups().pp;
  if (pp.size() == 1) return;
  const size_t bytes = tokens.size() * 4;
  copy_bytes(bcast_dev_.data(), model_.device(), tokens.data(), Device::cpu(), bytes, stream_);
  pp.broadcast(Tensor(bcast_dev_.data(), DType::kI32, model_.device(), {static_cast<int64_t>(tokens.size())}),
               pp.size() - 1, stream_);
  copy_bytes(tokens.data(), Device::cpu(), bcast_dev_.data(), model_.device(), bytes, stream_);
  stream_.synchronize();
}

GenerationResult TextGenerator::generate(const std::vector<std::vector<int32_t>>& prompts,
                                         const GenerationOptions& opt) {
  const int64_t n = static_cast<int64_t>(prompts.size()), B = max_batch_, V = model_.config().vocab_size;
  MT_REQUIRE(n >= 1 && n <= B, "{} prompts given; this generator takes 1 to {} at once", n, B);
  MT_REQUIRE(opt.max_new_tokens >= 0, "the number of tokens to generate must be >= 0, got {}", opt.max_new_tokens);
  const SamplingOptions& so = opt.sampling;
  if (!so.greedy) {
    MT_REQUIRE(so.temperature > 0 && std::isfinite(so.temperature), "temperature must be positive, got {}",
               so.temperature);
    MT_REQUIRE(so.top_k >= 0, "top_k must be >= 0, got {}", so.top_k);
    MT_REQUIRE(so.top_p >= 0 && so.top_p <= 1, "top_p must be in [0, 1], got {}", so.top_p);
  }
  std::vector<int64_t> len(static_cast<size_t>(B));
  for (int64_t b = 0; b < n; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    MT_REQUIRE(!p.empty(), "prompt {} is empty (it needs at least one token)", b);
    MT_REQUIRE(static_cast<int64_t>(p.size()) < max_seq_,
               "prompt {} has {} tokens but the context holds {} (prompt and generated tokens): at most {} prompt "
               "tokens",
               b, p.size(), max_seq_, max_seq_ - 1);
    for (int32_t t : p) MT_REQUIRE(t >= 0 && t < V, "prompt {}: token id {} outside the vocabulary of {}", b, t, V);
  }
  // Rows beyond the prompts repeat prompt 0 (the model is planned for max_batch rows).
  auto prompt = [&](int64_t b) -> const std::vector<int32_t>& { return prompts[static_cast<size_t>(b < n ? b : 0)]; };
  int64_t min_len = max_seq_, total = 0;
  for (int64_t b = 0; b < B; ++b) {
    len[static_cast<size_t>(b)] = static_cast<int64_t>(prompt(b).size());
    min_len = std::min(min_len, len[static_cast<size_t>(b)]);
    total = std::max(total, std::min(max_seq_, len[static_cast<size_t>(b)] + opt.max_new_tokens));
  }
  GenerationResult res;
  res.tokens = prompts;
  for (const auto& p : prompts) res.prompt_lengths.push_back(static_cast<int64_t>(p.size()));
  if (opt.max_new_tokens == 0) return res;

  const bool last_stage = model_.chunk(0).layers.has_loss;
  const Device dev = model_.device();
  std::vector<int32_t> host(static_cast<size_t>(total * B), opt.eod >= 0 ? opt.eod : 0);  // [position, row]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < len[static_cast<size_t>(b)]; ++i) host[static_cast<size_t>(i * B + b)] = prompt(b)[static_cast<size_t>(i)];
  std::vector<char> done(static_cast<size_t>(B), 0);
  std::vector<int64_t> generated(static_cast<size_t>(B), 0);
  for (int64_t b = n; b < B; ++b) done[static_cast<size_t>(b)] = 1;
  std::mt19937_64 rng(so.seed);

  // The tokens at position pos from the logits of position pos - 1 (last stage), then on every rank.
  auto choose = [&](int64_t pos, const std::vector<std::vector<float>>& rows) {
    std::vector<int32_t> next(static_cast<size_t>(B), 0);
    if (last_stage) {
      for (int64_t b = 0; b < B; ++b) {
        const size_t bi = static_cast<size_t>(b);
        if (pos < len[bi]) {
          next[bi] = prompt(b)[static_cast<size_t>(pos)];
        } else if (!done[bi]) {
          for (float v : rows[bi])
            MT_REQUIRE(std::isfinite(v), "non-finite logits for prompt {} at position {}: the checkpoint or the "
                       "computation is broken", b, pos);
          next[bi] = sample_next(rows[bi], so, rng);
        } else {
          next[bi] = opt.eod >= 0 ? opt.eod : 0;
        }
      }
    }
    broadcast_tokens(next);
    bool all_done = true;
    for (int64_t b = 0; b < B; ++b) {
      const size_t bi = static_cast<size_t>(b);
      host[static_cast<size_t>(pos * B + b)] = next[bi];
      if (pos >= len[bi] && !done[bi]) {
        res.tokens[bi].push_back(next[bi]);
        ++generated[bi];
        ++res.generated_tokens;
        if (next[bi] == opt.eod || generated[bi] >= opt.max_new_tokens || pos + 1 >= max_seq_) done[bi] = 1;
      }
      all_done = all_done && done[bi];
    }
    return all_done;
  };
  auto batch = [&](GPTModel& m, int64_t first_pos, int64_t s, const InferenceContext* inf) {
    copy_bytes(tokens_dev_.data(), dev, host.data() + first_pos * B, Device::cpu(), static_cast<size_t>(s * B) * 4,
               stream_);
    MicroBatch mb;
    mb.tokens = Tensor(tokens_dev_.data(), DType::kI32, dev, {s, B});
    mb.inference = inf;
    if (first_pos > 0) {
      std::vector<int32_t> pos(static_cast<size_t>(B), static_cast<int32_t>(first_pos));
      copy_bytes(positions_dev_.data(), dev, pos.data(), Device::cpu(), static_cast<size_t>(B) * 4, stream_);
      mb.position_ids = Tensor(positions_dev_.data(), DType::kI32, dev, {1, B});
    }
    pipeline_forward(m, mb, false, Tensor(), stream_);
  };

  const auto t0 = std::chrono::steady_clock::now();
  if (opt.use_cache) {
    InferenceContext ctx(cache_);
    GPTModel& pre = planned(prefill_, min_len);
    batch(pre, 0, min_len, &ctx);
    std::vector<std::vector<float>> rows = logits_at(pre, min_len - 1);
    res.prefill_seconds = seconds_since(t0);
    const auto t1 = std::chrono::steady_clock::now();
    for (int64_t pos = min_len; pos < total; ++pos) {
      if (choose(pos, rows) || pos + 1 == total) break;
      ctx.sequence_len_offset = pos;
      batch(*decode_, pos, 1, &ctx);
      rows = logits_at(*decode_, 0);
    }
    stream_.synchronize();
    res.decode_seconds = seconds_since(t1);
  } else {
    // Reference path: the whole prefix recomputed for every new token (causal attention: the
    // positions after pos - 1 do not change its logits).
    GPTModel& full = planned(full_, total);
    for (int64_t pos = min_len; pos < total; ++pos) {
      batch(full, 0, total, nullptr);
      if (choose(pos, logits_at(full, pos - 1))) break;
    }
    stream_.synchronize();
    res.decode_seconds = seconds_since(t0);
  }
  return res;
}

}  // namespace mt
