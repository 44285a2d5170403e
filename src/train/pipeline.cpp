#include "train/pipeline.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace mt {

using pipeline::Action;
using pipeline::ActionKind;

namespace {
// A pool of interchangeable buffers: lowest free index first, grows on demand; `peak` is the
// number of buffers the replay needed.
struct Pool {
  std::vector<int> free;
  int peak = 0;
  int take() {
    if (free.empty()) return peak++;
    auto it = std::min_element(free.begin(), free.end());
    const int k = *it;
    free.erase(it);
    return k;
  }
  void give(int k) { free.push_back(k); }
};
}  // namespace

PipelinePlan plan_pipeline(const pipeline::ScheduleConfig& cfg, int pp_rank,
                           const std::vector<pipeline::LayerRange>& chunks) {
  PipelinePlan p;
  p.config = cfg;
  p.pp_rank = pp_rank;
  MT_REQUIRE(static_cast<int>(chunks.size()) == cfg.num_chunks(),
             "pipeline rank {} holds {} model chunks but the schedule expects {}", pp_rank, chunks.size(),
             cfg.num_chunks());
  p.actions = pipeline::rank_actions(cfg, pp_rank);
  const size_t n = p.actions.size();
  p.buffers.assign(n, ChunkBuffers{-1, -1, -1});
  p.grad_buffer.assign(n, -1);
  // Buffer kinds: 0 activation slots (shared by the rank's chunks), 1 input buffers (per chunk),
  // 2 gradient buffers (shared), 3 head slots (per chunk; the loss chunk's). Keyed by
  // (micro-batch, chunk) while alive.
  enum { kSlot = 0, kInput = 1, kGrad = 2, kHead = 3 };
  Pool slots, grads;
  std::vector<Pool> inputs(chunks.size()), heads(chunks.size());
  std::map<std::pair<int, int>, int> alive[4];
  struct Deferred {
    int kind, chunk, index;
  };
  std::vector<Deferred> deferred;  // released when the current p2p batch has completed
  // The last p2p batch that received into or sent from each buffer, keyed (kind, chunk, index)
  // (chunk 0 for the shared slots and gradient buffers): what a compute using it waits for.
  p.wait_batch.assign(n, -1);
  std::map<std::tuple<int, int, int>, int> last_batch;
  auto touched = [&](int kind, int chunk, int index, int batch) { last_batch[{kind, chunk, index}] = batch; };
  auto batch_of = [&](int kind, int chunk, int index) {
    auto it = last_batch.find({kind, chunk, index});
    return it == last_batch.end() ? -1 : it->second;
  };
  auto pool = [&](int kind, int chunk) -> Pool& {
    if (kind == kSlot) return slots;
    if (kind == kGrad) return grads;
    return (kind == kInput ? inputs : heads)[static_cast<size_t>(chunk)];
  };
  auto get = [&](int kind, const Action& a) {
    const auto key = std::make_pair(a.microbatch, a.chunk);
    auto it = alive[kind].find(key);
    if (it != alive[kind].end()) return it->second;
    const int k = pool(kind, a.chunk).take();
    alive[kind][key] = k;
    return k;
  };
  auto release = [&](int kind, const Action& a, bool later) {
    const auto key = std::make_pair(a.microbatch, a.chunk);
    const int k = alive[kind].at(key);
    alive[kind].erase(key);
    if (later) {
      deferred.push_back({kind, a.chunk, k});
    } else {
      pool(kind, a.chunk).give(k);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const Action& a = p.actions[i];
    const pipeline::LayerRange* ch = a.microbatch >= 0 ? &chunks[static_cast<size_t>(a.chunk)] : nullptr;
    ChunkBuffers& buf = p.buffers[i];
    // The forward's buffers (all already taken by its forward, except a received input's).
    auto forward_buffers = [&] {
      buf.input = get(kInput, a);
      buf.slot = get(kSlot, a);
      if (ch->has_loss) buf.head = get(kHead, a);
    };
    auto release_forward_buffers = [&](bool later) {
      release(kSlot, a, later);
      release(kInput, a, later);
      if (ch->has_loss) release(kHead, a, later);
    };
    switch (a.kind) {
      case ActionKind::kRecvForward:
        buf.input = get(kInput, a);
        break;
      case ActionKind::kForward:
        forward_buffers();
        if (cfg.forward_only && ch->has_loss) release_forward_buffers(false);  // no send, no backward
        break;
      case ActionKind::kSendForward:
        forward_buffers();
        if (cfg.forward_only) release_forward_buffers(true);  // once the send has completed
        break;
      case ActionKind::kRecvBackward:
        p.grad_buffer[i] = get(kGrad, a);
        break;
      case ActionKind::kBackward:
        forward_buffers();
        release_forward_buffers(false);
        // The loss chunk produces the gradient it sends; stages 0 and pp·V−1 on one rank need none.
        if (!(ch->has_loss && ch->has_embedding)) {
          p.grad_buffer[i] = get(kGrad, a);
          if (ch->has_embedding) release(kGrad, a, false);  // nothing to send
        }
        break;
      case ActionKind::kSendBackward:
        p.grad_buffer[i] = get(kGrad, a);
        release(kGrad, a, true);
        break;
      case ActionKind::kGradSync:
        break;
    }
    switch (a.kind) {
      case ActionKind::kRecvForward: touched(kInput, a.chunk, buf.input, a.batch); break;
      case ActionKind::kSendForward:  // chunk_output: the slot's last layer output, or the input of an empty chunk
        touched(kSlot, 0, buf.slot, a.batch);
        touched(kInput, a.chunk, buf.input, a.batch);
        break;
      case ActionKind::kRecvBackward:
      case ActionKind::kSendBackward: touched(kGrad, 0, p.grad_buffer[i], a.batch); break;
      case ActionKind::kForward:
      case ActionKind::kBackward: {
        int w = std::max(batch_of(kInput, a.chunk, buf.input), batch_of(kSlot, 0, buf.slot));
        if (p.grad_buffer[i] >= 0) w = std::max(w, batch_of(kGrad, 0, p.grad_buffer[i]));
        p.wait_batch[i] = w;
        break;
      }
      case ActionKind::kGradSync: break;
    }
    if (pipeline::is_p2p(a.kind)) p.num_batches = std::max(p.num_batches, a.batch + 1);
    const bool batch_ends = pipeline::is_p2p(a.kind) && (i + 1 == n || !pipeline::is_p2p(p.actions[i + 1].kind) ||
                                                         p.actions[i + 1].batch != a.batch);
    if (batch_ends) {
      for (const auto& d : deferred) pool(d.kind, d.chunk).give(d.index);
      deferred.clear();
    }
  }
  MT_CHECK(alive[kSlot].empty() && alive[kInput].empty() && alive[kGrad].empty() && alive[kHead].empty(),
           "pipeline plan of rank {} leaves buffers alive", pp_rank);
  p.activation_slots = std::max(slots.peak, 1);
  for (size_t c = 0; c < chunks.size(); ++c) {
    p.inputs_per_chunk.push_back(std::max(inputs[c].peak, 1));
    p.loss_slots_per_chunk.push_back(std::max(heads[c].peak, 1));
  }
  p.grad_buffers = grads.peak;
  return p;
}

ModelLayout model_layout(const std::vector<pipeline::LayerRange>& chunks,
                         const std::vector<const PipelinePlan*>& plans) {
  ModelLayout out;
  out.head.keep_logits = false;  // the head computes its loss and gradients in chunks of rows
  for (size_t c = 0; c < chunks.size(); ++c) {
    ModelChunk mc{chunks[c], 1, 1};
    for (const PipelinePlan* p : plans) {
      mc.inputs = std::max(mc.inputs, p->inputs_per_chunk.at(c));
      mc.loss_slots = std::max(mc.loss_slots, p->loss_slots_per_chunk.at(c));
    }
    out.chunks.push_back(mc);
  }
  for (const PipelinePlan* p : plans) out.activation_slots = std::max(out.activation_slots, p->activation_slots);
  return out;
}

PipelineExecutor::PipelineExecutor(LanguageModel& model, std::shared_ptr<Communicator> pp,
                                   const std::vector<const PipelinePlan*>& plans)
    : model_(model), pp_(std::move(pp)) {
  int n = 0;
  for (const PipelinePlan* p : plans) {
    n = std::max(n, p->grad_buffers);
    max_microbatches_ = std::max(max_microbatches_, p->config.num_microbatches);
    MT_CHECK(p->activation_slots <= model.activation_slots(),
             "the model has {} activation slots; the pipeline plan needs {}", model.activation_slots(),
             p->activation_slots);
    for (size_t c = 0; c < p->inputs_per_chunk.size(); ++c) {
      const ModelChunk& mc = model.chunk(static_cast<int>(c));
      MT_CHECK(p->inputs_per_chunk[c] <= mc.inputs && p->loss_slots_per_chunk[c] <= mc.loss_slots,
               "model chunk {} has {} input buffers and {} loss slots; the pipeline plan needs {} and {}", c,
               mc.inputs, mc.loss_slots, p->inputs_per_chunk[c], p->loss_slots_per_chunk[c]);
    }
  }
  bool overlap = false;
  int batches = 0;
  for (const PipelinePlan* p : plans) {
    overlap = overlap || p->config.overlap_p2p_comm;
    batches = std::max(batches, p->num_batches);
  }
  if (overlap && pp_->size() > 1) {
    // The overlapped batches get a communicator of their own: one NCCL communicator is not used
    // from two streams, and the caller keeps using pp on its stream (e.g. the loss reduction).
    p2p_ = pp_->split(0, pp_->rank(), pp_->name() + "-p2p");
    p2p_stream_ = std::make_unique<Stream>(model.device());
    computed_ = std::make_unique<Event>(model.device());
    for (int b = 0; b < batches; ++b) batch_done_.push_back(std::make_unique<Event>(model.device()));
  }
  const std::vector<int64_t> shape = model.boundary_shape();
  const int64_t numel = shape[0] * shape[1] * shape[2];
  const size_t bytes = static_cast<size_t>(numel) * dtype_size(model.dtype());
  if (n > 0) grad_pool_ = Buffer(model.device(), bytes * static_cast<size_t>(n));
  for (int k = 0; k < n; ++k)
    grads_.emplace_back(static_cast<char*>(grad_pool_.data()) + bytes * static_cast<size_t>(k), model.dtype(),
                        model.device(), shape);
}

PipelineExecutor::~PipelineExecutor() {
  try {
    if (p2p_stream_) p2p_stream_->synchronize();  // no transfer may still use the buffers
  } catch (...) {
  }
}

void PipelineExecutor::use_slot_keys() {
  if (slot_keys_.bytes() > 0) return;
  slot_keys_ = Buffer(model_.device(), sizeof(uint32_t) * static_cast<size_t>(std::max(model_.activation_slots(), 1)));
  host_keys_ = Buffer(Device::cpu(), sizeof(uint32_t) * static_cast<size_t>(std::max(max_microbatches_, 1)),
                      model_.device().is_cuda() ? HostMemory::kPinned : HostMemory::kPageable);
}

void PipelineExecutor::run(const PipelinePlan& plan, const std::vector<MicroBatch>& micro_batches,
                           const RunContext& ctx, const Tensor& loss_accum, float loss_weight_scale,
                           const Tensor& loss_scale, const Stream& st) {
  MT_REQUIRE(static_cast<int>(micro_batches.size()) == plan.config.num_microbatches,
             "pipeline step got {} micro-batches; the schedule is for {}", micro_batches.size(),
             plan.config.num_microbatches);
  const auto& acts = plan.actions;
  const size_t n = acts.size();
  const bool has_backward = std::any_of(acts.begin(), acts.end(), [](const Action& a) {
    return a.kind == ActionKind::kBackward;
  });
  auto grad = [&](size_t i) { return plan.grad_buffer[i] < 0 ? Tensor() : grads_[plan.grad_buffer[i]]; };
  // Overlapped p2p: batches on p2p_stream_ behind the computes listed before them; each compute
  // waits for plan.wait_batch (the stream completes batches in order, so `waited` covers the earlier ones).
  const bool overlap = plan.config.overlap_p2p_comm && p2p_ != nullptr;
  MT_CHECK(!overlap || plan.num_batches <= static_cast<int>(batch_done_.size()),
           "pipeline plan has {} p2p batches; the executor was built for {}", plan.num_batches, batch_done_.size());
  int issued = -1, waited = -1;
  for (size_t i = 0; i < n;) {
    const Action& a = acts[i];
    if (pipeline::is_p2p(a.kind)) {
      if (!overlap) {  // one batch on the compute stream (Megatron's batched p2p)
        i = issue_batch(plan, i, *pp_, st);
        continue;
      }
      computed_->record(st);  // the sends read, the receives overwrite, what the computes so far left
      computed_->wait(*p2p_stream_);
      i = issue_batch(plan, i, *p2p_, *p2p_stream_);
      batch_done_[static_cast<size_t>(a.batch)]->record(*p2p_stream_);
      issued = a.batch;
      continue;
    }
    if (overlap && plan.wait_batch[i] > waited) {
      batch_done_[static_cast<size_t>(plan.wait_batch[i])]->wait(st);
      waited = plan.wait_batch[i];
    }
    if (a.kind == ActionKind::kForward || a.kind == ActionKind::kBackward) {
      const MicroBatch& mb = micro_batches[static_cast<size_t>(a.microbatch)];
      // Global micro-batch index (Megatron's sampler interleaves DP ranks) keys the dropout.
      DropoutContext dc{ctx.seed, static_cast<uint64_t>(ctx.iteration),
                        static_cast<uint32_t>(a.microbatch * ctx.dp_size + ctx.dp_rank), ctx.training,
                        ctx.iteration_ptr};
      if (slot_keys_.bytes() > 0) {  // the slot's micro-batch key, written before its forward
        uint32_t* key = static_cast<uint32_t*>(slot_keys_.data()) + plan.buffers[i].slot;
        if (a.kind == ActionKind::kForward) {
          uint32_t* host = static_cast<uint32_t*>(host_keys_.data()) + a.microbatch;
          *host = dc.microbatch;  // the same value every step: an in-flight copy of it reads the same
          copy_bytes(key, model_.device(), host, Device::cpu(), sizeof(uint32_t), st);
        }
        dc.microbatch_ptr = key;
      }
      if (a.kind == ActionKind::kForward) {
        // The loss chunk makes its gradients in the forward when this micro-batch's backward
        // follows in the plan, with the scales that backward uses (model/layers/output_head.h).
        const HeadGrad head_grad{mb.loss_weight, loss_scale};
        model_.forward_chunk(a.chunk, plan.buffers[i], mb, dc, loss_accum, loss_weight_scale * mb.loss_weight, st,
                             a.first_in_chunk, /*compute_loss=*/true, has_backward ? &head_grad : nullptr);
      } else {
        model_.backward_chunk(a.chunk, plan.buffers[i], mb, dc, grad(i), mb.loss_weight, loss_scale, st,
                              a.last_in_chunk);
      }
    }
    ++i;
  }
  if (issued > waited) batch_done_[static_cast<size_t>(issued)]->wait(st);  // nothing in flight after the run
}

size_t PipelineExecutor::issue_batch(const PipelinePlan& plan, size_t i, Communicator& comm, const Stream& st) {
  // One batch: all of its sends and receives issued together (NCCL group / MPI non-blocking + wait-all).
  const auto& acts = plan.actions;
  const int batch = acts[i].batch;
  comm.group_start();
  size_t j = i;
  for (; j < acts.size() && pipeline::is_p2p(acts[j].kind) && acts[j].batch == batch; ++j) {
    const Action& b = acts[j];
    const Tensor grad = plan.grad_buffer[j] < 0 ? Tensor() : grads_[static_cast<size_t>(plan.grad_buffer[j])];
    switch (b.kind) {
      case ActionKind::kSendForward: comm.send(model_.chunk_output(b.chunk, plan.buffers[j]), b.peer, st); break;
      case ActionKind::kRecvForward: comm.recv(model_.chunk_input(b.chunk, plan.buffers[j].input), b.peer, st); break;
      case ActionKind::kSendBackward: comm.send(grad, b.peer, st); break;
      case ActionKind::kRecvBackward: comm.recv(grad, b.peer, st); break;
      default: break;
    }
  }
  comm.group_end();
  return j;
}

}  // namespace mt
