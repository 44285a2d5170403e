// Data-parallel gradient reduction and parameter all-gather by buckets: Megatron-Core's
// DistributedDataParallel with its bucket groups (megatron/core/distributed/
// distributed_data_parallel.py, param_and_grad_buffer.py) and the shard ownership of the
// distributed optimizer (megatron/core/optimizer/distrib_optimizer.py), driven by the explicit
// hooks of model/param_hooks.h instead of autograd hooks.
//
// Buckets are the ParamStore's (ParamLayout / ParamBucket in model/params.h): contiguous flat
// ranges of the fp32 gradient buffer in reverse parameter order, each padded to kAlign · DP.
// Per step (docs/distributed.md "Gradient buckets"):
//
//   zero_grad_buffer(s)                 start of the step: zero gradients, reset bucket state
//   params_needed(first, end, s)        model, before the first forward kernel of a layer
//   grads_ready(first, end, s)          model, after the last backward of a layer's parameters
//   finish_grad_sync(s)                 before the optimizer step (AdamWOptimizer::step calls it)
//   start_param_sync(s)                 end of the optimizer step (AdamWOptimizer::step calls it)
//
// Reduction: the summed gradient over DP (each rank's loss gradient already carries 1/DP), as
// an all-reduce of the bucket, or with the distributed optimizer a reduce-scatter after which
// rank d holds the sum of slice d of EVERY bucket ([begin + d·n/DP, begin + (d+1)·n/DP) for a
// bucket of n elements): the elements it owns and updates. Parameter all-gather (distributed
// optimizer): after the step, each bucket's owned slice of the model-dtype parameters is
// gathered into the whole bucket on every rank.
//
// Streams: with --overlap-grad-reduce a bucket's reduction is launched as soon as all its
// parameters are reported, on a communication stream owned by this object, after an event
// recorded on the compute stream; finish_grad_sync launches what is left and makes the compute
// stream wait. Without it nothing is launched before finish_grad_sync, which reduces every
// bucket on the compute stream. With --overlap-param-gather the all-gathers run on the
// communication stream in forward bucket order and params_needed makes the compute stream wait
// for the buckets covering the requested parameters; without it they run on the compute stream
// inside the optimizer step. On CPU (inline streams, no-op events) both paths run the same
// collectives in the same order, so results are bitwise identical with overlap on and off.
//
// With overlap the bucket collectives use a communicator of their own (split from the DP group
// at construction), because the caller keeps using the DP communicator on its own stream and one
// NCCL communicator must not be used from two streams at once.
//
// --grad-reduce-in-bf16 (DdpConfig::grad_reduce_in_bf16): each bucket's fp32 gradients are
// rounded to bf16 into a communication buffer (one, as large as the largest bucket; the bucket
// collectives are serialised on one stream), reduced in bf16 (half the traffic), and the reduced
// values (the owned slice with the distributed optimizer) are widened back into the fp32
// gradient buffer. Unlike Megatron, whose flag also makes the gradient buffer bf16, gradients are
// still accumulated over micro-batches in fp32: only the reduction is in bf16. With the copy
// engine the bf16 buffer is a registered region and the rank-order sum is taken in fp32 and
// rounded once.
//
// Copy-engine collectives (DdpConfig::copy_engine, --ddp-copy-engine): when the DP group is an
// NCCL group whose GPUs are all on one host with peer access, the bucket reductions are
// reduce-scatters by copy-engine transfers plus one summation kernel (comm/nccl/peer_copy.h),
// followed (without the distributed optimizer) by a copy-engine all-gather of the reduced fp32
// slices, and the parameter all-gathers are copy-engine all-gathers: no NCCL kernel competes with
// the backward's GEMMs for SMs. The sum is taken in rank order (deterministic; not NCCL's ring
// order, so results differ from the NCCL path in the last bits). Only collectives that overlap
// compute use the copy engine: the ones nothing runs beside — every collective without overlap,
// the reduction of the bucket that completes the backward (layer 0's with GPTModel), the
// all-gather of the first bucket of the forward — stay on NCCL, whose bandwidth is higher
// (fp32 reduce-scatter 317 vs 212 GB/s bus bandwidth on 4 H200, docs/benchmarks.md). Where the
// group does not qualify (CPU, one rank, several hosts, no peer access) the NCCL path is used;
// copy_engine_active() says whether the group exists.
//
// Sharded gradients (DdpConfig::shard_grads, --data-parallel-sharding-strategy optim_grads,
// Megatron-FSDP's ZeRO-2; docs/fsdp.md): the ParamStore holds no whole gradient buffer, only a
// few bucket-sized staging slots and an expert slot of the largest MoE layer's experts
// (ParamStore::use_grad_slots; docs/fsdp.md "Expert buckets"), and this object holds the fp32
// gradient shard: the owned slice of every bucket, concatenated in ascending flat order (the
// optimizer state's order, so the shard is indexed like the moments). The model reports every
// parameter in every backward (grads_every_backward); when a bucket's parameters are all reported
// its slot is reduce-scattered over the bucket's group (in bf16 with grad_reduce_in_bf16), the
// owned slice is ADDED into the shard (accumulation over micro-batches), the slot is re-zeroed
// and unbound. Without overlap_grad_reduce all of it runs on the compute stream. With one
// micro-batch the shard is bitwise the owned gradient of the distributed optimizer; with several,
// the sum over micro-batches of DP sums instead of the DP sum of micro-batch sums (same values up
// to fp32 rounding).
//
// Sharded gradients overlapped (shard_grads with overlap_grad_reduce; docs/fsdp.md "Overlapped
// reduce-scatter"): the reduce-scatter, the add into the shard and the slot's re-zeroing run on
// the communication stream after an event recorded on the compute stream when the bucket
// completes (the ZeRO-1 path's machinery), and an event recorded on the communication stream
// after them releases the slot. The slot stays bound on the host while the bucket is in flight,
// so nothing else binds it; the compute stream waits for the release event (and the slot is
// unbound) — "retired" — at the first hook that has to: (1) before a use that may write the
// bucket again: the model brackets every use of a unit's parameters (params_every_use() is true
// here too), and params_begin retires the in-flight buckets of the unit's range (a backward; also
// a forward: the output layer's fused loss writes its weight gradient there); a bucket holding a
// parameter no backward bracket has ever covered (the embedding's, whose backward is not
// bracketed — the word embedding too unless a tied head reads it; the last stage's copy of an untied word embedding, written only by the multi-token
// prediction's unbracketed embedding backward; any caller without brackets) is retired at the
// report that completes it; (2) when slots run short: after every report and bracket, in-flight
// buckets are retired oldest first until the free non-expert slots cover the unbound buckets of
// the open brackets plus the unbound buckets holding never-bracketed
// parameters (their writers bind without a hook), and no expert bucket stays in flight while an
// expert bucket the backward will bind is unbound (one expert slot). So a bind never finds the
// slots full and the slot count is unchanged (grad_slots_needed; the memory estimate is exact):
// fewer free slots mean less overlap, never an error. The first backward of each model chunk
// overlaps little (its lower parameters are not yet known to be bracketed). finish_grad_sync
// retires everything; the gradient shard is written only by the communication stream during the
// backward and read after finish_grad_sync. With shard_params the parameter all-gathers share
// the communication stream (their own communicator, issued in the same order on every rank).
//
// Sharded parameters (DdpConfig::shard_params, --data-parallel-sharding-strategy
// optim_grads_params, Megatron-FSDP's ZeRO-3; docs/fsdp.md): on top of the sharded gradients the
// ParamStore keeps only the owned slice of every bucket's model-dtype parameters
// (ParamStore::use_param_slots; the optimizer writes it from the fp32 main slice) and a few
// bucket-sized slots. The model brackets every use of a unit's parameters (a layer's forward, its
// recomputed forward, its backward; the embedding's and the head's forward and backward) with
// params_begin / params_end (params_every_use): params_begin binds each bucket of the unit to a
// slot and all-gathers the owned slices into it on this object's communication stream (a
// communicator of its own), makes the compute stream wait for them, then issues the all-gather of
// the buckets of the next unit the model names (prefetch: they run beside the unit's compute).
// params_end returns the slots of buckets no other active unit reads, except the prefetched
// buckets and the one the unit shares with the next unit, which the next params_begin returns if
// it does not read them. Expert buckets are staged the same way over the expert-data-parallel
// group (a communicator of their own), into the store's expert slots (MoE layer k always in slot
// k mod 2 at a fixed offset: docs/fsdp.md "Expert buckets"); a prefetch onto an expert slot the
// unit in use holds is skipped (gathered at its own params_begin); nothing is gathered after the
// optimizer step. A gather waits (an event on the
// compute stream) for every kernel enqueued before it, so a slot is overwritten only after the
// readers of its previous binding and the shard only read after the optimizer wrote it.
//
// Hybrid sharding (DdpConfig::num_distributed_optimizer_instances k > 1, Megatron's
// --num-distributed-optimizer-instances; docs/fsdp.md): the data-parallel group of D ranks (and
// the expert one of EDP ranks) is split at construction into k instances of D/k contiguous ranks
// (Megatron's intra-partial data-parallel group: group ranks [i·D/k, (i+1)·D/k)) and D/k replica
// groups of k ranks (the inter-instance group: ranks j, j + D/k, ...). dp() / edp() are then the
// instance groups: everything sharded (owned ranges, the gradient shard, the optimizer state, the
// parameter all-gathers, the norm's sum) is sharded over D/k ranks, as with a data-parallel group
// of D/k; the gradients are reduce-scattered within the instance and the owned slice then
// all-reduced over the replica group (replicas()), so every instance holds the sum over all D
// ranks. With shard_grads the replica all-reduce runs once per step, on the accumulated shard,
// in finish_grad_sync (the sum is linear: the same sum as per micro-batch, one all-reduce per
// bucket and step instead of one per micro-batch; not overlapped with the backward). The layout must be ParamLayout::data_parallel_size = D/k (edp: EDP/k).
#pragma once
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/stream.h"
#include "model/param_hooks.h"
#include "model/params.h"

