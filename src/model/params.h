// Parameters and gradients in contiguous buffers (docs/architecture.md principle 1; Megatron's
// ParamAndGradBuffer, megatron/core/distributed/param_and_grad_buffer.py): one flat model-dtype
// parameter buffer, one flat fp32 main-parameter buffer (the same memory when the model dtype is
// fp32; only this rank's owned elements once the distributed optimizer shards it, see
// shard_main; int16 remainders beside the bf16 parameters with --use-precision-aware-optimizer,
// see store_main_as_remainders) and one flat fp32 gradient buffer. Each parameter starts at a multiple of kAlign
// elements so kernels may vectorise. The buffers are divided into data-parallel buckets
// (ParamLayout, ParamBucket): contiguous ranges reduced as one collective each.
#pragma once
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"
#include "core/stream.h"
#include "ops/init.h"

namespace mt {

enum class InitKind : uint8_t { kNormal, kZeros, kOnes };

/// When the gradient of a parameter replicated over the tensor-parallel group is a partial sum
/// that the model all-reduces over TP after the step's last backward (Megatron's
/// finalize_model_grads, _allreduce_non_tensor_model_parallel_grads).
enum class TpGradSum : uint8_t {
  kNone,              ///< complete on every TP rank
  kSequenceParallel,  ///< partial under sequence parallelism only: each TP rank sees its own sequence
                      ///< shard (norm weights, biases added after a row-parallel layer)
  kAlways,            ///< partial whenever TP > 1: each TP rank sees its own heads (q/k layernorm)
};

/// One parameter tensor (this rank's shard). name uses Megatron-Core's module names, e.g.
/// "decoder.layers.3.self_attention.linear_qkv.weight".
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;         ///< local shape, as the layer uses it
  InitKind init = InitKind::kNormal;
  float init_std = 0.02f;
  bool weight_decay = true;           ///< Megatron: no decay for biases and 1-D (norm) params
  /// The unsharded tensor and this rank's box in it (ops/init.h ShardBox): global_shape empty =
  /// shape (not sharded); shard_offset empty = zeros; shard_shape empty = shape. The box may have
  /// a different rank than `shape` (its elements are stored in the box's row-major order).
  std::vector<int64_t> global_shape;
  std::vector<int64_t> shard_offset;
  std::vector<int64_t> shard_shape;
  /// The dimension of global_shape the layer splits over the tensor-parallel group (0: column- or
  /// vocab-parallel rows, 1: row-parallel columns of a matrix), -1 = replicated. Declared whatever
  /// the TP size.
  int tp_split_dim = -1;
  /// Split over the tensor-parallel group (tp_split_dim >= 0 and TP > 1). Otherwise replicated on
  /// every TP rank: counted once in the gradient norm.
  bool tensor_parallel = false;
  /// Replicated parameter whose gradient is a partial sum over TP (see TpGradSum).
  TpGradSum tp_grad_sum = TpGradSum::kNone;
  /// > 0 when dimension 0 of global_shape is the padded vocabulary (word embedding, output
  /// layer): rows >= vocab_rows are padding, which checkpoints do not store, so that a checkpoint
  /// loads under any padding (any TP size or --make-vocab-size-divisible-by).
  int64_t vocab_rows = 0;
  /// Duplicates a parameter of another pipeline stage (the tied output word embedding on the last
  /// stage): excluded from the gradient norm (counted on the first stage) and from checkpoints
  /// (filled from the parameter of the same name on load).
  bool shared_embedding_copy = false;
  /// A MoE expert's parameter (Megatron's allreduce = False): split over expert parallelism
  /// (different experts on different EP ranks) and the expert tensor-parallel group, replicated
  /// over the expert-data-parallel group, whose reduction (GradSync) and distributed-optimizer
  /// sharding it follows; it lives in buckets of expert parameters only. tensor_parallel then means
  /// split over the expert tensor-parallel group.
  bool expert = false;
  /// Every training step writes this parameter's whole gradient, and each of its writers asks
  /// ParamStore::take_first_grad_write before writing (the dense linear layers' weights, model/
  /// layers/linear.h): zero_grads leaves its gradient alone and the step's first write overwrites
  /// it (PyTorch's gradients set to None; no zeroing pass over most of the gradient buffer).
  bool grad_overwrite = false;
  /// The model chunk of this rank (virtual pipeline stage, in ParamStore order: 0 .. chunks - 1)
  /// whose forward and backward use the parameter (GPTModel::param_specs; the embedding belongs
  /// to the chunk with the embedding, the head and the multi-token prediction to the chunk with the
  /// loss). 0 without the interleaved schedule. ParamLayout::split_model_chunks keeps buckets per chunk.
  int model_chunk = 0;
};

