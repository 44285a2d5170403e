#include "train/batch_stager.h"

#include "core/check.h"
#include "core/host_memory.h"
#include "parallel/context_parallel.h"

namespace mt {

BatchStager::BatchStager(const Options& o, Device device)
    : o_(o), device_(device), dev_(device, bytes(o.num_micro)) {
  for (int i = 0; i < 2; ++i) {
    host_[i] = Buffer(Device::cpu(), bytes(o.num_micro), HostMemory::kPinned);
    copied_[i] = std::make_unique<Event>(device);
  }
}

BatchStager::~BatchStager() {
  if (pending_.valid()) pending_.wait();
}

void BatchStager::stage(const data::SampleSource& src, Batch batch, Batch next, const Stream& stream) {
  for (const Batch& b : {batch, next})
    MT_REQUIRE(b.first < 0 || (b.num_micro >= 1 && b.num_micro <= o_.num_micro),
               "BatchStager: a batch of {} micro-batches per data-parallel rank; the buffers hold 1 to {}",
               b.num_micro, o_.num_micro);
  int k;
  if (pending_.valid() && pending_batch_.first == batch.first && pending_batch_.num_micro == batch.num_micro &&
      pending_src_ == &src) {
    k = pending_.get();  // rethrows a data error of the loader thread
  } else {
    if (pending_.valid()) pending_.get();
    k = last_ < 0 ? 0 : last_ ^ 1;
    wait_free(k);
    fill(src, batch, k);
  }
  copy_bytes(dev_.data(), device_, host_[k].data(), Device::cpu(), bytes(batch.num_micro), stream);
  copied_[k]->record(stream);
  used_[k] = true;
  last_ = k;
  staged_micro_ = batch.num_micro;
  if (next.first >= 0) {
    const int nk = k ^ 1;
    pending_batch_ = next;
    pending_src_ = &src;
    pending_ = std::async(std::launch::async, [this, &src, next, nk] {
      wait_free(nk);  // the copy that last read this buffer (issued one stage ago) is done
      fill(src, next, nk);
      return nk;
    });
  }
}

MicroBatch BatchStager::micro_batch(int64_t m) const {
  const int64_t sl = o_.seq / o_.cp, sb = sl * o_.micro;
  char* d = static_cast<char*>(dev_.data()) + m * 5 * sb * 4;
  auto t = [&](int i, DType dt, std::vector<int64_t> shape) { return Tensor(d + i * sb * 4, dt, device_, shape); };
  MicroBatch mb;
  mb.tokens = t(0, DType::kI32, {sl, o_.micro});
  mb.labels = t(1, DType::kI32, {sl, o_.micro});
  mb.loss_mask = t(2, DType::kF32, {sl, o_.micro});
  if (o_.positions || o_.cp > 1) mb.position_ids = t(3, DType::kI32, {sl, o_.micro});
  if (o_.doc_start) mb.doc_start = t(4, DType::kI32, {o_.micro, sl});
  // The micro-batch's 1 / unmasked tokens is folded into its staged loss mask (device data, so
  // a captured step reads each step's value); what remains is the same for every step.
  mb.loss_weight = 1.f / static_cast<float>(staged_micro_ * o_.dp);
  mb.aux_loss_weight = 1.f / static_cast<float>(staged_micro_ * o_.dp);
  return mb;
}

std::vector<MicroBatch> BatchStager::micro_batches() const {
  std::vector<MicroBatch> mbs;
  for (int64_t m = 0; m < staged_micro_; ++m) mbs.push_back(micro_batch(m));
  return mbs;
}

void BatchStager::wait_free(int k) {
  if (used_[k]) copied_[k]->synchronize();
}

void BatchStager::fill(const data::SampleSource& src, Batch batch, int k) {
  const int64_t first = batch.first, num_micro = batch.num_micro;
  const int64_t S = o_.seq, B = o_.micro, sb = S * B, lsb = sb / o_.cp;
  std::vector<int32_t> samples(static_cast<size_t>(B * (S + 1)));
  std::vector<int32_t> tok(sb), lab(sb), pos(sb), doc(sb), tok_sb(sb), lab_sb(sb), pos_sb(sb);
  std::vector<float> mask(sb), mask_sb(sb);
  char* h = static_cast<char*>(host_[k].data());
  const auto read_samples = [&](int64_t base) {
    for (int64_t ib = 0; ib < B; ++ib) {
      const int64_t i = (base + ib) % src.size();
      int32_t* smp = samples.data() + ib * (S + 1);
      src.get(i, smp);
      for (int64_t t = 0; t <= S; ++t)
        MT_REQUIRE(smp[t] >= 0 && smp[t] < o_.vocab, "token id {} at position {} of sample {} of {} is outside the "
                   "vocabulary of {} tokens", smp[t], t, i, src.name(), o_.vocab);
    }
  };
  // --calculate-per-token-loss: the unmasked tokens of the whole global batch (every DP rank's).
  double global_unmasked = 0;
  if (o_.per_token_loss) {
    for (int64_t g = 0; g < num_micro * o_.dp; ++g) {
      read_samples(first + g * B);
      data::prepare_ltor_batch(samples.data(), B, S, o_.ltor, tok.data(), lab.data(), mask.data(), pos.data(),
                               doc.data());
      for (int64_t l = 0; l < sb; ++l) global_unmasked += mask[l];
    }
  }
  for (int64_t m = 0; m < num_micro; ++m) {
    read_samples(first + (m * o_.dp + o_.dp_rank) * B);
    int32_t* dtok = reinterpret_cast<int32_t*>(h + (m * 5 + 0) * lsb * 4);
    int32_t* dlab = reinterpret_cast<int32_t*>(h + (m * 5 + 1) * lsb * 4);
    float* dmask = reinterpret_cast<float*>(h + (m * 5 + 2) * lsb * 4);
    int32_t* dpos = reinterpret_cast<int32_t*>(h + (m * 5 + 3) * lsb * 4);
    int32_t* ddoc = reinterpret_cast<int32_t*>(h + (m * 5 + 4) * lsb * 4);
    data::prepare_ltor_batch(samples.data(), B, S, o_.ltor, tok.data(), lab.data(), mask.data(), pos.data(),
                             doc.data());
    double unmasked = 0;  // over the whole sequences: the loss weight is the one of a single rank
    for (int64_t l = 0; l < sb; ++l) unmasked += mask[l];
    // Megatron's per-micro-batch mean: each unmasked token weighs 1 / unmasked (the staged mask);
    // per token: num_micro · dp / global_unmasked, so that with the loss weight 1 / (num_micro · dp)
    // every unmasked token of the global batch weighs 1 / global_unmasked.
    const double count = o_.per_token_loss ? global_unmasked / static_cast<double>(num_micro * o_.dp) : unmasked;
    const float w = count > 0 ? static_cast<float>(1.0 / count) : 0.f;
    for (int64_t ib = 0; ib < B; ++ib) {
      for (int64_t is = 0; is < S; ++is) {  // [b, s] -> the model's [s, b]
        tok_sb[is * B + ib] = tok[ib * S + is];
        lab_sb[is * B + ib] = lab[ib * S + is];
        mask_sb[is * B + ib] = mask[ib * S + is] * w;
        pos_sb[is * B + ib] = o_.positions ? pos[ib * S + is] : static_cast<int32_t>(is);
      }
    }
    // This CP rank's tokens (Megatron's get_batch_on_this_cp_rank; the identity for cp = 1).
    cp_shard_rows(dtok, tok_sb.data(), S, B, o_.cp, o_.cp_rank);
    cp_shard_rows(dlab, lab_sb.data(), S, B, o_.cp, o_.cp_rank);
    cp_shard_rows(dmask, mask_sb.data(), S, B, o_.cp, o_.cp_rank);
    cp_shard_rows(dpos, pos_sb.data(), S, B, o_.cp, o_.cp_rank);
    cp_shard_columns(ddoc, doc.data(), B, S, o_.cp, o_.cp_rank);
  }
}

}  // namespace mt