namespace mt {

class PeerCopyGroup;  // comm/nccl/peer_copy.h (CUDA + NCCL builds)
class Fp8Model;       // model/fp8/fp8_model.h
class Fp8Linear;

/// Megatron's DistributedDataParallelConfig (the fields implemented here). The bucket size is
/// part of the ParamStore's layout (ParamLayout::bucket_size, --ddp-bucket-size).
struct DdpConfig {
  bool overlap_grad_reduce = false;        ///< --overlap-grad-reduce
  bool overlap_param_gather = false;       ///< --overlap-param-gather (needs use_distributed_optimizer)
  bool use_distributed_optimizer = false;  ///< --use-distributed-optimizer
  /// --ddp-copy-engine: bucket collectives by copy-engine transfers between the GPUs of one host
  /// where the DP group allows it (see above), else NCCL.
  bool copy_engine = false;
  /// --grad-reduce-in-bf16: the gradient reduction in bf16 (see above).
  bool grad_reduce_in_bf16 = false;
  /// --data-parallel-sharding-strategy optim_grads (ZeRO-2; needs use_distributed_optimizer): see
  /// "Sharded gradients" above.
  bool shard_grads = false;
  /// Staging slots with shard_grads; 0 = grad_slots_needed(the store).
  int grad_slots = 0;
  /// --data-parallel-sharding-strategy optim_grads_params (ZeRO-3; needs shard_grads): see
  /// "Sharded parameters" above.
  bool shard_params = false;
  /// Parameter slots with shard_params; 0 = param_slots_needed(the store).
  int param_slots = 0;
  /// --num-distributed-optimizer-instances k (needs use_distributed_optimizer): see "Hybrid
  /// sharding" above.
  int num_distributed_optimizer_instances = 1;
};

/// Ranks of one distributed-optimizer instance of a data-parallel group of `group_size` ranks
/// split into `instances` replicas (--num-distributed-optimizer-instances): group_size /
/// instances. Errors (mt::Error naming both values and `group`, e.g. "dp-cp"): instances < 1, or
/// group_size not divisible by instances.
int instance_group_size(int group_size, int instances, const std::string& group);

class GradSync final : public ParamGradHooks {
 public:
  /// params: the store whose buckets are reduced (not owned; must outlive this). dp: the
  /// data-parallel group (nullptr = a single rank). Errors (mt::Error): overlap_param_gather
  /// without use_distributed_optimizer; num_distributed_optimizer_instances > 1 without
  /// use_distributed_optimizer, with copy_engine, or not dividing DP or EDP (instance_group_size);
  /// with the distributed optimizer and DP > 1, a bucket
  /// whose length is not a multiple of kAlign · DP (the ParamStore was laid out for another
  /// data-parallel size: ParamLayout::data_parallel_size).
  /// With shard_grads, a bucket holding parameters of two model chunks (ParamSpec::model_chunk; lay
  /// the store out with ParamLayout::split_model_chunks) is an mt::Error naming both.
  /// edp: the expert-data-parallel group, over which the buckets of expert parameters
  /// (ParamBucket::expert) are reduced and sharded (nullptr = dp; MoE parallel folding).
  GradSync(ParamStore& params, std::shared_ptr<Communicator> dp, const DdpConfig& config,
           std::shared_ptr<Communicator> edp = nullptr);
  ~GradSync() override;
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  const DdpConfig& config() const { return config_; }
  ParamStore& params() const { return params_; }
  /// The group the distributed optimizer shards over: the data-parallel group given, or with
  /// hybrid sharding this rank's instance of it (D/k ranks).
  const std::shared_ptr<Communicator>& dp() const { return dp_; }
  /// The expert-data-parallel group (== dp() when none was given; with hybrid sharding the
  /// instance, EDP/k ranks).
  const std::shared_ptr<Communicator>& edp() const { return edp_; }
  /// The group bucket `bk` is reduced over: edp() for expert buckets, else dp().
  Communicator& group(const ParamBucket& bk) const { return bk.expert ? *edp_ : *dp_; }
  /// Hybrid sharding: the group over which bucket `bk`'s owned slice is all-reduced after the
  /// reduce-scatter within group(bk) (one rank: no hybrid sharding).
  Communicator& replicas(const ParamBucket& bk) const { return bk.expert ? *inter_edp_ : *inter_dp_; }
  /// Gradients reduce-scattered and parameters sharded: use_distributed_optimizer and DP > 1 (or
  /// EDP > 1); a bucket whose group has one rank stays whole.
  bool distributed() const { return distributed_; }
  const std::vector<ParamBucket>& buckets() const { return params_.buckets(); }
  /// Flat ranges whose optimizer state this rank owns, ascending: [0, total) without the
  /// distributed optimizer, else this rank's slice of each bucket.
  const std::vector<ParamStore::Range>& owned_ranges() const { return owned_; }
  /// This rank's slice of bucket b (the whole bucket without the distributed optimizer).
  ParamStore::Range owned_range(size_t bucket) const;
  /// Sum of the owned ranges' lengths (total / DP with the distributed optimizer).
  int64_t owned_elements() const { return owned_elements_; }
  /// The communication stream (inline on CPU), for the optimizer step's own collectives between
  /// finish_grad_sync and start_param_sync (MuonStep's all-gathers and broadcasts over group()):
  /// nothing of this object's is in flight then, and what the caller enqueues here runs before
  /// the overlapped parameter all-gathers, which start_param_sync enqueues after it. The caller
  /// orders it against its own stream with events and makes its stream wait before returning.
  const Stream& comm_stream() const { return comm_; }