struct ParamInfo : ParamSpec {
  int64_t offset = 0;  ///< element offset in the flat buffers
  int64_t numel = 0;
  ShardBox box;        ///< where the shard sits in the global tensor (from the spec)
};

/// Megatron's --ddp-bucket-size default: max(40,000,000, 1,000,000 · data-parallel size)
/// elements (larger buckets for large DP keep NCCL ring chunks bandwidth-bound).
int64_t default_ddp_bucket_size(int64_t data_parallel_size);

/// How the flat buffers are divided into data-parallel buckets (Megatron's ParamAndGradBuffer
/// bucketing). Buckets are formed walking the parameters in REVERSE order (the backward produces
/// the last parameters' gradients first): a bucket is closed once it holds >= bucket_size
/// elements (Megatron's rule); a parameter of >= bucket_size elements, and a
/// shared_embedding_copy parameter (reported late, after the embedding-group all-reduce), get a
/// bucket of their own; expert and non-expert parameters never share a bucket, nor do the expert
/// parameters of two layers (the MoE layers' expert slots of sharded strategies, see
/// ParamStore::use_grad_slots), and with split_model_chunks no bucket holds parameters of two
/// model chunks (ParamSpec::model_chunk). Each bucket is padded to a multiple of kAlign · data_parallel_size
/// elements, so that every data-parallel rank owns an equal, kAlign-aligned 1/DP slice of it
/// (Megatron pads to lcm(128, DP)).
struct ParamLayout {
  /// Implicit from the data-parallel size (one bucket), as the old pad_multiple argument.
  ParamLayout(int64_t data_parallel_size_ = 1, int64_t bucket_size_ = 0)
      : data_parallel_size(data_parallel_size_), bucket_size(bucket_size_) {}
  int64_t data_parallel_size = 1;  ///< >= 1
  /// Elements per bucket (Megatron's --ddp-bucket-size after DistributedDataParallel's
  /// defaulting: default_ddp_bucket_size() with --overlap-grad-reduce, else one bucket).
  /// 0 = one bucket (so does any value >= the buffer length).
  int64_t bucket_size = 0;
  /// Expert-data-parallel size: expert buckets are padded to a multiple of kAlign · this (0 = the
  /// data-parallel size).
  int64_t expert_data_parallel_size = 0;
  /// The word embedding ('embedding.word_embeddings.weight') gets a bucket of its own, as a
  /// shared_embedding_copy does: with sharded gradients under pipeline parallelism it is reported
  /// once per step (after the embedding-group all-reduce) while the rest is reported every backward.
  bool isolate_word_embedding = false;
  /// No bucket holds parameters of two model chunks (ParamSpec::model_chunk; Megatron builds the
  /// buckets of each chunk in a buffer of its own): with sharded gradients under the interleaved
  /// pipeline schedule a chunk's backward must complete every bucket it writes (the backwards of
  /// different chunks and micro-batches interleave; docs/fsdp.md "Interleaved pipeline schedule").
  bool split_model_chunks = false;
  int64_t edp() const { return expert_data_parallel_size > 0 ? expert_data_parallel_size : data_parallel_size; }
};

/// One data-parallel bucket: parameters [param_begin, param_end) (ParamStore indices,
/// consecutive), flat elements [begin, end) of the buffers (the parameters plus alignment and
/// bucket padding; end - begin is a multiple of kAlign · data_parallel_size).
struct ParamBucket {
  size_t param_begin = 0, param_end = 0;
  int64_t begin = 0, end = 0;
  bool expert = false;  ///< holds expert parameters only (else none); padded to kAlign · EDP
  int64_t numel() const { return end - begin; }
};

class ParamStore {
 public:
  static constexpr int64_t kAlign = 64;
  /// A flat element range [begin, end) of the buffers.
  struct Range {
    int64_t begin, end;
  };