  /// Start of a step (Megatron's DistributedDataParallel.zero_grad_buffer): zeroes the fp32
  /// gradients on `stream` (ParamStore::zero_grads: the grad_overwrite parameters' first writes
  /// overwrite instead) and resets the per-step bucket state. Reductions of an abandoned
  /// step still in flight are waited for first.
  void zero_grad_buffer(const Stream& stream);
  /// ParamGradHooks: marks parameters [first, end) ready; with overlap_grad_reduce launches the
  /// reduction of every bucket now complete (in bucket order). Errors: a range outside
  /// [0, params.size()), a parameter reported twice in one step, or a call after
  /// finish_grad_sync in the same step (the gradients were already reduced).
  void grads_ready(size_t first, size_t end, const Stream& stream) override;
  /// Launches the reduction of every bucket not launched yet (all of them without overlap, on
  /// `stream`), then makes `stream` wait for all of them; also waits for parameter all-gathers
  /// still in flight (the optimizer step writes the parameters next). The gradients are reduced
  /// after it (with the distributed optimizer: in the owned ranges only). Once per step; later
  /// calls in the same step do nothing, and no bucket is ever reduced twice in a step. Errors:
  /// mt::Error naming a grad_overwrite parameter whose gradient no write of the step has taken
  /// (ParamStore::untaken_first_write: it would hold the last step's values).
  void finish_grad_sync(const Stream& stream);
  /// The host-side state of a step whose zero_grad_buffer ... finish_grad_sync ran inside a CUDA
  /// graph just replayed (StepRunner's full-iteration graph): the replay did the reductions, so
  /// this sets the state finish_grad_sync leaves — every bucket reduced, the step finished, and
  /// (the step-boundary rule below) nothing bound, gathered or in flight — without launching
  /// anything. Without it the optimizer step's finish_grad_sync would reduce every bucket a
  /// second time (the replay does not run the host code that records what was launched). Host
  /// only. Errors: mt::Error when a slot is bound, a bucket in flight or a unit open (the state
  /// before the replay was not a step boundary's).
  void mark_replayed_grad_sync();
  /// The host-side state start_param_sync leaves, after a replayed graph that held the optimizer
  /// step too (--cuda-graph-include-optimizer; call after mark_replayed_grad_sync): the step's
  /// gradient phase ended, every parameter slot free, and with --fp8-param-gather the model
  /// parameters marked stale as start_param_sync marks them. Host only; launches nothing.
  void mark_replayed_param_sync();
  /// What this object holds live on the host between hooks (CUDA graphs, docs/fsdp.md "CUDA graphs
  /// of the whole step"): gradient or parameter slots bound, buckets whose reduce-scatter is in
  /// flight, units open (params_begin without params_end), gathers whose events the compute stream
  /// still owes a wait, communication-stream work not joined back. Empty at every step boundary:
  /// after finish_grad_sync, after start_param_sync (except --overlap-param-gather's all-gathers,
  /// which CUDA graphs refuse) and after end_param_use — the state a captured
  /// step starts from and ends in, so that a replay needs no host bookkeeping but
  /// mark_replayed_*, and so that no event recorded inside a capture is waited for outside it
  /// (nor one recorded outside inside it).
  std::string live_host_state() const;
  /// The per-step host state in words (tests: the state a simulated replay leaves equals the
  /// eager step's; two steps after the warm-up take the same decisions): the live state above plus
  /// the reduction bookkeeping and each bucket's slots.
  std::string host_state() const;
  /// End of a use of the parameters outside a training step (a validation forward): makes `stream`
  /// wait for the parameter gathers still on the communication stream and returns every parameter
  /// slot no unit uses, so that the next step (or a captured validation forward) starts from the
  /// step-boundary state. Nothing without sharded parameters beyond finish_param_sync.
  void end_param_use(const Stream& stream);
  /// After the optimizer updated the owned parameters on `stream`: with the distributed
  /// optimizer, all-gathers each bucket's model-dtype parameters from the owned slices, in
  /// forward bucket order (on the communication stream with overlap_param_gather, else on
  /// `stream`). Also ends the step's gradient phase (the next grads_ready starts a new step).
  void start_param_sync(const Stream& stream);
  /// ParamGradHooks: makes `stream` wait for the all-gathers of the buckets holding parameters
  /// [first, end) (nothing to wait for without overlap_param_gather). Errors: a range outside
  /// [0, params.size()).
  void params_needed(size_t first, size_t end, const Stream& stream) override;
  /// Makes `stream` wait for every parameter all-gather still in flight (checkpointing,
  /// evaluation without params_needed, the next optimizer step).
  void finish_param_sync(const Stream& stream);

  /// --fp8-param-gather (Megatron's fp8_param; docs/fp8.md "FP8 parameter gather"): from the next
  /// start_param_sync on, every bucket holding FP8 linear weights (dense buckets over a group of
  /// 2+ ranks; the expert buckets keep the model-dtype gather) is gathered as one byte buffer per
  /// rank: its owned slice's other parameters in the model dtype, its pieces of the FP8 weights
  /// quantised to FP8 (1 byte an element instead of 2), each rank's part padded to the largest.
  /// The FP8 bytes land in the linears' persistent wq (wq_t transposed from them), so the forward
  /// quantises nothing for these weights (Fp8Model::weights_gathered); the scale is the whole
  /// weight's: tensorwise from the owned slices' amaxes all-reduced MAX over TP and DP x CP
  /// (on the compute stream, before the gathers), delayed the step's stored scale with the slices'
  /// amaxes recorded. A weight kept in its bf16 storage (Fp8Linear::in_params) is quantised from
  /// the fp32 main shard, rounded to bf16 first; otherwise the model-dtype copies of the FP8
  /// weights hold only this rank's slice up to date until sync_model_params. Without
  /// overlap_param_gather (and shard_grads) the gathered bytes use the bucket's fp32 gradients,
  /// which the optimizer step has consumed; else one buffer of the largest bucket. Nothing with one
  /// data-parallel rank (each layer quantises its weights). Errors: mt::Error without
  /// use_distributed_optimizer.
  void set_fp8_param_gather(Fp8Model& fp8);
  /// Whether buckets are gathered in FP8 (set_fp8_param_gather with DP > 1 and FP8 weights in a
  /// dense bucket).
  bool fp8_param_gather_active() const { return !fp8_linears_.empty(); }
  /// Bytes set_fp8_param_gather allocates for a store laid out as `store` (ParamStore::laid_out)
  /// whose parameters named in `fp8_weights` are the FP8 linears' weights, its dense buckets over
  /// `ranks` data-parallel ranks, under `config` (the memory estimate): one fp32 amax per gathered
  /// weight and, with overlap_param_gather or shard_grads, the byte buffer of the largest gathered
  /// bucket (every rank's part padded to the largest, a multiple of 16 bytes; otherwise the gather
  /// runs in the bucket's fp32 gradients, which the optimizer step has consumed); 0 when nothing is
  /// gathered in FP8 (ranks < 2, no FP8 weight in a dense bucket).
  static int64_t fp8_param_gather_bytes(const ParamStore& store, const std::vector<std::string>& fp8_weights, int ranks,
                                        const DdpConfig& config);
  /// Bytes one FP8 parameter all-gather of every bucket moves into each rank (received, own part
  /// included), and what the model-dtype gather of the same buckets moves (tests, logging).
  std::pair<int64_t, int64_t> fp8_gather_bytes() const;
  /// After FP8 gathers: the model-dtype all-gather of the buckets that were gathered in FP8, so
  /// that every rank's model parameters are whole again (checkpoint saves read them: with an fp32
  /// model they are the main parameters). Waits for the gathers in flight first; nothing when no
  /// FP8 gather ran since the last call, or when the main parameters are a separate fp32 copy
  /// (checkpoints read those; the bf16 storage of a weight kept in FP8 holds its FP8 bytes).
  void sync_model_params(const Stream& stream);
  /// Whether the bucket collectives run as copy-engine transfers (DdpConfig::copy_engine and a
  /// DP group that qualifies); why_not_copy_engine() says why not otherwise.
  bool copy_engine_active() const { return peer_copy_ != nullptr; }
  const std::string& why_not_copy_engine() const { return why_not_copy_engine_; }
  /// Bucket collectives (reduce-scatters and all-gathers) run by the copy engine since
  /// construction (tests: which collectives took which path).
  size_t copy_engine_collectives() const { return copy_engine_collectives_; }
  /// Number of bucket reductions launched in the current step (tests, logging).
  size_t grad_reductions_launched() const;