  /// Lays out and allocates (uninitialised) buffers on `device`. model_dtype: fp32, bf16 or fp16.
  /// The parameters are laid out in order (offsets ascending), grouped into the buckets of
  /// `layout`. Errors: mt::Error for an unknown dtype, a duplicate name, data_parallel_size < 1
  /// or bucket_size < 0.
  ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, const ParamLayout& layout)
      : ParamStore(std::move(specs), model_dtype, device, layout, /*allocate=*/true) {}
  /// The flat buffers' sizes of a store with these specs and layout, without allocating (the
  /// memory estimate, train/memory_estimate.h): elements in all buckets, in the expert buckets,
  /// and in the largest bucket. Errors: as the constructor.
  struct Plan {
    int64_t total = 0, expert = 0, largest_bucket = 0;
    int64_t count = 0, buckets = 0;  ///< parameters, gradient buckets
    int grad_slots = 0;              ///< grad_slots_needed()
    int param_slots = 0;             ///< param_slots_needed()
    int64_t largest_dense_bucket = 0;  ///< the parameter and gradient slots' length
    /// The expert slots (docs/fsdp.md "Expert buckets"): their length (the largest MoE layer's
    /// expert elements, expert_slot_length()) and counts (expert_param_slots_needed(),
    /// expert_grad_slots_needed()); 0 without expert parameters.
    int64_t expert_slot = 0;
    int expert_param_slots = 0, expert_grad_slots = 0;
  };
  static Plan plan(std::vector<ParamSpec> specs, const ParamLayout& layout);
  /// The store these specs and layout give (infos, buckets, model dtype) without its buffers: for
  /// sizing what depends on the layout (GradSync::fp8_param_gather_bytes); param(), grad() and the
  /// other buffer accessors must not be used. Errors: as the constructor.
  static std::unique_ptr<const ParamStore> laid_out(std::vector<ParamSpec> specs, DType model_dtype,
                                                    const ParamLayout& layout);
  /// One bucket, padded to a multiple of kAlign · pad_multiple (the data-parallel size, so the
  /// distributed optimizer can shard it evenly): ParamLayout{pad_multiple, 0}.
  ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, int64_t pad_multiple = 1)
      : ParamStore(std::move(specs), model_dtype, device, ParamLayout{std::max<int64_t>(pad_multiple, 1), 0}) {}

  size_t size() const { return infos_.size(); }
  const ParamInfo& info(size_t i) const { return infos_[i]; }
  const std::vector<ParamInfo>& infos() const { return infos_; }
  /// Index of a parameter by name; throws mt::Error naming it when absent.
  size_t index(const std::string& name) const;
  /// Index of a parameter by name, or kNoParam when this store does not hold it.
  static constexpr size_t kNoParam = SIZE_MAX;
  size_t find(const std::string& name) const;
  DType model_dtype() const { return model_dtype_; }
  Device device() const { return device_; }
  bool has_separate_main() const { return model_dtype_ != DType::kF32; }
  /// The whole fp32 main copy is addressable: main() and main_flat() work (neither sharded nor
  /// stored as remainders). Otherwise read it through the optimizer's gather_main and write it
  /// with set_main_from_full.
  bool has_main_flat() const { return !main_sharded_ && !main_remainders_; }

  Tensor param(size_t i) const;  ///< model dtype, local shape
  /// fp32 main parameter (== param when fp32). Error (mt::Error) when sharded or stored as
  /// remainders (has_main_flat() false).
  Tensor main(size_t i) const;
  Tensor grad(size_t i) const;   ///< fp32 main gradient
  /// grad(i), except that an expert parameter's staged gradient (use_grad_slots) is returned at its
  /// fixed address in its MoE layer's expert slot without binding the slot (its writers bind it
  /// first with grad(i): MoeExperts' address tables, built in the forward, hold these views).
  Tensor grad_view(size_t i) const;
  Tensor param(const std::string& n) const { return param(index(n)); }
  Tensor grad(const std::string& n) const { return grad(index(n)); }
  Tensor params_flat() const;    ///< model dtype [total]
  Tensor main_flat() const;      ///< fp32 [total]; error as main()
  Tensor grads_flat() const;     ///< fp32 [total]; error when grads_staged()
  int64_t total_elements() const { return total_; }
  int64_t num_parameters() const;  ///< sum of numel (no alignment padding)
  const ParamLayout& layout() const { return layout_; }
  /// Buckets in reduction order: bucket 0 holds the LAST parameters (highest offsets), the last
  /// bucket starts at offset 0. Together they cover [0, total) without gaps.
  const std::vector<ParamBucket>& buckets() const { return buckets_; }
  /// Index into buckets() of the bucket holding parameter i.
  size_t bucket_of(size_t i) const { return bucket_of_.at(i); }

  // --- Sharded fp32 main parameters (distributed optimizer, Megatron's DistributedOptimizer
  // keeping fp32 main copies of its shard only). Only when has_separate_main(): with an fp32
  // model the main parameters are the model parameters and nothing is sharded. ---

  /// Keeps only the main elements in `owned` (sorted, disjoint flat ranges), copying their
  /// current values into a compact buffer [sum of range lengths] (owned ranges concatenated in
  /// order) and freeing the full one: the fp32 values, or the int16 remainders once
  /// store_main_as_remainders ran. Afterwards main()/main_flat() are errors; use main_shard() (or
  /// main_remainders()), initialize(), set_main_from_full() and the optimizer's gather. No-op
  /// without a separate main copy; a repeated call with the same ranges does nothing. Outside a
  /// training step. Errors: ranges unsorted, overlapping or out of [0, total), or already sharded
  /// over other ranges.
  void shard_main(const std::vector<Range>& owned, const Stream& stream);
  bool main_sharded() const { return main_sharded_; }
  /// fp32 [owned elements]: the compact main shard (requires main_sharded(); error when stored as
  /// remainders, see main_remainders()).
  Tensor main_shard() const;
  /// The owned ranges given to shard_main (empty when not sharded).
  const std::vector<Range>& main_shard_ranges() const { return main_ranges_; }

  /// --use-precision-aware-optimizer with --bf16 (Megatron's store_param_remainders,
  /// megatron/core/optimizer/optimizer_config.py; TransformerEngine's FusedAdam): the fp32 main
  /// parameters are kept as the bf16 model parameters (their high 16 bits, rounded) plus an int16
  /// remainder per element (the low 16 bits; ops/optimizer.h split_param_remainders), reconstructed
  /// exactly inside the AdamW step: 2 bytes per element instead of 4. Splits the whole fp32 copy
  /// into the model parameters (all elements, so every data-parallel rank keeps identical bf16
  /// parameters; they differ from the round-to-nearest-even cast only at exact ties) and an int16
  /// [total] remainder buffer, and frees the fp32 one. With staged parameters (use_param_slots,
  /// optim_grads_params) only the owned slices exist: each rank splits its owned elements into
  /// param_shard() and the remainders beside them (the others zero, dropped by shard_main), so the
  /// AdamW step updates the pair (owned bf16 slice, owned remainder) by state index, with no fp32
  /// copy. Call before shard_main (which then keeps the owned remainders), outside a training step. Afterwards main(), main_flat(),
  /// main_shard() and sync_model_from_main() are errors; initialize() and set_main_from_full()
  /// write both halves. A repeated call does nothing. Errors: mt::Error naming the flag when the
  /// model dtype is not bf16, or when the main parameters are already sharded.
  void store_main_as_remainders(const Stream& stream);
  bool main_remainders_stored() const { return main_remainders_; }
  /// int16 remainders of the fp32 main parameters: [owned elements] (owned ranges concatenated,
  /// as main_shard()) when sharded, else [total] (flat index). Requires main_remainders_stored().
  Tensor main_remainders() const;

  /// Main-parameter elements this store holds beyond the model parameters: 0 for an fp32 model,
  /// total_elements() for a whole copy, the owned count once sharded; fp32 elements, or int16
  /// remainders when main_remainders_stored() (see main_storage_bytes).
  int64_t main_storage_elements() const;
  /// Bytes of that storage: 4 per element, 2 with remainders.
  int64_t main_storage_bytes() const { return main_storage_elements() * (main_remainders_ ? 2 : 4); }
  /// Sets the fp32 main parameters from a full-length fp32 [total] tensor on this device (a
  /// loaded checkpoint): the model parameters become its rounding, the main copy (whole, or the
  /// owned elements when sharded) its values; with remainders, the model parameters are the split's
  /// bf16 (every element) and the remainders those of the stored elements. Outside a training step.
  void set_main_from_full(const Tensor& full, const Stream& stream);

  /// Initialises main parameters (layout-invariant Philox init, see ops/init.h) and copies
  /// them into the model-dtype parameters; zeroes the padding and the gradients. With sharded
  /// main parameters or remainders each parameter is drawn into a scratch buffer (one parameter
  /// at a time), rounded (or split) into the model parameters and its stored elements kept.
  void initialize(uint64_t seed, const Stream& stream);
  /// Casts main -> model parameters (after loading main parameters). Error when sharded (the
  /// non-owned model elements would need a data-parallel all-gather; use set_main_from_full) or
  /// stored as remainders (the model parameters are part of the main ones).
  void sync_model_from_main(const Stream& stream);
  /// Start of a step's gradients: afterwards every gradient reads as zero to its first writer.
  /// Staged (use_grad_slots): zeroes every slot and unbinds them.
  /// Zeroes every element of the gradient buffer (padding included) except those of the
  /// grad_overwrite parameters (ParamSpec), which are marked instead: their first writer of the
  /// step overwrites them (take_first_grad_write). With set_grad_overwrite(false), or when no
  /// parameter is grad_overwrite, one memset of the whole buffer.
  void zero_grads(const Stream& stream);
  /// True exactly once after zero_grads for a marked parameter (and clears the mark): the caller
  /// must write the whole gradient (=) instead of adding to it. False otherwise (add). Host-side
  /// bookkeeping in stream order of the calls; a captured step replays the writes of its capture.
  bool take_first_grad_write(size_t i);
  /// The first parameter still marked by zero_grads, i.e. whose gradient no writer has written in
  /// this step (its buffer still holds the last step's values), or kNoParam. GradSync's
  /// finish_grad_sync raises an error naming it.
  size_t untaken_first_write() const;
  // --- Gradient staging slots (--data-parallel-sharding-strategy optim_grads, docs/fsdp.md
  // "optim_grads (ZeRO-2)"): the whole gradient buffer is never held, only a few bucket-sized
  // slots that GradSync reduce-scatters into its gradient shard. ---

  /// Replaces the whole fp32 gradient buffer by `slots` zeroed buffers of the largest bucket's
  /// length, allocated once. Afterwards grad(i) is a view into the slot bound to parameter i's
  /// bucket; a bucket is bound to the lowest free slot at the first grad(i) / bucket_grads of one
  /// of its parameters and stays bound until release_grad_slot (host-side bookkeeping; the
  /// binding sequence depends only on the order of the calls, so the addresses are the same in
  /// every step). A free slot always holds zeros (release_grad_slot's caller re-zeroes it), so
  /// every write accumulates: grad_overwrite is turned off. grads_flat() is an error afterwards.
  /// Expert buckets (docs/fsdp.md "Expert buckets") are staged in a pool of their own:
  /// expert_grad_slots_needed() slots of expert_slot_length() elements; MoE layer k (the k-th run of
  /// expert buckets, moe_layer_of) always binds slot k mod the pool size, at a fixed offset, so the
  /// gradient addresses MoeExperts caches in its grouped-GEMM tables are the same in every backward.
  /// Binding an expert bucket whose slot another MoE layer still holds is an mt::Error naming both
  /// (never a silent overwrite). Outside a training step. Errors: slots < 1, or called twice.
  void use_grad_slots(int slots, const Stream& stream);
  bool grads_staged() const { return !grad_slot_buf_.empty(); }
  int grad_slots() const { return static_cast<int>(grad_slot_buf_.size()); }
  /// fp32 [bucket b's numel]: the bucket's gradients: a range of the whole buffer, or (staged) the
  /// slot it is bound to, binding it. Error (staged): every slot bound to another bucket (named).
  Tensor bucket_grads(size_t b) const;
  /// fp32 [n]: flat gradient elements [begin, begin + n); staged, they must lie in one bucket.
  Tensor grads_range(int64_t begin, int64_t n) const;
  /// The bucket holding flat element `e` (0 <= e < total).
  size_t bucket_at(int64_t e) const;
  /// Staged: unbinds bucket b's slot (an expert bucket: its part of its layer's expert slot, freed
  /// with the layer's last bucket), which the caller has zeroed (in stream order). No-op when unbound.
  void release_grad_slot(size_t b);
  /// Whether bucket b is bound to a slot now (staged), or always (whole buffer).
  bool grad_bound(size_t b) const { return !grads_staged() || slot_of_bucket_.at(b) >= 0; }
  /// Staged: the slot bucket b is bound to (an expert bucket: its expert slot), -1 when unbound
  /// (tests, GradSync::host_state: the bindings of two steps compared).
  int grad_slot_of(size_t b) const { return grads_staged() ? slot_of_bucket_.at(b) : -1; }
  /// Staging slots the model's backward needs (DdpConfig::grad_slots' default): the most buckets
  /// one reported unit of the backward writes before it is reported (a layer: the name up to
  /// 'layers.<i>'; else the first name component, e.g. 'embedding', 'output_layer'), plus one for
  /// the bucket it shares with the unit reported before and one for the tied word embedding (bound
  /// from the output layer's backward to the embedding's); at most the number of non-expert buckets.
  int grad_slots_needed() const;
  /// Expert gradient slots (use_grad_slots): 1 when the store has expert parameters (a MoE layer's
  /// expert gradients are written and reported within its backward, and the backwards of one
  /// stage's layers do not interleave), else 0.
  int expert_grad_slots_needed() const { return expert_regions_.empty() ? 0 : 1; }
  /// Expert parameter slots (use_param_slots): 2 (the MoE layer in use and the next one prefetched,
  /// whose MoE-layer indices differ by one in every pass — except under full recompute, where a
  /// group's first backward would prefetch a layer an even distance away: GradSync::params_begin
  /// skips that prefetch), at most the number of MoE layers.
  int expert_param_slots_needed() const { return static_cast<int>(std::min<size_t>(2, expert_regions_.size())); }
  /// The MoE layers of this store in flat order: each one's expert buckets' flat range [begin, end).
  const std::vector<Range>& expert_regions() const { return expert_regions_; }
  /// The MoE-layer index (into expert_regions()) of expert bucket b, -1 for a non-expert bucket.
  int moe_layer_of(size_t b) const { return moe_layer_of_bucket_.at(b); }
  /// The expert slots' length: the largest MoE layer's expert elements (0: none).
  int64_t expert_slot_length() const;
  int expert_grad_slots() const { return expert_grads_.slots(); }
  int expert_param_slots() const { return expert_params_.slots(); }
  /// Bytes of gradient storage this store holds: the whole buffer, or the slots.
  int64_t grad_storage_bytes() const;

  // --- Parameter staging (--data-parallel-sharding-strategy optim_grads_params, ZeRO-3;
  // docs/fsdp.md "optim_grads_params (ZeRO-3): as built"): each rank keeps only its owned slice of
  // every bucket's model-dtype parameters; a bucket's whole parameters exist only while GradSync
  // has gathered them into one of a few bucket-sized slots. ---

  /// Replaces the whole model-dtype parameter buffer by the owned slices: owned[b] (b indexes
  /// buckets(); a kAlign-aligned sub-range of the bucket, GradSync::owned_range) of every bucket,
  /// concatenated in ascending offset order (the optimizer state's order: param_shard() is
  /// indexed like the moments), plus `slots` buffers of the largest non-expert bucket's length,
  /// allocated once. For an fp32 model the shard is the main shard (main_sharded() afterwards,
  /// over the non-empty owned ranges). Expert buckets are staged in a pool of their own,
  /// expert_param_slots_needed() slots of expert_slot_length() elements, MoE layer k always in slot
  /// k mod the pool size at a fixed offset (MoeExperts caches its weight addresses, as for
  /// use_grad_slots); binding one whose slot another MoE layer holds is an mt::Error naming both.
  /// Afterwards param(i) of a staged
  /// bucket is a view into the slot it is bound to (bind_param_slot) and an mt::Error naming the
  /// parameter when it is not bound; params_flat() and sync_model_from_main are errors
  /// (store_main_as_remainders then splits the owned slices). Outside a training step, before
  /// shard_main and store_main_as_remainders. Errors:
  /// slots < 1, called twice, owned not one range per bucket inside it, or the main parameters
  /// already sharded or stored as remainders.
  void use_param_slots(const std::vector<Range>& owned, int slots, const Stream& stream);
  bool params_staged() const { return params_staged_; }
  int param_slots() const { return static_cast<int>(param_slot_buf_.size()); }
  /// Model dtype [sum of the owned ranges]: the owned slices (requires params_staged()).
  Tensor param_shard() const;
  /// Bucket b's owned slice of the model-dtype parameters: a view into param_shard().
  Tensor bucket_param_shard(size_t b) const;
  /// Whether bucket b's whole parameters are always addressable (not staged).
  bool param_resident(size_t /*b*/) const { return !params_staged_; }
  /// Model dtype [bucket b's numel]: its whole parameters (the resident buffer, or the slot it is
  /// bound to). Error (mt::Error) when staged and not bound.
  Tensor bucket_params(size_t b) const;
  /// Binds staged bucket b to the lowest free slot (an expert bucket: its place in its MoE layer's
  /// expert slot) (no-op when bound) and returns its view; the caller fills it. Error: every slot
  /// bound (the buckets named), or the expert slot held by another MoE layer (both named).
  /// Host-side bookkeeping only.
  Tensor bind_param_slot(size_t b);
  /// Unbinds bucket b's slot (no-op when unbound or resident); the caller orders later writes of
  /// the slot after the readers of this binding.
  void release_param_slot(size_t b);
  bool param_bound(size_t b) const { return param_resident(b) || slot_of_param_bucket_.at(b) >= 0; }
  /// Staged: the parameter slot bucket b is bound to (an expert bucket: its expert slot), -1 when
  /// unbound or resident (tests, GradSync::host_state).
  int param_slot_of(size_t b) const { return params_staged_ ? slot_of_param_bucket_.at(b) : -1; }
  /// Staged expert bucket b: the MoE layer (moe_layer_of) holding the expert parameter slot b binds
  /// to, -1 when free.
  int expert_param_slot_holder(size_t b) const;
  /// Parameter slots the model needs with GradSync's prefetch (DdpConfig::param_slots' default):
  /// twice the most non-expert buckets one unit reads (a layer; the embedding; the final norm and
  /// output layer) — the unit in use and the next one prefetched — plus one for the tied word
  /// embedding's bucket the head reads; at most the number of non-expert buckets.
  int param_slots_needed() const;
  /// The largest non-expert bucket's length (the parameter slots' length), 0 when none.
  int64_t largest_dense_bucket() const;
  /// Bytes of model-dtype parameter storage this store holds: the whole buffer (0 for an fp32
  /// model: the main parameters), or (staged) the shard (an fp32 model's main shard), the slots and
  /// the expert slots.
  int64_t param_storage_bytes() const;

  /// Off: zero_grads zeroes every gradient and marks none (per-layer CUDA graphs replay one
  /// captured backward for every micro-batch, so the first write of a step cannot differ from the
  /// others). On by default.
  void set_grad_overwrite(bool on) { grad_overwrite_ = on; }

  /// Flat element ranges [begin, end) covering the parameters for which pred(info) holds,
  /// consecutive parameters merged into one range (the alignment padding between them, whose
  /// gradients stay zero, included), so an op or collective runs once per range instead of once
  /// per tensor. Computed once by the caller, outside the training step.
  template <typename Pred>
  std::vector<Range> ranges(Pred pred) const {
    std::vector<Range> out;
    for (size_t i = 0; i < infos_.size(); ++i) {
      if (!pred(infos_[i])) continue;
      const int64_t b = infos_[i].offset, e = i + 1 < infos_.size() ? infos_[i + 1].offset : total_;
      if (!out.empty() && out.back().end == b) {
        out.back().end = e;
      } else {
        out.push_back({b, e});
      }
    }
    return out;
  }

 private:
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, size_t> by_name_;
  DType model_dtype_;
  Device device_;
  ParamLayout layout_;
  ParamStore(std::vector<ParamSpec> specs, DType model_dtype, Device device, const ParamLayout& layout, bool allocate);
  int64_t total_ = 0;
  std::vector<ParamBucket> buckets_;
  std::vector<size_t> bucket_of_;
  Buffer params_, main_, grads_;
  // Staging slots (use_grad_slots): the buffers, the slot bound to each bucket (-1: none) and the
  // bucket bound to each slot (-1: free). Mutable: grad() binds on first use.
  std::vector<Buffer> grad_slot_buf_;
  mutable std::vector<int> slot_of_bucket_, bucket_of_slot_;
  int64_t grad_slot_len_ = 0;
  // The MoE layers' expert regions (ascending) and each bucket's MoE layer (-1: dense).
  std::vector<Range> expert_regions_;
  std::vector<int> moe_layer_of_bucket_;
  // Expert slot pools (use_grad_slots / use_param_slots): one buffer of n slots of
  // expert_slot_length() elements each; per slot the MoE layer holding it (-1: free) and how many of
  // its buckets are bound.
  struct ExpertPool {
    Buffer buf;
    std::vector<int> owner, bound;
    int64_t len = 0;
    int slots() const { return static_cast<int>(owner.size()); }
  };
  mutable ExpertPool expert_grads_, expert_params_;
  // Allocates `pool`: n free slots of expert_slot_length() elements of elem_bytes each.
  void allocate_expert_pool(ExpertPool& pool, int n, size_t elem_bytes);
  // Binds expert bucket b in `pool` (n slots; slot_of: the per-bucket slot table): MoE layer k's
  // slot k mod n; error (what: "gradient" / "parameter") when another layer holds it. Unbinds.
  void bind_expert(ExpertPool& pool, std::vector<int>& slot_of, size_t b, const char* what) const;
  void unbind_expert(ExpertPool& pool, std::vector<int>& slot_of, size_t b) const;
  // The slot of `pool` expert bucket b always binds to: its MoE layer k's k mod n (the one rule that
  // bind_expert, grad_view and expert_param_slot_holder share: the grouped-GEMM tables cache it).
  int expert_slot(const ExpertPool& pool, size_t b) const {
    return moe_layer_of_bucket_[b] % pool.slots();
  }
  // Expert bucket b's view in pool slot s, as dtype dt.
  Tensor expert_view(const ExpertPool& pool, int s, size_t b, DType dt) const;
  // Parameter staging (use_param_slots): params_ is freed; param_shard_ the owned slices (the main
  // shard for an fp32 model: empty here).
  bool params_staged_ = false;
  Buffer param_shard_;
  std::vector<Buffer> param_slot_buf_;
  mutable std::vector<int> slot_of_param_bucket_;
  std::vector<int> bucket_of_param_slot_;
  std::vector<Range> param_owned_;            // per bucket
  std::vector<int64_t> param_shard_off_;      // per bucket
  int64_t param_shard_n_ = 0, param_slot_len_ = 0;
  // The unit of the model's forward that reads parameter i (param_slots_needed): its layer
  // ('...layers.<n>'), else the embedding, else the head (final norm, output layer, and the last
  // stage's copy of a tied embedding).
  std::string unit_of(size_t i) const;
  // Staging slots when `unit` names the unit of each parameter index: `units` times the most
  // non-expert buckets of one unit, plus `extra`; at least 1, at most the non-expert bucket count.
  int slots_needed(const std::function<std::string(size_t)>& unit, size_t units, size_t extra) const;
  // Binds the lowest free slot (-1 in bucket_of_slot) to bucket b; its index, or -1 when none.
  static int take_free_slot(std::vector<int>& bucket_of_slot, size_t b);
  // Writes parameter i's stored elements (its bucket's owned slice) from `model` (model dtype [numel]).
  void write_stored_params(size_t i, const Tensor& model, const Stream& stream);
  // The stored elements of every bucket from an fp32 [total] tensor (rounded to the model dtype).
  void set_stored_params(const Tensor& full, const Stream& stream);
  bool main_sharded_ = false;
  bool main_remainders_ = false;  // main_ holds int16 remainders (store_main_as_remainders)
  std::vector<Range> main_ranges_;
  // The flat ranges whose main elements this store keeps, in storage order: main_ranges_ when
  // sharded, else [0, total).
  std::vector<Range> stored_ranges() const;
  // main_ as stored: fp32 or int16, [total] or [owned].
  Tensor main_storage() const;
  int64_t main_shard_n_ = 0;
  // Gradient first writes (zero_grads / take_first_grad_write): how many parameters are
  // grad_overwrite, the flat ranges zero_grads clears when some are (all the rest, padding
  // included), the marks.
  bool grad_overwrite_ = true;
  size_t grad_overwrite_params_ = 0;
  std::vector<Range> grad_zero_ranges_;
  std::vector<uint8_t> first_write_;
  size_t first_writes_pending_ = 0;
};

}  // namespace mt