  /// Sharded gradients (DdpConfig::shard_grads): fp32 [owned_elements()], the owned ranges'
  /// reduced gradients concatenated in ascending order. Error without shard_grads.
  bool grads_sharded() const { return config_.shard_grads; }
  Tensor grad_shard() const;
  /// Bytes of gradient memory this rank holds: the shard plus the store's staging slots
  /// (shard_grads), else the store's whole buffer.
  int64_t grad_bytes() const;
  bool grads_every_backward() const override { return config_.shard_grads; }
  /// Sharded gradients whose reduce-scatters overlap the backward (shard_grads and
  /// overlap_grad_reduce; see "Sharded gradients overlapped" above).
  bool grads_overlapped() const { return config_.shard_grads && config_.overlap_grad_reduce; }
  /// Buckets whose reduce-scatter into the shard is in flight on the communication stream, their
  /// slots still bound (tests).
  size_t grad_slots_in_flight() const { return in_flight_.size(); }

  /// Sharded parameters (DdpConfig::shard_params): see "Sharded parameters" above.
  bool params_sharded() const { return config_.shard_params; }
  /// The model brackets every use of a unit (params_begin / params_end): sharded parameters, and
  /// overlapped sharded gradients (whose slots are retired at the backward brackets).
  bool params_every_use() const override { return config_.shard_params || grads_overlapped(); }
  /// ParamGradHooks: gathers the staged buckets holding parameters [first, end) (bound buckets
  /// are reused), makes `stream` wait for them, then (prefetch) starts the gathers of the buckets
  /// holding [next_first, next_end) in the pass's order, which the compute stream waits for at
  /// their own params_begin. First returns the slots of idle buckets neither range reads (a nested
  /// use without a next range keeps the current prefetch). With grads_overlapped(): a backward use
  /// first retires the in-flight gradient slots it needs (see "Sharded gradients overlapped"), and
  /// without shard_params every use waits for the parameter all-gathers of its range as
  /// params_needed does (the model calls params_begin instead). Nothing else without
  /// shard_params. Errors: a range outside [0, params.size()); more buckets in use than slots
  /// (ParamStore::bind_param_slot).
  void params_begin(size_t first, size_t end, bool backward, size_t next_first, size_t next_end,
                    const Stream& stream) override;
  /// ParamGradHooks: the end of a params_begin's use (same range and direction). Errors: a range
  /// not begun.
  void params_end(size_t first, size_t end, bool backward, const Stream& stream) override;
  /// Parameter all-gathers into slots issued since construction (tests: prefetch and reuse).
  size_t param_gathers() const { return param_gathers_; }
  /// Bytes of model-dtype parameter memory this rank holds (ParamStore::param_storage_bytes).
  int64_t param_bytes() const { return params_.param_storage_bytes(); }

 private:
  // exposed: nothing computes beside this collective (see "Copy-engine collectives" above), so
  // NCCL, which has the higher bandwidth, runs it even when the copy engine is active.
  void launch_grad_reduce(size_t b, const Stream& stream, bool exposed);
  void launch_param_gather(size_t b, const Stream& stream, bool exposed);
  // The stream a bucket reduction launched now runs on: comm_ with overlap_grad_reduce (made to
  // wait, once per `recorded`, for the work enqueued on `stream` so far), else `stream`.
  const Stream& reduce_stream(const Stream& stream, bool& recorded);
  // comm_ waits for the work enqueued on `stream` so far; `stream` waits for comm_'s.
  void comm_after(const Stream& stream);
  void wait_for_comm(const Stream& stream);
  // shard_grads: reduce-scatter bucket b's slot, add the owned slice into the shard, re-zero
  // the slot, and make its parameters reportable again; the slot is released now (`stream` is
  // the compute stream) or, on comm_, after release_[b] (in flight until retired).
  void reduce_into_shard(size_t b, const Stream& stream);
  // shard_grads: reduces into the shard every bucket of [lo, hi] whose parameters are all
  // reported, then retires what must be (grads_overlapped()).
  void reduce_complete_buckets(size_t lo, size_t hi, const Stream& stream);
  // grads_overlapped(): `stream` waits for the release of the n oldest in-flight buckets (the
  // n-th's event: comm_ runs in order) and their slots are unbound.
  void retire_grad_slots(size_t n, const Stream& stream);
  // Retires through the newest in-flight bucket `pick` selects (nothing when none does).
  template <class Pick>
  void retire_through_last(Pick pick, const Stream& stream);
  // grads_overlapped(): retires in-flight buckets until every bind possible before the next hook
  // finds a free slot (see "Sharded gradients overlapped").
  void make_room_for_grads(const Stream& stream);
  // grads_overlapped(), a params_begin of [first, end): a backward one marks the parameters
  // bracketed; retires the in-flight buckets of the range (they may be written now), makes room.
  void begin_grad_writes(size_t first, size_t end, bool backward, const Stream& stream);
  // Whether bucket b holds a parameter no backward params_begin has covered.
  bool holds_unbracketed(size_t b) const;
  // Hybrid sharding: all-reduces each bucket's slice of the gradient shard over replicas().
  void all_reduce_shard_over_instances(const Stream& stream);
  void reset_grad_state();
  // shard_params: returns every parameter slot no unit uses and forgets the prefetch (host only;
  // the next gather into a slot is ordered after its readers on comm_, see gather_into_slot).
  void release_param_slots();
  // shard_params: binds staged bucket b to a slot and all-gathers its owned slices into it on
  // comm_ (nothing when bound); releases every bound bucket no unit uses.
  void gather_into_slot(size_t b, const Stream& stream);
  void release_idle_params(size_t keep_lo, size_t keep_hi, size_t keep_lo2, size_t keep_hi2);
  // Expert bucket b (not bound): returns the buckets of the MoE layer holding b's expert slot
  // that no unit uses.
  void free_expert_slot(size_t b);
  void setup_copy_engine();
  // The first bucket whose length is not a multiple of kAlign · DP (cannot be split into equal
  // aligned slices), or nullptr.
  const ParamBucket* unshardable_bucket() const;
  // Bucket indices covering parameters [first, end) (non-empty range): [lo, hi] ascending.
  std::pair<size_t, size_t> bucket_span(size_t first, size_t end) const;

  // --fp8-param-gather: one contiguous element range [begin, begin + n) of a rank's owned slice
  // of a bucket, sent as model-dtype values (linear == nullptr) or as the FP8 bytes of linear's
  // weight elements [weight_begin, weight_begin + n); byte: its offset in the gathered buffer.
  struct Fp8Piece {
    int rank = 0;
    int64_t begin = 0, n = 0;
    Fp8Linear* linear = nullptr;
    int64_t weight_begin = 0, byte = 0;
    size_t amax = 0;  // the linear's index in fp8_linears_
  };
  struct Fp8Bucket {
    std::vector<Fp8Piece> pieces;    // empty: the model-dtype gather
    std::vector<Fp8Linear*> linears;  // whose weights lie in the bucket
    int64_t segment = 0;             // bytes per rank
  };
  void plan_fp8_bucket(size_t b, std::vector<std::pair<int64_t, Fp8Linear*>> weights);
  // The values this rank quantises of piece p (its own): Fp8Linear::weight_piece of the fp32 main
  // shard's elements for a weight kept in its parameter storage, else of the model parameters.
  Tensor fp8_piece_values(const Fp8Piece& p) const;
  void fp8_weight_scales(const Stream& stream);
  void launch_fp8_gather(size_t b, const Stream& stream);
  void launch_model_gather(size_t b, const Stream& stream);

  ParamStore& params_;
  std::shared_ptr<Communicator> dp_, edp_;
  std::shared_ptr<Communicator> inter_dp_, inter_edp_;  // hybrid sharding's replica groups (else one rank)
  Fp8Model* fp8_ = nullptr;
  std::vector<Fp8Linear*> fp8_linears_;  // gathered in FP8, in Fp8Model::linears order
  std::vector<Fp8Bucket> fp8_buckets_;   // per bucket (empty: none gathered in FP8)
  Buffer fp8_comm_, fp8_amax_;           // the gathered bytes (largest bucket), the weights' amaxes
  bool fp8_in_grads_ = false;            // the gathered bytes in the bucket's fp32 gradients (no fp8_comm_)
  bool model_params_stale_ = false;      // FP8 gathers ran since sync_model_params
  DdpConfig config_;
  std::unique_ptr<PeerCopyGroup> peer_copy_;  // copy-engine collectives (null: NCCL / CPU path)
  Buffer bf16_comm_;                          // --grad-reduce-in-bf16: largest bucket, bf16
  Buffer shard_;                              // shard_grads: fp32 [owned_elements_]
  std::vector<int64_t> shard_offset_;         // per bucket: where its owned slice starts in shard_
  std::string why_not_copy_engine_;
  size_t copy_engine_collectives_ = 0;
  bool distributed_ = false;
  std::vector<ParamStore::Range> owned_;
  int64_t owned_elements_ = 0;
  Stream comm_;                 // communication stream (overlap); inline on CPU
  Event compute_ready_, comm_done_;
  std::vector<std::unique_ptr<Event>> gathered_;  // per bucket, recorded on comm_ after its all-gather
  // Per-step state.
  std::vector<uint8_t> ready_;        // per parameter: reported by grads_ready
  std::vector<size_t> waiting_;       // per bucket: parameters not reported yet
  std::vector<uint8_t> launched_;     // per bucket: reduction launched
  size_t n_launched_ = 0;             // buckets with launched_ set
  std::vector<uint8_t> gather_pending_;  // per bucket: all-gather on comm_ not yet waited for
  bool comm_used_ = false;            // a reduction of this step runs on comm_
  bool finished_ = false;             // finish_grad_sync ran this step
  // shard_params: per bucket, the units using it now (params_begin without params_end) and
  // whether its slot's gather on comm_ has not been waited for by the compute stream; the
  // prefetched buckets [prefetch_lo_, prefetch_hi_] (kNone: none); the communicator of the
  // gathers; gathers issued; whether comm_ ran a gather the compute stream has not waited for.
  static constexpr size_t kNone = SIZE_MAX;
  std::vector<int> param_refs_;
  std::vector<uint8_t> param_pending_;
  size_t prefetch_lo_ = kNone, prefetch_hi_ = kNone;
  std::shared_ptr<Communicator> gather_dp_, gather_edp_;
  size_t param_gathers_ = 0;
  bool param_comm_used_ = false;
  // grads_overlapped(): per bucket, the event comm_ records after its reduce-scatter into the
  // shard and the re-zeroing of its slot; the buckets in flight (slots still bound), oldest first;
  // per parameter, whether a backward params_begin has ever covered it; per bucket, the
  // params_begin without params_end covering it (its gradients may be written).
  std::vector<std::unique_ptr<Event>> released_;
  std::deque<size_t> in_flight_;
  std::vector<uint8_t> bracketed_;
  std::vector<int> grad_writers_;
};

}  // namespace mt
